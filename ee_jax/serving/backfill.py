"""KV back-fill: the skipped layers' K/V of a token that left early (architecture.md section 5).

A token that left at exit layer e has no K/V in layers e..L-1, yet later tokens attend to
them. Before the step ends, its exit hidden state is projected through each skipped layer's
`kv_project` (vmapped over the stacked layers: one batched projection, no loop) and written
at the token's slot (CALM's state propagation). `kv_project` is the very function the layer
uses, so a back-filled entry is exactly what that layer would write given that input.
Back-fill "learned" adds a fitted low-rank correction per (exit, layer) to those K/V
(`ee_jax.models.exits.backfill_maps`), in the same vmapped projection and the same scatter.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from ee_jax.models import llama
from ee_jax.models.config import ModelConfig
from ee_jax.models.exits import backfill_maps
from ee_jax.serving.attention import AttentionMetadata
from ee_jax.serving.kv_cache import NULL_PAGE, KVCache, write_slots


@functools.partial(jax.tree_util.register_dataclass, data_fields=("maps", "slots"),
                   meta_fields=("start", "gather"))
@dataclasses.dataclass(frozen=True)
class Learned:
    """What back-fill "learned" adds to a step's back-fill."""

    maps: backfill_maps.Maps  # the fitted maps (`backfill_maps.map_shapes`)
    slots: jax.Array  # [B] int32: each row's exit slot (-1: none)
    start: int  # static: the lowest exit layer, where the maps' layer axis starts
    gather: bool = True  # static: gather the rows' maps (`backfill_maps.gathers`)


def backfill_kv(params: llama.Params, h: jax.Array, meta: AttentionMetadata, cfg: ModelConfig,
                first: int = 0, learned: Learned | None = None) -> tuple[jax.Array, jax.Array]:
    """K/V of h [B, T, D] through layers first..L-1 (`kv_project` vmapped over layers):
    [L - first, B, T, K, hd] each. `first` (static) is the lowest exit that can be taken;
    below it nothing is ever skipped. With `learned` (back-fill "learned"), each row's
    fitted correction for its exit is added (`backfill_maps.kv_correction`)."""
    if llama.per_layer(params):  # a projection a layer, each reading its own buffers
        kv = [llama.kv_project(lp, h, meta.positions, cfg) for lp in params.layers[first:]]
        ks, vs = (jnp.stack(t) for t in zip(*kv, strict=True))
    else:
        layers = jax.tree.map(lambda a: a[first:], params.layers)
        ks, vs = jax.vmap(lambda lp: llama.kv_project(lp, h, meta.positions, cfg))(layers)
    if learned is None:
        return ks, vs
    maps, slots, start = learned.maps, learned.slots, learned.start
    off = first - start  # the maps cover layers start..L-1 (start: the lowest exit layer)
    maps = jax.tree.map(lambda a: a[:, off:], maps)
    dk, dv = backfill_maps.kv_correction(maps, slots, h, meta.positions, cfg, learned.gather)
    return (ks.astype(jnp.float32) + dk).astype(ks.dtype), (vs.astype(jnp.float32)
                                                            + dv).astype(vs.dtype)


def write_backfill(cache: KVCache, ks: jax.Array, vs: jax.Array, n_done,
                   meta: AttentionMetadata, first: int = 0) -> KVCache:
    """Write layers >= n_done of the back-filled K/V at this step's slots; the writes of
    layers < n_done go to the null page, so shapes are static and only the token's slots are
    touched (a scatter, in place). n_done: a scalar (the batch's exit layer), [B] (each
    row's) or [B, T] (each token's); n_done = L writes nothing real.

    Kept out of any lax.cond/switch on purpose: a cache that is an operand of a branch can be
    copied whole by XLA (hundreds of MB at batch 8), every step."""
    L = first + ks.shape[0]
    pages, offsets = meta.write_slots(cache.page_size)  # [B, T]
    layer_ids = jnp.arange(first, L, dtype=jnp.int32)
    n_done = jnp.asarray(n_done, jnp.int32)
    if n_done.ndim < 2:
        n_done = jnp.reshape(n_done, (-1, 1))  # [1 or B, 1]; else per token [B, T]
    skipped = layer_ids[:, None, None] >= n_done[None]  # [L - first, 1 or B, 1 or T]
    pages = jnp.where(skipped, pages[None], NULL_PAGE)  # [L - first, B, T]
    layer_idx = jnp.broadcast_to(layer_ids[:, None, None], pages.shape)
    offsets = jnp.broadcast_to(offsets[None], pages.shape)
    return write_slots(cache, layer_idx, pages, offsets, ks, vs)


def backfill(params: llama.Params, cache: KVCache, h: jax.Array, n_done, meta: AttentionMetadata,
             cfg: ModelConfig, first: int = 0, any_exit=None, learned: Learned | None = None
             ) -> KVCache:
    """Fill layers n_done..L-1 at this step's slots with `kv_project` of h [B, T, D] (plus
    the learned correction with `learned`, see `backfill_kv`).

    With `any_exit` (a traced bool), the projections are computed only when it holds (a
    lax.cond over the small K/V arrays, never over the cache) and nothing is written when it
    does not."""
    if any_exit is None:
        ks, vs = backfill_kv(params, h, meta, cfg, first, learned)
    else:
        project = lambda: backfill_kv(params, h, meta, cfg, first, learned)  # noqa: E731
        zeros = lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype),  # noqa: E731
                                     jax.eval_shape(project))
        ks, vs = jax.lax.cond(any_exit, project, zeros)
        n_done = jnp.where(any_exit, n_done, cfg.n_layers)
    return write_backfill(cache, ks, vs, n_done, meta, first)
