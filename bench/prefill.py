"""Prefill time of the full-depth engine: B HumanEval prompts, one new token each.

    python -m bench.prefill --batches 8 32 --reps 3 [--attention-share]

Engine knobs as bench/serving.py's (max_num_seqs 32, max_model_len 1024, pages of 16, a
token budget of 512 per row), so its "ee-jax prefill s" column is what this measures alone,
without transformers beside it. Per batch: a warm-up call (compiles, reported apart), then
`--reps` calls; the figures are the median of the engine's own prefill seconds
(`EngineStats.prefill_time`) per call, the process's CPU seconds per call (on a loaded
machine a steadier measure of the work than wall time), and the token slots the steps'
shapes computed beside the real prompt tokens. Contention (other processes' CPU share during
the calls) is printed: on a shared machine compare runs made side by side, never with a
quiet run.

`--attention-share` (ragged prefill only): the step's attention alone (every layer's K/V
write and both backend calls at the step's metadata, random q/k/v), timed against the
whole step on the same inputs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from bench.common import Meter, humaneval_prompts, load_f32, log


def _cpu() -> float:
    """CPU seconds this process used (all threads): the work a call did, which other
    processes' load inflates far less than its wall time."""
    t = os.times()
    return t.user + t.system


def _shapes_of(engine):
    """Record every StepBatch the runner is handed (for slot counts and re-timing)."""
    runner, seen = engine.runner, []
    orig = runner.step

    def step(batch):
        seen.append(batch)
        return orig(batch)

    runner.step = step
    return seen


def attention_share(engine, batch, repeats: int = 3) -> tuple[float, float]:
    """(seconds of the whole step, seconds of its attention alone) on `batch`."""
    import jax
    import jax.numpy as jnp

    from ee_jax.serving.attention import AttentionMetadata, attend
    from ee_jax.serving.model_runner import unpack

    runner, cfg = engine.runner, engine.model_config
    shape = batch.shape
    buf = jax.device_put(batch.pack())
    inp = unpack(shape, buf)
    meta = AttentionMetadata(inp["positions"], inp["page_table"], inp["kv_lens"],
                             inp["block_positions"], inp["block_rows"])
    n = shape.tokens + shape.batch
    key = jax.random.PRNGKey(0)
    q = jax.random.normal(key, (n, cfg.n_heads, cfg.head_dim), jnp.float32)
    kv = jax.random.normal(key, (n, cfg.n_kv_heads, cfg.head_dim), jnp.float32)

    @jax.jit
    def attention_only(cache, q, kv):
        def body(i, carry):
            acc, cache = carry
            out, cache = attend(q, kv, kv, cache, i, meta, cfg, runner.attention)
            return acc + out, cache
        return jax.lax.fori_loop(0, cfg.n_layers, body, (jnp.zeros_like(q), cache))

    def best(fn):
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            jax.block_until_ready(fn())
            times.append(time.perf_counter() - t)
        return min(times)

    def whole():
        return runner._launch(shape, batch.pack())

    whole()  # compiled already; warm
    t_step = best(whole)
    cache = runner.cache
    jax.block_until_ready(attention_only(cache, q, kv))
    t_attn = best(lambda: attention_only(cache, q, kv))
    return t_step, t_attn


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--min-prompt", type=int, default=128)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--attention-share", action="store_true")
    args = p.parse_args(argv)

    from ee_jax.serving.llm import LLM
    from ee_jax.serving.params import SamplingParams

    m = load_f32(args.model)
    max_b = max(args.batches)
    llm = LLM(m, early_exit=False, progress=False, max_num_seqs=max(32, max_b),
              max_model_len=1024, page_size=16, max_num_batched_tokens=max(32, max_b) * 512)
    engine = llm.engine
    seen = _shapes_of(engine)
    prompts = [ids for _, ids in humaneval_prompts(m.tokenizer, args.min_prompt,
                                                   args.max_prompt)]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for b in args.batches:
        batch = prompts[:b]
        real = sum(map(len, batch))
        t = time.perf_counter()
        llm.generate(batch, params, use_tqdm=False)
        log(f"batch {b}: warm-up (compiles) {time.perf_counter() - t:.1f} s")
        times, cpus = [], []
        with Meter() as meter:
            for _ in range(args.reps):
                seen.clear()
                before = engine.stats.snapshot()
                c0 = _cpu()
                llm.generate(batch, params, use_tqdm=False)
                cpus.append(_cpu() - c0)
                s = engine.stats.since(before)
                if s.num_compiles:
                    log(f"batch {b}: a measured call compiled {s.num_compiles} programs")
                times.append(s.prefill_time)
        # token slots the dense layers ran: N + B packed (ragged), B x T padded (before)
        slots = sum(x.shape.tokens + x.shape.batch if hasattr(x, "block_tokens")
                    else x.shape.batch * x.shape.tokens for x in seen)
        shapes = ", ".join(f"{x.shape.batch}x{x.shape.tokens}x{x.shape.pages}" for x in seen)
        print(f"batch {b}: prompts {min(map(len, batch))}-{max(map(len, batch))} tokens, "
              f"{real} real; prefill s median {statistics.median(times):.3f} "
              f"(all: {', '.join(f'{x:.3f}' for x in times)}); process CPU s per call median "
              f"{statistics.median(cpus):.2f} (all: {', '.join(f'{x:.2f}' for x in cpus)}); "
              f"steps {len(seen)} "
              f"[{shapes}]; computed token slots {slots} ({slots / real:.2f}x real); "
              f"contention {meter.contention:.0%}", flush=True)
        if args.attention_share:
            big = max(seen, key=lambda x: x.shape.tokens)
            t_step, t_attn = attention_share(engine, big)
            print(f"batch {b}: step {big.shape} whole {t_step:.3f} s, attention alone "
                  f"{t_attn:.3f} s ({t_attn / t_step:.0%})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
