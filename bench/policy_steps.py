"""Decode step time per exit policy, same prompts, one process (a quick side-by-side check).

    python -m bench.policy_steps --batch 8 --new-tokens 48

Engines: no exit config (plain full depth), policy "never", "all" at threshold 0.9, and
"per_row" at thresholds inf (no row may leave: its fixed overhead) and 0.9; the shipped heads of
the default model. Every engine runs the prompts once to compile (excluded), then --repeats
interleaved rounds with EOS ignored (all see the same sequence lengths); the best round's mean
decode step time is printed with mean executed layers per row and the share of row-layers
computed.
"""

from __future__ import annotations

import argparse
import dataclasses

from bench.common import humaneval_prompts, log


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args(argv)

    from ee_jax.models.loading import load_model
    from ee_jax.serving.engine import EngineStats
    from ee_jax.serving.llm import LLM
    from ee_jax.serving.params import greedy

    m = load_model(args.model)
    shipped = m.shipped_exit_heads()
    if shipped is None:
        raise SystemExit(f"{args.model} ships no exit heads")
    ec, heads = shipped
    prompts = [ids for _, ids in humaneval_prompts(m.tokenizer, 100, 200)][:args.batch]

    def engine(exit_config=None):
        return LLM(m, exit_config=exit_config, exit_heads=heads if exit_config else None,
                   early_exit=exit_config is not None, progress=False,
                   max_num_seqs=args.batch, max_model_len=256 + args.new_tokens)

    per_row = engine(dataclasses.replace(ec, policy="per_row"))
    runs = {"no exit config": (engine(), None),
            "never": (engine(dataclasses.replace(ec, policy="never")), None),
            "all @ 0.9": (engine(dataclasses.replace(ec, policy="all")), 0.9),
            "per_row @ inf": (per_row, float("inf")),
            "per_row @ 0.9": (per_row, 0.9)}
    sp = lambda thr: greedy(args.new_tokens, ignore_eos=True, exit_threshold=thr)  # noqa: E731
    for name, (e, thr) in runs.items():
        log(f"compiling {name}")
        e.generate(prompts, sp(thr), use_tqdm=False)
    best: dict[str, EngineStats] = {}
    for _ in range(args.repeats):
        for name, (e, thr) in runs.items():
            e.engine.stats = EngineStats()
            e.generate(prompts, sp(thr), use_tqdm=False)
            s = e.engine.stats
            if name not in best or s.decode_step_time < best[name].decode_step_time:
                best[name] = s
    base = best["never"].decode_step_time
    print(f"batch {args.batch}, {len(prompts)} HumanEval prompts, {args.new_tokens} tokens")
    for name, s in best.items():
        t = s.decode_step_time
        print(f"{name:16s} {1000 * t:6.1f} ms/step ({base / t:.2f}x never)"
              f"  mean layers/row {s.mean_layers_per_row:4.1f}  row-layers computed "
              f"{s.work_fraction:.2f}  rows per exit layer {{{s.row_exit_histogram()}}}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
