"""How long XLA takes to compile a tiny engine's step programs, under this process's XLA_FLAGS
and JAX settings: the measurement behind the test suite's compile settings (docs/testing.md).

    python -m bench.compile_time                                      # XLA's defaults
    XLA_FLAGS=--xla_cpu_use_fusion_emitters=false python -m bench.compile_time
    JAX_DISABLE_MOST_OPTIMIZATIONS=1 python -m bench.compile_time     # -O0, as the suite

Method: one process, a 4-layer random model (`ee_jax.testing.tiny_model`) served full depth
(`early_exit=False`, stated: the baseline engine) with 8 sequences in 4 batch buckets and
16-token prefill chunks, greedy, 12 new tokens each; JAX's own compile events
(`jax.monitoring`) are summed: backend compile (XLA), lowering to MLIR, tracing. Prints them
with the run's wall and process CPU time, and a checksum of the tokens (the settings must not
change them). Run each setting in its own process, interleaved, more than once: one process
reads XLA_FLAGS once.
"""

from __future__ import annotations

import argparse
import collections
import os
import time

import jax
import numpy as np

from bench.common import cpu_model

EVENTS = {"backend": "/jax/core/compile/backend_compile_duration",
          "lowering": "/jax/core/compile/jaxpr_to_mlir_module_duration",
          "tracing": "/jax/core/compile/jaxpr_trace_duration"}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--new-tokens", type=int, default=12)
    args = ap.parse_args(argv)

    seconds: collections.Counter = collections.Counter()
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **_: seconds.update({event: duration}))

    from ee_jax.models.loading import LoadedModel
    from ee_jax.serving.llm import LLM
    from ee_jax.serving.params import greedy
    from ee_jax.testing import tiny_model

    cfg, params = tiny_model(seed=3, eos_token_ids=())
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (5, 17, 1, 33, 9, 24)]
    cpu0, t0 = time.process_time(), time.perf_counter()
    llm = LLM(LoadedModel(cfg, params, None, "tiny"), early_exit=False, max_num_seqs=8,
              max_model_len=128, page_size=4, num_pages=200, max_prefill_chunk=16,
              max_num_batched_tokens=48, batch_buckets=(1, 2, 4, 8), progress=False)
    outs = llm.generate(prompts, greedy(args.new_tokens), use_tqdm=False)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    compiled = " ".join(f"{k} {seconds[v]:.2f} s" for k, v in EVENTS.items())
    env = {k: os.environ.get(k, "") for k in ("XLA_FLAGS", "JAX_DISABLE_MOST_OPTIMIZATIONS")}
    print(f"CPU: {cpu_model()}; {env}")
    print(f"compile: {compiled}; run {wall:.2f} s wall, {cpu:.2f} s process CPU; "
          f"token checksum {sum(sum(o.token_ids) for o in outs)}")


if __name__ == "__main__":
    main()
