"""Confidence checks at an exit and the batch exit rule, as pure functions.

Measures: max softmax probability, top-1 minus top-2 margin, entropy (over the exit head's
logits), hidden-state saturation, a learned classifier, and "candidates" (SpecEE-style, arXiv
2504.08850): the first exit check projects onto the exit head's vocabulary once and keeps its
top-k ids as candidates; every later check scores only those k rows of the LM head and feeds a
few features (candidate probabilities and margins, their change since the previous check, the
hidden state's change) to one tiny MLP per exit, whose output is a calibrated probability that
the exit's token equals the final layer's. `check_confidence` is the one dispatch.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ee_jax.models import llama
from ee_jax.models.config import ModelConfig
from ee_jax.models.exits.config import ExitConfig
from ee_jax.models.exits.heads import (
    approx_subset_logits,
    at_exit,
    exit_hidden,
    exit_input,
    exit_logits,
    unembed_rows,
)


def confidence_from_logits(logits: jax.Array, measure: str) -> jax.Array:
    """[..., V] -> [...] in [0, 1]; higher is more confident."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    if measure == "max_prob":
        return jnp.exp(jnp.max(logp, axis=-1))
    if measure == "margin":
        top2 = top_k(logp, 2)[0]
        return jnp.exp(top2[..., 0]) - jnp.exp(top2[..., 1])
    if measure == "entropy":
        ent = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
        return 1.0 - ent / np.log(logits.shape[-1])
    raise ValueError(f"{measure!r} is not a vocabulary measure")


def saturation(h: jax.Array, h_prev: jax.Array) -> jax.Array:
    """Cosine similarity of hidden states at consecutive exit checks, clipped to [0, 1]."""
    h, h_prev = h.astype(jnp.float32), h_prev.astype(jnp.float32)
    cos = jnp.sum(h * h_prev, -1) / (jnp.linalg.norm(h, axis=-1) *
                                     jnp.linalg.norm(h_prev, axis=-1) + 1e-6)
    return jnp.clip(cos, 0.0, 1.0)


def classifier_logit(heads, slot, h: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The learned confidence before the sigmoid (what tuning's BCE loss sees)."""
    return at_exit(heads, slot, lambda c, norm: llama.norm(h, norm, cfg).astype(jnp.float32)
                   @ c.w + c.b, "classifier", "norm")


def classifier_confidence(heads, slot, h: jax.Array, cfg: ModelConfig) -> jax.Array:
    return jax.nn.sigmoid(classifier_logit(heads, slot, h, cfg))


def top_k(z: jax.Array, k: int, block: int = 32) -> tuple[jax.Array, jax.Array]:
    """Exactly `jax.lax.top_k(z, k)` over the last axis (values, int32 indices; ties to the
    lower index), at a fraction of its cost on CPU, where XLA sorts the whole axis (K = 8,192:
    1.3 ms at batch 1 and 16 ms at batch 8, against 0.04 / 0.3 ms here).

    Two stages: the maximum of every block of `block` entries, the k best blocks (ties to
    the lower block), then top_k over those k blocks put back in index order. Exact: an
    entry of the top k lies in a block whose maximum ranks at least as high as it does, and
    k blocks ranked above its own would hold k entries ranked above it."""
    K = z.shape[-1]
    nb = -(-K // block)
    if nb <= k:  # nothing to gain
        v, i = jax.lax.top_k(z, k)
        return v, i.astype(jnp.int32)
    pad = nb * block - K
    if pad:
        z = jnp.concatenate([z, jnp.full((*z.shape[:-1], pad), -jnp.inf, z.dtype)], -1)
    z3 = z.reshape(*z.shape[:-1], nb, block)
    _, blk = jax.lax.top_k(jnp.max(z3, axis=-1), k)  # [..., k]
    blk = jnp.sort(blk, axis=-1)  # index order: ties keep going to the lower index
    zb = jnp.take_along_axis(z3, blk[..., None], axis=-2).reshape(*z.shape[:-1], k * block)
    v, j = jax.lax.top_k(zb, k)
    idx = jnp.take_along_axis(blk, j // block, axis=-1) * block + j % block
    return v, idx.astype(jnp.int32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CheckState:
    """What an exit check carries from one check to the next within a step (per row).

    Measures that look back (saturation; candidate features) keep their memory here, so the
    decode step carries one opaque pytree whatever the measure. The step must call
    `check_confidence` at every exit layer in order (slot 0 first), as the layer-wise
    evaluation does: measure "candidates" picks its candidates at slot 0."""

    h_prev: jax.Array  # [..., D] hidden state at the previous exit check
    cand: jax.Array  # [..., k] int32 candidate token ids (measure "candidates")
    cand_pos: jax.Array  # [..., k] int32 their positions in the subset (ExitHeads.vocab; 0 without)
    cand_logit: jax.Array  # [..., k] f32 their logits at the previous check
    p0: jax.Array  # [...] f32 the first check's top-1 probability over the head's vocabulary


def init_check_state(h0: jax.Array, ec: ExitConfig) -> CheckState:
    """The state before the first check; h0 [..., D] is the embedding (layer 0's input)."""
    lead = h0.shape[:-1]
    return CheckState(h_prev=h0, cand=jnp.zeros((*lead, ec.candidates), jnp.int32),
                      cand_pos=jnp.zeros((*lead, ec.candidates), jnp.int32),
                      cand_logit=jnp.zeros((*lead, ec.candidates), jnp.float32),
                      p0=jnp.zeros(lead, jnp.float32))


def _score_candidates(params: llama.Params, heads, hn: jax.Array, cand: jax.Array,
                      pos: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Exact logits of each row's own candidates: hn [..., D], cand [..., k] token ids, pos
    [..., k] their positions in the subset -> [..., k] f32.

    From the subset's rows (`with_vocab_rows`) at pos when the heads hold them: the same
    values as the LM head's rows at cand, so the same logits, without touching the head. On
    TPU a gather from the whole head is not k rows: XLA copies SmolLM2's [49152, 576]
    embedding out of its column-major entry layout first (113 MB, every check), and
    Llama-3.1-8B's [4096, 128256] head whole (2.1 GB). Without the rows, from the head."""
    rows = heads.vocab_rows
    if rows is not None:
        w = jnp.take(rows, pos, axis=0)  # [..., k, D]
    else:
        w = llama.head_rows(params, cand, cfg)  # [..., k, D]
    return llama.cap_logits(jnp.einsum("...d,...kd->...k", hn, w,
                                       preferred_element_type=jnp.float32), cfg)


def _int8_first_check(params: llama.Params, heads, hn: jax.Array, cfg: ModelConfig, k: int
                      ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The first check from the int8 rows: (candidates [..., k] int32, their positions in the
    subset [..., k] int32, their exact logits [..., k] f32, p0 [...]), candidates in order of
    exact logit (ties to the search's order).

    The k best ids of the approximate subset logits become the candidates, and their logits
    are recomputed from the f32 head rows (`_score_candidates`), so the top candidate is the
    exact subset argmax whenever the search kept it (it did on all 3,416 SmolLM2 layer-16
    states measured when the search was added).
    p0 = exp(exact top logit) / (sum of exp over the subset), the sum taken from the
    approximate logits with the k candidates' terms replaced by their exact ones: the
    candidates hold nearly all the mass, so p0 is within 0.003 of the exact search's
    (0.17 with the approximate sum left as it is)."""
    za = approx_subset_logits(heads, hn, cfg)  # [..., K]
    top_a, idx = top_k(za, k)
    cand = jnp.take(heads.vocab, idx)
    ze = _score_candidates(params, heads, hn, cand, idx, cfg)  # [..., k] exact
    top, j = jax.lax.top_k(ze, k)  # k entries: sorting them is cheap
    cand = jnp.take_along_axis(cand, j, axis=-1)
    idx = jnp.take_along_axis(idx, j, axis=-1)
    m = jnp.maximum(top_a[..., :1], top[..., :1])  # [..., 1]
    rest = jnp.sum(jnp.exp(za - m), axis=-1) - jnp.sum(jnp.exp(top_a - m), axis=-1)
    total = jnp.maximum(rest, 0.0) + jnp.sum(jnp.exp(top - m), axis=-1)
    p0 = jnp.exp(top[..., 0] - m[..., 0]) / total
    return cand.astype(jnp.int32), idx.astype(jnp.int32), top, p0


def candidate_features(params: llama.Params, heads, slot, h: jax.Array, state: CheckState,
                       cfg: ModelConfig, ec: ExitConfig, first: bool | None = None
                       ) -> tuple[jax.Array, CheckState]:
    """(features [..., N_FEATURES] f32, next state) of exit `slot` for h [..., D].

    At slot 0 the exit head scores its whole vocabulary (subset) once and its top-k become the
    candidates; later slots score only those k rows of the LM head. Features: the candidates'
    softmax top-1, top-1 - top-2, 1 - normalised entropy, top logit / 10, change of the top-1
    probability since the previous check, whether the top candidate is unchanged, this check's
    probability of the previous check's top candidate, cosine to the previous check's hidden
    state, the first check's top-1 probability over the whole subset (p0).

    Heads holding the int8 rows of `with_vocab_rows` search the subset with them
    (`approx_subset_logits`, a quarter of the f32 rows' bytes) and then score their k
    candidates exactly (`_int8_first_check`): the features see exact logits; which ids are
    candidates (one or two of the lowest-ranked on 17% of SmolLM2's layer-16 states, the top
    one never) and p0 (by < 0.003) can differ from the f32 search's.

    first: whether this is the first check (slot 0), when the caller knows it statically;
    None reads it from `slot` (a traced slot then branches with a lax.cond, which costs as
    much as the later check itself on CPU)."""
    k = ec.candidates
    hn = exit_hidden(heads, slot, h, cfg)

    def first_check():
        if heads.vocab_rows_q is not None:
            return _int8_first_check(params, heads, hn, cfg, k)
        if heads.vocab is not None:
            z = unembed_rows(params, hn, heads.vocab, cfg, heads.vocab_rows)
            top, idx = top_k(z, k)
            cand = jnp.take(heads.vocab, idx)
        else:
            z = llama.unembed(params, hn, cfg)
            top, cand = top_k(z, k)
            idx = jnp.zeros_like(cand)  # no subset: scored from the head by id
        p0 = jnp.exp(top[..., 0] - jax.nn.logsumexp(z, axis=-1))
        return cand.astype(jnp.int32), idx.astype(jnp.int32), top, p0

    def later():
        return (state.cand, state.cand_pos,
                _score_candidates(params, heads, hn, state.cand, state.cand_pos, cfg), state.p0)

    if first is None and isinstance(slot, int):
        first = slot == 0
    if first is None:
        cand, pos, z, p0 = jax.lax.cond(slot == 0, first_check, later)
    else:
        cand, pos, z, p0 = first_check() if first else later()
    pc = jax.nn.softmax(z, axis=-1)  # [..., k]
    top2 = jax.lax.top_k(pc, 2)[0]
    ent = -jnp.sum(pc * jnp.log(pc + 1e-20), axis=-1) / np.log(k)
    prev_pc = jax.nn.softmax(state.cand_logit, axis=-1)
    prev_top = jnp.argmax(prev_pc, axis=-1)
    top = jnp.argmax(pc, axis=-1)
    feats = jnp.stack([
        top2[..., 0], top2[..., 0] - top2[..., 1], 1.0 - ent, jnp.max(z, axis=-1) / 10.0,
        top2[..., 0] - jnp.max(prev_pc, axis=-1), (top == prev_top).astype(jnp.float32),
        jnp.take_along_axis(pc, prev_top[..., None], axis=-1)[..., 0],
        saturation(h, state.h_prev), p0], axis=-1).astype(jnp.float32)
    return feats, CheckState(h_prev=h, cand=cand, cand_pos=pos, cand_logit=z,
                             p0=p0.astype(jnp.float32))


def decision_logit(heads, slot, feats: jax.Array) -> jax.Array:
    """The exit's decision MLP before the sigmoid: feats [..., F] -> [...]."""
    def logit(d):
        return jnp.tanh(feats @ d.w1 + d.b1) @ d.w2 + d.b2

    return at_exit(heads, slot, logit, "decision")


def check_confidence(params: llama.Params, heads, slot, h: jax.Array, state: CheckState,
                     cfg: ModelConfig, ec: ExitConfig, first: bool | None = None
                     ) -> tuple[jax.Array, jax.Array | None, CheckState]:
    """The one confidence dispatch: (confidence [...] f32 in [0, 1], the exit's logits [..., V]
    when the measure had to compute them (else None), the next state). h: [..., D].

    The decode step, the layer-wise evaluation and the tests all call this, so a measure
    is written once. first: measure "candidates" only, see `candidate_features`."""
    logits = None
    if ec.measure == "candidates":
        feats, state = candidate_features(params, heads, slot, h, state, cfg, ec, first)
        return jax.nn.sigmoid(decision_logit(heads, slot, feats)), None, state
    if ec.needs_vocab:
        logits = exit_logits(params, heads, slot, h, cfg, ec.temperatures)
        conf = confidence_from_logits(logits, ec.measure)
    elif ec.measure == "saturation":
        conf = saturation(h, state.h_prev)
    else:
        conf = classifier_confidence(heads, slot, h, cfg)
    return conf.astype(jnp.float32), logits, dataclasses.replace(state, h_prev=h)


def batch_exits(confident: jax.Array, active: jax.Array, policy: str, quorum: float
                ) -> jax.Array:
    """Whether the batch leaves now. confident, active: [B] bool. Padding rows (inactive)
    never hold the batch back; a batch with no active row leaves at the first check.
    Under "per_row" a row leaves when it is confident, so the step ends as under "all"."""
    if policy == "never":
        return jnp.asarray(False)
    if policy in ("all", "per_row"):
        return jnp.all(confident | ~active)
    n_active = jnp.sum(active)
    n_conf = jnp.sum(confident & active)
    return (n_conf >= quorum * n_active) | (n_active == 0)


# ------------------------------------------------------------- dense (evaluation, tuning)


def _slot_confidence(params, heads, slot, h, state, cfg: ModelConfig, ec: ExitConfig):
    """(confidence, top-1, next check state) of exit `slot` for h [B, T, D], as the decode
    step computes it (the state chained over exits in order)."""
    conf, logits, state = check_confidence(params, heads, slot, h, state, cfg, ec)
    if logits is None:
        logits = exit_logits(params, heads, slot, h, cfg, ec.temperatures)  # [B, T, V]
    top = jnp.argmax(logits, axis=-1)
    return conf, top, state


def dense_confidences(params, heads, hidden: jax.Array, tokens: jax.Array, final_top: jax.Array,
                      cfg: ModelConfig, ec: ExitConfig, mid: jax.Array | None = None
                      ) -> tuple[jax.Array, jax.Array]:
    """Every exit's (confidence [E, B, T] f32, top-1 == final_top [E, B, T]) from the dense
    forward's hidden [L, B, T, D] of tokens [B, T], the checks chained over the exits in
    order as the decode step chains them (one exit's logits at a time). mid: the forward's
    states after attention [L, B, T, D] (`llama.forward(return_mid=True)`), which a branch
    exit reads."""
    emb = llama.embed(params, tokens, cfg)
    at = np.asarray(ec.exit_layers) - 1
    hs = hidden[at]  # [E, B, T, D]
    ms = hs if mid is None else mid[at]

    def one(state, args):
        slot, h, m = args
        h = exit_input(heads, slot, h, None if mid is None else m, cfg)
        conf, top, state = _slot_confidence(params, heads, slot, h, state, cfg, ec)
        return state, (conf.astype(jnp.float32), top == final_top)

    state0 = init_check_state(emb.astype(hs.dtype), ec)
    return jax.lax.scan(one, state0, (jnp.arange(len(ec.exit_layers)), hs, ms))[1]
