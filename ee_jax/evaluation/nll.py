"""The full model's negative log-likelihood of generated text (docs/architecture.md section 7).

A dense forward of prompt + generated tokens; the NLL of each generated token given all
before it, under the full model (final head), whatever produced the text. Widths are
bucketed so few programs compile; identical (prompt, output) pairs are scored once.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ee_jax.models import llama
from ee_jax.models.config import ModelConfig


def _bucket(n: int, smallest: int = 64) -> int:
    """Powers of two and 1.5x powers of two (at most a third wasted), at least `smallest`."""
    b = smallest
    while b < n:
        b = b * 3 // 2 if (b & (b - 1)) == 0 else (b // 3) * 4
    return b


@functools.partial(jax.jit, static_argnames=("cfg",))
def _token_nll(params, tokens, cfg: ModelConfig):
    """tokens [1, W] -> [W - 1]: -log p(tokens[p + 1] | tokens[:p + 1])."""
    logits = llama.forward(params, tokens, cfg)[0]  # [W, V]
    logp = jax.nn.log_softmax(logits[:-1], axis=-1)
    return -jnp.take_along_axis(logp, tokens[0, 1:, None], axis=-1)[:, 0]


class FullModelNLL:
    """`scorer(prompt, generated)` -> per-token NLL [len(generated)] (nats)."""

    def __init__(self, cfg: ModelConfig, params):
        self.cfg, self.params = cfg, params
        self._memo: dict[tuple, np.ndarray] = {}

    def __call__(self, prompt: Sequence[int], generated: Sequence[int]) -> np.ndarray:
        if not generated:
            return np.zeros(0, np.float32)
        key = (tuple(prompt), tuple(generated))
        if key not in self._memo:
            ids = list(prompt) + list(generated)
            buf = np.zeros((1, _bucket(len(ids))), np.int32)
            buf[0, :len(ids)] = ids
            nll = np.asarray(_token_nll(self.params, jnp.asarray(buf), self.cfg))
            self._memo[key] = nll[len(prompt) - 1:len(ids) - 1]
        return self._memo[key]
