"""The paged KV cache: two preallocated arrays and slot-wise writes into them.

    k, v: [layers, num_pages, page_size, kv_heads, head_dim]

A token at position `pos` of a sequence lives at page `page_table[pos // page_size]`, offset
`pos % page_size`. Page 0 is reserved: padding rows and padding tokens point their writes at
it and no live sequence ever reads it, so they cannot corrupt a live page.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ee_jax.models.config import ModelConfig

NULL_PAGE = 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    k: jax.Array  # [L, P, S, K, hd]
    v: jax.Array  # [L, P, S, K, hd]

    @property
    def num_pages(self) -> int:
        return self.k.shape[1]

    @property
    def page_size(self) -> int:
        return self.k.shape[2]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


def cache_shape(cfg: ModelConfig, num_pages: int, page_size: int) -> tuple[int, ...]:
    return (cfg.n_layers, num_pages, page_size, cfg.n_kv_heads, cfg.head_dim)


def bytes_per_page(cfg: ModelConfig, page_size: int, dtype) -> int:
    return 2 * cfg.n_layers * page_size * cfg.n_kv_heads * cfg.head_dim * jnp.dtype(dtype).itemsize


def allocate_cache(cfg: ModelConfig, num_pages: int, page_size: int, dtype=None,
                   sharding=None) -> KVCache:
    """Allocate once, zero-filled, directly on the device (no host copy)."""
    dtype = jnp.dtype(dtype or cfg.dtype)
    shape = cache_shape(cfg, num_pages, page_size)

    @jax.jit
    def zeros():
        return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    if sharding is not None:
        zeros = jax.jit(zeros, out_shardings=sharding)
    return zeros()


def write_layer(cache: KVCache, layer, pages: jax.Array, offsets: jax.Array,
                k: jax.Array, v: jax.Array) -> KVCache:
    """Write K/V of N tokens into `layer` (a traced scalar is fine) at (pages, offsets).

    pages, offsets: [N]; k, v: [N, K, hd]. Only those N slots are touched (a scatter, which
    XLA performs in place on a donated buffer) — never a whole-layer select.
    """
    return KVCache(
        cache.k.at[layer, pages, offsets].set(k.astype(cache.k.dtype)),
        cache.v.at[layer, pages, offsets].set(v.astype(cache.v.dtype)),
    )


def gather_layer(cache: KVCache, layer, page_table: jax.Array):
    """The pages of each sequence in `layer`, flattened to a token axis.

    page_table: [B, W] -> k, v: [B, W * page_size, K, hd]; token j of row b is position j.
    One gather straight from the full array (no per-layer slice copy).
    """
    B, W = page_table.shape
    k = cache.k[layer, page_table]  # [B, W, S, K, hd]
    v = cache.v[layer, page_table]
    S = cache.page_size
    return (k.reshape(B, W * S, *k.shape[3:]), v.reshape(B, W * S, *v.shape[3:]))
