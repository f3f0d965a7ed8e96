"""What a decode step really runs, per back-fill mode (issue #23, DESIGN.md section 5): the
honest ceiling counts steps, not tokens.

A step pays for the union of what its rows run. Two regimes:

* memory-bound (GPU/TPU at small batch, a CPU at batch 1): a weight is paid once per step if
  any row uses it. Layers: the deepest row's; under back-fill "deferred" every layer whenever
  a row has a pending token (it runs layers e_prev..L-1 for it). The LM head's rows: once for
  the exit head if any row left early, once for the final head if any ran to L. Checks: each
  exit checked while any row was running. K/V back-fill: the skipped layers' K/V weights
  (`kv_fraction` of a layer each) from the shallowest exit up; "learned" adds its maps.
* compute-bound (a CPU at batch 8 and up): everything per row: its layers (plus, deferred,
  the L - e_prev layers of its pending token), its checks, its head, its back-fill.

All costs are in layer-equivalents (a decoder layer's multiply-adds per token), from a
`CostModel` (`exits.cost_model`: heads and checks); full depth is L + the final head per row
(compute) or per step (memory). `step_speedup` is what the engine's controller reads;
`sequence_speedup` replays real per-row exit sequences (deferred depends on each row's
previous token).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Literal, Protocol

import numpy as np

from ee_jax.models.config import ModelConfig

Regime = Literal["memory", "compute"]
REGIMES = ("memory", "compute")
BACKFILLS = ("propagate", "deferred", "learned")


class Costs(Protocol):  # `exits.CostModel`
    n_layers: int
    exit_layers: tuple[int, ...]
    final_head: float
    exit_head: float
    checks: tuple[float, ...]


def kv_fraction(cfg: ModelConfig) -> float:
    """A layer's K/V projections as a share of the layer's multiply-adds."""
    D, q, kv = cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    return 2 * D * kv / (D * q + 2 * D * kv + q * D + 3 * D * cfg.ffn_dim)


def map_fraction(cfg: ModelConfig, rank: int) -> float:
    """One learned map (`backfill_maps`: (D + 1) x r then r x 2KV) as a share of a layer."""
    D, q, kv = cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    return ((D + 1) * rank + rank * 2 * kv) / (D * q + 2 * D * kv + q * D + 3 * D * cfg.ffn_dim)


def _checks_upto(cm: Costs, layer: int) -> float:
    return sum(c for e, c in zip(cm.exit_layers, cm.checks, strict=True) if e <= layer)


def step_cost(cm: Costs, exit_layers: Sequence[int], pending: Sequence[int] | None,
              backfill: str, regime: Regime, kv: float, maps: float = 0.0) -> float:
    """Cost of one decode step whose rows left at `exit_layers` (L: full depth), with their
    pending tokens' exits `pending` (deferred only; L or None: none)."""
    if backfill not in BACKFILLS:
        raise ValueError(f"backfill {backfill!r}: expected one of {BACKFILLS}")
    if regime not in REGIMES:
        raise ValueError(f"regime {regime!r}: expected one of {REGIMES}")
    L = cm.n_layers
    ex = [int(e) for e in exit_layers]
    if not ex:
        return 0.0
    pend = [L] * len(ex) if pending is None or backfill != "deferred" else [int(p) for p in
                                                                             pending]
    fill = kv + (maps if backfill == "learned" else 0.0)  # per skipped layer
    if regime == "compute":
        cost = 0.0
        for e, p in zip(ex, pend, strict=True):
            cost += e + (L - p) + _checks_upto(cm, min(e, L - 1))
            cost += cm.final_head if e >= L else cm.exit_head + fill * (L - e)
        return cost
    deepest = max(ex)
    layers = L if any(p < L for p in pend) else deepest
    early = [e for e in ex if e < L]
    cost = layers + _checks_upto(cm, min(deepest, L - 1))
    cost += cm.final_head if deepest >= L else 0.0
    if early:
        cost += cm.exit_head + fill * (L - min(early))
    return cost


def full_step_cost(cm: Costs, batch: int, regime: Regime) -> float:
    return (cm.n_layers + cm.final_head) * (batch if regime == "compute" else 1)


def sequence_speedup(cm: Costs, steps: Sequence[Sequence[int]], backfill: str,
                     regime: Regime, kv: float, maps: float = 0.0) -> float:
    """Full depth over early exit for decode steps whose rows (the same rows, in order, every
    step) left at steps[t][r]; a row's pending token is its previous step's (deferred)."""
    L = cm.n_layers
    total, prev = 0.0, None
    for rows in steps:
        pend = None if prev is None else [p if p < L else L for p in prev]
        total += step_cost(cm, rows, pend, backfill, regime, kv, maps)
        prev = rows
    full = sum(full_step_cost(cm, len(r), regime) for r in steps)
    return full / total if total else 1.0


def step_speedup(cm: Costs, counts: dict[int, int], batch: int, backfill: str, regime: Regime,
                 kv: float, maps: float = 0.0, policy: str = "per_row", samples: int = 512,
                 seed: int = 0) -> float:
    """Expected speed-up of steps of `batch` rows whose exit layers are drawn independently
    from `counts` {exit layer: rows} (each row's pending token drawn the same way); policy
    "all" makes every row leave at the step's deepest. Exact for batch 1 in expectation up
    to sampling; a fixed seed keeps it deterministic."""
    layers = np.asarray(sorted(counts), np.int64)
    if not len(layers):
        return 1.0
    p = np.asarray([counts[k] for k in sorted(counts)], np.float64)
    p /= p.sum()
    rng = np.random.default_rng(seed)
    draws = rng.choice(layers, size=(samples, 2, batch), p=p)
    total = 0.0
    for now, before in draws:
        if policy == "all":
            now = np.full(batch, now.max())
            before = np.full(batch, before.max())
        total += step_cost(cm, now.tolist(), before.tolist(), backfill, regime, kv, maps)
    return samples * full_step_cost(cm, batch, regime) / total


def histogram(exits: Sequence[int]) -> dict[int, int]:
    return dict(collections.Counter(int(e) for e in exits))
