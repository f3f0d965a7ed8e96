"""Token sampling with per-row parameters in one batch: greedy, temperature, top-k, top-p.

Everything here is jit-friendly: the per-row choices are arrays, never Python branches, so one
compiled program serves any mix of requests for a given batch size and vocabulary.

Reproducibility. Row `b` draws its randomness from
`fold_in(PRNGKey(seeds[b]), steps[b])`, where `seeds[b]` is its request's seed and `steps[b]`
the index of the token being sampled within that request's output (0 for the first generated
token). Nothing else enters, so a request's tokens do not depend on its row, on the other rows,
on the batch size, or on whether it was preempted and recomputed.

Filtering follows vLLM: logits / temperature, then top-k, then top-p on the renormalised
top-k distribution. Both filters become one per-row threshold on the scaled logits, and the
token is drawn with the Gumbel-max trick over the whole vocabulary in its original order, so a
row's draw is the same whether or not other rows in the batch use a filter. Logits tied with
the threshold are kept (vLLM does the same).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

# Temperatures below this are greedy (as in vLLM): dividing by them would overflow.
GREEDY_EPS = 1e-5


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingTensors:
    """Per-row sampling parameters for one batch; a pytree of [B] arrays."""

    temperature: jax.Array  # [B] f32; < GREEDY_EPS means greedy
    top_k: jax.Array        # [B] int32; <= 0 means off; 1 means greedy
    top_p: jax.Array        # [B] f32 in (0, 1]; >= 1 means off
    seeds: jax.Array        # [B] uint32; the request's seed (mod 2**32)
    steps: jax.Array        # [B] int32; index of the token being sampled in its request

    @property
    def batch_size(self) -> int:
        return self.temperature.shape[0]

    @classmethod
    def from_lists(cls, temperature: Sequence[float], top_k: Sequence[int],
                   top_p: Sequence[float], seeds: Sequence[int], steps: Sequence[int],
                   batch_size: int | None = None) -> SamplingTensors:
        """Host-side packing (numpy leaves); rows past the lists up to `batch_size` are greedy.

        Raises ValueError naming the row and field of any out-of-range value.
        """
        n = len(temperature)
        for name, values in (("top_k", top_k), ("top_p", top_p), ("seeds", seeds),
                             ("steps", steps)):
            if len(values) != n:
                raise ValueError(f"SamplingTensors.from_lists: {name} has {len(values)} rows, "
                                 f"temperature has {n}")
        batch_size = n if batch_size is None else int(batch_size)
        if batch_size < n:
            raise ValueError(f"SamplingTensors.from_lists: {n} rows do not fit batch_size "
                             f"{batch_size}")
        for row in range(n):
            if not temperature[row] >= 0:
                raise ValueError(f"row {row}: temperature must be >= 0, got {temperature[row]}")
            if not 0 < top_p[row] <= 1:
                raise ValueError(f"row {row}: top_p must be in (0, 1], got {top_p[row]}")
            if not 0 <= seeds[row] < 2**32:
                raise ValueError(f"row {row}: seed must be in [0, 2**32), got {seeds[row]}")
            if not 0 <= steps[row] < 2**31:
                raise ValueError(f"row {row}: step must be in [0, 2**31), got {steps[row]}")
        pad = batch_size - n

        def col(values, fill, dtype):
            return np.concatenate([np.asarray(values, dtype=dtype).reshape(n),
                                   np.full(pad, fill, dtype=dtype)])

        return cls(temperature=col(temperature, 0.0, np.float32),
                   top_k=col(top_k, 0, np.int32), top_p=col(top_p, 1.0, np.float32),
                   seeds=col(seeds, 0, np.uint32), steps=col(steps, 0, np.int32))

    @classmethod
    def greedy(cls, batch_size: int) -> SamplingTensors:
        return cls.from_lists([], [], [], [], [], batch_size=batch_size)


def row_keys(st: SamplingTensors) -> jax.Array:
    """Per-row PRNG keys [B, ...]: fold_in(PRNGKey(seed), step)."""
    return jax.vmap(lambda s, t: jax.random.fold_in(jax.random.PRNGKey(s), t))(
        jnp.asarray(st.seeds, jnp.uint32), jnp.asarray(st.steps, jnp.int32))


def _ordered_keys(x: jax.Array) -> jax.Array:
    """uint32 keys in the order of the float32 values `x` (-inf < ... < -0 < 0 < ... < inf)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _min_key_where(pred, hi: jax.Array) -> jax.Array:
    """Per row, the smallest uint32 key t with pred(t) true, for pred monotone in t (false,
    then true) and true at `hi` [B]: 32 halvings of [0, hi], no sort."""
    def halve(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        ok = pred(mid)
        return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)

    _, hi = jax.lax.fori_loop(0, 32, halve, (jnp.zeros_like(hi), hi))
    return hi


def _filter_threshold(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Per-row logit threshold [B] such that `scaled >= threshold` is the top-k ∩ top-p set.

    scaled: [B, V] logits already divided by the temperature.

    The threshold is the smallest logit t whose strictly larger logits number fewer than k
    and hold less than top_p of the top-k mass: both counts only grow as t falls, so each
    bound is found by bisection over the logits' bit patterns (exact, 32 passes over [B, V]).
    No sort: a full-vocabulary sort dominated the step's compile on TPU and is slow there.
    """
    vocab = scaled.shape[-1]
    keys = _ordered_keys(scaled)                                           # [B, V]
    top = jnp.max(keys, axis=-1)                                           # [B]
    k = jnp.where(top_k <= 0, vocab, jnp.minimum(top_k, vocab))           # [B]

    def above(t):  # [B, V]: logits strictly above the per-row key t [B]
        return keys > t[:, None]

    # The k-th largest logit: the smallest t with fewer than k logits above it.
    kth = _min_key_where(lambda t: jnp.sum(above(t), axis=-1) < k, top)  # [B]
    e = jnp.exp(scaled - jnp.max(scaled, axis=-1, keepdims=True))         # [B, V]
    kth_e = jnp.max(jnp.where(keys == kth[:, None], e, 0.0), axis=-1)     # [B]
    over_kth = above(kth)                                                  # [B, V]
    n_above = jnp.sum(over_kth, axis=-1)
    # The top-k mass (ties at the k-th value counted up to k logits, as a sort would).
    mass_k = jnp.sum(jnp.where(over_kth, e, 0.0), axis=-1) + (k - n_above) * kth_e
    nucleus = _min_key_where(
        lambda t: (jnp.sum(jnp.where(above(t), e, 0.0), axis=-1) < top_p * mass_k)
        | (top_p >= 1.0), top)
    t = jnp.maximum(kth, nucleus)                                          # [B]
    return jnp.max(jnp.where(keys == t[:, None], scaled, -jnp.inf), axis=-1)


def _greedy_rows(st: SamplingTensors) -> jax.Array:
    return (jnp.asarray(st.temperature, jnp.float32) < GREEDY_EPS) | (
        jnp.asarray(st.top_k, jnp.int32) == 1)                            # [B]


def filtered_logits(logits: jax.Array, st: SamplingTensors) -> jax.Array:
    """The logits a sampled row draws from [B, V]: divided by its temperature, -inf outside
    its top-k / top-p set (greedy rows: the logits as they are). The filter's threshold is
    computed only when some sampled row asks for one."""
    logits = logits.astype(jnp.float32)
    temperature = jnp.asarray(st.temperature, jnp.float32)
    top_k = jnp.asarray(st.top_k, jnp.int32)
    top_p = jnp.asarray(st.top_p, jnp.float32)
    greedy_rows = _greedy_rows(st)
    scaled = logits / jnp.where(greedy_rows, 1.0, temperature)[:, None]
    filtered = ~greedy_rows & ((top_k > 0) | (top_p < 1.0))
    threshold = jax.lax.cond(
        jnp.any(filtered),
        lambda: jnp.where(filtered, _filter_threshold(scaled, top_k, top_p), -jnp.inf),
        lambda: jnp.full(scaled.shape[:1], -jnp.inf, scaled.dtype))
    return jnp.where(scaled >= threshold[:, None], scaled, -jnp.inf)


def sample(logits: jax.Array, st: SamplingTensors) -> jax.Array:
    """Draw one token per row. logits: [B, V] -> tokens [B] int32.

    Greedy rows (temperature < GREEDY_EPS, or top_k == 1) return exactly argmax(logits).
    The whole random path is skipped when every row is greedy.
    """
    greedy_rows = _greedy_rows(st)
    argmax = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw():
        drawn = jax.vmap(jax.random.categorical)(row_keys(st), filtered_logits(logits, st))
        return jnp.where(greedy_rows, argmax, drawn.astype(jnp.int32))

    return jax.lax.cond(jnp.all(greedy_rows), lambda: argmax, draw)


def draft_kept(p_logits: jax.Array, q_logits: jax.Array, draft: jax.Array,
               st: SamplingTensors) -> jax.Array:
    """Standard speculative sampling's test at one position a row (Leviathan et al. 2023,
    Chen et al. 2023): whether a draft d drawn from q is kept, with probability
    min(1, p(d) / q(d)). p and q are the target's and the draft's logits [B, V], each after
    the row's own filters (`filtered_logits`); a greedy row keeps d where it is p's argmax.
    The uniform draws from the row's key folded with 1: independent of the draft's own
    noise (`sample` under the same key) and of the rest of the batch. Returns [B] bool."""
    greedy_rows = _greedy_rows(st)
    draft = draft.astype(jnp.int32)[:, None]
    argmax = jnp.argmax(p_logits, axis=-1).astype(jnp.int32)

    def check():
        lp = jax.nn.log_softmax(filtered_logits(p_logits, st), axis=-1)   # [B, V]
        lq = jax.nn.log_softmax(filtered_logits(q_logits, st), axis=-1)
        ratio = (jnp.take_along_axis(lp, draft, axis=-1)
                 - jnp.take_along_axis(lq, draft, axis=-1))[:, 0]         # log p(d)/q(d)
        u = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, 1)))(row_keys(st))
        return jnp.where(greedy_rows, draft[:, 0] == argmax, jnp.log(u) < ratio)

    return jax.lax.cond(jnp.all(greedy_rows), lambda: draft[:, 0] == argmax, check)


def residual_sample(p_logits: jax.Array, q_logits: jax.Array,
                    st: SamplingTensors) -> jax.Array:
    """The token a position takes where `draft_kept` dropped its draft: a sample of the
    normalised max(0, p - q), so the position's token is distributed as p whatever q is
    (p == q leaves no residual, and then the draft is always kept: p stands in). Greedy
    rows: p's argmax. Keys: the row's folded with 2. Returns [B] int32."""
    greedy_rows = _greedy_rows(st)
    argmax = jnp.argmax(p_logits, axis=-1).astype(jnp.int32)

    def draw():
        p = jax.nn.softmax(filtered_logits(p_logits, st), axis=-1)        # [B, V]
        q = jax.nn.softmax(filtered_logits(q_logits, st), axis=-1)
        resid = jnp.maximum(p - q, 0.0)
        resid = jnp.where(jnp.sum(resid, axis=-1, keepdims=True) > 0, resid, p)
        drawn = jax.vmap(lambda k, r: jax.random.categorical(jax.random.fold_in(k, 2), r))(
            row_keys(st), jnp.log(resid))
        return jnp.where(greedy_rows, argmax, drawn.astype(jnp.int32))

    return jax.lax.cond(jnp.all(greedy_rows), lambda: argmax, draw)


def token_logprobs(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """Log-probability [B] of `tokens` under the unmodified distribution (vLLM's default)."""
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logprobs, tokens[:, None].astype(jnp.int32), axis=-1)[:, 0]


def top_logprobs(logits: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
    """The `n` (static) most likely tokens of the unmodified distribution.

    Returns (logprobs [B, n] f32, token ids [B, n] int32), most likely first.
    """
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    values, ids = jax.lax.top_k(logprobs, n)
    return values, ids.astype(jnp.int32)
