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


def _filter_threshold(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Per-row logit threshold [B] such that `scaled >= threshold` is the top-k ∩ top-p set.

    scaled: [B, V] logits already divided by the temperature.
    """
    vocab = scaled.shape[-1]
    sorted_desc = -jnp.sort(-scaled, axis=-1)                            # [B, V]
    rank = jnp.arange(vocab)[None, :]                                      # [1, V]
    k = jnp.where(top_k <= 0, vocab, jnp.minimum(top_k, vocab))[:, None]  # [B, 1]
    in_top_k = rank < k
    probs = jax.nn.softmax(jnp.where(in_top_k, sorted_desc, -jnp.inf), axis=-1)
    # Exclusive cumulative mass before each rank: non-decreasing even in floating point, so
    # the kept set is a prefix. Rank 0 is always kept.
    cum = jnp.cumsum(probs, axis=-1)
    mass_before = jnp.concatenate([jnp.zeros_like(cum[:, :1]), cum[:, :-1]], axis=-1)
    in_top_p = (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    keep = in_top_k & in_top_p
    num_kept = jnp.maximum(jnp.sum(keep, axis=-1), 1)                     # [B]
    return jnp.take_along_axis(sorted_desc, (num_kept - 1)[:, None], axis=-1)[:, 0]


def sample(logits: jax.Array, st: SamplingTensors) -> jax.Array:
    """Draw one token per row. logits: [B, V] -> tokens [B] int32.

    Greedy rows (temperature < GREEDY_EPS, or top_k == 1) return exactly argmax(logits).
    The sort for top-k / top-p runs only when some sampled row asks for a filter, and the
    whole random path is skipped when every row is greedy.
    """
    logits = logits.astype(jnp.float32)
    temperature = jnp.asarray(st.temperature, jnp.float32)
    top_k = jnp.asarray(st.top_k, jnp.int32)
    top_p = jnp.asarray(st.top_p, jnp.float32)
    greedy_rows = (temperature < GREEDY_EPS) | (top_k == 1)               # [B]
    argmax = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw():
        scaled = logits / jnp.where(greedy_rows, 1.0, temperature)[:, None]
        filtered = ~greedy_rows & ((top_k > 0) | (top_p < 1.0))
        threshold = jax.lax.cond(
            jnp.any(filtered),
            lambda: jnp.where(filtered, _filter_threshold(scaled, top_k, top_p), -jnp.inf),
            lambda: jnp.full(scaled.shape[:1], -jnp.inf, scaled.dtype))
        masked = jnp.where(scaled >= threshold[:, None], scaled, -jnp.inf)
        drawn = jax.vmap(jax.random.categorical)(row_keys(st), masked)
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
