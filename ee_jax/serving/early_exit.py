"""The early-exit decode step over the paged cache (DESIGN.md section 5).

    x = embed(tokens)
    while n < L and not exited:                      # lax.while_loop over stacked layers
        x, cache = layer n (writes its K/V at this token's slot)
        n += 1
        if n is an exit layer: done |= confidence(exit head n, x) >= threshold   # per row
                               exited = batch_exits(done, active)  # all / quorum
    logits = exit head at n if exited else final head
    if exited: back-fill K/V of layers n..L-1 from x (vmapped kv_project, written at the slot)

One compiled program serves every exit outcome. The batch exit layer comes back to the
host with the sampled tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ee_jax.models import exits, llama
from ee_jax.models.config import ModelConfig
from ee_jax.serving.attention import AttentionMetadata
from ee_jax.serving.kv_cache import NULL_PAGE, KVCache
from ee_jax.serving.paged_model import paged_layer


def backfill(params: llama.Params, cache: KVCache, h: jax.Array, n_done, meta: AttentionMetadata,
             cfg: ModelConfig) -> KVCache:
    """Fill layers n_done..L-1 at this step's slots with `kv_project` of h [B, T, D].

    vmapped over all layers with the writes of layers < n_done sent to the null page, so
    the shapes are static; only the token's slots are touched (a scatter, in place).
    """
    L = cfg.n_layers
    ks, vs = jax.vmap(lambda lp: llama.kv_project(lp, h, meta.positions, cfg))(
        params["layers"])  # [L, B, T, K, hd]
    pages, offsets = meta.write_slots(cache.page_size)  # [B, T]
    layer_ids = jnp.arange(L, dtype=jnp.int32)
    skipped = (layer_ids >= n_done)[:, None, None]  # [L, 1, 1]
    pages = jnp.where(skipped, pages[None], NULL_PAGE)  # [L, B, T]
    layers = jnp.broadcast_to(layer_ids[:, None, None], pages.shape)
    offsets = jnp.broadcast_to(offsets[None], pages.shape)
    return KVCache(cache.k.at[layers, pages, offsets].set(ks.astype(cache.k.dtype)),
                   cache.v.at[layers, pages, offsets].set(vs.astype(cache.v.dtype)))


def early_exit_decode(params: llama.Params, heads, cache: KVCache, tokens: jax.Array,
                      meta: AttentionMetadata, thresholds: jax.Array, cfg: ModelConfig,
                      ec: exits.ExitConfig):
    """One decode token per row. tokens: [B, 1]; thresholds: [B] f32.

    Returns (logits [B, V] f32, exit_layer int32 scalar = layers run, vocab_checks int32
    scalar = exit checks that projected onto the vocabulary (the measure's cost), cache).
    """
    L = cfg.n_layers
    B = tokens.shape[0]
    table = jnp.asarray(ec.exit_index_table(L))
    active = meta.kv_lens > 0  # padding rows have no keys
    enabled = ec.enabled
    V = cfg.vocab_size if (enabled and ec.needs_vocab) else 1

    def check(n, x, h_prev, logits, done):
        slot = table[n]
        h = x[:, 0]
        if ec.force_exit_layer is not None:
            return n == ec.force_exit_layer, h, logits, done
        if ec.needs_vocab:
            logits = exits.exit_logits(params, heads, slot, h, cfg)
            conf = exits.confidence_from_logits(logits, ec.measure)
        elif ec.measure == "saturation":
            conf = exits.saturation(h, h_prev)
        else:
            conf = exits.classifier_confidence(heads, slot, h, cfg)
        counts = n >= ec.min_exit_layer
        done = done | ((conf >= thresholds) & counts)  # a row once confident stays done
        leave = exits.batch_exits(done, active, ec.policy, ec.quorum) & counts
        return leave, h, logits, done

    def skip(n, x, h_prev, logits, done):
        return jnp.asarray(False), h_prev, logits, done

    def cost(is_check):
        return (is_check & ec.needs_vocab & (ec.force_exit_layer is None)).astype(jnp.int32)

    def cond(carry):
        n, _, _, exited, _, _, _, _ = carry
        return (n < L) & ~exited

    def body(carry):
        n, x, cache, _, h_prev, logits, done, checks = carry
        x, cache = paged_layer(params, n, x, cache, meta, cfg)
        n = n + 1
        if not enabled:
            return n, x, cache, jnp.asarray(False), h_prev, logits, done, checks
        is_check = (n < L) & (table[jnp.minimum(n, L)] >= 0) & can_exit
        if ec.measure != "saturation":  # below min_exit_layer nothing needs computing
            is_check = is_check & (n >= ec.min_exit_layer)
        exited, h_prev, logits, done = jax.lax.cond(is_check, check, skip,
                                                    n, x, h_prev, logits, done)
        return n, x, cache, exited, h_prev, logits, done, checks + cost(is_check)

    # If the rule cannot be met even by rows that are always confident (e.g. a row with
    # threshold NEVER under policy "all"), skip every check: no confidence is computed.
    can_exit = exits.batch_exits(thresholds <= 1.0, active, ec.policy, ec.quorum)
    if ec.force_exit_layer is not None:
        can_exit = jnp.asarray(True)
    x = llama.embed(params, tokens)
    init = (jnp.asarray(0, jnp.int32), x, cache, jnp.asarray(False), x[:, 0],
            jnp.zeros((B, V), jnp.float32), jnp.zeros((B,), bool), jnp.asarray(0, jnp.int32))
    n, x, cache, exited, _, logits, _, checks = jax.lax.while_loop(cond, body, init)
    h = x[:, 0]

    def head_at_exit():
        if ec.needs_vocab and ec.force_exit_layer is None:
            return logits  # computed by the check that let the batch leave
        return exits.exit_logits(params, heads, table[n], h, cfg)

    if enabled:
        logits = jax.lax.cond(exited, head_at_exit, lambda: llama.final_head(params, h, cfg))
        cache = jax.lax.cond(exited, lambda c: backfill(params, c, x, n, meta, cfg),
                             lambda c: c, cache)
    else:
        logits = llama.final_head(params, h, cfg)
    return logits, n, checks, cache
