"""What back-fill "deferred"'s second query costs a decode step: the row's pending token
riding along in the layers its new token runs (`step._with_checks`), against the same exit
step with nothing pending and against propagate.

    python -m bench.ride_along                      # SmolLM2 as served (GGUF blocks), batch 1
    python -m bench.ride_along --pending 16 24 29 --rounds 25
    python -m bench.ride_along --verify-runs 1 2 4 --verify-at 20   # verified exits too

Each variant is one jitted `step.model_step` on the shipped heads at threshold 1.0 (every
check runs, no row leaves, so the new token runs all L layers and the pending token rides
from its layer up), the cache donated, batch 1 at a context of --context keys. The baseline
is full depth (`FullDepth`, the program `early_exit=False` serves), stated here. Rounds run
every variant --steps times in a random order (`bench.common.interleaved_rounds`, the timer
`bench.step` uses); the figure is the median over rounds. The extra ms of a pending token at
layer E over "deferred, nothing pending", divided by the L - E layers it rides and by a
full-depth layer's ms ((full depth ms) / (L + the head's layer-equivalents)), is
`ControllerConfig.ride_cost` on this machine.

With --verify-runs K..., also verified exits' verify step (`ExitConfig.verified`, max_draft
max(K)): the row's run of K drafts at layer --verify-at rides to L and the final head scores
the run with the row's own token, against the same program with an empty run (a verify with
nothing to check: one head row); per ridden layer and draft, as for deferred.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import numpy as np

from bench.common import cpu_model, head_layers, interleaved_rounds, load_f32, log, num_cpus


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
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

    model = load_f32(args.model)  # GGUF block weights, as the engine serves them
    cfg, params = model.config, model.params
    ec, heads = model.shipped_exit_heads()
    B, page = 1, 16
    pages = -(-(args.context + 1) // page)
    cache = allocate_cache(cfg, B * pages + 1, page)
    meta = AttentionMetadata(jnp.full((B, 1), args.context, jnp.int32),
                             jnp.asarray(1 + np.arange(pages)[None], jnp.int32),
                             jnp.full((B,), args.context + 1, jnp.int32))
    tokens = jnp.asarray([[42]], jnp.int32)
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
    variants = {"full depth": program(FullDepth(), None),
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
    layer_ms = med["full depth"] / (L + head_layers(cfg))
    cmd = " ".join(sys.argv[1:] if argv is None else argv)
    lines = [f"Command: `python -m bench.ride_along {cmd}`; {cpu_model()}, {num_cpus()} cores; "
             f"{args.model} (GGUF blocks), batch 1, context {args.context}, threshold 1.0; "
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
            ride = (f"{extra / (L - e) / k / layer_ms:.2f} layers a draft (head rows "
                    f"included)")
        lines.append(f"| {name} | {ms * 1e3:.2f} | {med['full depth'] / ms:.3f}x | {ride} |")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
