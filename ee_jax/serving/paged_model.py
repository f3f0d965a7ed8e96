"""The model's layers run over the paged cache: the same `decoder_layer`, another attention.

`attend` is the one attention entry point every layer of every step calls: it writes this
step's K/V at their slots (a scatter, in place on the donated cache), then attends over each
row's pages with the backend named (`attention_kernels.select_backend`, the one registry).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ee_jax.models import llama
from ee_jax.models.config import ModelConfig
from ee_jax.serving.attention import AttentionMetadata, write_kv
from ee_jax.serving.attention_kernels import select_backend
from ee_jax.serving.kv_cache import KVCache, pad_head_dim
from ee_jax.serving.sharding import cache_spec


def _keep_sharding(cache: KVCache, cfg: ModelConfig) -> KVCache:
    """Under a mesh (the runner traces sharded steps inside `jax.set_mesh`) where the KV heads
    are replicated (tp does not divide them), pin the cache replicated after each write:
    otherwise XLA reshards it to suit the query heads' split and gathers it whole every step
    (`python -m bench.kernels collectives`)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return cache
    spec = cache_spec(cfg, dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True)))
    if any(spec):  # KV heads split over tp: XLA keeps that layout by itself (pinning it
        return cache  # measured worse: the XLA attention path then gathered the cache)
    return jax.tree.map(lambda a: jax.lax.with_sharding_constraint(a, spec), cache)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, cache: KVCache, layer,
           meta: AttentionMetadata, cfg: ModelConfig, backend: str = "reference"
           ) -> tuple[jax.Array, KVCache]:
    """The one attention interface: write this step's k, v [B, T, K, hd] into `layer`, then
    attend with q [B, T, H, hd] -> (out [B, T, H, hd], cache). backend: a concrete name of
    `attention_kernels.BACKENDS` ("reference", "xla", "pallas_tpu", ...): "auto" is resolved
    on the step's platform before tracing (`model_step`), so this reads no platform.

    With query blocks (a ragged prefill step) q, k, v are on the layer's one token axis
    [N + B, heads, hd]: every K/V is written first (one scatter), then the backend runs twice,
    on the blocks as [NB, Q] query rows and on the rows' own tokens as [B, 1], and the
    outputs go back to the token axis.

    A cache stored with a wider head_dim (TPU, `kv_cache.storage_head_dim`) holds zeros in
    the extra columns: q is padded with zeros to match (q.k unchanged; the scale is the
    model's, given explicitly) and the output keeps the model's head_dim."""
    cache = _keep_sharding(write_kv(cache, layer, meta, k, v), cfg)
    hd = q.shape[-1]
    q = pad_head_dim(q, cache.k.shape[-1])
    fn = functools.partial(select_backend(backend), cache=cache, layer=layer,
                           scale=cfg.attn_scale, window=llama.layer_window(cfg, layer),
                           softcap=cfg.attn_logit_softcap)
    if not meta.has_blocks:
        return fn(q, meta=meta)[..., :hd], cache
    NB, Q = meta.block_positions.shape
    N = NB * Q
    blocks = fn(q[:N].reshape(NB, Q, *q.shape[1:]), meta=meta.blocks_view())
    rows = fn(q[N:, None], meta=meta.rows_view())
    out = jnp.concatenate([blocks.reshape(N, *q.shape[1:]), rows[:, 0]])
    return out[..., :hd], cache


def paged_layer(params: llama.Params, i, x: jax.Array, cache: KVCache, meta: AttentionMetadata,
                cfg: ModelConfig, backend: str = "reference", with_mid: bool = False):
    """Layer `i` (maybe traced) over the paged cache: write this step's K/V, attend.
    x: [B, T, D], or [N + B, D] on a ragged prefill step's token axis (`meta.has_blocks`).
    Returns (y, cache), or with `with_mid` (y, the state after attention, cache): what a
    branch exit reads (`exit_heads.exit_input`)."""

    def layer_attend(q, k, v):
        return attend(q, k, v, cache, i, meta, cfg, backend)

    pos = meta.token_positions
    if not llama.per_layer(params):  # stacked: the layer's slice of each weight
        lp = llama.layer_params(params, i)
    elif isinstance(i, int | np.integer):  # per layer, a static index: its own buffers
        lp = params.layers[int(i)]
    else:  # per layer, a traced index: each half of the layer a branch a layer, reading
        # that layer's buffers in place; attention (and the cache) between them, in no branch
        # (a cache through a branch can be copied whole, `backfill.write_backfill`)
        layers = params.layers
        q, k, v = jax.lax.switch(i, [functools.partial(_inputs, lp, cfg) for lp in layers],
                                 x, pos)
        o, cache = layer_attend(q, k, v)
        y, mid = jax.lax.switch(i, [functools.partial(_outputs, lp, cfg) for lp in layers],
                                x, o)
        return (y, mid, cache) if with_mid else (y, cache)
    y, mid, cache = llama.decoder_layer_mid(lp, x, pos, cfg, layer_attend)
    return (y, mid, cache) if with_mid else (y, cache)


def _inputs(lp, cfg, x, pos):
    return llama.attention_inputs(lp, x, pos, cfg)


def _outputs(lp, cfg, x, o):
    return llama.layer_outputs(lp, x, o, cfg)


def run_layers(params: llama.Params, lo: int, hi: int, body, carry):
    """body(i, carry) for layers lo..hi-1 (static bounds): a `fori_loop` over stacked
    layers; over per-layer ones a Python loop, each layer reading its own buffers (a static
    index: no branch, no copy)."""
    if llama.per_layer(params):
        for i in range(lo, hi):
            carry = body(i, carry)
        return carry
    return jax.lax.fori_loop(lo, hi, body, carry)
