"""Early-exit decoding benchmark: the step's ceiling, its overhead, and real exits.

    python -m bench.early_exit --out docs/benchmarks.md

In one process, after warm-up, compile time apart:
  A. ceiling: decode step time with a forced exit at layer 10, 15, 20 vs full depth, against
     the ideal (e / L), at batch 1, 8, 32 (context ~256 tokens);
  B. overhead: exits configured (every 4 layers, max_prob) but never taken — once with the
     checks skipped because no row can exit (threshold NEVER), once with checks computed
     against threshold 1.0 (the vocabulary projection at every check) — vs the plain step;
  C. real exits with the untrained shared head on HumanEval prompts: engine decode tokens/s
     vs full depth, the batch exit-layer histogram, mean layers, ideal speedup, greedy
     agreement with full depth, for thresholds 0.8 / 0.9 / 0.95 and policies all / quorum.
     Full depth is the engine built with `early_exit=False`. The ideal counts the LM head
     (`exit_cost.cost_model`): (L + head) / (mean layers + exit head + checks).
`--random` uses same-shape random weights (no GGUF needed; speed only, for accelerators).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax
import numpy as np

from bench.common import (
    cpu_model,
    exit_summary,
    humaneval_prompts,
    log,
    serve,
    smollm2_shaped_random,
    write_marked,
)

MARK = ("<!-- bench.early_exit:begin -->", "<!-- bench.early_exit:end -->")
EXITS_EVERY_4 = (4, 8, 12, 16, 20, 24, 28)


# --------------------------------------------------------------------------- A and B: step times


def step_runner(cfg, params, batch: int, context: int, exit_config=None):
    from ee_jax.serving.kv_cache import allocate_cache
    from ee_jax.serving.model_runner import ModelRunner, StepBatch, StepShape

    page = 16
    pages = -(-(context + 1) // page)
    runner = ModelRunner(cfg, params, allocate_cache(cfg, batch * pages + 1, page),
                         exit_config)
    b = StepBatch.empty(StepShape(batch, 1, pages))
    for r in range(batch):
        b.page_table[r] = 1 + r * pages + np.arange(pages)
    b.positions[:] = context
    b.kv_lens[:] = context + 1
    return runner, b


def time_steps(pairs: dict, repeats: int) -> dict[str, float]:
    """Median step time per runner, measured round-robin so drift hits all alike."""
    for runner, b in pairs.values():  # warm-up (compiles)
        np.asarray(runner.step(b))
    times = {k: [] for k in pairs}
    for _ in range(repeats):
        for k, (runner, b) in pairs.items():
            t = time.perf_counter()
            np.asarray(runner.step(b))
            times[k].append(time.perf_counter() - t)
    return {k: float(np.median(v)) for k, v in times.items()}


def part_ab(cfg, params, batches, repeats, context=255):
    from ee_jax.models.exit_config import NEVER, ExitConfig

    rows = []
    for B in batches:
        log(f"A/B: batch {B}: compiling 7 step variants")
        pairs = {"full": step_runner(cfg, params, B, context)}
        for e in (10, 15, 20):
            ec = ExitConfig(exit_layers=(10, 15, 20), force_exit_layer=e)
            pairs[f"forced {e}"] = step_runner(cfg, params, B, context, ec)
        ec = ExitConfig(exit_layers=EXITS_EVERY_4, threshold=NEVER)
        pairs["never (checks skipped)"] = step_runner(cfg, params, B, context, ec)
        pairs["never (checks run, thr 1.0)"] = step_runner(cfg, params, B, context, ec)
        pairs["never (checks run, thr 1.0)"][1].threshold[:] = 1.0
        pairs["never (checks skipped)"][1].threshold[:] = np.inf
        for k in list(pairs):
            if k.startswith("forced"):
                pairs[k][1].threshold[:] = 0.5
        t = time_steps(pairs, repeats)
        rows.append((B, t))
        log("  " + ", ".join(f"{k} {1000 * v:.1f} ms" for k, v in t.items()))
    return rows


# --------------------------------------------------------------------------- C: real exits


def part_c(model, batch, new_tokens, thresholds, policies, n_prompts):
    from ee_jax.models.exit_config import ExitConfig
    from ee_jax.serving.llm import LLM
    from ee_jax.serving.params import greedy

    prompts = [ids for _, ids in humaneval_prompts(model.tokenizer, 64, 400)][:n_prompts]
    L = model.config.n_layers
    kw = dict(max_num_seqs=batch, max_model_len=1024, page_size=16, progress=False,
              max_num_batched_tokens=8192)
    variants = {"full depth": None}
    for pol in policies:
        for thr in thresholds:
            variants[f"{pol} @ {thr}"] = ExitConfig(
                exit_layers=EXITS_EVERY_4, threshold=thr, policy=pol, measure="max_prob")
    results = {}
    for name, ec in variants.items():
        log(f"C: {name}: {len(prompts)} HumanEval prompts, batch {batch}, {new_tokens} tokens")
        # Full depth: early_exit=False (LLM(model) alone would serve the shipped heads).
        llm = LLM(model, exit_config=ec, early_exit=ec is not None, **kw)
        warm = serve(llm, prompts[:batch], greedy(4, ignore_eos=True))
        run = serve(llm, prompts, greedy(new_tokens, ignore_eos=True))
        s = run.stats
        ex = exit_summary(s, model.config, ec)
        results[name] = dict(tps=s.decode_tokens_per_s, hist=s.exit_histogram(),
                             mean=s.mean_layers_per_decode_step or L, ideal=ex["ideal"],
                             tokens=[o.token_ids for o in run.outputs],
                             compile=warm.compile_time + run.compile_time)
        log(f"  {s.decode_tokens_per_s:.1f} tok/s, exits {{{s.exit_histogram()}}}"
            f"{f', {run.num_compiles} compiles in the measured call' if run.num_compiles else ''}")
        del llm
    ref = results["full depth"]["tokens"]
    for r in results.values():
        same = [a == b for a, b in zip(r["tokens"], ref, strict=True)]
        tok = [np.mean([x == y for x, y in zip(a, b, strict=True)])
               for a, b in zip(r["tokens"], ref, strict=True)]
        prefix = []
        for a, b in zip(r["tokens"], ref, strict=True):
            k = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(b))
            prefix.append(k / len(b))
        r.update(seq_agree=float(np.mean(same)), tok_agree=float(np.mean(tok)),
                 prefix_agree=float(np.mean(prefix)))
    return results, len(prompts)


# --------------------------------------------------------------------------- report


def render(ctx) -> str:
    L = ctx["L"]
    out = ["## Early-exit decoding (`bench/early_exit.py`)", "",
           f"Command: `{ctx['command']}`  ", f"Machine: {ctx['machine']}; jax {jax.__version__},"
           f" backend {jax.default_backend()}; weights: {ctx['weights']}. Run {ctx['date']}.",
           "", "### A. Ceiling: forced exit vs full depth (decode step, context 256)", "",
           "| batch | full depth ms | exit@10 ms (ratio / ideal 0.33) | exit@15 (ideal 0.50) |"
           " exit@20 (ideal 0.67) |", "|---|---|---|---|---|"]
    for B, t in ctx["ab"]:
        f = t["full"]
        cells = [f"{1000 * t[f'forced {e}']:.1f} ({t[f'forced {e}'] / f:.2f})"
                 for e in (10, 15, 20)]
        out.append(f"| {B} | {1000 * f:.1f} | " + " | ".join(cells) + " |")
    out += ["", "Exit-layer histogram: every decode step exits at the forced layer "
            "(by construction).", "",
            "### B. Overhead of exits that are never taken (exits every 4 layers, max_prob)", "",
            "| batch | plain ms | checks skipped (NEVER) ms (ratio) | checks run, threshold 1.0 "
            "ms (ratio) |", "|---|---|---|---|"]
    for B, t in ctx["ab"]:
        f = t["full"]
        a, b = t["never (checks skipped)"], t["never (checks run, thr 1.0)"]
        out.append(f"| {B} | {1000 * f:.1f} | {1000 * a:.1f} ({a / f:.3f}) | "
                   f"{1000 * b:.1f} ({b / f:.3f}) |")
    out += ["", f"Exit-layer histogram: all steps at {L}/{L} (no exit is taken).", ""]
    if ctx.get("c"):
        res, n, B, T = ctx["c"]
        full = res["full depth"]["tps"]
        out += [f"### C. Real exits, untrained shared head (per-exit norm = final norm), "
                f"{n} HumanEval prompts, batch {B}, {T} greedy tokens", "",
                "| variant | decode tok/s | speedup vs full | mean layers | ideal (head counted) | "
                "batch exit histogram (layer:steps) | identical seqs | token agreement | "
                "agreeing prefix |", "|---|---|---|---|---|---|---|---|---|"]
        for name, r in res.items():
            out.append(f"| {name} | {r['tps']:.1f} | {r['tps'] / full:.2f}x | {r['mean']:.1f} "
                       f"| {r['ideal']:.2f}x | {r['hist']} | {r['seq_agree']:.2f} | "
                       f"{r['tok_agree']:.2f} | {r['prefix_agree']:.2f} |")
        out += ["", "Token agreement: fraction of positions equal to the full-depth output; "
                "agreeing prefix: mean fraction of tokens before the first difference."]
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.early_exit")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--random", action="store_true", help="same-shape random weights")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--real-batch", type=int, default=8)
    p.add_argument("--real-prompts", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--thresholds", type=float, nargs="+", default=[0.8, 0.9, 0.95])
    p.add_argument("--policies", nargs="+", default=["all", "quorum"])
    p.add_argument("--skip-real", action="store_true")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    from ee_jax.models.loading import load_model

    if args.random:
        cfg, params = smollm2_shaped_random()
        model, weights = None, "random, SmolLM2-135M shapes, f32"
    else:
        model = load_model(args.model, dtype="float32")
        cfg, params, weights = model.config, model.params, f"{args.model} (GGUF, f32)"
    ctx = {"L": cfg.n_layers, "machine": f"{cpu_model()}, {len(jax.devices())} "
           f"{jax.devices()[0].platform} device(s)",
           "weights": weights, "date": time.strftime("%Y-%m-%d"),
           "command": "python -m bench.early_exit " + " ".join(argv or __import__("sys").argv[1:])}
    ctx["ab"] = part_ab(cfg, params, args.batches, args.repeats)
    if model is not None and not args.skip_real:
        res, n = part_c(model, args.real_batch, args.new_tokens, args.thresholds,
                        args.policies, args.real_prompts)
        ctx["c"] = (res, n, args.real_batch, args.new_tokens)
    text = render(ctx)
    print(text)
    if args.out:
        write_marked(args.out, text, MARK)
        log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
