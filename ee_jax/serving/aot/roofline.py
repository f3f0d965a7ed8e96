"""The roofline of a step: pure arithmetic over the compiler's counts and a chip's peaks.

A program of `flops` and `bytes` (XLA's cost analysis of the compiled program, per device)
takes at least max(flops / peak FLOP/s, bytes / HBM bandwidth) on a chip. XLA's cost analysis
counts a `while_loop`'s body once (it does not know the trip count), so a step's prediction is
composed from separately compiled pieces, priced by what the step runs of each:

    step = fixed + sum over pieces of (flops a row x rows, bytes a pass x passes)

`fixed` is what a step pays once whatever the depth (embedding, sampling); the pieces are one
layer, the first and a later exit check, the exit head and the final head, one layer's
back-fill (its K/V projected from the exit state), a layer's pending queries riding along
(back-fill "deferred"; `ride`: their activations and their own read of the row's K/V, the
kernels taking each query as a row; the weights are read once for all) and the fitted maps'
correction. What a step runs of each, in passes over the piece's weights and in row
computations, is `exit_cost.step_work`: the one count of a step, which the exit controller and
the ceilings price in layer-equivalents. A piece measured at batch B (one pass, B rows) is
stored a row's flops and a pass's bytes (`per_unit`): a pass at batch B costs what was
measured, and a second query a row (deferred's back-fill of the pending token's state) adds
its flops, not its weights' bytes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from ee_jax.models.config import ModelConfig
from ee_jax.models.exits.config import ExitConfig, rides_along
from ee_jax.models.exits.cost import Count, StepWork, full_depth_work, step_work


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


def per_unit(cost: Cost, measured: Count) -> Cost:
    """A piece XLA counted doing `measured` work, as flops a row and bytes a pass."""
    return Cost(cost.flops / measured.rows if measured.rows else 0.0,
                cost.bytes / measured.reads if measured.reads else 0.0)


@dataclasses.dataclass(frozen=True)
class Pieces:
    """The compiled pieces of one batch bucket, each a row's flops and a pass's bytes
    (`per_unit`), but `fixed`, a step's."""

    fixed: Cost
    layer: Cost
    first_check: Cost = ZERO
    later_check: Cost = ZERO
    exit_head: Cost = ZERO
    final_head: Cost = ZERO
    fill: Cost = ZERO
    ride: Cost = ZERO
    maps: Cost = ZERO

    def price(self, work: StepWork) -> Cost:
        """The step that runs `work` (`exit_cost.step_work`)."""
        out = self.fixed
        for unit, c in ((self.layer, work.layers), (self.ride, work.ride),
                        (self.first_check, work.first_check),
                        (self.later_check, work.later_checks), (self.exit_head, work.exit_head),
                        (self.final_head, work.final_head), (self.fill, work.fill),
                        (self.maps, work.maps)):
            out = out + Cost(unit.flops * c.rows, unit.bytes * c.reads)
        return out

    def full_depth(self, n_layers: int, rows: int) -> Cost:
        """The full-depth step of `rows` rows (the bucket's)."""
        return self.price(full_depth_work(n_layers, rows))

    def expected(self, histogram: Mapping[int, float], ec: ExitConfig, n_layers: int,
                 bucket: int = 1, platform: str = "cpu") -> Cost:
        """The mean step of one row leaving per a histogram {exit layer: share} (L: full
        depth) in a program of `bucket` rows, under `ec`; where the back-fill rides along,
        the row's pending token drawn from the same histogram."""
        total = sum(histogram.values())
        if total <= 0:
            raise ValueError("the exit histogram is empty")
        pend = histogram if rides_along(ec.backfill) else {n_layers: total}
        out = Cost(0.0, 0.0)
        for e, share in histogram.items():
            for p, w in pend.items():
                work = step_work(ec, n_layers, [e], [p], bucket, platform)
                out = out + (share * w / total ** 2) * self.price(work)
        return out


def layer_weight_bytes(cfg: ModelConfig) -> float:
    """One decoder layer's weights (attention, MLP, both norms) at the model's dtype."""
    D, H, K, hd, F = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim
    return (D * H * hd * 2 + D * K * hd * 2 + 3 * D * F + 2 * D) * cfg.jnp_dtype.itemsize


def step_bytes(cfg: ModelConfig, rows: int, pages: int, page_size: int,
               new_tokens: int | None = None, kv_itemsize: int | None = None,
               kv_hd: int | None = None, weight_bytes: float | None = None) -> float:
    """The bytes a step must move at least, by hand: every weight once (the LM head whole,
    the embedding's rows of a step's tokens too few to count, the final norm),
    the K/V of `rows` rows x `pages` pages in every layer (whole pages, as every backend
    reads them), `new_tokens` tokens' K/V written (default a token a row: decode). kv_hd:
    the stored head_dim (default the model's); kv_itemsize: the pool's (default the
    model's dtype); weight_bytes: the weights as held, where not the dense model's (GGUF
    blocks: what `quant.param_bytes` counts of them, the whole embedding included)."""
    it = cfg.jnp_dtype.itemsize
    kv = cfg.n_kv_heads * (kv_hd or cfg.head_dim) * (kv_itemsize or it)
    weights = weight_bytes if weight_bytes is not None else \
        cfg.n_layers * layer_weight_bytes(cfg) + (cfg.vocab_size + 1) * cfg.d_model * it
    new = rows if new_tokens is None else new_tokens
    kv_bytes = cfg.n_layers * 2 * kv * (rows * pages * page_size + new)
    return weights + kv_bytes


__all__ = ["ZERO", "Cost", "Pieces", "layer_weight_bytes", "per_unit",
           "seconds", "step_bytes"]
