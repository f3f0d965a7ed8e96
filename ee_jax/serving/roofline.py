"""The roofline of a step: pure arithmetic over the compiler's counts and a chip's peaks.

A program of `flops` and `bytes` (XLA's cost analysis of the compiled program, per device)
takes at least max(flops / peak FLOP/s, bytes / HBM bandwidth) on a chip. XLA's cost analysis
counts a `while_loop`'s body once (it does not know the trip count), so a step's prediction is
composed from separately compiled pieces:

    full depth:  step = fixed + L * layer(B)
    early exit:  step = fixed + sum over exit layers e of P(e) * cost(e)
        cost(e)  = e * layer(B) + checks(e) * check(B) + (L - e) * fill(B)   (propagate)
        cost(p, e) = cost(e) + max(0, e - p) * ride(B)                       (deferred)
        learned, deferred_learned: the same + maps(B) in a step where a row left

`fixed` is what a step pays once whatever the depth (embedding, final head, sampling);
`layer(B)` one layer at batch bucket B; `check(B)` one exit check (exit head and confidence);
`fill(B)` the back-fill of one skipped layer (its K/V projected from the exit state). Under
back-fill "deferred" a row's previous token, left early at p, rides along as a second query
in the layers p..e-1 its new token runs anyway (`step._with_checks`): `ride(B)` is what that
second query adds to a layer (its activations and its own read of the row's K/V: the kernels
take it as a row of its own); the weights are read once for both. Its layers above e keep K/V
propagated from its state at e, in the same back-fill. The histogram of a step's exit layers
gives p and e, drawn independently (`expected`). The back-fills with fitted maps ("learned",
"deferred_learned") add `maps(B)`, the correction the engine computes for the rows that left
(`backfill_maps.kv_correction`: each such row's maps for every layer above the first exit read
once); "deferred_learned" corrects two states a row (its token and the pending one) from the
same maps, so its flops count twice and its bytes once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from ee_jax.models.exit_config import BACKFILLS, rides_along, uses_maps


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
    back-fill, deferred's second query in a layer, the first check, the fitted maps'
    correction of a step's leaving rows (Cost each)."""

    fixed: Cost
    layer: Cost
    check: Cost = ZERO  # a later check
    fill: Cost = ZERO
    ride: Cost = ZERO
    first: Cost | None = None  # the first check (it picks candidates); None: a later one's
    maps: Cost = ZERO  # back-fills with maps: the leaving rows' correction, once a step

    def full_depth(self, n_layers: int) -> Cost:
        return self.fixed + n_layers * self.layer

    def exit_at(self, e: int, n_layers: int, checks: int, backfill: str,
                pending: int | None = None) -> Cost:
        """One step whose rows leave after layer `e` (e = L: full depth with its checks),
        having run `checks` exit checks; under a back-fill that rides along ("deferred",
        "deferred_learned") with the rows' previous token pending at layer `pending` (None
        or L: nothing pending)."""
        if backfill not in BACKFILLS:
            raise ValueError(f"unknown back-fill mode {backfill!r}: one of {BACKFILLS}")
        cost = self.fixed + e * self.layer + checks * self.check + (n_layers - e) * self.fill
        if checks and self.first is not None:
            cost = cost + (self.first - self.check)
        if rides_along(backfill) and pending is not None:
            cost = cost + max(0, e - pending) * self.ride
        if uses_maps(backfill) and e < n_layers:
            cost = cost + self.maps
            if rides_along(backfill):  # the pending token's state corrected too
                cost = cost + Cost(self.maps.flops, 0.0)
        return cost

    def expected(self, histogram: Mapping[int, float], n_layers: int,
                 checked: tuple[int, ...], backfill: str) -> Cost:
        """The mean step under a histogram {exit layer: share} (L: full depth), the checks
        being at layers `checked` (a step leaving at e ran the checks at layers <= e); under
        a back-fill that rides along the pending token's layer drawn from the same histogram."""
        total = sum(histogram.values())
        if total <= 0:
            raise ValueError("the exit histogram is empty")
        pend = histogram if rides_along(backfill) else {None: total}
        out = ZERO
        for e, share in histogram.items():
            checks = sum(1 for c in checked if c <= e)
            for p, w in pend.items():
                out = out + (share * w / total ** 2) * self.exit_at(e, n_layers, checks,
                                                                     backfill, p)
        return out


def analytic_bytes(weight_bytes: float, kv_bytes_read: float) -> float:
    """The bytes a memory-bound decode step must move at least: every weight once, and the
    keys and values the rows attend to."""
    return weight_bytes + kv_bytes_read


__all__ = ["ZERO", "Cost", "Pieces", "analytic_bytes", "seconds"]
