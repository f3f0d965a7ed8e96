"""The early-exit decode step over the paged cache (DESIGN.md section 5).

Policies "all" / "quorum" (`early_exit_decode`): the batch leaves together.

    x = embed(tokens)
    while n < L and not exited:                      # lax.while_loop over stacked layers
        x, cache = layer n (writes its K/V at this token's slot)
        n += 1
        if n is an exit layer: done |= confidence(exit head n, x) >= threshold   # per row
                               exited = batch_exits(done, active)  # all / quorum
    logits = exit head at n if exited else final head
    if exited: back-fill K/V of layers n..L-1 from x (vmapped kv_project, written at the slot)

Policy "per_row" (`per_row_decode`): every row leaves at its own first confident exit.

    rows still running sit at the front of the loop state (compacted order, `perm` maps back)
    for each row bucket z in B, ceil(B/2), ..., min_row_bucket:    # static, a Python loop
        gather the running rows to the front
        while n < L and the running rows do not fit the next bucket:   # lax.while_loop
            layer n on the first z rows only (static shape: no branch over the bucket)
            n += 1
            if n is an exit layer: rows that are confident now leave: their hidden state and
                exit layer are recorded at their original row; their kv_lens in the loop
                state become 0, so while they ride along as padding of the bucket they write
                to the null page and attend to nothing
    logits = one LM head for all rows, each row normed/adapted by its own exit head
             (final norm for rows that ran to L)
    back-fill, per row: layers >= that row's exit layer get kv_project of its exit state

The cost model is in the stage boundaries: rows move (a gather of [B, D] hidden states and
[B, W] page tables, small next to a layer) only when the rows still running fit a smaller
bucket, i.e. count <= current/2 for power-of-two buckets; otherwise the rows that left stay in
place as padding, so a layer never pays for a gather that does not shrink it. A step gathers
at most log2(B) + 1 times (stages that run no layer included); the layer work it saves is
(old bucket - new bucket) rows for every remaining layer. `ExitConfig.min_row_bucket` stops
the halving where a layer over fewer rows would not be cheaper (weight reads dominate at small
buckets on accelerators, and on CPU too at batch <= 8).

An earlier version chose the bucket per layer with `lax.switch` inside one while_loop; on CPU
the two switches per layer made a batch-8 step slower than full depth with no row leaving. Stages in
sequence have no per-layer branch and the same one compiled program per step shape.

One compiled program per step shape serves every exit pattern (every bucket is a stage of
the same program); nothing goes back to the host inside the step. The exit layers (per row
under "per_row", the batch's under the other policies) come back with the sampled tokens.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from ee_jax.models import exits, llama
from ee_jax.models.config import ModelConfig
from ee_jax.serving.attention import AttentionMetadata
from ee_jax.serving.kv_cache import NULL_PAGE, KVCache
from ee_jax.serving.paged_model import paged_layer


def backfill_kv(params: llama.Params, h: jax.Array, meta: AttentionMetadata, cfg: ModelConfig,
                first: int = 0) -> tuple[jax.Array, jax.Array]:
    """K/V of h [B, T, D] through layers first..L-1 (`kv_project` vmapped over layers):
    [L - first, B, T, K, hd] each. `first` (static) is the lowest exit that can be taken;
    below it nothing is ever skipped."""
    layers = jax.tree.map(lambda a: a[first:], params["layers"])
    return jax.vmap(lambda lp: llama.kv_project(lp, h, meta.positions, cfg))(layers)


def write_backfill(cache: KVCache, ks: jax.Array, vs: jax.Array, n_done,
                   meta: AttentionMetadata, first: int = 0) -> KVCache:
    """Write layers >= n_done of the back-filled K/V at this step's slots; the writes of
    layers < n_done go to the null page, so shapes are static and only the token's slots are
    touched (a scatter, in place). n_done: a scalar (the batch's exit layer) or [B] (each
    row's); n_done = L writes nothing real.

    Kept out of any lax.cond/switch on purpose: a cache that is an operand of a branch can be
    copied whole by XLA (hundreds of MB at batch 8), every step."""
    L = first + ks.shape[0]
    pages, offsets = meta.write_slots(cache.page_size)  # [B, T]
    layer_ids = jnp.arange(first, L, dtype=jnp.int32)
    n_done = jnp.reshape(jnp.asarray(n_done, jnp.int32), (-1, 1))  # [1 or B, 1]
    skipped = layer_ids[:, None, None] >= n_done[None]  # [L - first, 1 or B, 1]
    pages = jnp.where(skipped, pages[None], NULL_PAGE)  # [L - first, B, T]
    layer_idx = jnp.broadcast_to(layer_ids[:, None, None], pages.shape)
    offsets = jnp.broadcast_to(offsets[None], pages.shape)
    return KVCache(cache.k.at[layer_idx, pages, offsets].set(ks.astype(cache.k.dtype)),
                   cache.v.at[layer_idx, pages, offsets].set(vs.astype(cache.v.dtype)))


def backfill(params: llama.Params, cache: KVCache, h: jax.Array, n_done, meta: AttentionMetadata,
             cfg: ModelConfig, first: int = 0, any_exit=None) -> KVCache:
    """Fill layers n_done..L-1 at this step's slots with `kv_project` of h [B, T, D].

    With `any_exit` (a traced bool), the projections are computed only when it holds (a
    lax.cond over the small K/V arrays, never over the cache) and nothing is written when it
    does not."""
    if any_exit is None:
        ks, vs = backfill_kv(params, h, meta, cfg, first)
    else:
        project = lambda: backfill_kv(params, h, meta, cfg, first)  # noqa: E731
        zeros = lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype),  # noqa: E731
                                     jax.eval_shape(project))
        ks, vs = jax.lax.cond(any_exit, project, zeros)
        n_done = jnp.where(any_exit, n_done, cfg.n_layers)
    return write_backfill(cache, ks, vs, n_done, meta, first)


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
        first = ec.first_exit or 0
        cache = backfill(params, cache, x, n, meta, cfg, first, any_exit=exited)
    else:
        logits = llama.final_head(params, h, cfg)
    return logits, n, checks, cache


# --------------------------------------------------------------------------- policy "per_row"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Rows:
    """Loop state of `per_row_decode`. Fields marked (c) are in compacted order: slot c holds
    original row perm[c]; in the stage of bucket z the running rows occupy slots < z."""

    n: jax.Array  # int32: layers run
    x: jax.Array  # (c) [B, 1, D] hidden states
    h_prev: jax.Array  # (c) [B, D] hidden state at the previous exit check (saturation)
    perm: jax.Array  # (c) [B] int32: original row of each slot
    running: jax.Array  # (c) [B] bool
    meta: AttentionMetadata  # (c) kv_lens 0 for rows not running: they write to the null page
    h_exit: jax.Array  # [B, D] (original order) hidden state each row left with
    exit_layer: jax.Array  # [B] (original order) int32, L until the row leaves
    checks: jax.Array  # int32: exit checks that projected onto the vocabulary
    work: jax.Array  # int32: row-layers computed (bucket rows summed over layers)


def _take_rows(meta: AttentionMetadata, rows, kv_mask) -> AttentionMetadata:
    """meta of `rows` (an index array or a static prefix slice), kv_lens zeroed where ~kv_mask."""
    return AttentionMetadata(meta.positions[rows], meta.page_table[rows],
                             jnp.where(kv_mask, meta.kv_lens[rows], 0))


def per_row_decode(params: llama.Params, heads, cache: KVCache, tokens: jax.Array,
                   meta: AttentionMetadata, thresholds: jax.Array, cfg: ModelConfig,
                   ec: exits.ExitConfig):
    """Policy "per_row": one decode token per row, each row leaving at its own first
    confident exit; the layers run only on the smallest row bucket holding the rows still
    running (module docstring). tokens: [B, 1]; thresholds: [B] f32.

    Returns (logits [B, V] f32, exit_layers [B] int32 (layers each row ran; 0 for padding
    rows), vocab_checks int32 scalar, row_layers int32 scalar = rows the layers actually ran
    on, summed over layers (padding rows in a bucket included), cache).
    """
    L = cfg.n_layers
    B = tokens.shape[0]
    sizes = ec.row_buckets(B)
    table = jnp.asarray(ec.exit_index_table(L))
    active = meta.kv_lens > 0  # padding rows have no keys: they never run
    force = ec.force_exit_layer
    # Rows whose threshold no confidence reaches never leave early: with none that can,
    # no check is computed at all.
    can_exit = jnp.asarray(True) if force is not None else jnp.any(active & (thresholds <= 1.0))

    def compact(s: _Rows) -> _Rows:
        """Gather the running rows to the front (order kept); the rest follow as padding."""
        order = jnp.argsort(~s.running, stable=True)
        perm, running = s.perm[order], s.running[order]
        return dataclasses.replace(s, x=s.x[order], h_prev=s.h_prev[order], perm=perm,
                                   running=running, meta=_take_rows(meta, perm, running))

    def check(z: int, s: _Rows) -> _Rows:
        """Rows among the first z that are confident now leave (z: the stage's bucket)."""
        n, h, slot = s.n, s.x[:, 0], table[s.n]
        h_prev, checks = s.h_prev, s.checks
        if force is not None:
            leave = s.running & (n == force)
        else:
            if ec.needs_vocab:  # the vocabulary projection only over the bucket's rows
                conf = exits.confidence_from_logits(
                    exits.exit_logits(params, heads, slot, h[:z], cfg), ec.measure)
                conf = conf if z == B else jnp.zeros((B,), conf.dtype).at[:z].set(conf)
                checks = checks + 1
            elif ec.measure == "saturation":
                conf, h_prev = exits.saturation(h, s.h_prev), h
            else:
                conf = exits.classifier_confidence(heads, slot, h, cfg)
            leave = s.running & (conf >= thresholds[s.perm]) & (n >= ec.min_exit_layer)
        rows = jnp.where(leave, s.perm, B)  # B is out of range: dropped
        running = s.running & ~leave
        return dataclasses.replace(
            s, h_prev=h_prev, checks=checks, running=running,
            meta=dataclasses.replace(s.meta, kv_lens=jnp.where(running, s.meta.kv_lens, 0)),
            h_exit=s.h_exit.at[rows].set(h, mode="drop"),
            exit_layer=s.exit_layer.at[rows].set(n, mode="drop"))

    def stage(k: int, s: _Rows, cache: KVCache) -> tuple[_Rows, KVCache]:
        """Layers on the first z = sizes[k] rows, for as long as the running rows do not fit
        the next bucket (the cost model). Static shapes: no branch over the bucket."""
        z = sizes[k]
        fits_next = sizes[k + 1] if k + 1 < len(sizes) else 0

        def cond(c):
            count = jnp.sum(c[0].running)
            return (c[0].n < L) & (count > fits_next)

        def body(c):
            s, cache = c
            mz = _take_rows(s.meta, slice(0, z), True)  # rows that left: kv_lens 0
            y, cache = paged_layer(params, s.n, s.x[:z], cache, mz, cfg)
            x = y if z == B else s.x.at[:z].set(y)
            s = dataclasses.replace(s, n=s.n + 1, x=x, work=s.work + z)
            n = s.n
            is_check = (n < L) & (table[jnp.minimum(n, L)] >= 0) & can_exit
            if ec.measure != "saturation" or force is not None:
                is_check = is_check & (n >= ec.min_exit_layer)
            s = jax.lax.cond(is_check, functools.partial(check, z), lambda s: s, s)
            return s, cache

        return jax.lax.while_loop(cond, body, (compact(s) if k else s, cache))

    x = llama.embed(params, tokens)  # [B, 1, D]
    s = _Rows(n=jnp.asarray(0, jnp.int32), x=x, h_prev=x[:, 0],
              perm=jnp.arange(B, dtype=jnp.int32), running=active,
              meta=_take_rows(meta, slice(None), active),
              h_exit=x[:, 0], exit_layer=jnp.full((B,), L, jnp.int32),
              checks=jnp.asarray(0, jnp.int32), work=jnp.asarray(0, jnp.int32))
    s = compact(s)  # padding rows leave first
    for k in range(len(sizes)):
        s, cache = stage(k, s, cache)

    # Rows that ran to the end: their final hidden state, from the compacted order.
    h_exit = s.h_exit.at[jnp.where(s.running, s.perm, B)].set(s.x[:, 0], mode="drop")
    exit_layer = jnp.where(active, s.exit_layer, 0)
    slots = jnp.where(active & (exit_layer < L), table[exit_layer], -1)
    if ec.exit_layers:
        logits = exits.row_exit_logits(params, heads, slots, h_exit, cfg)
    else:
        logits = llama.final_head(params, h_exit, cfg)
    if ec.enabled:
        n_done = jnp.where(active, exit_layer, L)  # padding rows: nothing to fill
        first = ec.first_exit or 0
        cache = backfill(params, cache, h_exit[:, None], n_done, meta, cfg, first,
                         any_exit=jnp.any(n_done < L))
    return logits, exit_layer, s.checks, s.work, cache
