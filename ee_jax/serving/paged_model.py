"""The model's layers run over the paged cache: the same `decoder_layer`, another `attend`."""

from __future__ import annotations

import jax

from ee_jax.models import llama
from ee_jax.models.config import ModelConfig
from ee_jax.serving.attention import AttentionMetadata, paged_attention, write_kv
from ee_jax.serving.kv_cache import KVCache


def paged_layer(params: llama.Params, i, x: jax.Array, cache: KVCache, meta: AttentionMetadata,
                cfg: ModelConfig) -> tuple[jax.Array, KVCache]:
    """Layer `i` over the paged cache: write this step's K/V, then attend over the pages."""

    def attend(q, k, v):
        new_cache = write_kv(cache, i, meta, k, v)
        return paged_attention(q, new_cache, i, meta), new_cache

    return llama.decoder_layer(llama.layer_params(params, i), x, meta.positions, cfg, attend)


def paged_forward(params: llama.Params, cache: KVCache, tokens: jax.Array,
                  meta: AttentionMetadata, cfg: ModelConfig) -> tuple[jax.Array, KVCache]:
    """All layers over [B, T] tokens; returns the last hidden states [B, T, D] and the cache."""

    def body(i, carry):
        x, cache = carry
        return paged_layer(params, i, x, cache, meta, cfg)

    x = llama.embed(params, tokens)
    return jax.lax.fori_loop(0, cfg.n_layers, body, (x, cache))
