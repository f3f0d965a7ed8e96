"""What every exit head would say on held-out text, from one dense pass of the backbone.

For each token of a corpus and each exit slot: the exit's confidence (its ExitConfig's
measure, computed as the decode step computes it) and whether its top-1 token equals the
final layer's. Agreement and calibration per exit layer, and the teacher-forced simulation
(`ee_jax.evaluation.simulate`), are read off these two arrays.

Exit layer e is the hidden state after e decoder layers: `llama.forward(...,
return_hidden=True)` returns hidden [L, B, T, D] with hidden[i] the output of layer i, so
exit e reads hidden[e - 1] (and hidden[L - 1] under the final head gives the logits).
Saturation at the first exit compares with the embedding, as the decode step does.

Sequences longer than `seq_len` are cut into windows that each start a fresh context.
Several heads (e.g. untrained and tuned) share the one backbone pass.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from ee_jax.evaluation.calibration import Reliability, reliability
from ee_jax.models import llama
from ee_jax.models.config import ModelConfig
from ee_jax.models.exits import checks as exit_checks
from ee_jax.models.exits import heads as exit_heads
from ee_jax.models.exits.config import ExitConfig, ExitConfigError


@dataclasses.dataclass(frozen=True)
class LayerStats:
    exit_layer: int
    num_tokens: int
    agreement: float  # exit top-1 == final top-1
    mean_confidence: float
    ece: float
    reliability: Reliability


@dataclasses.dataclass(frozen=True)
class ExitPredictions:
    """Per exit slot and token: confidence [E, N] and agreement with the final layer [E, N]."""

    exit_config: ExitConfig
    n_layers: int
    confidence: np.ndarray  # [E, N] f32
    agree: np.ndarray  # [E, N] bool

    @property
    def exit_layers(self) -> tuple[int, ...]:
        return self.exit_config.exit_layers

    @property
    def num_tokens(self) -> int:
        return int(self.agree.shape[1])

    def agreement(self) -> np.ndarray:
        """[E] fraction of tokens whose exit top-1 equals the final layer's."""
        return self.agree.mean(axis=1)

    def reliability(self, slot: int | None = None, n_bins: int = 10) -> Reliability:
        """Reliability bins of one exit, or of all exits pooled (slot None)."""
        if slot is None:
            return reliability(self.confidence, self.agree, n_bins)
        return reliability(self.confidence[slot], self.agree[slot], n_bins)

    def layer_stats(self, n_bins: int = 10) -> list[LayerStats]:
        out = []
        for slot, e in enumerate(self.exit_layers):
            rel = self.reliability(slot, n_bins)
            out.append(LayerStats(e, self.num_tokens, float(self.agree[slot].mean()),
                                  float(self.confidence[slot].mean()), rel.ece, rel))
        return out


def windows(sequences: Sequence[Sequence[int]], seq_len: int) -> list[list[int]]:
    """Each sequence cut into consecutive pieces of at most seq_len tokens (empty dropped)."""
    return [list(s[i:i + seq_len]) for s in sequences for i in range(0, len(s), seq_len)]


def scored_masks(sequences: Sequence[Sequence[int]], score_from: Sequence[int] | None
                 ) -> list[list[bool]]:
    """Per sequence, which positions count: those >= score_from[i] (e.g. the prompt length
    - 1, so only positions predicting the model's answer count); all when None."""
    if score_from is None:
        return [[True] * len(s) for s in sequences]
    return [[j >= k for j in range(len(s))] for s, k in zip(sequences, score_from, strict=True)]


@functools.partial(jax.jit, static_argnames=("cfg", "configs"))
def _dense_pass(params, heads_list, tokens, cfg: ModelConfig, configs: tuple[ExitConfig, ...]):
    """tokens [B, T] -> per config: (confidence [E, B, T], agree [E, B, T])."""
    branch = any(ec.head == "branch" for ec in configs)  # exits that read the mid states
    logits, hidden, *mid = llama.forward(params, tokens, cfg, return_hidden=True,
                                         return_mid=branch)
    final_top = jnp.argmax(logits, axis=-1)  # [B, T]
    del logits
    return [exit_checks.dense_confidences(params, heads, hidden, tokens, final_top, cfg, ec,
                                          mid[0] if ec.head == "branch" else None)
            for ec, heads in zip(configs, heads_list, strict=True)]


def exit_predictions(cfg: ModelConfig, params, sequences: Sequence[Sequence[int]],
                     variants: Mapping[str, tuple[ExitConfig, object]], *, seq_len: int = 256,
                     rows: int = 2, progress: bool = True, desc: str = "dense exits",
                     score_from: Sequence[int] | None = None) -> dict[str, ExitPredictions]:
    """Confidence and agreement of every exit of every variant {name: (ExitConfig, heads)}
    on every token of `sequences` (each position predicts the next token; all count unless
    `score_from` says from which position on each sequence counts). Runs `rows` windows of
    `seq_len` tokens per jitted call (one compiled program)."""
    names = list(variants)
    configs = tuple(variants[n][0] for n in names)
    for ec, heads in variants.values():
        ec.validate_for(cfg)
        if not ec.exit_layers:
            raise ExitConfigError("exit_predictions needs at least one exit layer")
        exit_heads.check_heads(cfg, ec, heads)
    heads_list = [variants[n][1] for n in names]
    wins = windows(sequences, seq_len)
    scored = windows(scored_masks(sequences, score_from), seq_len)
    if not wins:
        raise ValueError("exit_predictions: no tokens to evaluate")
    conf: list[list[np.ndarray]] = [[] for _ in names]
    agree: list[list[np.ndarray]] = [[] for _ in names]
    for start in tqdm(range(0, len(wins), rows), desc=desc, unit="call", file=sys.stderr,
                      disable=not progress, leave=False):
        chunk = wins[start:start + rows]
        tokens = np.zeros((rows, seq_len), np.int32)
        valid = np.zeros((rows, seq_len), bool)
        for r, w in enumerate(chunk):
            tokens[r, :len(w)] = w
            valid[r, :len(w)] = scored[start + r]
        res = _dense_pass(params, heads_list, jnp.asarray(tokens), cfg, configs)
        for i, (c, a) in enumerate(res):
            conf[i].append(np.asarray(c)[:, valid])  # [E, n valid]
            agree[i].append(np.asarray(a)[:, valid])
    return {n: ExitPredictions(configs[i], cfg.n_layers, np.concatenate(conf[i], axis=1),
                               np.concatenate(agree[i], axis=1))
            for i, n in enumerate(names)}
