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

`--policies old new ...` serves each batch under several prefill shape policies, one engine
each, their calls interleaved (rep 1 of every policy, then rep 2, ...) so that contention
falls on all alike: `new` is the default (a prefill step's rows padded to at least one per
64 packed tokens, its page table pages_per_seq wide), `old` the policy before it (every
batch bucket, page tables in powers of two from 4), `rows` / `pages` one lever each,
`max-rows` every prefill step at the batch bucket of max_num_seqs. Each policy's prefill
shape count is printed; `--precompile` also times compiling every prefill shape of each
policy, then every decode shape (`LLMEngine.precompile((kind,))`).

    python -m bench.prefill --policies old new --batches 1 2 8 --max-num-seqs 8 \
        --max-model-len 480 --budget 2048 --min-prompt 64 --max-prompt 400 --reps 5

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

    from ee_jax.serving.attention import AttentionMetadata
    from ee_jax.serving.model_runner import unpack
    from ee_jax.serving.paged_model import attend

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


def _policy(name: str, max_num_seqs: int, max_model_len: int, page_size: int = 16) -> dict:
    """EngineConfig knobs of a prefill shape policy (see the module docstring)."""
    pages = -(-max_model_len // page_size)
    pow2 = tuple(4 << k for k in range(max(0, pages.bit_length())) if 4 << k < pages)
    return {"new": {}, "old": dict(prefill_row_tokens=None, prefill_page_buckets=pow2),
            "rows": dict(prefill_page_buckets=pow2),
            "pages": dict(prefill_row_tokens=None),
            "max-rows": dict(prefill_row_tokens=1)}[name]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--min-prompt", type=int, default=128)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=None, help="default: max(32, batches)")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--budget", type=int, default=None,
                   help="max_num_batched_tokens (default: 512 per row of max_num_seqs)")
    p.add_argument("--policies", nargs="+", default=["new"],
                   choices=("new", "old", "rows", "pages", "max-rows"))
    p.add_argument("--precompile", action="store_true",
                   help="time compiling every prefill shape of each policy first")
    p.add_argument("--attention-share", action="store_true")
    p.add_argument("--chunk-elements", type=int, default=None,
                   help="diagnostic: the xla attention's _CHUNK_ELEMENTS (keys per chunk are "
                   "max(128, this // rows); 0: 128 keys whatever the rows)")
    args = p.parse_args(argv)
    if args.chunk_elements is not None:
        from ee_jax.serving import attention_kernels

        attention_kernels._CHUNK_ELEMENTS = args.chunk_elements

    from ee_jax.serving.llm import LLM
    from ee_jax.serving.params import SamplingParams

    m = load_f32(args.model)
    seqs = args.max_num_seqs or max(32, max(args.batches))
    llms = {}
    for name in args.policies:
        llms[name] = LLM(m, early_exit=False, progress=False, max_num_seqs=seqs,
                         max_model_len=args.max_model_len, page_size=16,
                         max_num_batched_tokens=args.budget or seqs * 512,
                         **_policy(name, seqs, args.max_model_len))
        engine = llms[name].engine
        line = f"policy {name}:"
        for kind in ("prefill", "decode") if args.precompile else ("prefill",):
            n = len(engine.scheduler.config.step_shapes((kind,)))
            line += f" {n} {kind} shapes"
            if args.precompile:
                t, c0 = time.perf_counter(), _cpu()
                with Meter() as meter:
                    engine.precompile((kind,), progress=False)
                line += (f" precompiled in {time.perf_counter() - t:.1f} s ({_cpu() - c0:.1f} "
                         f"CPU s, contention {meter.contention:.0%});")
        print(line, flush=True)
    seen = {name: _shapes_of(llm.engine) for name, llm in llms.items()}
    prompts = [ids for _, ids in humaneval_prompts(m.tokenizer, args.min_prompt,
                                                   args.max_prompt)]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for b in args.batches:
        batch = prompts[:b]
        real = sum(map(len, batch))
        for name, llm in llms.items():
            t = time.perf_counter()
            llm.generate(batch, params, use_tqdm=False)
            log(f"batch {b}, {name}: warm-up (compiles) {time.perf_counter() - t:.1f} s")
        times = {name: [] for name in llms}
        cpus = {name: [] for name in llms}
        with Meter() as meter:
            for _ in range(args.reps):
                for name, llm in llms.items():
                    engine = llm.engine
                    seen[name].clear()
                    before = engine.stats.snapshot()
                    c0 = _cpu()
                    llm.generate(batch, params, use_tqdm=False)
                    cpus[name].append(_cpu() - c0)
                    s = engine.stats.since(before)
                    if s.num_compiles:
                        log(f"batch {b}, {name}: a measured call compiled {s.num_compiles} "
                            f"programs")
                    times[name].append(s.prefill_time)
        for name in llms:
            # token slots the dense layers ran: N + B
            slots = sum(x.shape.tokens + x.shape.batch for x in seen[name])
            shapes = ", ".join(f"{x.shape.batch}x{x.shape.tokens}x{x.shape.pages}"
                               for x in seen[name])
            label = f" {name}" if len(llms) > 1 else ""
            print(f"batch {b}{label}: prompts {min(map(len, batch))}-{max(map(len, batch))} "
                  f"tokens, {real} real; prefill s median {statistics.median(times[name]):.3f} "
                  f"(all: {', '.join(f'{x:.3f}' for x in times[name])}); process CPU s per call "
                  f"median {statistics.median(cpus[name]):.2f} "
                  f"(all: {', '.join(f'{x:.2f}' for x in cpus[name])}); "
                  f"steps {len(seen[name])} [{shapes}]; computed token slots {slots} "
                  f"({slots / real:.2f}x real); contention {meter.contention:.0%}", flush=True)
            if args.attention_share:
                big = max(seen[name], key=lambda x: x.shape.tokens)
                t_step, t_attn = attention_share(llms[name].engine, big)
                print(f"batch {b}{label}: step {big.shape} whole {t_step:.3f} s, attention "
                      f"alone {t_attn:.3f} s ({t_attn / t_step:.0%})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
