"""Attention over the paged cache: the per-step metadata, the cache write, the reference.

Cache writes (`write_kv`), back-fill writes (`ee_jax.serving.backfill`, through
`write_slots`) and attention all follow the slot rule of `AttentionMetadata` in this one
module. Every layer of every step attends through `ee_jax.serving.paged_model.attend`, which
writes this step's K/V and calls the backend `attention_kernels.select_backend` names.

Backends share one signature (`Backend`); `paged_attention` below is the pure-jnp gather
reference (every row's pages copied out and masked): it runs everywhere and is the oracle the
faster ones (`ee_jax.serving.attention_kernels`: an XLA decode path, the Pallas kernels JAX
ships for GPU and TPU) are tested against.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from ee_jax.models import llama
from ee_jax.serving.kv_cache import NULL_PAGE, KVCache, gather_layer, write_layer


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Built once per step, handed unchanged to every layer.

    Every step has B rows (sequences), each with its own page table and kv_len, and T tokens
    per row in `positions` (decode: one; a prefill step: each row's last token). A prefill
    step also carries the rest of its rows' chunks packed on one token axis (ragged prefill,
    architecture.md section 5): N = NB x Q tokens in query blocks of Q consecutive tokens of
    one row (`block_positions` [NB, Q], `block_rows` [NB]), so the dense work runs on the
    real tokens, not on B x the longest chunk. A layer then sees its tokens as one axis
    [N + B]: the blocks, then one token per row (`token_positions`).

    A token is real iff its position is < kv_lens of its row; padding tokens (the tail of a
    row's last block) and padding rows and blocks (kv_lens 0, block_rows -1) write to the
    null page and are never attended to.
    """

    positions: jax.Array  # [B, T] int32, absolute positions of the rows' tokens
    page_table: jax.Array  # [B, W] int32, padded with the null page
    kv_lens: jax.Array  # [B] int32, number of valid keys once this step's K/V are written
    block_positions: jax.Array | None = None  # [NB, Q] int32 (prefill steps with blocks)
    block_rows: jax.Array | None = None  # [NB] int32, the row of each block; -1: padding

    @property
    def has_blocks(self) -> bool:  # static: the layout of the layer's token axis
        return self.block_rows is not None

    @property
    def token_positions(self) -> jax.Array:
        """Positions in the layer's token layout: [B, T] without blocks, else [N + B]
        (blocks, then the rows' tokens; a prefill step's rows hold one token each)."""
        if not self.has_blocks:
            return self.positions
        return jnp.concatenate([self.block_positions.reshape(-1), self.positions[:, 0]])

    def rows_view(self) -> AttentionMetadata:
        """The rows' tokens alone: [B, T] queries, one per-row table (what backends take)."""
        return AttentionMetadata(self.positions, self.page_table, self.kv_lens)

    def blocks_view(self) -> AttentionMetadata:
        """The query blocks as rows of their own: [NB, Q] queries, each block with its row's
        page table. Blocks of one row see each other's keys through the cache, like any
        earlier key of the row. A block's kv_len is its causal bound, its last real token's
        position + 1 (0 for padding blocks): no query of it sees a later key, and a backend
        that stops at each row's kv_len (`attention_kernels.xla`) skips the keys no query of
        the block can see."""
        rows = jnp.maximum(self.block_rows, 0)
        row_lens = jnp.where(self.block_rows >= 0, self.kv_lens[rows], 0)  # [NB]
        real = self.block_positions < row_lens[:, None]  # [NB, Q]
        bound = jnp.max(jnp.where(real, self.block_positions, -1), axis=1) + 1
        return AttentionMetadata(self.block_positions, self.page_table[rows],
                                 bound.astype(jnp.int32))

    @property
    def token_valid(self) -> jax.Array:  # [B, T], or [N + B] with blocks
        if self.has_blocks:
            return jnp.concatenate([self.blocks_view().token_valid.reshape(-1),
                                    self.rows_view().token_valid[:, 0]])
        return self.positions < self.kv_lens[:, None]

    def write_slots(self, page_size: int):
        """(pages, offsets), each [B, T] (or [N + B] with blocks, the layer's token layout):
        where this step's tokens go in the cache."""
        if self.has_blocks:
            parts = [m.write_slots(page_size) for m in (self.blocks_view(), self.rows_view())]
            return tuple(jnp.concatenate([a.reshape(-1), b.reshape(-1)])
                         for a, b in zip(*parts, strict=True))
        W = self.page_table.shape[1]
        page_idx = jnp.clip(self.positions // page_size, 0, W - 1)
        pages = jnp.take_along_axis(self.page_table, page_idx, axis=1)
        pages = jnp.where(self.token_valid, pages, NULL_PAGE)
        return pages, self.positions % page_size


# backend(q [B, T, H, hd], cache, layer, meta, *, scale, window, softcap) -> [B, T, H, hd],
# called after this step's K/V are in the cache. window: int32 scalar (0: none) or None.
Backend = Callable[..., jax.Array]


def write_kv(cache: KVCache, layer, meta: AttentionMetadata, k: jax.Array, v: jax.Array
             ) -> KVCache:
    """k, v: [B, T, K, hd] (or [N + B, K, hd] with blocks) written at this step's slots of
    `layer`: one scatter."""
    pages, offsets = meta.write_slots(cache.page_size)
    kh, hd = k.shape[-2:]
    return write_layer(cache, layer, pages.reshape(-1), offsets.reshape(-1),
                       k.reshape(-1, kh, hd), v.reshape(-1, kh, hd))


def paged_attention(q: jax.Array, cache: KVCache, layer, meta: AttentionMetadata, *,
                    scale: float | None = None, window: jax.Array | None = None,
                    softcap: float | None = None) -> jax.Array:
    """The reference: causal attention of q [B, T, H, hd] over each row's pages of `layer`,
    gathered into one [B, W*S] copy -> [B, T, H, hd]."""
    k, v = gather_layer(cache, layer, meta.page_table)  # [B, W*S, K, hd]
    key_pos = jnp.arange(k.shape[1], dtype=jnp.int32)
    mask = llama.attention_weights_mask(meta.positions, key_pos,
                                        key_pos[None, :] < meta.kv_lens[:, None], window=window)
    return llama.gqa_attention(q, k, v, mask, scale=scale, softcap=softcap)
