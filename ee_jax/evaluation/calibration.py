"""Calibration of an exit's confidence against whether its token is right.

Reliability bins split [0, 1] into `n_bins` equal-width confidence intervals; for each, the
number of tokens, their mean confidence and the fraction that were right ("accuracy").
Expected calibration error (ECE) = sum over bins of (tokens in bin / all tokens) *
|accuracy - mean confidence|: 0 for a perfectly calibrated measure.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Reliability:
    edges: np.ndarray  # [n_bins + 1]
    count: np.ndarray  # [n_bins] tokens per bin
    confidence: np.ndarray  # [n_bins] mean confidence (nan where empty)
    accuracy: np.ndarray  # [n_bins] fraction right (nan where empty)

    @property
    def total(self) -> int:
        return int(self.count.sum())

    @property
    def ece(self) -> float:
        if not self.total:
            return float("nan")
        full = self.count > 0
        gap = np.abs(self.accuracy[full] - self.confidence[full])
        return float(np.sum(self.count[full] * gap) / self.total)


def reliability(confidence, correct, n_bins: int = 10) -> Reliability:
    """confidence: [N] in [0, 1]; correct: [N] bool. Confidence 1.0 falls in the last bin."""
    conf = np.asarray(confidence, np.float64).reshape(-1)
    ok = np.asarray(correct, bool).reshape(-1)
    if conf.shape != ok.shape:
        raise ValueError(f"confidence and correct differ in size: {conf.shape} vs {ok.shape}")
    idx = np.clip((conf * n_bins).astype(np.int64), 0, n_bins - 1)
    count = np.bincount(idx, minlength=n_bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_conf = np.bincount(idx, conf, minlength=n_bins) / count
        acc = np.bincount(idx, ok.astype(np.float64), minlength=n_bins) / count
    return Reliability(np.linspace(0.0, 1.0, n_bins + 1), count, mean_conf, acc)


def expected_calibration_error(confidence, correct, n_bins: int = 10) -> float:
    return reliability(confidence, correct, n_bins).ece
