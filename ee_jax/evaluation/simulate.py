"""Teacher-forced simulation of batch-1 early exits from dense per-exit predictions.

Every token of the held-out text leaves at its first exit layer (>= min_exit_layer) whose
confidence reaches the threshold, else runs all L layers. Teacher-forced: the context is
always the real text, so one token's exit never changes the next one's input (the engine's
free-running output can drift; see `ee_jax.evaluation.sweep`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import numpy as np

from ee_jax.evaluation.layerwise import ExitPredictions


@dataclasses.dataclass(frozen=True)
class SimulatedExits:
    threshold: float
    num_tokens: int
    mean_layers: float  # executed layers per token
    ideal_speedup: float  # L / mean_layers
    agreement: float  # exit token == final token (tokens that run all layers agree)
    exit_counts: dict[int, int]  # tokens per exit layer (L: no exit)
    ideal_with_head: float | None = None  # (L + head) / mean cost, heads and checks counted

    def histogram(self) -> str:
        return " ".join(f"{k}:{v}" for k, v in sorted(self.exit_counts.items()))


def simulate_exits(pred: ExitPredictions, thresholds: Iterable[float],
                   min_exit_layer: int | None = None, cost=None) -> list[SimulatedExits]:
    """One SimulatedExits per threshold. min_exit_layer defaults to the ExitConfig's.
    cost: an `exit_cost.CostModel` (`exit_cost.cost_model(cfg, ec)`) for the ideal with head
    costs."""
    L = pred.n_layers
    layers = np.asarray(pred.exit_layers)
    lo = pred.exit_config.min_exit_layer if min_exit_layer is None else min_exit_layer
    eligible = (layers >= lo)[:, None]  # [E, 1]
    n = pred.num_tokens
    out = []
    for thr in thresholds:
        ok = (pred.confidence >= thr) & eligible  # [E, N]
        leaves = ok.any(axis=0)
        first = ok.argmax(axis=0)
        exit_layer = np.where(leaves, layers[first], L)
        agree = np.where(leaves, pred.agree[first, np.arange(n)], True)
        vals, counts = np.unique(exit_layer, return_counts=True)
        mean = float(exit_layer.mean()) if n else float(L)
        hist = {int(v): int(c) for v, c in zip(vals, counts, strict=True)}
        out.append(SimulatedExits(float(thr), n, mean, L / mean if mean else 1.0,
                                  float(agree.mean()) if n else 1.0, hist,
                                  None if cost is None else cost.ideal_speedup(hist)))
    return out
