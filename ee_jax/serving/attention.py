"""Attention over the paged cache: one entry point, the per-step metadata, the reference.

Every layer of every step calls `attend(q, k, v, cache, layer, meta, cfg, backend)`: it
writes this step's K/V at their slots (a scatter, in place on the donated cache), then
attends over each row's pages with the chosen backend. Cache writes, back-fill writes
(`ee_jax.serving.backfill`, through `write_slots`) and attention all follow the slot rule of
`AttentionMetadata` in this one module.

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
from ee_jax.models.config import ModelConfig
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


# backend(q [B, T, H, hd], cache, layer, meta, *, scale, window, softcap) -> [B, T, H, hd],
# called after this step's K/V are in the cache. window: int32 scalar (0: none) or None.
Backend = Callable[..., jax.Array]


def write_kv(cache: KVCache, layer, meta: AttentionMetadata, k: jax.Array, v: jax.Array
             ) -> KVCache:
    """k, v: [B, T, K, hd] written at this step's slots of `layer`."""
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


def backend_by_name(name: str) -> Backend:
    """The backend called `name` ("reference", or one of `attention_kernels.BACKENDS`;
    "auto" picks by platform)."""
    if name == "reference":
        return paged_attention
    from ee_jax.serving import attention_kernels

    return attention_kernels.select_backend(name)


def _keep_sharding(cache: KVCache, cfg: ModelConfig) -> KVCache:
    """Under a mesh (the runner traces sharded steps inside `jax.set_mesh`) where the KV heads
    are replicated (tp does not divide them), pin the cache replicated after each write:
    otherwise XLA reshards it to suit the query heads' split and gathers it whole every step
    (bench/collectives.py)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return cache
    from ee_jax.serving.sharding import cache_spec

    spec = cache_spec(cfg, dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True)))
    if any(spec):  # KV heads split over tp: XLA keeps that layout by itself (pinning it
        return cache  # measured worse: the XLA attention path then gathered the cache)
    return jax.tree.map(lambda a: jax.lax.with_sharding_constraint(a, spec), cache)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, cache: KVCache, layer,
           meta: AttentionMetadata, cfg: ModelConfig, backend: str = "reference"
           ) -> tuple[jax.Array, KVCache]:
    """The one attention interface: write this step's k, v [B, T, K, hd] into `layer`, then
    attend with q [B, T, H, hd] -> (out [B, T, H, hd], cache)."""
    cache = _keep_sharding(write_kv(cache, layer, meta, k, v), cfg)
    out = backend_by_name(backend)(q, cache, layer, meta, scale=cfg.attn_scale,
                                   window=llama.layer_window(cfg, layer),
                                   softcap=cfg.attn_logit_softcap)
    return out, cache
