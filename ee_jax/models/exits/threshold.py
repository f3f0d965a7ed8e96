"""Exit thresholds with a stated guarantee, the statistics: Learn-then-Test (arXiv 2110.01052;
CALM, arXiv 2207.07061) on a calibration split that tuning and evaluation never read.

Risk of a threshold t: the fraction of calibration tokens that leave at an exit (their first
exit whose confidence >= t) with a token different from full depth's, i.e. 1 - teacher-forced
(TF) agreement. For a target agreement a (risk bound eps = 1 - a) and each t on a grid, test
H_t: risk(t) > eps with the exact binomial p-value P(Binom(n, eps) <= errors(t)). Fixed-sequence
testing from the most conservative t downwards rejects while p <= delta and stops at the first
t it cannot reject; the lowest rejected t is the threshold. Then, with probability >= 1 - delta
over the draw of the calibration tokens, the chosen threshold's risk is <= eps.

Tokens of one answer are correlated (an answer the decision finds hard is hard throughout), so
the per-token binomial test overstates the evidence. When the calibration tokens come in
clusters (packed rows of answers), H_t must also be rejected by a cluster-robust one-sided z-test
of the error ratio (`p_value_clustered`); the p-value used is the larger of the two.

Caveat stated with every result: the guarantee assumes calibration answers are exchangeable with
the answers served, and a served token's context is the model's own (possibly exited) output,
not the teacher's. The evaluation measures TF agreement on held-out workloads to check it.

These are the models layer's: a shipped calibration.json is read back with
`threshold_from_json` when heads are loaded (`exit_checkpoint.load_exit_heads`); measuring the
tables (tuning, the served engine) is training's (`ee_jax.training.calibrate`, `tune`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import numpy as np

from ee_jax.models.exits.config import NEVER, ExitConfigError

DEFAULT_GRID = tuple(np.round(np.arange(0.995, 0.0, -0.005), 3).tolist())  # safest first
DEFAULT_DELTA = 0.1


@dataclasses.dataclass(frozen=True)
class CalibrationTable:
    """Errors per candidate threshold on n calibration tokens; enough to pick a threshold for
    any target agreement later (shipped with the heads as calibration.json)."""

    thresholds: tuple[float, ...]  # safest (highest) first
    errors: tuple[int, ...]  # tokens leaving with a token != full depth's, per threshold
    exited: tuple[int, ...]  # tokens leaving early at all, per threshold
    mean_layers: tuple[float, ...]  # mean executed layers per token, per threshold
    n: int
    cluster_sizes: tuple[int, ...] = ()  # tokens per cluster (empty: no clusters)
    cluster_errors: tuple[tuple[int, ...], ...] = ()  # [threshold][cluster] errors

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> CalibrationTable:
        return cls(tuple(d["thresholds"]), tuple(d["errors"]), tuple(d["exited"]),
                   tuple(d["mean_layers"]), int(d["n"]), tuple(d.get("cluster_sizes", ())),
                   tuple(tuple(e) for e in d.get("cluster_errors", ())))


def check_target(target_agreement: float, delta: float = DEFAULT_DELTA) -> None:
    if not 0.0 < target_agreement <= 1.0:
        raise ExitConfigError(f"target agreement must be in (0, 1] (a fraction of "
                                    f"tokens equal to full depth), got {target_agreement}")
    if not 0.0 < delta < 1.0:
        raise ExitConfigError(f"delta (the allowed failure probability) must be in "
                              f"(0, 1), got {delta}")


def first_exit(confidence: np.ndarray, threshold: float, eligible: np.ndarray | None = None
               ) -> tuple[np.ndarray, np.ndarray]:
    """confidence [E, N] -> (leaves [N] bool, slot [N] int) of each token's first exit with
    confidence >= threshold (slot meaningless where it does not leave)."""
    ok = confidence >= threshold
    if eligible is not None:
        ok &= eligible[:, None]
    return ok.any(axis=0), ok.argmax(axis=0)


def calibration_table(confidence: np.ndarray, agree: np.ndarray, exit_layers, n_layers: int,
                      grid=DEFAULT_GRID, min_exit_layer: int = 1,
                      clusters: np.ndarray | None = None) -> CalibrationTable:
    """confidence, agree: [E, N] per exit slot and calibration token; clusters [N]: each
    token's cluster id (e.g. its packed row), for the cluster-robust test."""
    conf, ok = np.asarray(confidence), np.asarray(agree, bool)
    if conf.shape != ok.shape or conf.ndim != 2 or conf.shape[0] != len(exit_layers):
        raise ValueError(f"confidence {conf.shape} and agree {ok.shape} must both be "
                         f"[{len(exit_layers)} exits, N tokens]")
    layers = np.asarray(exit_layers)
    eligible = layers >= min_exit_layer
    n = conf.shape[1]
    grid = tuple(sorted((float(t) for t in grid), reverse=True))
    if clusters is not None:
        _, cid = np.unique(np.asarray(clusters), return_inverse=True)
        if cid.shape != (n,):
            raise ValueError(f"clusters must give one id per token ({n}), got {cid.shape}")
    errors, exited, mean, by_cluster = [], [], [], []
    for t in grid:
        leaves, slot = first_exit(conf, t, eligible)
        wrong = leaves & ~ok[slot, np.arange(n)]
        errors.append(int(wrong.sum()))
        exited.append(int(leaves.sum()))
        mean.append(float(np.where(leaves, layers[slot], n_layers).mean()) if n else n_layers)
        if clusters is not None:
            by_cluster.append(tuple(np.bincount(cid, weights=wrong).astype(int).tolist()))
    sizes = () if clusters is None else tuple(np.bincount(cid).tolist())
    return CalibrationTable(grid, tuple(errors), tuple(exited), tuple(mean), n, sizes,
                            tuple(by_cluster))


def p_value(errors: int, n: int, eps: float) -> float:
    """P(Binom(n, eps) <= errors): small when a risk above eps would rarely give so few
    errors."""
    if eps <= 0.0:
        return 1.0
    from scipy import stats  # here, not at the top: scipy.stats costs every process ~1 s

    return float(stats.binom.cdf(errors, n, eps))


def p_value_clustered(cluster_errors, cluster_sizes, eps: float) -> float:
    """One-sided z-test of H: risk > eps for the ratio r = sum(errors) / sum(sizes) over k
    clusters, with the cluster-robust variance k / (k - 1) * sum((e_c - r n_c)^2) / N^2
    (tokens within a cluster may be correlated; clusters are independent). A normal
    approximation: asymptotic in the number of clusters. With no spread in the errors the
    variance is 0 and the binomial test alone decides (returns 0 or 1 by r < eps); with
    fewer than 2 clusters nothing can be said (returns 1)."""
    e = np.asarray(cluster_errors, float)
    m = np.asarray(cluster_sizes, float)
    k, total = len(m), m.sum()
    if eps <= 0.0 or k < 2 or total == 0:
        return 1.0
    r = e.sum() / total
    var = k / (k - 1) * np.sum((e - r * m) ** 2) / total**2
    if var == 0.0:
        return 0.0 if r < eps else 1.0
    return 0.5 * math.erfc((eps - r) / math.sqrt(2.0 * var))  # the normal CDF at (r-eps)/sd


def table_p_value(table: CalibrationTable, i: int, eps: float) -> float:
    """The p-value of threshold i: the binomial one, or the larger of it and the
    cluster-robust one when the table has clusters."""
    p = p_value(table.errors[i], table.n, eps)
    if table.cluster_sizes:
        p = max(p, p_value_clustered(table.cluster_errors[i], table.cluster_sizes, eps))
    return p


def pick_threshold(table: CalibrationTable, target_agreement: float,
                   delta: float = DEFAULT_DELTA) -> float:
    """The lowest threshold fixed-sequence testing certifies (risk <= 1 - target with
    probability >= 1 - delta); NEVER when not even the safest one is certified."""
    check_target(target_agreement, delta)
    eps = 1.0 - target_agreement
    chosen = NEVER
    for i, t in enumerate(table.thresholds):
        if table_p_value(table, i, eps) > delta:
            break
        chosen = t
    return chosen


def pick_threshold_groups(tables: Mapping[str, CalibrationTable], target_agreement: float,
                          delta: float = DEFAULT_DELTA) -> float:
    """The highest of the groups' certified thresholds: each group (a kind of request:
    instructions, code, everyday chat) then keeps risk <= 1 - target with probability
    >= 1 - delta on its own, so a workload like any one group is covered, not only the
    pooled mix (pooling let a large easy group hide a small hard one)."""
    if not tables:
        raise ValueError("no calibration groups to pick a threshold from")
    return max(pick_threshold(t, target_agreement, delta) for t in tables.values())


def threshold_from_json(cal: dict, target_agreement: float) -> float:
    """The threshold a shipped calibration.json certifies for a target: per group when it
    has groups (`pick_threshold_groups`), else on its one pooled table."""
    delta = cal.get("delta", DEFAULT_DELTA)
    if cal.get("groups"):
        return pick_threshold_groups({k: CalibrationTable.from_json(v)
                                      for k, v in cal["groups"].items()},
                                     target_agreement, delta)
    return pick_threshold(CalibrationTable.from_json(cal), target_agreement, delta)


def exit_prior(cal: dict, threshold: float, n_layers: int) -> tuple[tuple[int, float], ...]:
    """What a decode row's exit layer is expected to be at `threshold`, from a shipped
    calibration.json pooled over its groups: ((mean layer of the tokens that left, their
    share), (n_layers, the rest)), or () where the table has no row at `threshold`. The exit
    controller decides from it before it has seen a step (`ControllerConfig.prior`)."""
    tables = ([CalibrationTable.from_json(v) for v in cal["groups"].values()]
              if cal.get("groups") else [CalibrationTable.from_json(cal)])
    n = exited = layers = 0.0
    for t in tables:
        i = next((i for i, th in enumerate(t.thresholds) if abs(th - threshold) < 1e-9), None)
        if i is None or not t.n:
            return ()
        n, exited, layers = n + t.n, exited + t.exited[i], layers + t.mean_layers[i] * t.n
    if not exited:
        return ((n_layers, 1.0),)
    left = (layers - (n - exited) * n_layers) / exited  # mean layer of the tokens that left
    share = exited / n
    return ((min(n_layers - 1, max(1, round(left))), share), (n_layers, 1.0 - share))
