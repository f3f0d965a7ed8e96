"""Exits that never cost (an engine with exits must not serve slower than one without): per
batch bucket, run the exit program only where its checks pay for themselves; elsewhere run the
full-depth program (no checks compiled in), and look again from time to time.

A decision reads the exit program's recent decode rows in that bucket (their exit layers)
and the engine's cost model of one step (`predict(bucket, row_exit_counts)` -> the step's
speed-up over full depth, e.g. `exit_cost.step_speedup`): the exit program runs while the
prediction clears 1 + margin. Without observations (the start, or a bucket never seen) the
exit program runs `probe_steps` steps to get them, unless a prior (the shipped calibration's
exit rates, `ControllerConfig.prior`) already predicts that the checks cannot pay: then the
bucket starts at full depth, and a short job never compiles the exit program. A bucket at
full depth runs the exit program again for `probe_steps` steps every `probe_every` of its
steps, so a change of load (exit rates, batch) moves the decision back. Everything here is
host-side bookkeeping: the two programs are ordinary step shapes (`StepShape.exits`),
compiled once each.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Literal

import jax
import numpy as np

from ee_jax.errors import EEJaxError
from ee_jax.models.config import ModelConfig
from ee_jax.models.exits import backfill_maps
from ee_jax.models.exits import cost as exit_cost
from ee_jax.models.exits.config import ExitConfig, uses_maps

Mode = Literal["auto", "exits", "full"]
MODES = ("auto", "exits", "full")


class ControllerConfigError(EEJaxError, ValueError):
    """Controller settings that cannot work."""


CPU_RIDE_COST = 0.7  # ControllerConfig.ride_cost's default on CPU


@dataclasses.dataclass(frozen=True)
class ControllerConfig:
    """mode "auto": decide per batch bucket; "exits": always the exit program (no
    controller); "full": never (the exit heads stay loaded, no check runs).
    window: decode rows of the exit program a decision reads (the latest, per bucket).
    probe_steps: exit-program steps a bucket runs to (re)gather rows before deciding.
    probe_every: steps a bucket runs at full depth before it probes again.
    margin: the predicted speed-up must exceed 1 + margin for the checks to run.
    prior: ((exit layer, share of rows), ...), the exit layers a bucket's rows are expected
    to take before any is seen (`exit_threshold.exit_prior` of the heads' calibration; the
    engine's callers set it where they load heads): a bucket whose prior predicts no pay
    starts at full depth instead of probing. None or (): probe first."""

    mode: Mode = "auto"
    window: int = 256
    probe_steps: int = 16
    probe_every: int = 512
    margin: float = 0.02
    # The cost model's regime per batch: batches up to this are memory-bound (a weight read
    # once per step), larger ones compute-bound (`exit_cost.CostModel.price`); None: 1 on
    # CPU, 64 elsewhere.
    memory_bound_batch: int | None = None
    # What the exit program costs beyond the cost model's arithmetic (the while loop, the
    # checks' dispatches), as a share of a full-depth step: calibrate it with
    # `python -m bench.shipped_exits --overhead` ("checks only / full" = 1 / (1 + this)).
    check_overhead: float = 0.05
    # What back-fill "deferred"'s second query (its pending token riding along) adds to a
    # memory-bound layer, in layers (`exit_cost.CostModel.price`'s ride); None: 0.7 on CPU (GGUF
    # block weights are dequantized per row: measured 0.5-0.85 at batch 1 on a 2-core Xeon,
    # docs/benchmarks.md), 0 elsewhere (the weights are read once for both queries).
    ride_cost: float | None = None
    prior: tuple[tuple[int, float], ...] | None = None

    def __post_init__(self):
        if self.mode not in MODES:
            raise ControllerConfigError(f"exit controller mode {self.mode!r} is unknown; "
                                        f"choose one of {MODES}")
        for name in ("window", "probe_steps", "probe_every"):
            v = getattr(self, name)
            if not (isinstance(v, int) and v >= 1):
                raise ControllerConfigError(f"exit controller {name} must be an integer >= 1, "
                                            f"got {v!r}")
        if self.memory_bound_batch is not None and not (
                isinstance(self.memory_bound_batch, int) and self.memory_bound_batch >= 0):
            raise ControllerConfigError(f"exit controller memory_bound_batch must be an "
                                        f"integer >= 0 or None, got {self.memory_bound_batch!r}")
        if not 0.0 <= self.check_overhead < 10.0:
            raise ControllerConfigError(f"exit controller check_overhead must be in [0, 10) "
                                        f"(a share of a full-depth step), got "
                                        f"{self.check_overhead}")
        if self.ride_cost is not None and not 0.0 <= self.ride_cost <= 2.0:
            raise ControllerConfigError(f"exit controller ride_cost must be in [0, 2] (layers "
                                        f"a second query adds to one), got {self.ride_cost}")
        if self.prior and not _is_histogram(self.prior):
            raise ControllerConfigError(f"exit controller prior must be a tuple of (exit layer "
                                        f">= 1, share in [0, 1]) pairs whose shares sum to 1, "
                                        f"got {self.prior!r}")
        if not 0.0 <= self.margin < 1.0:
            raise ControllerConfigError(f"exit controller margin must be in [0, 1), got "
                                        f"{self.margin}")


def _is_histogram(prior) -> bool:
    """((exit layer >= 1, share in [0, 1]), ...) with shares summing to 1."""
    return (isinstance(prior, tuple)
            and all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], int)
                    and p[0] >= 1 and 0.0 <= p[1] <= 1.0 for p in prior)
            and abs(sum(p[1] for p in prior) - 1.0) < 1e-6)


@dataclasses.dataclass
class _Bucket:
    rows: collections.deque  # exit layers of the exit program's latest decode rows
    exits: bool = True  # the program this bucket runs now
    probing: int = 0  # exit-program steps left in the current look
    since: int = 0  # steps at full depth since the last look / exit steps since a decision
    predicted: float = float("nan")  # the last decision's predicted speed-up
    prior: bool = False  # the last decision was the prior's (no step observed)
    steps: dict = dataclasses.field(default_factory=lambda: {True: 0, False: 0})


class ExitController:
    """Which program each decode step runs (`use_exits`), from what steps showed (`observe`)."""

    def __init__(self, config: ControllerConfig,
                 predict: Callable[[int, dict[int, int]], float], verified: bool = False):
        """verified: the exit program runs verified exits (`ExitConfig.verify`): a decision
        reads the steps themselves (each row's layers, the drafts riding along, the tokens
        emitted), not a histogram of rows; before any is seen, the prior's exit rates and
        the heads' calibrated agreement stand in for them."""
        self.config = config
        self.predict = predict
        self.verified = verified
        self.buckets: dict[int, _Bucket] = {}

    def _bucket(self, batch: int) -> _Bucket:
        if batch not in self.buckets:
            b = _Bucket(collections.deque(maxlen=self.config.window),
                        probing=self.config.probe_steps)
            if self.config.prior:  # rows the prior expects, as counts
                counts = {layer: round(1000 * share) for layer, share in self.config.prior}
                b.predicted = self.predict(batch, {k: v for k, v in counts.items() if v})
                b.prior = True
                if b.predicted <= 1.0 + self.config.margin:  # start at full depth
                    b.exits, b.probing = False, 0
            self.buckets[batch] = b
        return self.buckets[batch]

    def use_exits(self, batch: int) -> bool:
        """The program the next decode step of `batch` rows runs (True: the exit program)."""
        mode = self.config.mode
        if mode != "auto":
            return mode == "exits"
        b = self._bucket(batch)
        if b.probing:
            return True
        if not b.exits:
            b.since += 1
            if b.since > self.config.probe_every:  # look again
                b.since, b.probing = 0, self.config.probe_steps
                return True
        return b.exits

    def observe(self, batch: int, exits: bool, row_exit_layers: list[int],
                riding: list[int] | None = None, emitted: int = 0) -> None:
        """A decode step of `batch` rows ran (`exits`: the exit program) with these rows;
        verified exits also give each row's drafts riding along and the tokens emitted."""
        if self.config.mode != "auto":
            return
        b = self._bucket(batch)
        b.steps[exits] += 1
        if not exits:
            return
        if self.verified:
            b.rows.append((tuple(row_exit_layers), tuple(riding or [0] * len(row_exit_layers)),
                           emitted))
        else:
            b.rows.extend(row_exit_layers)
        if b.probing:
            b.probing -= 1
            if b.probing:
                return
        else:  # running the exit program: decide again every probe_steps steps
            b.since += 1
            if b.since < self.config.probe_steps:
                return
        b.since = 0
        b.predicted = self.predict(batch, list(b.rows) if self.verified
                                   else dict(collections.Counter(b.rows)))
        b.prior = False
        b.exits = b.predicted > 1.0 + self.config.margin

    def summary(self) -> str:
        """Which program each bucket ran and why, e.g. for the CLI's closing line."""
        if self.config.mode != "auto":
            return f"exit program: {self.config.mode} (set by mode, not decided)"
        parts = []
        for batch, b in sorted(self.buckets.items()):
            why = ("no decision yet" if b.predicted != b.predicted else
                   f"{'calibration predicts' if b.prior else 'predicted'} "
                   f"{b.predicted:.2f}x {'>' if b.predicted > 1 + self.config.margin else '<='}"
                   f" {1 + self.config.margin:.2f}x")
            parts.append(f"batch {batch}: {'exits' if b.exits else 'full depth'} ({why}; "
                         f"steps exits {b.steps[True]}, full {b.steps[False]})")
        return "; ".join(parts) or "no decode step yet"


def exit_predictor(cfg: ModelConfig, ec: ExitConfig, config: ControllerConfig,
                   heads=None, platform: str | None = None
                   ) -> Callable[[int, dict[int, int]], float]:
    """The engine's prediction: batch, {row exit layer: rows} -> the exit program's speed-up
    over the full-depth program (`exit_cost.step_speedup` under `ec`, the runner's exit
    config: its back-fill, policy and row buckets; the exit loop's `check_overhead` charged
    on top). platform: the runner's (default: JAX's default backend)."""
    rank = (backfill_maps.rank_of(heads.backfill)
            if uses_maps(ec.backfill) and heads is not None and heads.backfill is not None
            else 0)
    cm = exit_cost.cost_model(cfg, ec, maps_rank=rank)
    platform = platform or jax.default_backend()
    cpu = platform == "cpu"
    mem = config.memory_bound_batch
    if mem is None:
        mem = 1 if cpu else 64
    ride = config.ride_cost if config.ride_cost is not None else (CPU_RIDE_COST if cpu else 0.0)

    if ec.verify:
        def predict_verified(batch: int, seen) -> float:
            """seen: the steps [(row exit layers, drafts riding, tokens emitted)], or before
            any, the prior's {exit layer: rows} (a sequence drawn from it, drafts confirmed
            at the agreement the heads were calibrated to, spread over the early tokens)."""
            regime = "memory" if batch <= mem else "compute"
            if isinstance(seen, dict):
                ideal = _verified_prior(cm, ec, seen, regime, ride)
            else:
                ideal = exit_cost.verified_steps_speedup(cm, ec, seen, batch, regime, ride,
                                                         platform)
            return 1.0 / (1.0 / ideal + config.check_overhead)

        return predict_verified

    def predict(batch: int, counts: dict[int, int]) -> float:
        regime = "memory" if batch <= mem else "compute"
        ideal = exit_cost.step_speedup(cm, ec, counts, batch, regime, ride, samples=128,
                                       platform=platform)
        return 1.0 / (1.0 / ideal + config.check_overhead)

    return predict


def _verified_prior(cm: exit_cost.CostModel, ec: ExitConfig, counts: dict[int, int],
                    regime: exit_cost.Regime, ride: float) -> float:
    """Verified exits' speed-up expected from exit rates alone: 512 tokens drawn from
    `counts` (fixed seed), a draft confirmed with the share of early tokens that keeps
    teacher-forced agreement at the calibration's target; one row's steps, priced in the
    batch's regime."""
    layers = sorted(counts)
    p = np.asarray([counts[k] for k in layers], np.float64)
    p /= p.sum()
    rng = np.random.default_rng(0)
    exits = rng.choice(layers, 512, p=p)
    early = float(np.mean(exits < cm.n_layers))
    accept = 1.0 - min(1.0, (1.0 - ec.target_agreement) / early) if early else 1.0
    agrees = rng.random(512) < accept
    return exit_cost.verified_sequence_speedup(cm, ec, exits.tolist(), agrees.tolist(),
                                               regime, ride)[0]
