"""The model's layers run over the paged cache: the same `decoder_layer`, another `attend`."""

from __future__ import annotations

import jax

from ee_jax.models import llama
from ee_jax.models.config import ModelConfig
from ee_jax.serving.attention import AttentionMetadata, attend
from ee_jax.serving.kv_cache import KVCache


def paged_layer(params: llama.Params, i, x: jax.Array, cache: KVCache, meta: AttentionMetadata,
                cfg: ModelConfig, backend: str = "reference") -> tuple[jax.Array, KVCache]:
    """Layer `i` (maybe traced) over the paged cache: write this step's K/V, attend.
    x: [B, T, D], or [N + B, D] on a ragged prefill step's token axis (`meta.has_blocks`)."""

    def layer_attend(q, k, v):
        return attend(q, k, v, cache, i, meta, cfg, backend)

    return llama.decoder_layer(llama.layer_params(params, i), x, meta.token_positions, cfg,
                               layer_attend)
