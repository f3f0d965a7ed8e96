"""Host time per step and the overlap's effect (issue 13: host time < 10% of a batch-8 step).

SmolLM2-shaped random weights, full depth (no exit config: `LLMEngine(..., exit_config=None)`
is the FullDepth policy), batch 8, 100-token prompts, 48 new tokens each; the same workload
with overlapped steps (`async_scheduling=True`, the default) and blocking steps, each warmed up
by one identical run first. Host time is `EngineStats.host_time`: step() time not spent
waiting for the device nor compiling.

    python -m bench.host_time [--batch 8] [--new-tokens 48]
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--prompt-len", type=int, default=100)
    args = p.parse_args(argv)
    import numpy as np

    from bench.common import log, machine, smollm2_shaped_random
    from ee_jax.serving.engine import EngineConfig, LLMEngine
    from ee_jax.serving.params import SamplingParams

    cfg, params = smollm2_shaped_random()
    B = args.batch
    print(f"{machine()}; batch {B}, prompts {args.prompt_len}, {args.new_tokens} new tokens, "
          f"full depth, SmolLM2-shaped random weights")
    print("| steps | wall (s) | decode ms/step | host ms/step | host / decode step |"
          .replace("steps", "mode", 1))
    print("|---|---|---|---|---|")
    for overlapped in (True, False):
        engine = LLMEngine(cfg, params, None, EngineConfig(
            max_num_seqs=B, max_model_len=512, async_scheduling=overlapped,
            batch_buckets=tuple(b for b in (1, 2, 4, 8, 16, 32, 64) if b <= B) or (B,)),
            exit_config=None)
        rng = np.random.default_rng(0)

        def run(tag: str) -> float:
            for i in range(B):
                engine.add_request(f"{tag}-{i}", rng.integers(3, 40000, args.prompt_len).tolist(),
                                   SamplingParams(max_tokens=args.new_tokens, temperature=0.0,
                                                  ignore_eos=True))
            t = time.perf_counter()
            while engine.has_unfinished_requests():
                engine.step()
            return time.perf_counter() - t

        log(f"warm-up ({'overlapped' if overlapped else 'blocking'})")
        run("warm")
        snap = engine.stats.snapshot()
        wall = run("measured")
        s = engine.stats.since(snap)
        host = s.host_time / s.num_steps
        print(f"| {'overlapped' if overlapped else 'blocking'} | {wall:.2f} | "
              f"{1000 * s.decode_step_time:.1f} | {1000 * host:.2f} | "
              f"{100 * host / s.decode_step_time:.1f}% |", flush=True)
    print(f"\ncommand: python -m bench.host_time {' '.join(sys.argv[1:])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
