"""Attention backends over the paged cache, all with one signature:

    backend(q [B, T, H, hd], cache, layer, meta, *, scale, window=None, softcap=None)
        -> [B, T, H, hd]

called after this step's K/V are in the cache: a query at position p of row b sees the keys
at positions k < kv_lens[b] with k <= p and, when `window` > 0, p - k < window; scores are
q.k * scale, soft-capped as tanh(s / softcap) * softcap when `softcap` is set. A query that
sees no key (padding rows, kv_lens == 0) gives zeros. `layer` may be a traced int32 scalar.

- `reference`: `ee_jax.serving.attention.paged_attention`, the gather oracle (every row's W
  pages copied into one [B, W*S] array, then masked).
- `xla`: flash-decoding in plain XLA. A `lax.fori_loop` over chunks of page columns, up to
  the longest row's real length (not the page-table bucket), gathering one chunk of pages at
  a time and folding it into an online softmax with f32 accumulators. Any T. Batches of
  at least two row blocks are sorted by length and each block of rows loops only to its own
  longest row, so a step's work follows the rows' real lengths, not B x the longest.
- `pallas_gpu`, `pallas_tpu`: the paged decode-attention Pallas kernels JAX ships: one
  query a row, no sliding window. Up to `KERNEL_MAX_QUERIES` queries a row (a decode step
  with back-fill "deferred" carries the row's pending token as a second query) go through
  the kernel as that many rows, each with its own length, reading the row's pages once per
  query; more (prefill blocks) or a window fall back to `xla`.

`select_backend(name, platform)` picks one; "auto" picks by platform, which is always given:
a step's configuration holds the platform it is built for and the backend resolved there
(`model_runner.StepConfig`), so tracing reads no state of the process.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp

from ee_jax.serving.attention import AttentionMetadata, Backend, paged_attention
from ee_jax.serving.kv_cache import NULL_PAGE, TPU_LANES, KVCache, kernel_pages, take_pages

# Masked scores: finite, so that exp(m_old - m_new) of a row that has seen no key yet is
# exp(0) or 0, never NaN (inf - inf).
_NEG = -1e30
# xla: keys per chunk of the online softmax, at least _CHUNK_KEYS and at least
# _CHUNK_ELEMENTS / (B * T) (small batches pay more per loop iteration than per key; counted
# per query, so a prefill step's 32-query blocks take 128-key chunks, not up to 2048 / blocks:
# a lone prompt's blocks read 512 keys where 128 would do: the prefill benchmark at ed116cf).
# Chosen on CPU (`python -m bench.kernels attention`, SmolLM2 shapes, page size 16): 64-128
# keys were best at batch 32, larger chunks no worse at batch 1-8, within the noise of a
# shared 2-core machine.
_CHUNK_KEYS = 128
_CHUNK_ELEMENTS = 2048
# xla: rows per block, max(_MIN_ROW_BLOCK, B // _ROW_BLOCKS), once a batch holds at least two
# blocks. Sorted by kv_len, each block's loop stops at its own longest row. Measured on the
# whole decode step (the decode micro-benchmark removed in f73b65e, rows of ~130-450 keys in a
# 512-key page bucket; `python -m bench.kernels attention --backends xla xla_unblocked` repeats
# batch 32): batch 32, blocks of 8: 15% less step time than one loop over all rows; blocks of 4
# or 16 no better than 8; batch 8, blocks of 4: 8-11% less CPU time per step.
_ROW_BLOCKS = 4
_MIN_ROW_BLOCK = 4

reference: Backend = paged_attention


def _check(q: jax.Array, cache: KVCache, meta: AttentionMetadata) -> tuple[int, ...]:
    """Shapes (B, T, H, K, hd, S, W); a clear error for shapes that cannot go together."""
    if q.ndim != 4:
        raise ValueError(f"q must be [B, T, H, head_dim], got shape {q.shape}")
    B, T, H, hd = q.shape
    K, hd_c = cache.kv_heads, cache.head_dim
    if hd != hd_c or H % K:
        raise ValueError(f"q {q.shape} does not fit the cache {cache.k.shape}: need the same "
                         "head_dim and n_heads a multiple of the cache's kv heads")
    if meta.positions.shape != (B, T) or meta.page_table.shape[0] != B \
            or meta.kv_lens.shape != (B,):
        raise ValueError(f"metadata does not fit q {q.shape}: positions "
                         f"{meta.positions.shape}, page_table {meta.page_table.shape}, "
                         f"kv_lens {meta.kv_lens.shape}")
    return B, T, H, K, hd, cache.page_size, meta.page_table.shape[1]


def _static_zero(window) -> bool:
    """True when `window` is known at trace time to mean "no sliding window"."""
    if window is None:
        return True
    if isinstance(window, jax.core.Tracer):
        return False
    return int(window) <= 0


# --------------------------------------------------------------------------- xla

# Up to this many query rows per kv head (T * H/K), `xla` forms q.k and p.v as broadcast
# products reduced over one axis rather than as batched matmuls: with 3 rows per (row, kv
# head) the matmuls are tiny and XLA's CPU backend pays per matmul; the products fuse with
# the page gather's layout and ran about 2x faster at batch 32 (the attention benchmark
# removed in f73b65e).
_PRODUCT_MAX_ROWS = 8


def _scores(qh: jax.Array, kc: jax.Array) -> jax.Array:
    """q.k in f32: qh [B, K, R, hd], kc [B, N, K, hd] -> [B, K, R, N]."""
    if qh.shape[2] <= _PRODUCT_MAX_ROWS:
        prod = qh.astype(jnp.float32)[:, None] * kc.astype(jnp.float32)[:, :, :, None, :]
        return jnp.moveaxis(jnp.sum(prod, axis=-1), 1, 3)  # [B, N, K, R] -> [B, K, R, N]
    return jnp.einsum("bkrd,bnkd->bkrn", qh, kc, preferred_element_type=jnp.float32)


def _weighted_values(p: jax.Array, vc: jax.Array) -> jax.Array:
    """p.v in f32: p [B, K, R, N] (f32), vc [B, N, K, hd] -> [B, K, R, hd]."""
    if p.shape[2] <= _PRODUCT_MAX_ROWS:
        prod = jnp.moveaxis(p, 3, 1)[..., None] * vc.astype(jnp.float32)[:, :, :, None, :]
        return jnp.sum(prod, axis=1)  # [B, N, K, R, hd] -> [B, K, R, hd]
    return jnp.einsum("bkrn,bnkd->bkrd", p.astype(vc.dtype), vc,
                      preferred_element_type=jnp.float32)


def xla(q: jax.Array, cache: KVCache, layer, meta: AttentionMetadata, *,
        scale: float | None = None, window: jax.Array | None = None,
        softcap: float | None = None, chunk_keys: int | None = None,
        row_block: int | None = None) -> jax.Array:
    """Flash-decoding in plain XLA: no [B, W*S] copy, and no work past each row block's
    longest row.

    With B >= 2 * row_block (static; default max(4, B // 4)), rows are sorted by kv_len
    (longest first) and cut into blocks of row_block rows, each attended by its own loop
    (`_flash`) that stops at the block's longest row; outputs go back to the rows' order.
    Fewer rows: one loop over all of them. `chunk_keys` (static; default 128 for decode,
    T = 1, else max(128, 2048 // (B * T)), B the whole batch) sets the keys each iteration
    gathers. Decode's 128 makes the cost follow the rows' lengths, not the page table's
    width (`follows_lengths`): SmolLM2's attention, one layer, 2-core Xeon, W = 128 pages
    against the width ladder's W (8 / 32 / 96), contexts 100 / 500 / 1,500: batch 1
    116 / 234 / 695 us against 173 / 270 / 797; batch 8 410 / 1,319 / 3,516 against
    458 / 1,416 / 4,069; batch 32 1,390 / 4,815 / 14,692 against 1,398 / 4,937 / 14,087
    (2026-12-03, a second job sharing the CPU).
    """
    B = _check(q, cache, meta)[0]
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if chunk_keys is None:  # decode (T = 1): the loop stops within 127 keys of the longest row
        chunk_keys = _CHUNK_KEYS if q.shape[1] == 1 else \
            max(_CHUNK_KEYS, _CHUNK_ELEMENTS // (B * q.shape[1]))
    rb = max(_MIN_ROW_BLOCK, B // _ROW_BLOCKS) if row_block is None else int(row_block)
    if rb < 1:
        raise ValueError(f"row_block must be >= 1, got {row_block}")
    kw = dict(scale=scale, window=window, softcap=softcap, chunk_keys=chunk_keys)
    if B // rb < 2:  # fewer than two blocks: one loop
        return _flash(q, cache, layer, meta, **kw)
    order = jnp.argsort(-meta.kv_lens, stable=True)  # [B] longest first
    rows = AttentionMetadata(meta.positions[order], meta.page_table[order],
                             meta.kv_lens[order])
    qs = q[order]
    parts = [_flash(qs[i:i + rb], cache, layer,
                    AttentionMetadata(rows.positions[i:i + rb], rows.page_table[i:i + rb],
                                      rows.kv_lens[i:i + rb]), **kw)
             for i in range(0, B, rb)]
    return jnp.concatenate(parts)[jnp.argsort(order)]


def _flash(q: jax.Array, cache: KVCache, layer, meta: AttentionMetadata, *, scale: float,
           window: jax.Array | None, softcap: float | None, chunk_keys: int) -> jax.Array:
    """One flash-decoding loop over all rows of `q`, up to the longest row.

    Each of ceil(max(kv_lens) / (C*S)) iterations gathers C page columns of every row
    ([B, C*S, K, hd], small enough to stay in cache) and folds them into running max / sum /
    output accumulators in f32. With a sliding window the loop also starts at the first chunk
    any query can see. C = max(1, chunk_keys // page_size); a table of one chunk runs
    without a loop.
    """
    B, T, H, K, hd, S, W = _check(q, cache, meta)
    G = H // K
    R = T * G  # query rows per kv head, (t, g) t-major as in llama.gqa_attention
    C = max(1, min(W, chunk_keys // S))
    n_static = -(-W // C)
    table = meta.page_table
    if n_static * C != W:
        table = jnp.pad(table, ((0, 0), (0, n_static * C - W)), constant_values=NULL_PAGE)

    P = cache.num_pages
    qh = jnp.moveaxis(q.reshape(B, T, K, G, hd), 2, 1).reshape(B, K, R, hd)  # [B, K, R, hd]
    q_pos = jnp.repeat(meta.positions, G, axis=1)  # [B, R]
    kv_lens = meta.kv_lens
    hi = jnp.minimum(-(-jnp.max(kv_lens) // (C * S)), n_static)
    if _static_zero(window):
        window = None
        lo = jnp.int32(0)
    else:
        window = jnp.asarray(window, jnp.int32)
        first = jnp.maximum(jnp.min(meta.positions) - window + 1, 0)
        lo = jnp.where(window > 0, first // (C * S), 0).astype(jnp.int32)

    def body(c, carry):
        m, l, acc = carry  # [B, K, R], [B, K, R], [B, K, R, hd], f32
        rows = jax.lax.dynamic_slice_in_dim(table, c * C, C, axis=1) + layer * P  # [B, C]
        kc, vc = take_pages(cache, rows)  # [B, C*S, K, hd] each
        s = _scores(qh, kc) * scale  # [B, K, R, C*S]
        if softcap is not None:
            s = jnp.tanh(s / softcap) * softcap
        k_pos = c * C * S + jnp.arange(C * S, dtype=jnp.int32)  # [C*S]
        diff = q_pos[:, :, None] - k_pos  # [B, R, C*S]
        seen = (diff >= 0) & (k_pos < kv_lens[:, None, None])
        if window is not None:
            seen = seen & ((window <= 0) | (diff < window))
        seen = seen[:, None]  # [B, 1, R, C*S]
        s = jnp.where(seen, s, _NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        p = jnp.where(seen, jnp.exp(s - m_new[..., None]), 0.0)
        alpha = jnp.exp(m - m_new)
        pv = _weighted_values(p, vc)  # [B, K, R, hd]
        return m_new, alpha * l + p.sum(-1), alpha[..., None] * acc + pv

    init = (jnp.full((B, K, R), _NEG, jnp.float32), jnp.zeros((B, K, R), jnp.float32),
            jnp.zeros((B, K, R, hd), jnp.float32))
    if n_static == 1:  # one chunk: straight-line code (masking covers rows of any length)
        _, l, acc = body(0, init)
    else:
        _, l, acc = jax.lax.fori_loop(lo, hi, body, init)
    out = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
    out = jnp.moveaxis(out.reshape(B, K, T, G, hd), 1, 2)  # [B, T, K, G, hd]
    return out.reshape(B, T, H, hd).astype(q.dtype)


# --------------------------------------------------------------------------- Pallas


def layer_pages(cache: KVCache, layer, page_table: jax.Array
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The pages of `layer` the batch can read, in the kernels' layout, and a table into them:
    k, v [K, P', S, hd], table [B, W].

    A head-major pool (the engine's where a kernel reads it) is that layout already, all
    layers at once: no copy (`kv_cache.kernel_pages`). A layer-major one [L, P, S, K, hd]
    costs one copy per layer per step, of whichever is smaller (a static choice): the
    batch's B*W table entries (gathered; the table becomes 0..B*W-1) or the layer's whole
    pool of P pages (sliced), O(min(B*W, P) * S * K * hd) bytes written and read again by
    the kernel.
    """
    view = kernel_pages(cache, layer, page_table)
    if view is not None:
        return view
    L, P, S, K, hd = cache.k.shape
    B, W = page_table.shape
    if B * W < P:
        rows = (page_table + layer * P).reshape(B * W)
        k = jnp.take(cache.k.reshape(L * P, S, K, hd), rows, axis=0, mode="clip")
        v = jnp.take(cache.v.reshape(L * P, S, K, hd), rows, axis=0, mode="clip")
        page_table = jnp.arange(B * W, dtype=jnp.int32).reshape(B, W)
    else:
        k = jax.lax.dynamic_index_in_dim(cache.k, layer, 0, keepdims=False)  # [P, S, K, hd]
        v = jax.lax.dynamic_index_in_dim(cache.v, layer, 0, keepdims=False)
    return jnp.moveaxis(k, 2, 0), jnp.moveaxis(v, 2, 0), page_table


def _pad_columns(table: jax.Array, multiple: int) -> jax.Array:
    W = table.shape[1]
    extra = -W % multiple
    if extra:
        table = jnp.pad(table, ((0, 0), (0, extra)), constant_values=NULL_PAGE)
    return table


# Queries a row the kernel wrappers take as rows of their own (`_query_rows`). Each reads its
# row's pages again: at two (deferred's pending token beside the row's own) that is 2x the
# K/V a one-query step reads, where the `xla` fallback moved 8-17x on TPU
# (docs/roofline.md); a prefill block's 16-512 queries stay on `xla`.
KERNEL_MAX_QUERIES = 2


def _kernel_applies(q: jax.Array, window, softcap) -> bool:
    """The shipped kernels do one query per row (we give them up to KERNEL_MAX_QUERIES as
    rows), no sliding window, a static softcap."""
    return q.shape[1] <= KERNEL_MAX_QUERIES and _static_zero(window) and (
        softcap is None or not isinstance(softcap, jax.core.Tracer))


def _query_rows(q: jax.Array, meta: AttentionMetadata, table: jax.Array
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The one-query kernels' rows for q [B, T, H, hd]: each query a row of its own
    (q [B*T, H, hd]), seeing its row's keys up to its own position (lengths [B*T]: causal
    attention without a window), through its row's page table (table [B, W'] repeated)."""
    B, T = q.shape[:2]
    lengths = jnp.clip(jnp.minimum(meta.kv_lens[:, None], meta.positions + 1), 0)  # [B, T]
    return (q.reshape(B * T, *q.shape[2:]), lengths.reshape(B * T).astype(jnp.int32),
            jnp.repeat(table, T, axis=0) if T > 1 else table)


def pallas_gpu(q: jax.Array, cache: KVCache, layer, meta: AttentionMetadata, *,
               scale: float | None = None, window: jax.Array | None = None,
               softcap: float | None = None, interpret: bool = False) -> jax.Array:
    """JAX's Pallas (Triton) paged decode attention for GPU; `xla` where it does not apply.

    The kernel has no scale argument (q is scaled first; its softcap acts on scaled scores,
    as ours does), takes q in the cache's dtype, and splits each row's pages into `k_splits`
    partitions merged afterwards; block_h must be a multiple of 16 (3 query heads per kv head
    in SmolLM2 are padded to 16). `interpret=True` runs it on CPU (tests).
    """
    B, T, *_, hd, S, W = _check(q, cache, meta)
    if not _kernel_applies(q, window, softcap):
        return xla(q, cache, layer, meta, scale=scale, window=window, softcap=softcap)
    from jax.experimental.pallas.ops.gpu import paged_attention as gpu_kernel

    scale = hd ** -0.5 if scale is None else float(scale)
    # Up to 16 partitions of each row's table; blocks of the kernel's loop of a power-of-two
    # number of pages, up to 8, and at least 16 keys (Triton's dot needs 16 on each side).
    min_pages = -(-16 // S)
    k_splits = max(1, min(16, W // min_pages))
    per_split = -(-W // k_splits)
    pages_per_block = max(min_pages, min(8, 1 << (per_split - 1).bit_length()))
    per_split = -(-per_split // pages_per_block) * pages_per_block
    k_pages, v_pages, table = layer_pages(cache, layer, meta.page_table)
    qr, lengths, table = _query_rows(q, meta, _pad_columns(table, k_splits * per_split))
    qs = (qr.astype(jnp.float32) * scale).astype(cache.k.dtype)  # [B*T, H, hd]
    out = gpu_kernel.paged_attention(
        qs, k_pages, v_pages, table, lengths, block_h=16,
        pages_per_compute_block=pages_per_block, k_splits=k_splits, interpret=interpret,
        attn_logits_soft_cap=None if softcap is None else float(softcap))
    out = jnp.where((lengths > 0)[:, None, None], out, 0)
    return out.reshape(B, T, *out.shape[1:]).astype(q.dtype)


# Mosaic's block rule: a block's last two dimensions are multiples of 8 and 128, or equal to
# the array's. The kernel's running max and sum outputs are [B, H, 1] (or [B, H, 1, 1]) under
# the query's block spec, whose last dimension is head_dim: only head_dim % 128 == 0 passes
# (SmolLM2's 64 is refused in Mosaic lowering, found compiling for TPU v5e ahead of time).
# So a TPU cache is stored with head_dim padded to 128 (`kv_cache.storage_head_dim`) and the
# engine calls this kernel at 128.


def tpu_kernel_fits(head_dim: int) -> bool:
    """Whether JAX's Pallas TPU paged-attention kernel lowers for this head_dim."""
    return head_dim % TPU_LANES == 0


def pallas_tpu(q: jax.Array, cache: KVCache, layer, meta: AttentionMetadata, *,
               scale: float | None = None, window: jax.Array | None = None,
               softcap: float | None = None, interpret: bool = False) -> jax.Array:
    """JAX's Pallas (Mosaic) paged decode attention for TPU; `xla` where it does not apply.

    The kernel has no scale argument (q is scaled first) and computes q.k and p.v with K and
    V rounded to bf16 whatever the cache dtype (its page loader's dequantize step casts to
    bf16), so on an f32 cache it agrees with the reference to bf16 precision, not f32.
    Decided from the shapes at trace time: a head_dim Mosaic refuses (`tpu_kernel_fits`:
    not a multiple of 128, e.g. SmolLM2's 64) takes `xla`; the interpreter has no such rule
    and runs the kernel on any head_dim. The engine's TPU cache is stored at a multiple of
    128 (`kv_cache.storage_head_dim`), so through `paged_model.attend` the kernel applies.
    `interpret=True` runs it on CPU under Pallas' TPU interpreter (tests).
    """
    B, T, *_, hd, S, W = _check(q, cache, meta)
    if not _kernel_applies(q, window, softcap) or not (interpret or tpu_kernel_fits(hd)):
        return xla(q, cache, layer, meta, scale=scale, window=window, softcap=softcap)
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as tpu_kernel

    scale = hd ** -0.5 if scale is None else float(scale)
    pages_per_block = max(1, min(W, 128 // S))  # 128 keys per block, at most the table
    k_pages, v_pages, table = layer_pages(cache, layer, meta.page_table)
    qr, lengths, table = _query_rows(q, meta, _pad_columns(table, pages_per_block))
    qs = (qr.astype(jnp.float32) * scale).astype(q.dtype)  # [B*T, H, hd]
    ctx = pltpu.force_tpu_interpret_mode() if interpret else contextlib.nullcontext()
    with ctx:
        out = tpu_kernel(qs, k_pages, v_pages, lengths, table,
                         pages_per_compute_block=pages_per_block,
                         attn_logits_soft_cap=None if softcap is None else float(softcap))
    out = jnp.where((lengths > 0)[:, None, None], out, 0)
    return out.reshape(B, T, *out.shape[1:]).astype(q.dtype)


# --------------------------------------------------------------------------- selection

BACKENDS: dict[str, Backend] = {
    "reference": reference, "xla": xla, "pallas_gpu": pallas_gpu, "pallas_tpu": pallas_tpu,
}
_AUTO = {"cpu": "xla", "gpu": "pallas_gpu", "cuda": "pallas_gpu", "rocm": "pallas_gpu",
         "tpu": "pallas_tpu"}


def backend_name(name: str, platform: str | None = None) -> str:
    """The backend `name` means on `platform` ("tpu", "gpu"/"cuda", "cpu"): "auto" picks
    pallas_tpu on TPU, pallas_gpu on GPU and xla elsewhere; a Pallas kernel named for a
    platform it cannot run on is refused. "auto" needs the platform: nothing here defaults to
    where this process runs, since a step may be built for another machine (`aot`). Resolved
    once, where a step's static configuration is built (`model_runner.StepConfig.attention`),
    so a traced step only ever sees a concrete name."""
    if name != "auto" and name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}: choose one of "
                         f"{['auto', *BACKENDS]}")
    if platform is None:
        if name == "auto":
            raise ValueError("attention backend 'auto' names no backend without a platform: "
                             "resolve it where the step is configured, with "
                             "attention_kernels.backend_name(name, platform)")
        return name
    platform = platform.lower()
    name = _AUTO.get(platform, "xla") if name == "auto" else name
    kernel_platform = {"pallas_gpu": ("gpu", "cuda", "rocm"), "pallas_tpu": ("tpu",)}
    if name in kernel_platform and platform not in kernel_platform[name]:
        raise ValueError(
            f"attention backend {name!r} needs a {kernel_platform[name][0].upper()}, but the "
            f"platform is {platform!r}: use 'xla' (or 'auto') here; tests can run the kernel "
            f"interpreted with functools.partial(attention_kernels.{name}, interpret=True)")
    return name


def select_backend(name: str, platform: str | None = None) -> Backend:
    """The backend called `name` (`backend_name`: "auto" and the kernels' platforms are
    resolved on `platform`; a concrete name needs none, as a step's resolved one)."""
    return BACKENDS[backend_name(name, platform)]


def follows_lengths(name: str, platform: str | None = None) -> bool:
    """Whether backend `name`'s decode attention costs what the rows' lengths ask, whatever
    the page table's width: `xla`'s loop stops at the longest row, so the scheduler gives
    decode steps one width (`SchedulerConfig.decode_page_ladder` off: SmolLM2's default
    server compiles 6 decode programs, not 66). The reference gathers all W pages; the
    Pallas kernels stay on the ladder until timed on their devices."""
    return backend_name(name, platform) == "xla"


__all__ = ["BACKENDS", "Backend", "backend_name", "follows_lengths", "layer_pages",
           "pallas_gpu", "pallas_tpu", "reference", "select_backend", "tpu_kernel_fits", "xla"]
