"""The learned back-fill maps in bf16 (as loaded, `backfill_maps.MAP_DTYPE`) against the same
maps cast to f32, on this CPU: full depth (`early_exit=False`, the baseline) and the shipped
exit engine with each map dtype, interleaved in one process after a warm-up, exits forced on
(controller "exits"), the full-depth tokens forced so every engine decodes the same text.

    python -m bench.maps_dtype [--prompts 12] [--new-tokens 32] [--rounds 6]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

from bench.common import cpu_model, log, num_cpus
from bench.shipped_exits import forced_params, make_llm, serve, workload_prompts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--workload", default="instructions")
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=6)
    args = p.parse_args(argv)

    import jax.numpy as jnp

    from ee_jax.models.loading import load_model
    from ee_jax.serving.controller import ControllerConfig
    from ee_jax.serving.params import greedy

    model = load_model(args.model, dtype="float32", progress=False)
    ec, heads = model.shipped_exit_heads()
    ec = dataclasses.replace(ec, policy="all")
    f32 = dict(heads, backfill={k: jnp.asarray(v, jnp.float32)
                                for k, v in heads["backfill"].items()})
    prompts = workload_prompts(model, args.workload, args.prompts)
    max_len = -(-(max(map(len, prompts)) + args.new_tokens + 16) // 16) * 16
    full = make_llm(model, None, None, 1, max_len)  # early_exit=False: the baseline
    refs = [o.token_ids for o in serve(full, prompts, greedy(args.new_tokens)).outputs]
    params = forced_params(refs)
    forced = ControllerConfig(mode="exits")
    engines = {"full depth": full,
               "maps bf16": make_llm(model, ec, heads, 1, max_len, exit_control=forced),
               "maps f32": make_llm(model, ec, f32, 1, max_len, exit_control=forced)}
    for llm in engines.values():  # warm-up: every program these sequences need
        serve(llm, prompts, params)
    tps = {n: [] for n in engines}
    for rep in range(args.rounds):
        order = list(engines) if rep % 2 == 0 else list(reversed(engines))
        for n in order:
            tps[n].append(serve(engines[n], prompts, params).stats.decode_tokens_per_s)
        log(f"round {rep + 1}: " + ", ".join(f"{n} {tps[n][-1]:.1f}" for n in engines))
    print(f"{cpu_model()}, {num_cpus()} cores; {args.model}, {args.workload}, "
          f"{args.prompts} prompts x {args.new_tokens} tokens, batch 1, threshold {ec.threshold}, "
          f"back-fill {ec.backfill}")
    for n in engines:
        r = [a / b for a, b in zip(tps[n], tps["full depth"], strict=True)]
        print(f"{n}: {statistics.median(tps[n]):.1f} tok/s, {statistics.median(r):.3f}x of full "
              f"depth (rounds {', '.join(f'{x:.3f}' for x in r)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
