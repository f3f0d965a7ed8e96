"""The roofline of a step: pure arithmetic over the compiler's counts and a chip's peaks.

A program of `flops` and `bytes` (XLA's cost analysis of the compiled program, per device)
takes at least max(flops / peak FLOP/s, bytes / HBM bandwidth) on a chip. XLA's cost analysis
counts a `while_loop`'s body once (it does not know the trip count), so a step's prediction is
composed from separately compiled pieces:

    full depth:  step = fixed + L * layer(B)
    early exit:  step = fixed + sum over exit layers e of P(e) * cost(e)
        cost(e)  = e * layer(B) + checks(e) * check(B) + (L - e) * fill(B)   (propagate)
                 = L * layer(B) + checks(e) * check(B) + fill                 (deferred)

`fixed` is what a step pays once whatever the depth (embedding, final head, sampling);
`layer(B)` one layer at batch bucket B; `check(B)` one exit check (exit head and confidence);
`fill(B)` the back-fill of one skipped layer (its K/V projected from the exit state). Under
back-fill "deferred" a token that left early runs its skipped layers in the row's next step,
so a step with a pending token runs every layer (DESIGN.md section 5): in steady state every
layer is paid on every step, and only the exit head differs from full depth.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping


@dataclasses.dataclass(frozen=True)
class Cost:
    """XLA's counts for one piece: floating-point operations and bytes accessed."""

    flops: float
    bytes: float

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.flops + other.flops, self.bytes + other.bytes)

    def __sub__(self, other: Cost) -> Cost:
        return Cost(self.flops - other.flops, self.bytes - other.bytes)

    def __mul__(self, k: float) -> Cost:
        return Cost(self.flops * k, self.bytes * k)

    __rmul__ = __mul__


ZERO = Cost(0.0, 0.0)


def seconds(cost: Cost, peak_flops: float, bytes_per_s: float) -> float:
    """The roofline time of `cost` on a chip of these peaks."""
    return max(cost.flops / peak_flops, cost.bytes / bytes_per_s)


@dataclasses.dataclass(frozen=True)
class Pieces:
    """The compiled pieces of one batch bucket: fixed, one layer, one check, one layer's
    back-fill (Cost each)."""

    fixed: Cost
    layer: Cost
    check: Cost = ZERO
    fill: Cost = ZERO

    def full_depth(self, n_layers: int) -> Cost:
        return self.fixed + n_layers * self.layer

    def exit_at(self, e: int, n_layers: int, checks: int, backfill: str) -> Cost:
        """One step whose rows leave after layer `e` (e = L: full depth with its checks),
        having run `checks` exit checks."""
        if backfill == "deferred":  # the pending token runs the layers above e next step
            return self.full_depth(n_layers) + checks * self.check + \
                (0 if e >= n_layers else 1) * self.fill
        if backfill != "propagate":
            raise ValueError(f"unknown back-fill mode {backfill!r}: 'deferred' or 'propagate'")
        return self.fixed + e * self.layer + checks * self.check + (n_layers - e) * self.fill

    def expected(self, histogram: Mapping[int, float], n_layers: int,
                 checked: tuple[int, ...], backfill: str) -> Cost:
        """The mean step under a histogram {exit layer: share} (L: full depth), the checks
        being at layers `checked` (a step leaving at e ran the checks at layers <= e)."""
        total = sum(histogram.values())
        if total <= 0:
            raise ValueError("the exit histogram is empty")
        out = ZERO
        for e, share in histogram.items():
            checks = sum(1 for c in checked if c <= e)
            out = out + (share / total) * self.exit_at(e, n_layers, checks, backfill)
        return out


def analytic_bytes(weight_bytes: float, kv_bytes_read: float) -> float:
    """The bytes a memory-bound decode step must move at least: every weight once, and the
    keys and values the rows attend to."""
    return weight_bytes + kv_bytes_read


__all__ = ["ZERO", "Cost", "Pieces", "analytic_bytes", "seconds"]
