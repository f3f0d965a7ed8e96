"""Attention backends, step times: decode (T = 1) over a page-table bucket wider than the rows.

    python -m bench.attention                               # CPU: reference vs xla
    python -m bench.attention --backends reference xla pallas_gpu layout_copy --batches 8 32 128
    python -m bench.attention --backends xla xla_unblocked --batches 16 32 --lens 128 451
    XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1" \
        python -m bench.attention                           # CPU, one thread: steadier when shared

SmolLM2-135M's attention shapes (9 query / 3 kv heads of 64, page size 16), random f32 data;
rows hold about 250 tokens (220-280) in a bucket of 32 pages (512 keys), distinct random pages,
the rest of each row's table the null page. One jitted call runs the backend `--layers` times
in a `fori_loop` with a traced layer index (the cache holds 2 layers; layer = i % 2), each
call's output feeding the next query so nothing is hoisted: that is the attention share of one
decode step. Backends are timed interleaved after a warm-up (compile apart): median and best
of `--repeats` rounds, each round the mean of `--steps` calls (on a shared machine the best
round is the steadier figure). `layout_copy` times a lower bound of the Pallas wrappers'
per-layer copy of our [L, P, S, K, hd] cache into the kernels' [K, P, S, hd] layout (here the
B * pages table entries: the pool is one page larger), which grows with the page bucket, not
with what the rows hold.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from ee_jax.serving.attention import AttentionMetadata
from ee_jax.serving.attention_kernels import BACKENDS, layer_pages
from ee_jax.serving.kv_cache import NULL_PAGE, KVCache

H, K, HD, S = 9, 3, 64, 16


def make_inputs(batch: int, tokens: int, pages: int, lo: int, hi: int, dtype, seed: int = 0):
    """q [B, T, H, hd], a 2-layer cache with distinct random pages per row, the metadata."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(lo, hi + 1, size=batch).astype(np.int32)
    lens = np.minimum(lens, pages * S)
    num_pages = 1 + batch * pages
    pool = rng.permutation(np.arange(1, num_pages))
    table = np.full((batch, pages), NULL_PAGE, np.int32)
    for b, n in enumerate(lens):
        need = -(-int(n) // S)
        table[b, :need], pool = pool[:need], pool[need:]
    shape = (2, num_pages, S, K, HD)
    cache = KVCache(jnp.asarray(rng.standard_normal(shape), dtype),
                    jnp.asarray(rng.standard_normal(shape), dtype))
    positions = np.maximum(lens[:, None] - tokens + np.arange(tokens), 0).astype(np.int32)
    meta = AttentionMetadata(jnp.asarray(positions), jnp.asarray(table), jnp.asarray(lens))
    q = jnp.asarray(rng.standard_normal((batch, tokens, H, HD)), dtype)
    return q, cache, meta


def layout_copy(q, cache, layer, meta, **_):
    """Not a backend: what the Pallas wrappers' per-layer slice + transpose of our cache into
    the kernels' [K, P, S, hd] layout costs at least. The wrappers materialise it (a kernel
    operand); here it is summed, which XLA fuses into one read of those pages, so this is a
    lower bound (a copy reads and writes them)."""
    k, v, _ = layer_pages(cache, layer, meta.page_table)
    return q + 1e-9 * (jnp.sum(k) + jnp.sum(v))


CHOICES = {**BACKENDS, "layout_copy": layout_copy,
           # xla as one loop over every row up to the longest (before rows were sorted into
           # row blocks, see `attention_kernels._ROW_BLOCKS`): the blocks' gain, side by side
           "xla_unblocked": functools.partial(BACKENDS["xla"], row_block=1 << 30)}


def step_fn(backend, layers: int):
    """jit(q, cache, meta) -> q after `layers` chained attention calls, layer index traced."""

    def run(q, cache, meta):
        def body(i, x):
            # The layer index depends on the data, so XLA cannot unroll the loop and share
            # work between the calls on the same layer.
            layer = (i + (x[0, 0, 0, 0] > 1e30).astype(jnp.int32)) % 2
            out = backend(x, cache, layer, meta, scale=HD ** -0.5)
            return x + 1e-3 * out

        return jax.lax.fori_loop(0, layers, body, q)

    return jax.jit(run)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backends", nargs="+", default=["reference", "xla"], choices=list(CHOICES))
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--tokens", type=int, default=1, help="queries per row (1: decode)")
    p.add_argument("--pages", type=int, default=32, help="page-table bucket W")
    p.add_argument("--lens", nargs=2, type=int, default=[220, 280], help="row lengths lo hi")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dtype", default="float32")
    args = p.parse_args(argv)
    print(f"jax {jax.__version__} {jax.devices()[0].platform}; H={H} K={K} hd={HD} S={S} "
          f"W={args.pages} lens {args.lens[0]}-{args.lens[1]} T={args.tokens} "
          f"{args.layers} layers {args.dtype}", flush=True)
    for batch in args.batches:
        q, cache, meta = make_inputs(batch, args.tokens, args.pages, *args.lens,
                                     jnp.dtype(args.dtype))
        fns = {}
        for name in args.backends:
            fns[name] = step_fn(CHOICES[name], args.layers)
            t0 = time.perf_counter()
            jax.block_until_ready(fns[name](q, cache, meta))
            print(f"  B={batch} {name}: compile+first {time.perf_counter() - t0:.2f} s",
                  flush=True)
        times: dict[str, list[float]] = {n: [] for n in fns}
        for _ in range(args.repeats):
            for name, fn in fns.items():  # interleaved
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    out = fn(q, cache, meta)
                jax.block_until_ready(out)
                times[name].append((time.perf_counter() - t0) / args.steps)
        med = {n: statistics.median(ts) for n, ts in times.items()}
        best = {n: min(ts) for n, ts in times.items()}
        parts = []
        for name in fns:
            ratio = ""
            if "reference" in fns and name != "reference":
                ratio = (f" ({med['reference'] / med[name]:.2f}x ref median, "
                         f"{best['reference'] / best[name]:.2f}x best)")
            parts.append(f"{name} {med[name] * 1e3:.2f} ms (best {best[name] * 1e3:.2f}){ratio}")
        print(f"B={batch}: per step of {args.layers} layers: " + "; ".join(parts), flush=True)

if __name__ == "__main__":
    main()
