"""Attention over the paged cache, and the per-step metadata every layer shares.

`paged_attention` is the pure-jnp gather reference: it runs on CPU, GPU and TPU. A faster
kernel (Pallas ragged paged attention) can replace it behind the same signature.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ee_jax.models.llama import gqa_attention
from ee_jax.serving.kv_cache import NULL_PAGE, KVCache, gather_layer, write_layer


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Built once per step, handed unchanged to every layer.

    A token is real iff its position is < kv_lens of its row; padding tokens (in a prompt
    chunk shorter than the bucket) and padding rows (kv_lens == 0) write to the null page
    and are never attended to.
    """

    positions: jax.Array  # [B, T] int32, absolute positions of this step's tokens
    page_table: jax.Array  # [B, W] int32, padded with the null page
    kv_lens: jax.Array  # [B] int32, number of valid keys once this step's K/V are written

    @property
    def token_valid(self) -> jax.Array:  # [B, T]
        return self.positions < self.kv_lens[:, None]

    def write_slots(self, page_size: int):
        """(pages, offsets), each [B, T]: where this step's tokens go in the cache."""
        W = self.page_table.shape[1]
        page_idx = jnp.clip(self.positions // page_size, 0, W - 1)
        pages = jnp.take_along_axis(self.page_table, page_idx, axis=1)
        pages = jnp.where(self.token_valid, pages, NULL_PAGE)
        return pages, self.positions % page_size


def write_kv(cache: KVCache, layer, meta: AttentionMetadata, k: jax.Array, v: jax.Array
             ) -> KVCache:
    """k, v: [B, T, K, hd] written at this step's slots of `layer`."""
    pages, offsets = meta.write_slots(cache.page_size)
    kh, hd = k.shape[-2:]
    return write_layer(cache, layer, pages.reshape(-1), offsets.reshape(-1),
                       k.reshape(-1, kh, hd), v.reshape(-1, kh, hd))


def paged_attention(q: jax.Array, cache: KVCache, layer, meta: AttentionMetadata) -> jax.Array:
    """Causal attention of q [B, T, H, hd] over each row's pages in `layer` -> [B, T, H, hd]."""
    k, v = gather_layer(cache, layer, meta.page_table)  # [B, W*S, K, hd]
    key_pos = jnp.arange(k.shape[1], dtype=jnp.int32)
    mask = ((key_pos[None, None, :] <= meta.positions[:, :, None])
            & (key_pos[None, None, :] < meta.kv_lens[:, None, None]))  # [B, T, W*S]
    return gqa_attention(q, k, v, mask)
