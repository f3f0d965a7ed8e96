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
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from bench.common import (
    StepTimes,
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


def load(args):
    """(config, f32 params, (exit config, heads) for the policy axis, weights description)."""
    import jax

    from ee_jax.models import exit_config, exit_heads, llama

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
        model = load_f32(args.model, blocks=False)
        cfg, params = model.config, model.params
        # dense f32 (the dtype axis re-quantises it), not the GGUF blocks the engine serves:
        # a full-depth step here reads 425 MB of layer weights, the engine's blocks 133 MB
        shipped, what = model.shipped_exit_heads(), f"{args.model} (dense f32 weights)"
    if shipped is None:
        ec = exit_config.ExitConfig(exit_layers=tuple(range(4, cfg.n_layers, 4)))
        shipped = ec, exit_heads.init_heads(cfg, ec, params)
        log("no shipped heads: the policy axis uses untrained norm heads every 4th layer")
    return cfg, params, shipped, what


def variants(args, cfg, params, shipped) -> dict[str, dict]:
    """name -> step_case keyword arguments; the baseline first."""
    from ee_jax.models import exit_config, llama
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
    p.add_argument("--out", default=None, help="markdown file whose bench.step section is "
                                               "(re)written")
    args = p.parse_args(argv)
    args.argv = argv
    return args


def main(argv=None) -> int:
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
