"""Engine statistics and the one exit summary every report uses.

`EngineStats` holds the counters each engine step adds to (steps, tokens, time apart from
compiles, exit layers per step and per row); `exit_summary` turns them into the exit figures
every speed figure comes with (histograms, mean layers, the ideal speed-up with the heads and
checks counted by the cost model), for the CLI's summary (`format_exit_summary`), the
server's /metrics and the benchmarks alike.
"""

from __future__ import annotations

import copy
import dataclasses

from ee_jax.models.config import ModelConfig
from ee_jax.models.exits.config import ExitConfig, uses_maps
from ee_jax.models.exits.cost import cost_model, layer_macs, step_speedup
from ee_jax.serving.params import acceptance_rate


@dataclasses.dataclass
class EngineStats:
    num_steps: int = 0
    num_prefill_steps: int = 0
    num_decode_steps: int = 0
    prefill_time: float = 0.0
    decode_time: float = 0.0
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    max_pages_used: int = 0
    compile_time: float = 0.0
    num_compiles: int = 0
    num_programs_loaded: int = 0  # step programs `precompile` loaded whole (ProgramCache)
    num_decode_compiles: int = 0
    num_decode_tokens: int = 0  # tokens produced by decode steps that did not compile
    # seconds step() spent on the host: not waiting for the device, not compiling
    host_time: float = 0.0
    num_mixed_steps: int = 0  # prefill steps that also advanced decoding requests
    # verified exits: drafts made, drafts the full model confirmed, decode steps that
    # verified at least one row (ExitConfig.verify)
    num_drafted: int = 0
    num_accepted: int = 0
    num_verify_steps: int = 0

    @property
    def acceptance_rate(self) -> float | None:
        return acceptance_rate(self.num_accepted, self.num_drafted)

    decode_layers_run: int = 0  # sum over decode steps of the layers the batch ran
    vocab_checks: int = 0  # exit checks that projected onto the vocabulary (their cost)
    step_exit_counts: dict[int, int] = dataclasses.field(default_factory=dict)
    token_exit_counts: dict[int, int] = dataclasses.field(default_factory=dict)
    # Per row of decode steps (policy "per_row": each row's own exit layer; otherwise the
    # batch's): the ideal work is decode_row_layers, the work done row_layers_computed
    # (rows a layer actually ran on, padding rows of a bucket included), the full-depth work
    # of the same steps row_layers_full_depth (batch bucket x L).
    num_decode_rows: int = 0
    decode_row_layers: int = 0
    row_layers_computed: int = 0
    row_layers_full_depth: int = 0
    row_exit_counts: dict[int, int] = dataclasses.field(default_factory=dict)

    @property
    def mean_layers_per_decode_step(self) -> float:
        return self.decode_layers_run / self.num_decode_steps if self.num_decode_steps else 0.0

    def ideal_speedup(self, n_layers: int) -> float:
        """L / mean executed layers: the most early exit can give at this exit pattern."""
        m = self.mean_layers_per_decode_step
        return n_layers / m if m else 1.0

    @property
    def mean_layers_per_row(self) -> float:
        """Mean layers executed per decoded row (per token of a decode step)."""
        return self.decode_row_layers / self.num_decode_rows if self.num_decode_rows else 0.0

    def ideal_speedup_with_head(self, cfg: ModelConfig, ec: ExitConfig | None,
                                memory_bound_batch: int = 1, maps_rank: int = 0) -> float:
        """The honest ceiling beside the measured speed: what this run's decode steps really
        ran (`exit_cost.step_speedup` at the run's mean rows per step under `ec`: heads,
        checks, K/V back-fill and deferred's pending tokens counted, in layer-equivalents),
        memory-bound up to `memory_bound_batch` rows (a CPU: 1), compute-bound above. L /
        mean layers leaves out the LM head (~8 layers on SmolLM2) and the back-fill."""
        if ec is None or not self.row_exit_counts or not self.num_decode_steps:
            return 1.0
        batch = max(1, round(self.num_decode_rows / self.num_decode_steps))
        counts = (self.step_exit_counts if ec.policy in ("all", "quorum")
                  else self.row_exit_counts)
        return step_speedup(
            cost_model(cfg, ec, maps_rank=maps_rank if uses_maps(ec.backfill) else 0), ec,
            counts, batch, "memory" if batch <= memory_bound_batch else "compute",
            samples=256)

    def snapshot(self) -> EngineStats:
        """A copy of the counters now; `since(snapshot)` gives a window's figures."""
        return copy.deepcopy(self)

    def since(self, before: EngineStats) -> EngineStats:
        """The counters accumulated after `before` (a `snapshot`); maxima stay as they are."""
        out = EngineStats()
        for f in dataclasses.fields(self):
            now, then = getattr(self, f.name), getattr(before, f.name)
            if isinstance(now, dict):
                diff = {k: v - then.get(k, 0) for k, v in now.items()}
                setattr(out, f.name, {k: v for k, v in diff.items() if v})
            elif f.name.startswith("max_"):
                setattr(out, f.name, now)
            else:
                setattr(out, f.name, now - then)
        return out

    def ideal_row_speedup(self, n_layers: int) -> float:
        """L / mean executed layers per row: the most per-row exits could give."""
        m = self.mean_layers_per_row
        return n_layers / m if m else 1.0

    @property
    def work_fraction(self) -> float:
        """Row-layers computed / row-layers at full depth over the same decode steps."""
        return (self.row_layers_computed / self.row_layers_full_depth
                if self.row_layers_full_depth else 1.0)

    def row_exit_histogram(self) -> str:
        """Decode rows per exit layer, e.g. '6:40 9:12 30:8'."""
        return " ".join(f"{k}:{v}" for k, v in sorted(self.row_exit_counts.items()))

    @property
    def vocab_checks_per_decode_step(self) -> float:
        return self.vocab_checks / self.num_decode_steps if self.num_decode_steps else 0.0

    def exit_histogram(self) -> str:
        """Decode steps per batch exit layer, e.g. '10:4 15:20 30:3'."""
        return " ".join(f"{k}:{v}" for k, v in sorted(self.step_exit_counts.items()))

    @property
    def decode_step_time(self) -> float:
        """Mean seconds per decode step that did not compile."""
        return self.decode_time / max(1, self.num_decode_steps - self.num_decode_compiles)

    @property
    def decode_tokens_per_s(self) -> float:
        return self.num_decode_tokens / self.decode_time if self.decode_time else 0.0


def exit_summary(stats: EngineStats, cfg: ModelConfig, ec: ExitConfig | None = None) -> dict:
    """The exit figures every speed figure comes with, from an engine's counters:
    row_hist / step_hist (decode rows / steps per exit layer), rows and early (rows that left
    before full depth), mean_layers per row, ideal_layers (L / mean layers), ideal ((L + head)
    / mean cost, heads and checks counted: `exit_cost.cost_model`; 1 at full depth),
    head_layers (the final norm and LM head in layer-equivalents, as the cost model counts
    it), work_fraction (layers x rows computed / full depth's) and checks_per_step
    (vocabulary projections per decode step).
    With exits: exit_head, first_check, later_check (layer-equivalents)."""
    L = cfg.n_layers
    mean = stats.mean_layers_per_row or float(L)
    rows = sum(stats.row_exit_counts.values())
    full = cost_model(cfg, ec) if ec is not None else None
    out = dict(row_hist=stats.row_exit_histogram() or f"{L}:0",
               step_hist=stats.exit_histogram(), rows=rows,
               early=rows - stats.row_exit_counts.get(L, 0), mean_layers=mean,
               ideal_layers=L / mean if mean else 1.0,
               ideal=stats.ideal_speedup_with_head(cfg, ec),
               head_layers=(cfg.d_model + cfg.vocab_size * cfg.d_model) / layer_macs(cfg),
               work_fraction=stats.work_fraction,
               checks_per_step=stats.vocab_checks_per_decode_step)
    if full is not None:
        out.update(exit_head=full.exit_head, first_check=full.first_check,
                   later_check=full.later_check)
    return out


def format_exit_summary(summary: dict, cfg: ModelConfig, ec: ExitConfig) -> str:
    """The early-exit line of the CLI's summary, from `exit_summary`."""
    vocab = f"{ec.vocab_subset:,}-id subset" if ec.vocab_subset else "whole vocabulary"
    deferred = f"; back-fill {ec.backfill!r}, counted as the steps run it"
    check = (f"first check {summary['first_check']:.2f}, later checks "
             f"{summary['later_check']:.3f} each" if ec.measure == "candidates"
             else f"each check {summary['first_check']:.2f}")
    return (f"early exit ({ec.policy}, {ec.measure} >= {ec.threshold}, head {ec.head}, exits "
            f"{list(ec.exit_layers)}): {summary['early']} of {summary['rows']} rows left "
            f"early; rows per exit layer {{{summary['row_hist']}}}; mean layers per token "
            f"{summary['mean_layers']:.1f} of {cfg.n_layers} -> ideal speedup "
            f"{summary['ideal_layers']:.2f}x, {summary['ideal']:.2f}x counting the heads and "
            f"checks (layer-equivalents: final head {summary['head_layers']:.2f}, exit head over "
            f"the {vocab} {summary['exit_head']:.2f}, {check}{deferred}); layers x rows "
            f"computed {summary['work_fraction']:.2f} of full depth; "
            f"{summary['checks_per_step']:.1f} vocabulary projections per step for exit checks")
