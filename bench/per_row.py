"""Per-row exits at batch > 1: full depth and policies never / all / quorum / per_row, on
HumanEval prompts.

    python -m bench.per_row --out docs/benchmarks.md
    python -m bench.per_row --tiny --batches 1 4 --prompts 4 --new-tokens 6   # smoke test

Method (docs/architecture.md section 7), everything in one process, per batch size B (the engine's
max_num_seqs; continuous batching over --prompts prompts):

1. Reference: the engine built with `early_exit=False` (full depth, the baseline every ratio
   is against) generates --new-tokens greedy tokens per prompt (EOS ignored).
2. Teacher forcing: every policy decodes the same prompts with the reference tokens forced
   (`SamplingParams.forced_tokens`), so all of them process exactly the same sequences and
   their speeds compare like for like. Agreement = mean over decode tokens of (the token the
   policy's model predicted == the full-depth token); the first token comes from the
   full-depth prefill and is left out.
3. Warm-up: each engine first runs the whole workload once (every program it needs is
   compiled then; compile time is reported apart). Then --repeats rounds, the policies
   interleaved in each round; the median decode tokens/s is reported, with its ratio to
   full depth in the same run.
4. Per policy: mean executed layers per decoded row and the ideal ratio L / mean, the
   row-layers actually computed as a share of full depth (per_row: rows in the bucket the
   layers ran on, padding rows included), and the histogram of rows' exit layers.
5. Forced pattern (the compaction ceiling): a single exit at layer L/3 with the "classifier"
   measure and w = 0, b = 0 (confidence 0.5 for every row); half the requests have threshold
   0 (leave at L/3), half NEVER (run to L). per_row vs full depth against the ideal
   L / mean layers; "never" and "all" beside it (at batch > 1 "all" almost never leaves
   early).

Exit heads: --exit-heads PATH, else the heads shipped for --model (registry), else (with a
warning) untrained heads (per-exit norm = final norm) at exits 6, 9, ..., 27.
`--random`: same-shape random weights (the tokenizer still comes from --model); `--tiny`: a
4-layer random model and random prompts, for smoke tests only.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

from bench.common import cpu_model, humaneval_prompts, ideal_speedup, log, serve, write_marked

MARK = ("<!-- bench.per_row:begin -->", "<!-- bench.per_row:end -->")
POLICIES = ("never", "all", "quorum", "per_row")


# --------------------------------------------------------------------------- setup


def load(args):
    """(LoadedModel, prompts [list of token ids], weights description)."""
    from ee_jax.models import llama
    from ee_jax.models.loading import LoadedModel, load_model

    if args.tiny:
        from ee_jax.testing import tiny_config

        cfg = tiny_config(eos_token_ids=(), max_position=2048)
        params = llama.init_params(cfg, jax.random.PRNGKey(0), scale=0.4)
        rng = np.random.default_rng(0)
        prompts = [rng.integers(3, cfg.vocab_size, int(rng.integers(20, 60))).tolist()
                   for _ in range(args.prompts)]
        return LoadedModel(cfg, params, None, "tiny"), prompts, "tiny random (4 layers, f32)"
    model = load_model(args.model, dtype="float32")
    weights = f"{args.model} (f32)"
    if args.random:
        cfg = model.config
        params = jax.jit(lambda k: llama.init_params(cfg, k))(jax.random.PRNGKey(0))
        model = dataclasses.replace(model, params=params)
        weights = f"random, {args.model} shapes (f32)"
    prompts = [ids for _, ids in humaneval_prompts(model.tokenizer, args.min_prompt,
                                                   args.max_prompt)][:args.prompts]
    return model, prompts, weights


def exit_setup(args, model):
    """(ExitConfig, heads, description) of the heads the policies use."""
    from ee_jax.models import exit_heads
    from ee_jax.models.exit_checkpoint import load_exit_heads
    from ee_jax.models.exit_config import ExitConfig

    cfg = model.config
    if args.exit_heads is not None:
        ec, heads = load_exit_heads(args.exit_heads, cfg)
        what = f"trained heads from {args.exit_heads}"
    elif not args.tiny and model.shipped_exit_heads() is not None:
        ec, heads = model.shipped_exit_heads()
        what = f"heads shipped for {args.model}"
    else:
        layers = (1, 2, 3) if args.tiny else tuple(range(6, cfg.n_layers - 2, 3))
        ec = ExitConfig(exit_layers=layers)
        heads = exit_heads.init_heads(cfg, ec, model.params)
        what = "untrained heads (per-exit norm = final norm)"
        log(f"WARNING: no exit heads given or shipped: using {what}")
    ec = dataclasses.replace(ec, threshold=args.threshold, quorum=args.quorum)
    return ec, heads, f"{what}: {ec.head} head, {ec.measure}, exits {list(ec.exit_layers)}"


# --------------------------------------------------------------------------- runs


def make_llm(model, ec, heads, batch, max_len):
    """ec None: the full-depth baseline (`early_exit=False`)."""
    from ee_jax.serving.llm import LLM

    return LLM(model, exit_config=ec, exit_heads=heads, early_exit=ec is not None,
               progress=False, max_num_seqs=batch, max_model_len=max_len, page_size=16,
               max_num_batched_tokens=8192, max_prefill_chunk=512)


def run(llm, prompts, params):
    """One pass over the prompts; returns (outputs, stats of that pass). The engine's compile
    time so far is kept in `llm.compile_time`."""
    served = serve(llm, prompts, params)
    llm.compile_time = getattr(llm, "compile_time", 0.0) + served.compile_time
    return served.outputs, served.stats


def forced_params(refs, thresholds=None):
    from ee_jax.serving.params import greedy

    thresholds = thresholds or [None] * len(refs)
    return [greedy(len(r), ignore_eos=True, forced_tokens=tuple(r), exit_threshold=t)
            for r, t in zip(refs, thresholds, strict=True)]


def agreement(outs, refs) -> float:
    hits = [p == f for o, r in zip(outs, refs, strict=True)
            for p, f in zip(o.predicted_token_ids[1:], r[1:], strict=True)]
    return float(np.mean(hits)) if hits else 1.0


def measure(variants: dict, prompts, params_of, refs, repeats: int, L: int) -> dict:
    """variants: name -> LLM. Warm-up pass each, then `repeats` interleaved rounds."""
    res = {}
    for name, llm in variants.items():
        t = time.perf_counter()
        run(llm, prompts, params_of(name))
        res[name] = dict(warmup=time.perf_counter() - t, compile=llm.compile_time, tps=[])
        log(f"    warm-up {name}: {res[name]['warmup']:.1f} s "
            f"(compile {res[name]['compile']:.1f} s)")
    for rep in range(repeats):
        for name, llm in variants.items():
            outs, s = run(llm, prompts, params_of(name))
            r = res[name]
            r["tps"].append(s.decode_tokens_per_s)
            if rep == 0:  # the exit pattern is the same every round (greedy, forced)
                r.update(mean=s.mean_layers_per_row or L, ideal=s.ideal_row_speedup(L),
                         ideal_head=ideal_speedup(s, llm.model.config, llm.engine.exit_config),
                         work=s.work_fraction, hist=s.row_exit_histogram(),
                         steps=s.exit_histogram(), agree=agreement(outs, refs))
            log(f"    round {rep + 1} {name}: {s.decode_tokens_per_s:.1f} tok/s, "
                f"mean layers/row {r['mean']:.1f}, agreement {r['agree']:.3f}")
    base = statistics.median(res[next(iter(res))]["tps"])
    for r in res.values():
        r["tps"] = statistics.median(r["tps"])
        r["ratio"] = r["tps"] / base if base else 0.0
    return res


def bench_batch(model, prompts, ec, heads, B, args, max_len):
    from ee_jax.models import exit_heads
    from ee_jax.models.exit_config import NEVER, ExitConfig
    from ee_jax.serving.params import greedy

    L = model.config.n_layers
    log(f"batch {B}: reference (full depth, early_exit=False) for {len(prompts)} prompts")
    full = make_llm(model, None, None, B, max_len)
    refs = [o.token_ids for o in run(full, prompts, greedy(args.new_tokens, ignore_eos=True))[0]]
    variants = {"full depth": full}
    for pol in POLICIES:
        variants[pol] = make_llm(model, dataclasses.replace(ec, policy=pol), heads, B, max_len)
    log(f"batch {B}: policies {', '.join(variants)} at threshold {ec.threshold}")
    main = measure(variants, prompts, lambda _: forced_params(refs), refs, args.repeats, L)
    del variants

    # Forced pattern: one exit at L/3 with constant confidence 0.5, thresholds 0 / NEVER.
    e = max(1, round(L / 3))
    fec = ExitConfig(exit_layers=(e,), measure="classifier", threshold=0.0)
    fheads = exit_heads.init_heads(model.config, fec, model.params)
    thr = [0.0 if i % 2 == 0 else NEVER for i in range(len(prompts))]
    variants = {"full depth": full}
    variants.update({pol: make_llm(model, dataclasses.replace(fec, policy=pol), fheads, B,
                                   max_len) for pol in ("never", "all", "per_row")})
    log(f"batch {B}: forced pattern (half the rows leave at {e}, half run to {L})")
    forced = measure(variants, prompts, lambda _: forced_params(refs, thr), refs,
                     args.repeats, L)
    return dict(main=main, forced=forced, forced_exit=e)


# --------------------------------------------------------------------------- report


def render(ctx) -> str:
    L = ctx["L"]
    out = ["## Per-row exits at batch > 1 (`bench/per_row.py`)", "",
           f"Command: `{ctx['command']}`  ",
           f"Machine: {ctx['machine']}; jax {jax.__version__}, backend "
           f"{jax.default_backend()}. Weights: {ctx['weights']}. Run {ctx['date']}.  ",
           f"Exits: {ctx['heads']}; threshold {ctx['threshold']}, quorum {ctx['quorum']}.  ",
           f"Workload: {ctx['n_prompts']} {ctx['prompt_kind']} prompts "
           f"({ctx['prompt_lens']} tokens), "
           f"{ctx['new_tokens']} tokens each, teacher-forced on the full-depth greedy output "
           f"(every policy decodes the same sequences); median of {ctx['repeats']} "
           f"interleaved rounds after a warm-up pass. Method: the docstring of "
           f"`bench/per_row.py`.", "",
           "| batch | policy | decode tok/s | vs full depth | mean layers / row | ideal L/mean | "
           "ideal, head counted | row-layers computed / full | TF agreement | "
           "rows per exit layer | compile s |",
           "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for B, r in ctx["batches"]:
        for name, v in r["main"].items():
            out.append(f"| {B} | {name} | {v['tps']:.1f} | {v['ratio']:.2f}x | {v['mean']:.1f} "
                       f"| {v['ideal']:.2f}x | {v['ideal_head']:.2f}x | {v['work']:.2f} | "
                       f"{v['agree']:.3f} | {v['hist']} | {v['compile']:.1f} |")
    e = ctx["batches"][0][1]["forced_exit"] if ctx["batches"] else L // 3
    out += ["", f"### Forced pattern: half the rows leave at layer {e}, half run to {L}", "",
            f"Exit at {e} only, classifier confidence 0.5 for every row, per-request threshold "
            f"0 or NEVER alternating. The ideal is L / mean layers per row; per_row's ratio "
            f"to it is how much of the saved work compaction turns into speed.", "",
            "| batch | policy | decode tok/s | vs full depth | mean layers / row | ideal | "
            "share of ideal | row-layers computed / full |",
            "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for B, r in ctx["batches"]:
        for name, v in r["forced"].items():
            out.append(f"| {B} | {name} | {v['tps']:.1f} | {v['ratio']:.2f}x | "
                       f"{v['mean']:.1f} | {v['ideal']:.2f}x | "
                       f"{v['ratio'] / v['ideal']:.2f} | {v['work']:.2f} |")
    out += ["", "Ideal, head counted: (L + head) / (mean layers + exit head + checks) in "
            "layer-equivalents (the engine's cost model, `exit_cost.cost_model`). "
            "TF agreement: share of decode tokens where the policy's own prediction equals "
            "the full-depth token (teacher forced). Row-layers computed / full: the rows the "
            "layers actually ran on (per_row: the compacted bucket, padding rows included), "
            "over batch bucket x L."]
    return "\n".join(out) + "\n"


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench.per_row",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--exit-heads", type=Path, default=None,
                   help="folder of exit heads (default: the heads shipped for --model)")
    p.add_argument("--threshold", type=float, default=0.8)
    p.add_argument("--quorum", type=float, default=0.75)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    p.add_argument("--prompts", type=int, default=32, help="HumanEval prompts per batch size")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--min-prompt", type=int, default=64)
    p.add_argument("--max-prompt", type=int, default=400)
    p.add_argument("--repeats", type=int, default=2, help="measured rounds per batch size")
    p.add_argument("--random", action="store_true", help="same-shape random weights")
    p.add_argument("--tiny", action="store_true", help="smoke test: a 4-layer random model")
    p.add_argument("--out", type=Path, default=None,
                   help="markdown file whose bench.per_row section is (re)written")
    return p.parse_args(argv)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    model, prompts, weights = load(args)
    ec, heads, heads_desc = exit_setup(args, model)
    lens = [len(p) for p in prompts]
    max_len = max(lens) + args.new_tokens + 16
    max_len = -(-max_len // 16) * 16
    ctx = dict(L=model.config.n_layers, command="python -m bench.per_row " + " ".join(argv),
               machine=f"{cpu_model()}, {os.cpu_count()} cores, {len(jax.devices())} "
                       f"{jax.devices()[0].platform} device(s)",
               weights=weights, date=time.strftime("%Y-%m-%d %H:%M"),
               heads=heads_desc, threshold=args.threshold, quorum=args.quorum,
               n_prompts=len(prompts), prompt_kind="random" if args.tiny else "HumanEval",
               prompt_lens=f"{min(lens)}-{max(lens)}",
               new_tokens=args.new_tokens, repeats=args.repeats, batches=[])
    for B in args.batches:
        ctx["batches"].append((B, bench_batch(model, prompts, ec, heads, B, args, max_len)))
        text = render(ctx)
        if args.out:  # after every batch size: a long run leaves what it has
            write_marked(args.out, text, MARK)
    print(text)
    if args.out:
        log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
