"""One decode step, variant against full depth: exit policy and check overhead, forced exits
(the ceiling), parameter dtype, attention backend. One process, one step timer.

    python -m bench.step                                  # SmolLM2, batch 1 and 8, every axis
    python -m bench.step --batches 8 --policies per_row --forced 10 20 --dtypes --attention
    python -m bench.step --random --batches 1 --rounds 3  # same-shape random weights
    python -m bench.step --tiny --rounds 2                # smoke test: a 4-layer random model
    python -m bench.step --out docs/benchmarks.md         # (re)write its section of the doc

Method (docs/architecture.md section 7): every variant is a `ModelRunner` step (the served
program: host inputs packed once, the cache donated, sampling included) on B rows at a context
of --context keys. The baseline is full depth: a runner with no exit config, the program
`early_exit=False` serves, f32, attention "auto". Each variant's first call is timed apart
(it compiles); then --rounds rounds run every variant --steps times in a random order each
(`bench.common.time_steps`). Per variant: median ms per step, the median over rounds of
full depth / variant (neighbours in time share the machine's load) with its quartiles,
process CPU ms, and the rows per exit layer of the timed steps.

Axes (each variant differs from the baseline in one thing):
* --policies P...: the shipped heads (untrained norm heads every 4th layer with --random or
  --tiny) under policy P, thresholds inf (no check runs: the loop, switches and bookkeeping)
  and 1.0 (every check runs, none fires): what checks cost where no token leaves;
* --forced E...: every row leaves at layer E (`force_exit_layer`): the step's ceiling, against
  the ideal L / E counted in layers (the head is paid either way);
* --dtypes D...: full depth with bfloat16 or int8 (weight-only, per output channel) weights;
* --attention A...: full depth with attention backend A (reference, xla, ...).

ride-along: what back-fill "deferred"'s second query costs a decode step: the row's pending
token riding along in the layers its new token runs (`step._with_checks`), against the same
exit step with nothing pending and against propagate.

    python -m bench.step ride-along                 # SmolLM2 as served (GGUF blocks), batch 1
    python -m bench.step ride-along --pending 16 24 29 --rounds 25
    python -m bench.step ride-along --verify-runs 1 2 4 --verify-at 20   # verified exits too
    python -m bench.step ride-along --tiny --pending 2 --verify-runs 1 --verify-at 2 --rounds 1

Each variant is one jitted `step.model_step` on the shipped heads at threshold 1.0 (every
check runs, no row leaves, so the new token runs all L layers and the pending token rides
from its layer up), the cache donated, batch 1 at a context of --context keys. The baseline
is full depth (`FullDepth`, the program `early_exit=False` serves). Rounds run every variant
--steps times in a random order (`bench.common.interleaved_rounds`, the timer under
`time_steps`); the figure is the median over rounds. The extra ms of a pending token at layer
E over "deferred, nothing pending", divided by the L - E layers it rides and by a full-depth
layer's ms ((full depth ms) / (L + the head's layer-equivalents)), is
`ControllerConfig.ride_cost` on this machine. With --verify-runs K..., also verified exits'
verify step (`ExitConfig.verified`, max_draft max(K)): the row's run of K drafts at layer
--verify-at rides to L and the final head scores the run with the row's own token, against
the same program with an empty run (a verify with nothing to check: one head row); per
ridden layer and draft, as for deferred.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import numpy as np

from bench.common import (
    StepTimes,
    head_layers,
    interleaved_rounds,
    load_f32,
    log,
    report_header,
    smollm2_shaped_random,
    step_case,
    time_steps,
    write_marked,
)

MARK = ("<!-- bench.step:begin -->", "<!-- bench.step:end -->")
BASELINE = "full depth"


def load(args, blocks: bool = False):
    """(config, f32 params, (exit config, heads) for the policy axis, weights description);
    blocks: a GGUF's layer weights in their blocks, as the engine serves them (else dense)."""
    import jax

    from ee_jax.models import llama
    from ee_jax.models.exits import config as exit_config
    from ee_jax.models.exits import heads as exit_heads

    if args.tiny:
        from ee_jax.testing import tiny_config

        cfg = tiny_config(eos_token_ids=())
        params = llama.init_params(cfg, jax.random.PRNGKey(0))
        ec = exit_config.ExitConfig(exit_layers=(1, 2, 3))
        return cfg, params, (ec, exit_heads.init_heads(cfg, ec, params)), "tiny random (4 layers)"
    if args.random:
        cfg, params = smollm2_shaped_random()
        shipped, what = None, f"random weights of {args.model}'s shapes"
    else:
        model = load_f32(args.model, blocks=blocks)
        cfg, params = model.config, model.params
        # dense f32 by default (the dtype axis re-quantises it), not the GGUF blocks the
        # engine serves: a full-depth step then reads 425 MB of layer weights, blocks 133 MB
        shipped = model.shipped_exit_heads()
        what = f"{args.model} ({'GGUF blocks' if blocks else 'dense f32 weights'})"
    if shipped is None:
        ec = exit_config.ExitConfig(exit_layers=tuple(range(4, cfg.n_layers, 4)))
        shipped = ec, exit_heads.init_heads(cfg, ec, params)
        log("no shipped heads: the policy axis uses untrained norm heads every 4th layer")
    return cfg, params, shipped, what


def variants(args, cfg, params, shipped) -> dict[str, dict]:
    """name -> step_case keyword arguments; the baseline first."""
    from ee_jax.models import llama
    from ee_jax.models.exits import config as exit_config
    from ee_jax.models.quant import quantize_params

    out = {BASELINE: dict(cfg=cfg, params=params)}
    ec, heads = shipped
    for pol in args.policies:
        for thr, what in ((float("inf"), "no check runs"), (1.0, "checks never fire")):
            out[f"{pol}, {what}"] = dict(cfg=cfg, params=params, heads=heads, threshold=thr,
                                         exit_config=dataclasses.replace(ec, policy=pol))
    for e in args.forced:
        out[f"forced exit {e}"] = dict(cfg=cfg, params=params, exit_config=exit_config.ExitConfig(
            exit_layers=(e,), force_exit_layer=e))
    for d in args.dtypes:
        if d == "bfloat16":
            out[d] = dict(cfg=cfg.replace(dtype=d), params=llama.cast_params(params, d))
        elif d == "int8":
            out[d] = dict(cfg=cfg, params=quantize_params(params, "int8"))
        else:
            raise SystemExit(f"--dtypes: unknown {d!r}; choose bfloat16 or int8")
    for a in args.attention:
        out[f"attention {a}"] = dict(cfg=cfg, params=params, attention=a)
    for layout in args.layer_layouts:  # the baseline holds the platform's (llama.layout_for)
        out[f"full depth, layers {layout}"] = dict(cfg=cfg, params=params, layer_layout=layout)
    return out


def render(args, what: str, cfg, results: dict[int, dict[str, StepTimes]]) -> str:
    cmd = "python -m bench.step " + " ".join(sys.argv[1:] if args.argv is None else args.argv)
    lines = [f"{report_header(cmd)}. {what}, context {args.context}; {args.rounds} rounds of "
             f"{args.steps} steps per variant, random order; ratio: median over rounds of "
             f"full depth / variant [quartiles]; first call (compile) apart.", "",
             "| batch | variant | ms/step | ratio | CPU ms/step | first call s | "
             "rows per exit layer |", "|---|---|---|---|---|---|---|"]
    for B, res in results.items():
        base = res[BASELINE]
        for name, t in res.items():
            q1, med, q3 = t.ratio_to(base)
            ideal = ""
            if name.startswith("forced exit "):
                ideal = f" (ideal {cfg.n_layers / int(name.split()[-1]):.2f}x)"
            hist = ", ".join(f"{e}: {n}" for e, n in t.exit_layers.items())
            lines.append(f"| {B} | {name} | {1e3 * _median(t.wall):.1f} | {med:.2f}x "
                         f"[{q1:.2f}-{q3:.2f}]{ideal} | {1e3 * _median(t.cpu):.1f} | "
                         f"{t.compile_s:.1f} | {hist} |")
    return "\n".join(lines) + "\n"


def _median(xs):
    import statistics

    return statistics.median(xs)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench.step",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--random", action="store_true", help="same-shape random weights")
    p.add_argument("--tiny", action="store_true", help="a 4-layer random model (smoke test)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--context", type=int, default=200, help="keys per row")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--steps", type=int, default=3, help="steps per variant per round")
    p.add_argument("--policies", nargs="*", default=["all", "per_row"])
    p.add_argument("--forced", type=int, nargs="*", default=None,
                   help="exit layers (default: L/3 and 2L/3)")
    p.add_argument("--dtypes", nargs="*", default=["bfloat16", "int8"])
    p.add_argument("--attention", nargs="*", default=["reference", "xla"])
    p.add_argument("--layer-layouts", nargs="*", default=[], choices=["stacked", "per_layer"],
                   help="full depth with the layers held so (the baseline: the platform's)")
    p.add_argument("--out", default=None, help="markdown file whose bench.step section is "
                                               "(re)written")
    args = p.parse_args(argv)
    args.argv = argv
    return args


def ride_along_main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.step ride-along",
                                description="what back-fill deferred's second query and a "
                                "verify step cost a decode step (module docstring)")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--random", action="store_true", help="same-shape random weights")
    p.add_argument("--tiny", action="store_true", help="a 4-layer random model (smoke test)")
    p.add_argument("--pending", type=int, nargs="+", default=[16, 24, 29],
                   help="layers the pending token left at")
    p.add_argument("--context", type=int, default=200)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--verify-runs", type=int, nargs="*", default=[],
                   help="verified exits: runs of this many drafts riding to L and verified")
    p.add_argument("--verify-at", type=int, default=20,
                   help="--verify-runs: the layer the drafts have reached")
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from ee_jax.serving.attention import AttentionMetadata
    from ee_jax.serving.kv_cache import allocate_cache
    from ee_jax.serving.step import BatchExit, FullDepth, Pending, model_step

    cfg, params, (ec, heads), what = load(args, blocks=True)  # as the engine serves them
    B, page = 1, 16
    pages = -(-(args.context + 1) // page)
    cache = allocate_cache(cfg, B * pages + 1, page)
    meta = AttentionMetadata(jnp.full((B, 1), args.context, jnp.int32),
                             jnp.asarray(1 + np.arange(pages)[None], jnp.int32),
                             jnp.full((B,), args.context + 1, jnp.int32))
    tokens = jnp.asarray([[42 % cfg.vocab_size]], jnp.int32)
    thresholds = jnp.ones((B,), jnp.float32)  # every check runs, none fires
    h = jnp.asarray(np.random.default_rng(0).normal(size=(B, cfg.d_model)), cfg.jnp_dtype)
    platform = jax.default_backend()  # the steps are for this host's devices

    def program(policy, pending_layer):
        def f(cache):
            pending = None if pending_layer is None else dataclasses.replace(
                Pending.none(B, cfg), h=h[:, None],
                layer=jnp.full((B, 1), pending_layer, jnp.int32))
            r, cache = model_step(params, heads, cache, tokens, meta, thresholds, cfg, policy,
                                  attention="auto", pending=pending, platform=platform)
            return r.logits, cache
        return jax.jit(f, donate_argnums=0)

    deferred = BatchExit(dataclasses.replace(ec, backfill="deferred", policy="all"))
    P = max(args.verify_runs, default=1)
    verify = BatchExit(dataclasses.replace(ec, policy="all").verified(P))

    def run_program(k):
        def f(cache):
            pending = Pending.none(B, cfg, P)
            live = np.arange(P) >= P - k  # right aligned
            pending = dataclasses.replace(
                pending, h=jnp.broadcast_to(h[:, None], pending.h.shape),
                layer=jnp.where(live, args.verify_at, cfg.n_layers)[None].astype(jnp.int32),
                token=jnp.where(live, 7, -1)[None].astype(jnp.int32),
                exit=jnp.where(live, args.verify_at, cfg.n_layers)[None].astype(jnp.int32))
            r, cache = model_step(params, heads, cache, tokens, meta, thresholds, cfg, verify,
                                  attention="auto", pending=pending, platform=platform)
            return r.run_logits[:, -1], cache
        return jax.jit(f, donate_argnums=0)

    variants = {BASELINE: program(FullDepth(), None),
                "propagate, nothing pending": program(BatchExit(dataclasses.replace(
                    ec, backfill="propagate", policy="all")), None),
                "deferred, nothing pending": program(deferred, None)}
    for e in args.pending:
        variants[f"deferred, pending at {e}"] = program(deferred, e)
    for k in [0, *args.verify_runs] if args.verify_runs else []:
        variants[f"verify, run of {k} at {args.verify_at}"] = run_program(k)
    state = {"cache": cache}  # donated to every call, the newest kept here

    def call(fn):
        def step():
            out, state["cache"] = fn(state["cache"])
            return out
        return step

    calls = {name: call(fn) for name, fn in variants.items()}
    for name, step in calls.items():
        t = time.perf_counter()
        np.asarray(step())
        log(f"{name}: first call {time.perf_counter() - t:.1f} s")
    times, _ = interleaved_rounds(calls, args.rounds, args.steps)
    med = {k: float(np.median(v)) for k, v in times.items()}
    L = cfg.n_layers
    layer_ms = med[BASELINE] / (L + head_layers(cfg))
    cmd = "python -m bench.step ride-along " + " ".join(sys.argv[2:] if argv is None else argv)
    lines = [f"{report_header(cmd)}. {what}, batch 1, context {args.context}, threshold 1.0; "
             f"median of {args.rounds} rounds.", "",
             "| variant | ms/step | full depth / variant | second query per ridden layer |",
             "|---|---:|---:|---:|"]
    for name, ms in med.items():
        ride = ""
        if name.startswith("deferred, pending at "):
            e = int(name.rsplit(" ", 1)[1])
            extra = ms - med["deferred, nothing pending"]
            ride = f"{extra / (L - e) / layer_ms:.2f} layers ({extra * 1e3 / (L - e):.2f} ms)"
        elif name.startswith("verify, run of ") and not name.startswith("verify, run of 0"):
            k, e = int(name.split()[3]), args.verify_at
            extra = ms - med[f"verify, run of 0 at {e}"]
            ride = f"{extra / (L - e) / k / layer_ms:.2f} layers a draft (head rows included)"
        lines.append(f"| {name} | {ms * 1e3:.2f} | {med[BASELINE] / ms:.3f}x | {ride} |")
    print("\n".join(lines))
    return 0


MODES = {"ride-along": ride_along_main}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] and argv[0] in MODES:
        return MODES[argv[0]](argv[1:])
    args = parse_args(argv)
    cfg, params, shipped, what = load(args)
    if args.forced is None:
        args.forced = [cfg.n_layers // 3, 2 * cfg.n_layers // 3]
    specs = variants(args, cfg, params, shipped)
    results = {}
    for B in args.batches:
        log(f"batch {B}: compiling {len(specs)} variants")
        cases = {name: step_case(batch=B, context=args.context, **kw)
                 for name, kw in specs.items()}
        results[B] = time_steps(cases, args.rounds, args.steps, seed=B)
        del cases
    text = render(args, what, cfg, results)
    print(text)
    if args.out:
        from pathlib import Path

        write_marked(Path(args.out), text, MARK)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
