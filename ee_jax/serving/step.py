"""One model step for every mode: prefill, full-depth decode and every exit policy.

A step runs the stacked layers over this step's tokens with the paged cache in the loop
carry, and ends with one typed result. What differs between modes is a small static
*policy* object (gemma's sampler-strategy habit), never a second loop:

    policy       loop                         check at an exit layer        leaves
    FullDepth    fori_loop over L layers      none                          —
    BatchExit    while_loop, one row bucket   confidence per row -> done    all rows at once when
                                                                            the rule holds (all,
                                                                            quorum: the paper's)
    PerRow       while_loops over shrinking   confidence per row            each row at its own
                 row buckets (stages)                                       first confident exit

The loop with checks, precisely (rows compacted: slot c holds original row perm[c]):

    x = embed(tokens); state = loop state (running rows, done flags, check state, ...)
    for each row bucket z of the policy (BatchExit: just B):        # static Python loop
        gather the running rows to the front (not before the first stage); the stage's
        attention metadata, built once, is the same for all its layers (loop-invariant)
        while n + 1 < the first check (all layers if no row may leave): layer n; n += 1
        while n < L and the running rows do not fit the next bucket:   # lax.while_loop
            layer n on the first z rows; n += 1
            if n is an exit layer: conf = exit_checks.check_confidence(...)     # one dispatch
                                   rows the policy lets leave record (h, n, logits if computed)
            (one lax.switch per layer: no check, the first check, a later check; the kind is
             static inside each branch, so measure "candidates" does not branch again)
    finalise: rows still running leave at L; logits per row (the exit head of the row's exit,
              the final head at L; logits a check already computed are reused);
              back-fill the skipped layers' K/V at this token's slot (`backfill.backfill`)

Pending tokens (`Pending`) ride along as extra queries a row in the layers the step runs:
back-fill "deferred"'s one token, or under verified exits (`ExitConfig.verify`) a run of up to
`max_draft` drafts, which the step verifies (the final head over the run) when the row runs
every layer; nothing is back-filled then (`_finish_run`; docs/early_exit.md, "Verified exits").

Prefill and full depth are the policy with no checks: a `fori_loop` with a static trip
count, the fastest full-depth program the engine has (a `while_loop` whose checks are
switched off is not: its bound is dynamic). The schedule's kind (`StepShape.kind`), not a
shape, picks the policy: prompt tokens always run at full depth. A prefill step's tokens are
packed on one axis (the query blocks, then each row's own token: ragged prefill,
architecture.md section 5), so its dense work is on real tokens, not on B x the longest chunk.

Cost model of the stages (PerRow): rows move (a gather of [B, D] hidden states and [B, W]
page tables, small next to a layer) only when the rows still running fit a smaller bucket,
i.e. count <= current/2 for power-of-two buckets; otherwise the rows that left stay in place
as padding (kv_lens 0: they write to the null page and attend to nothing). A step gathers at
most log2(B) + 1 times. One compiled program per step shape serves every exit pattern, and
nothing goes back to the host inside the step.

What a check costs (the shipped SmolLM2 heads, CPU): the first check projects onto the
8,192-id subset and picks 8 candidates; `exit_checks.top_k` does that without sorting the subset
(lax.top_k sorted it: 1.3 ms at batch 1, 16 ms at batch 8), and heads holding `vocab_rows`
(`exit_heads.with_vocab_rows`) skip gathering the 8,192 head rows every step. A later check is
about fifty small kernels (~50 us at batch 1): its cost is their count, not their arithmetic.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from ee_jax.models import llama
from ee_jax.models.config import ModelConfig
from ee_jax.models.exits import backfill_maps
from ee_jax.models.exits import checks as exit_checks
from ee_jax.models.exits import heads as exit_heads
from ee_jax.models.exits.config import (
    ExitConfig,
    checked_layers,
    rides_along,
    run_widths,
    uses_maps,
)
from ee_jax.serving import attention_kernels
from ee_jax.serving.attention import AttentionMetadata
from ee_jax.serving.backfill import Learned, backfill
from ee_jax.serving.kv_cache import KVCache
from ee_jax.serving.paged_model import paged_layer, run_layers


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Pending:
    """Each row's tokens whose skipped layers its next decode step runs, riding along in the
    layers that step runs anyway (one more query per entry, at the positions just before the
    row's own token; the step runs no layer more).

    Back-fill "deferred": one entry, the row's previous token while its skipped layers hold
    propagated K/V; above the new token's exit the old one's K/V are propagated again, from
    the deeper state it reached. The exit costs (`exit_cost.step_work`) count it so.
    Verified exits (`ExitConfig.verify`): the row's *run* of up to `max_draft` drafts, right
    aligned (entry P - 1 is the token just before the row's own): no K/V is ever propagated;
    each entry's K/V are exact up to its `layer`, and every later step completes them as far
    as it runs before any later token reads them. A step that runs the row to the last layer
    verifies the run (`model_runner`: the final head scores every entry)."""

    h: jax.Array  # [B, P, D] each entry's hidden state after `layer` layers
    layer: jax.Array  # [B, P] int32: layers it has run; L (n_layers): an empty entry
    token: jax.Array  # [B, P] int32: verify: the draft the exit head made from it; -1: none
    exit: jax.Array  # [B, P] int32: verify: the exit layer that made the draft
    # [B] int32, verify: positions the row's verify dropped (rejected drafts): the host,
    # which launched the next step before reading this one, counted them; that step takes
    # them off its positions, lengths and sample indices (`model_runner`)
    rollback: jax.Array
    # [B, P, Vq] f32, verify_sampling "rejection": the exit logits each draft was sampled
    # from (its q, Vq = vocab_size); Vq = 0 otherwise
    q: jax.Array

    @classmethod
    def none(cls, batch: int, cfg: ModelConfig, width: int = 1, vocab: int = 0) -> Pending:
        return cls(jnp.zeros((batch, width, cfg.d_model), cfg.jnp_dtype),
                   jnp.full((batch, width), cfg.n_layers, jnp.int32),
                   jnp.full((batch, width), -1, jnp.int32),
                   jnp.full((batch, width), cfg.n_layers, jnp.int32),
                   jnp.zeros((batch,), jnp.int32),
                   jnp.zeros((batch, width, vocab), jnp.float32))

    @classmethod
    def for_config(cls, batch: int, cfg: ModelConfig, ec: ExitConfig | None) -> Pending:
        """The empty runs a step under `ec` carries (`pending_width`; q only for rejection)."""
        rejection = ec is not None and ec.verify and ec.verify_sampling == "rejection"
        return cls.none(batch, cfg, pending_width(ec), cfg.vocab_size if rejection else 0)

    @property
    def width(self) -> int:
        return self.layer.shape[1]

    @property
    def shapes(self) -> tuple[tuple[int, ...], ...]:
        return tuple(a.shape for a in jax.tree.leaves(self))


def pending_width(ec: ExitConfig | None) -> int:
    """Entries of a row's Pending: a verify run's `max_draft`, else the one deferred token."""
    return ec.max_draft if ec is not None and ec.verify else 1


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepResult:
    """What every step returns, whatever the policy."""

    logits: jax.Array  # [B, V] f32 at each row's sampled token
    exit_layer: jax.Array  # [B] int32: layers each row ran (its exit layer; L at full depth;
    #                        0 for padding rows)
    checks: jax.Array  # int32: exit checks that projected onto the vocabulary (their cost)
    work: jax.Array  # int32: row-layers computed (rows a layer ran on, summed over layers)
    pending: Pending  # what the rows' next decode step completes (nothing unless "deferred"
    #                   or verify; under verify the drafts' tokens are the runner's to fill)
    # verify only: the final head's logits [B, P, V] at each entry of the run the step took
    # in, for the rows that ran every layer (exit_layer == L; zeros elsewhere)
    run_logits: jax.Array | None = None


# --------------------------------------------------------------------------- policies


@dataclasses.dataclass(frozen=True)
class FullDepth:
    """No checks: every row runs every layer (prefill, and decode without exits)."""

    has_checks = False

    def stages(self, batch: int) -> tuple[int, ...]:
        return (batch,)


@dataclasses.dataclass(frozen=True)
class BatchExit:
    """The batch leaves together once `ec.policy`'s rule holds over the rows that were
    confident at some check ("all": every active row, the paper's rule; "quorum")."""

    ec: ExitConfig
    has_checks = True
    batch_wide = True

    def stages(self, batch: int) -> tuple[int, ...]:
        return (batch,)

    def can_exit(self, thresholds: jax.Array, active: jax.Array) -> jax.Array:
        """Whether any exit could be taken at all: if the rule cannot be met even by rows
        that are always confident (a row with threshold NEVER under "all"), no check runs."""
        return exit_checks.batch_exits(thresholds <= 1.0, active, self.ec.policy, self.ec.quorum)

    def leave(self, confident, done, running, active):
        """(rows leaving now, done) in compacted order; confident: [B] bool at this check."""
        done = done | confident  # a row once confident stays done
        go = exit_checks.batch_exits(done, active, self.ec.policy, self.ec.quorum)
        return running & go, done


@dataclasses.dataclass(frozen=True)
class PerRow:
    """Each row leaves at its own first confident exit, taking that exit's head; the rows
    still running are compacted into the smallest row bucket that holds them."""

    ec: ExitConfig
    has_checks = True
    batch_wide = False

    def stages(self, batch: int) -> tuple[int, ...]:
        return self.ec.row_buckets(batch)

    def can_exit(self, thresholds: jax.Array, active: jax.Array) -> jax.Array:
        return jnp.any(active & (thresholds <= 1.0))

    def leave(self, confident, done, running, active):
        del active
        return running & confident, done | confident


Policy = FullDepth | BatchExit | PerRow


def policy_for(ec: ExitConfig | None, kind: str) -> Policy:
    """The policy a step of `kind` ("prefill" / "decode") runs under `ec`."""
    if kind == "prefill" or ec is None or not ec.enabled:
        return FullDepth()
    return PerRow(ec) if ec.policy == "per_row" else BatchExit(ec)


# --------------------------------------------------------------------------- the loop state


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Loop:
    """Loop state of a step with checks. Fields marked (c) are in compacted order: slot c
    holds original row perm[c]; in the stage of bucket z the running rows occupy slots < z.

    The attention metadata is not in it: each stage builds its own once, in the stage's row
    order (kv_lens 0 for the rows not running then: padding rows and rows that left in an
    earlier stage write to the null page), and hands it unchanged to every layer of its
    loops, so XLA computes what attention derives from it (row-block sort, page-table
    gathers, write slots) once per stage, not once per layer. A row that leaves inside a
    stage keeps its keys until the next compaction: it still writes its own slot in the
    layers above its exit, which the back-fill then overwrites (layers >= its exit layer)."""

    n: jax.Array  # int32: layers run
    x: jax.Array  # (c) [B, Q, D] hidden states: the pending queries (if any), then the own
    perm: jax.Array  # (c) [B] int32: original row of each slot
    pend: jax.Array  # (c) [B, P] int32: layers each of the row's pending tokens has run
    #                   (L: none)
    running: jax.Array  # (c) [B] bool
    done: jax.Array  # (c) [B] bool: confident at some check (BatchExit's rule reads it)
    check: exit_checks.CheckState  # (c) what a check carries to the next (per row)
    mid: jax.Array  # (c) [B, D] the own query's state after attention in the last layer run
    #                 (head "branch" reads it; [B, 0] otherwise)
    h_exit: jax.Array  # [B, D] (original order) hidden state each row left with
    exit_layer: jax.Array  # [B] (original order) int32, L until the row leaves
    logits: jax.Array  # [B, V or 1] (original order) logits a check computed for rows that left
    checks: jax.Array  # int32
    work: jax.Array  # int32


def _take_rows(meta: AttentionMetadata, rows, kv_mask) -> AttentionMetadata:
    """meta of `rows` (an index array or a static prefix slice), kv_lens zeroed where ~kv_mask."""
    return AttentionMetadata(meta.positions[rows], meta.page_table[rows],
                             jnp.where(kv_mask, meta.kv_lens[rows], 0))


def _rows(tree, rows):
    return jax.tree.map(lambda a: a[rows], tree)


# --------------------------------------------------------------------------- the step


@functools.partial(jax.named_call, name="model_step")
def model_step(params: llama.Params, heads, cache: KVCache, tokens: jax.Array,
               meta: AttentionMetadata, thresholds: jax.Array, cfg: ModelConfig,
               policy: Policy, attention: str = "reference",
               block_tokens: jax.Array | None = None, pending: Pending | None = None,
               platform: str = "cpu") -> tuple[StepResult, KVCache]:
    """The one step. tokens: [B, 1], each row's token (the one whose logits are sampled);
    block_tokens: [N] the rest of a prefill step's chunks in query blocks (`meta.has_blocks`);
    thresholds: [B] f32 (policies with checks: decode, one token per row, no blocks);
    pending: the previous decode step's `StepResult.pending`, in this step's row order
    (policies with checks under backfill "deferred"; any other step drops it, leaving the
    propagated K/V in place).

    attention and platform (static) are what the program takes from the machine it is for:
    the backend is resolved on the platform (`attention_kernels.backend_name`; the runner
    passes one already resolved, `StepConfig.attention`), and the platform decides how the
    learned maps are read (`backfill_maps.gathers`). Both are passed in, never read from the
    process, so a step traced on a CPU host for a TPU (`aot`) is the TPU's step. The default
    platform is the CPU the tests run on."""
    attention = attention_kernels.backend_name(attention, platform)
    if meta.has_blocks != (block_tokens is not None):
        raise ValueError("block_tokens and meta's query blocks come together")
    if tokens.shape[1] != 1:
        raise ValueError(f"a step has one token per row (a prefill step packs the rest of "
                         f"each chunk in query blocks), got T={tokens.shape[1]}")
    if not policy.has_checks:
        return _full_depth(params, cache, tokens, block_tokens, meta, cfg, attention)
    if block_tokens is not None:
        raise ValueError("exit policies decode one token per row; prompt chunks run at full "
                         "depth (StepShape.kind='prefill')")
    return _with_checks(params, heads, cache, tokens, meta, thresholds, cfg, policy, attention,
                        pending, platform)


def _full_depth(params, cache, tokens, block_tokens, meta: AttentionMetadata,
                cfg: ModelConfig, attention: str):
    """Every layer on every token: [B, 1] rows, or [N + B] (blocks, then the rows' tokens)
    on a ragged prefill step; the rows' tokens are sampled."""
    L, B = cfg.n_layers, tokens.shape[0]

    def body(i, carry):
        x, cache = carry
        return paged_layer(params, i, x, cache, meta, cfg, attention)

    if block_tokens is None:
        x = llama.embed(params, tokens, cfg)  # [B, 1, D]
    else:
        x = llama.embed(params, jnp.concatenate([block_tokens, tokens[:, 0]]), cfg)  # [N+B, D]
    x, cache = run_layers(params, 0, L, body, (x, cache))
    h = x[:, 0] if block_tokens is None else x[x.shape[0] - B:]  # [B, D]
    logits = llama.final_head(params, h, cfg)
    active = meta.kv_lens > 0
    return StepResult(logits=logits, exit_layer=jnp.where(active, L, 0).astype(jnp.int32),
                      checks=jnp.asarray(0, jnp.int32), work=jnp.asarray(B * L, jnp.int32),
                      pending=Pending.none(B, cfg)), cache


def _with_pending(meta: AttentionMetadata, x: jax.Array, pending: Pending
                  ) -> tuple[AttentionMetadata, jax.Array]:
    """P + 1 queries a row, (the P pending entries, the row's own token): positions
    [B, P + 1] (pos - P, ..., pos) and x [B, P + 1, D]. Which layers each pending query runs
    is decided per layer (`_Loop.pend`)."""
    P = pending.width
    pos = meta.positions  # [B, 1]
    meta = dataclasses.replace(meta, positions=jnp.maximum(
        pos - P + jnp.arange(P + 1, dtype=pos.dtype)[None], 0))
    return meta, jnp.concatenate([pending.h.astype(x.dtype), x], axis=1)


def _with_checks(params, heads, cache, tokens, meta, thresholds, cfg: ModelConfig,
                 policy: BatchExit | PerRow, attention: str, pending: Pending | None,
                 platform: str):
    ec = policy.ec
    L, B = cfg.n_layers, tokens.shape[0]
    verify = ec.verify
    deferred = rides_along(ec.backfill) or verify  # pending queries ride along
    P = pending_width(ec)
    if pending is None or not deferred:
        pending = Pending.for_config(B, cfg, ec)
    if pending.shapes != Pending.for_config(B, cfg, ec).shapes:
        raise ValueError(f"pending's shapes {pending.shapes} are not the exit config's "
                         f"{Pending.for_config(B, cfg, ec).shapes}")
    if verify:  # a row whose run is full verifies (the host, a step behind, cannot tell)
        full_run = jnp.sum(pending.token >= 0, axis=1) >= P
        thresholds = jnp.where(full_run, jnp.inf, thresholds)
    sizes = policy.stages(B)
    table = jnp.asarray(ec.exit_index_table(L))
    active = meta.kv_lens > 0  # padding rows have no keys: they never run
    force = ec.force_exit_layer
    branch = ec.head == "branch"  # exits read the layer's state after attention too
    # checks compute the exit's logits (a forced branch exit too: only the check has its state)
    keep_logits = ec.needs_vocab and (force is None or branch)
    can_exit = jnp.asarray(True) if force is not None else policy.can_exit(thresholds, active)
    checked = checked_layers(ec, L)
    start = checked[0] if checked else L  # the first check (none if L)
    later = np.zeros(L + 1, bool)  # the checks after the first (never at L)
    later[list(checked[1:])] = True
    later_table = jnp.asarray(later)

    def compact(s: _Loop) -> tuple[_Loop, AttentionMetadata]:
        """Gather the running rows to the front (order kept); the rest follow as padding.
        Returns the state and the metadata of its row order (rows not running: kv_lens 0)."""
        order = jnp.argsort(~s.running, stable=True)
        perm, running = s.perm[order], s.running[order]
        return dataclasses.replace(
            s, x=s.x[order], perm=perm, pend=s.pend[order], running=running,
            done=s.done[order], check=_rows(s.check, order), mid=s.mid[order]
        ), _take_rows(meta, perm, running)

    def check(z: int, first: bool, s: _Loop) -> _Loop:
        """Exit check over the first z rows (z: the stage's bucket; the rest are padding);
        `first` (static): the step's first check (measure "candidates" picks its candidates
        there), else one of the later ones."""
        n, h = s.n, s.x[:, -1]  # the row's own token (the last query)
        he = exit_heads.exit_input(heads, table[n], h, s.mid, cfg) if branch else h
        checks, logits_buf = s.checks, s.logits
        if force is not None:
            # forcing ignores confidence; under verify a row whose threshold is NEVER still
            # stays (the engine's limits: a full run, a last token, must verify)
            confident = jnp.broadcast_to(n == force, (B,))
            if verify:
                confident = confident & (thresholds[s.perm] <= 1.0)
            state = s.check
            if keep_logits:
                logits = exit_heads.exit_logits(params, heads, table[n], he[:z], cfg,
                                                ec.temperatures)
        else:
            conf, logits, part = exit_checks.check_confidence(
                params, heads, table[n], he[:z], _rows(s.check, slice(0, z)), cfg, ec,
                first=first)
            state = part if z == B else jax.tree.map(lambda a, p: a.at[:z].set(p),
                                                     s.check, part)
            conf = conf if z == B else jnp.zeros((B,), conf.dtype).at[:z].set(conf)
            confident = (conf >= thresholds[s.perm]) & (n >= ec.min_exit_layer)
            # checks that projected onto (a subset of) the vocabulary: every check of a
            # vocabulary measure; the first check of "candidates" (it picks the candidates)
            checks = checks + int(ec.needs_vocab) + int(first and ec.measure == "candidates")
        leave, done = policy.leave(confident & s.running, s.done, s.running, active[s.perm])
        rows = jnp.where(leave, s.perm, B)  # B is out of range: dropped
        if keep_logits:
            logits_buf = logits_buf.at[rows[:z]].set(logits, mode="drop")
        running = s.running & ~leave
        return dataclasses.replace(
            s, check=state, checks=checks, running=running, done=done, logits=logits_buf,
            h_exit=s.h_exit.at[rows].set(h, mode="drop"),
            exit_layer=s.exit_layer.at[rows].set(n, mode="drop"))

    def layer(z: int, w: int, mz: AttentionMetadata, c):
        """Layer n on the first z rows with the last w (static) of the rows' P pending
        queries and their own (w = 0: the own queries alone, as without "deferred"); mz: the
        stage's metadata of those rows (loop-invariant)."""
        s, cache = c

        def with_mid(mid):  # the own queries' states after attention, when exits read them
            return s.mid if not branch else (mid[:, -1] if z == B
                                             else s.mid.at[:z].set(mid[:, -1]))

        if not deferred:
            y, mid, cache = paged_layer(params, s.n, s.x[:z], cache, mz, cfg, attention,
                                        with_mid=True)
            return dataclasses.replace(s, n=s.n + 1, x=y if z == B else s.x.at[:z].set(y),
                                       work=s.work + z, mid=with_mid(mid)), cache
        # a pending query runs the layers its token skipped; elsewhere its position is made
        # invalid (>= kv_len): it writes nothing and keeps its state
        lo = P - w
        runs = (s.pend[:z, lo:] <= s.n) & s.running[:z, None]  # [z, w]
        pos = mz.positions[:, lo:]
        pos = pos.at[:, :w].set(jnp.where(runs, pos[:, :w], mz.kv_lens[:, None]))
        y, mid, cache = paged_layer(params, s.n, s.x[:z, lo:], cache,
                                    dataclasses.replace(mz, positions=pos), cfg, attention,
                                    with_mid=True)
        y = y.at[:, :w].set(jnp.where(runs[..., None], y[:, :w], s.x[:z, lo:P]))
        return dataclasses.replace(s, n=s.n + 1, x=s.x.at[:z, lo:].set(y),
                                   work=s.work + z, mid=with_mid(mid)), cache

    def stage(k: int, s: _Loop, smeta: AttentionMetadata, cache: KVCache
              ) -> tuple[_Loop, KVCache]:
        """Layers on the first z = sizes[k] rows, for as long as the running rows do not fit
        the next bucket, each followed by its check if any: the first check, the later ones
        or none, a static kind per branch (one lax.switch; not a lax.cond per check over the
        first check's projection). Static shapes: no branch over the bucket. smeta: the
        metadata of s's row order (stage 0; later stages compact first and build their own).

        The layers below the first check (all of them when no row may leave) run in a loop
        of their own, without the switch: on CPU a switch per layer costs its dispatch and a
        copy of every state field it passes through (about 10 thunks a layer)."""
        z = sizes[k]
        fits_next = sizes[k + 1] if k + 1 < len(sizes) else 0
        if k:
            s, smeta = compact(s)
        mz = smeta if z == B else _take_rows(smeta, slice(0, z), True)  # loop-invariant

        def cond(c):
            return (c[0].n < L) & (jnp.sum(c[0].running) > fits_next)

        def body(w: int, c):
            s, cache = layer(z, w, mz, c)
            n = jnp.minimum(s.n, L)
            first = (n == start) if start < L else jnp.asarray(False)
            kind = jnp.where(can_exit, jnp.where(first, 1, 2 * later_table[n].astype(jnp.int32)),
                             0)
            s = jax.lax.switch(kind, [lambda s: s, functools.partial(check, z, True),
                                      functools.partial(check, z, False)], s)
            return s, cache

        c = (s, cache)
        # below the lowest pending token of a running row (L: none), one query a row
        lowest = jnp.min(jnp.where(s.running[:, None], s.pend, L)) if deferred else L
        # the layer that brings n to `start` is followed by the first check
        no_check = jnp.minimum(jnp.where(can_exit, start - 1, L), lowest)
        c = jax.lax.while_loop(lambda c: cond(c) & (c[0].n < no_check),
                               lambda c: layer(z, 0, mz, c), c)
        if not deferred:
            return jax.lax.while_loop(cond, functools.partial(body, 0), c)
        c = jax.lax.while_loop(lambda c: cond(c) & (c[0].n < lowest),
                               functools.partial(body, 0), c)
        # from the lowest pending layer up, every pending query (a run's empty entries too:
        # a lax.switch over loops of fewer queries measured slower on CPU, its operands the
        # cache among them)
        return jax.lax.while_loop(cond, functools.partial(body, P), c)

    x = llama.embed(params, tokens, cfg)  # [B, 1, D]
    if deferred:
        meta, x = _with_pending(meta, x, pending)  # [B, 2], [B, 2, D]
    s = _Loop(n=jnp.asarray(0, jnp.int32), x=x, perm=jnp.arange(B, dtype=jnp.int32),
              pend=jnp.where(active[:, None], pending.layer, L), running=active,
              done=jnp.zeros((B,), bool), check=exit_checks.init_check_state(x[:, -1], ec),
              mid=jnp.zeros((B, cfg.d_model if branch else 0), x.dtype),
              h_exit=x[:, -1], exit_layer=jnp.full((B,), L, jnp.int32),
              logits=jnp.zeros((B, cfg.vocab_size if keep_logits else 1), jnp.float32),
              checks=jnp.asarray(0, jnp.int32), work=jnp.asarray(0, jnp.int32))
    smeta = _take_rows(meta, slice(None), active)
    if len(sizes) > 1:
        s, smeta = compact(s)  # padding rows leave first
    for k in range(len(sizes)):
        s, cache = stage(k, s, smeta, cache)

    # Rows that ran to the end leave at L with their final hidden state.
    h_exit = s.h_exit.at[jnp.where(s.running, s.perm, B)].set(s.x[:, -1], mode="drop")
    exit_layer = jnp.where(active, s.exit_layer, 0)
    left = active & (exit_layer < L)
    logits = _exit_logits(params, heads, h_exit, exit_layer, active, s, table, cfg, policy,
                          keep_logits, final=not verify)
    if verify:
        return _finish_run(params, s, pending, h_exit, logits, exit_layer, active, cfg), cache
    n_done = jnp.where(active, exit_layer, L)  # padding rows: nothing to fill
    first = ec.first_exit or 0
    # back-fill "learned" / "deferred_learned": each row's fitted maps for its exit (table: -1
    # at L and 0); under "deferred_learned" both the row's token and its pending one are
    # filled from their states at the row's exit, so one slot a row serves both
    learned = (Learned(heads.backfill, table[exit_layer], ec.exit_layers[0],
                       backfill_maps.gathers(platform, B))
               if uses_maps(ec.backfill) else None)
    if not deferred:
        cache = backfill(params, cache, h_exit[:, None], n_done, meta, cfg, first,
                         any_exit=jnp.any(left), learned=learned)
        return StepResult(logits=logits, exit_layer=exit_layer, checks=s.checks,
                          work=s.work, pending=Pending.none(B, cfg)), cache
    # The pending token ran every layer its row ran above its own progress: complete if the
    # row ran to L. If the row left early at e above that progress, the row's own token
    # becomes the pending one and the older token's layers >= e get K/V propagated from its
    # state at e (its deepest), overwriting those propagated from where it left (with the
    # learned correction under "deferred_learned").
    old = jnp.zeros((B,), jnp.int32).at[s.perm].set(s.pend[:, 0])  # original row order
    h_old = jnp.zeros_like(h_exit).at[s.perm].set(s.x[:, 0])
    refill = left & (exit_layer > old)
    n_done = jnp.stack([jnp.where(refill, exit_layer, L), n_done], axis=1)  # [B, 2]
    cache = backfill(params, cache, jnp.stack([h_old, h_exit], axis=1), n_done, meta, cfg,
                     first, any_exit=jnp.any(left), learned=learned)
    return StepResult(logits=logits, exit_layer=exit_layer, checks=s.checks, work=s.work,
                      pending=dataclasses.replace(
                          Pending.none(B, cfg), h=h_exit[:, None],
                          layer=jnp.where(left, exit_layer, L)[:, None])), cache


def _finish_run(params, s: _Loop, run: Pending, h_exit, logits, exit_layer, active,
                cfg: ModelConfig) -> StepResult:
    """The end of a verify step (docs/early_exit.md, "Verified exits"). Every entry of a row's run
    rode along as far as the row ran. A row that left at its exit e drafted: its run shifts by
    one and takes its own token (state at e, depth e; the runner fills the draft the exit head
    made), its older entries now at depth max(theirs, e); its K/V above e are left as they
    are (no back-fill: the run's next steps complete them before any later token reads
    them). A row that ran every layer verifies: the final head scores each entry, and the
    run is emptied (the runner keeps the longest confirmed prefix)."""
    L = cfg.n_layers
    B, P = run.layer.shape
    left = active & (exit_layer < L)
    verified = active & ~left
    pend = jnp.zeros((B, P), jnp.int32).at[s.perm].set(s.pend)  # original row order
    depth = jnp.where(pend < exit_layer[:, None], exit_layer[:, None], pend)  # [B, P]
    hs = jnp.zeros_like(s.x[:, :P]).at[s.perm].set(s.x[:, :P])  # [B, P, D]
    # The final head over the verifying rows' own tokens and their runs' last w entries
    # (runs are right aligned), one product: w the smallest of `widths` that holds every
    # verifying run, so a short run (the common case) reads no more rows than it has.
    V = cfg.vocab_size
    need = jnp.max(jnp.where(verified, jnp.sum(run.token >= 0, axis=1), 0))
    widths = run_widths(P)

    def verify_head(w: int):
        def f():
            out = llama.final_head(params, jnp.concatenate(
                [hs[:, P - w:], h_exit[:, None].astype(hs.dtype)], axis=1), cfg)  # [B, w+1, V]
            runs = jnp.zeros((B, P, V), jnp.float32).at[:, P - w:].set(out[:, :w])
            return runs, jnp.where(verified[:, None], out[:, w], logits)
        return f

    branch = jnp.where(jnp.any(verified),
                       1 + jnp.searchsorted(jnp.asarray(widths), need), 0)
    run_logits, logits = jax.lax.switch(
        branch, [lambda: (jnp.zeros((B, P, V), jnp.float32), logits)]
        + [verify_head(w) for w in widths])
    empty = Pending.none(B, cfg, P, run.q.shape[-1])
    own = left[:, None]

    def shift(old, new, fill):  # [B, P]: entries 1.. move down, the row's own token last
        drafted = jnp.concatenate([old[:, 1:], new[:, None].astype(old.dtype)], axis=1)
        return jnp.where(own if drafted.ndim == 2 else own[..., None], drafted, fill)

    nxt = Pending(h=shift(hs, h_exit.astype(hs.dtype), empty.h),
                  layer=shift(depth, exit_layer, empty.layer),
                  token=shift(run.token, jnp.full((B,), -1, jnp.int32), empty.token),
                  exit=shift(run.exit, exit_layer, empty.exit), rollback=empty.rollback,
                  q=shift(run.q, logits, empty.q) if run.q.shape[-1] else empty.q)
    return StepResult(logits=logits, exit_layer=exit_layer, checks=s.checks, work=s.work,
                      pending=nxt, run_logits=run_logits)


def _exit_logits(params, heads, h_exit, exit_layer, active, s: _Loop, table,
                 cfg: ModelConfig, policy: BatchExit | PerRow, keep_logits: bool,
                 final: bool = True) -> jax.Array:
    """Logits [B, V] of each row at the exit it took; the head runs once per row, and not
    at all where a check already computed the row's logits. final=False: rows at L get
    zeros (verified exits run their final head with their runs', `_finish_run`)."""
    L = cfg.n_layers
    left = active & (exit_layer < L)

    def final_head():
        return (llama.final_head(params, h_exit, cfg) if final
                else jnp.zeros((h_exit.shape[0], cfg.vocab_size), jnp.float32))

    if policy.batch_wide:  # every active row left at the same layer: one shared head
        n = jnp.max(exit_layer)
        exited = jnp.any(left)

        def at_exit():
            return s.logits if keep_logits else exit_heads.exit_logits(
                params, heads, table[n], h_exit, cfg, policy.ec.temperatures)

        return jax.lax.cond(exited, at_exit, final_head)
    slots = jnp.where(left, table[jnp.minimum(exit_layer, L)], -1)
    if not keep_logits:
        return exit_heads.row_exit_logits(params, heads, slots, h_exit, cfg, final,
                                          policy.ec.temperatures)
    # Rows that left have their logits from the check; the head runs only if a row did not.
    need_head = jnp.any(active & ~left) & final
    return jax.lax.cond(
        need_head,
        lambda: jnp.where(left[:, None], s.logits, llama.final_head(params, h_exit, cfg)),
        lambda: s.logits)
