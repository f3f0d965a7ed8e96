"""The cost of early exit in layer-equivalents (pure arithmetic on the shapes).

Per token (`CostModel.token_cost`): a token leaving at exit e costs e layers + the checks it
ran + the exit head; the ideal counts the heads: (L + final head) / mean cost (leaving the
final head out would flatter every exit). Exact only where each token's work is its own.

Per step (`step_work`): what one decode step runs, read off `serving.step` piece by piece, for
every back-fill, policy and verified exits. It is the one count of a step: the exit
controller, the ceilings, `EngineStats` and the roofline all price what it returns. Each piece
is counted twice (`Count`): `reads`, passes over its weights, what a memory-bound step pays
(GPU/TPU at small batch, a CPU at batch 1: a weight is read once a pass whatever the rows);
`rows`, row computations, what a compute-bound step pays (a CPU at batch 8 and up).
`CostModel.price` turns a count into layer-equivalents, `serving.roofline.Pieces.price` into
XLA's flops and bytes.

What a step with checks runs (`step._with_checks`) for active rows leaving at e_r (L: every
layer) in a program of B rows:

* layers 0..max(e_r)-1, layer n over the smallest row bucket that holds the rows still running
  (policy "per_row", `ExitConfig.row_buckets`); a batch-wide policy, or a runner that does not
  compact, runs every layer over all B rows, padding included;
* the checks at `checked_layers` up to the deepest exit, each over its layer's bucket (the
  first one dearer under measure "candidates": it picks the candidates);
* pending queries (back-fill "deferred" / "deferred_learned": the row's previous token;
  verified exits: the row's run, all `max_draft` entries, empty ones too) ride along, one
  query each for every row of the bucket, from the lowest pending depth among the rows running
  when the stage starts up to the step's deepest layer, never in a layer the step would not
  run (`ride`);
* the heads over all B rows: batch-wide, the exit head if the batch left (none under a
  vocabulary measure, whose check kept the exit's logits), else the final head; per_row, the
  exit head if a row left and the final head if a row ran to L (one product for both where
  the exits score the whole vocabulary with the shared head and a measure that does not);
  a verify step's final head also scores the verified runs' entries;
* the back-fill, once any row left early (a `lax.cond`): `kv_project` of every layer from
  `ExitConfig.first_exit` (static: the lowest exit that can be taken, whatever the rows'
  exits) to L-1, for all B rows and each of their queries (two under the deferred modes: the
  pending token's state and the new one's), and under maps their correction
  (`backfill_maps.kv_correction`: half the bucket's rows, all when more left; on TPU above 4
  rows every exit's maps for every row). Verified exits back-fill nothing.

Not counted: the embedding and sampling (the roofline adds them as `fixed`), the per-row exit
adapters a per_row step evaluates whether or not a row left (`row_exit_logits`: ~0.04 of a
layer a row for SmolLM2's MLP heads), and the back-fill's writes to the null page in a step
nobody left (one token's K/V a layer).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Literal

import numpy as np

from ee_jax.models.config import ModelConfig
from ee_jax.models.exits import backfill_maps
from ee_jax.models.exits.config import (
    DECISION_HIDDEN,
    N_FEATURES,
    VOCAB_MEASURES,
    ExitConfig,
    ExitConfigError,
    checked_layers,
    rides_along,
    run_widths,
    served_min_row_bucket,
    uses_maps,
)

Regime = Literal["memory", "compute"]
REGIMES = ("memory", "compute")


def layer_macs(cfg: ModelConfig) -> int:
    """Multiply-adds of one decoder layer's weights per token (attention over the context
    is not counted: at short contexts it is small next to the projections)."""
    D, q, kv = cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    return D * q + 2 * D * kv + q * D + 3 * D * cfg.ffn_dim


def kv_fraction(cfg: ModelConfig) -> float:
    """A layer's K/V projections as a share of the layer's multiply-adds."""
    return 2 * cfg.d_model * cfg.n_kv_heads * cfg.head_dim / layer_macs(cfg)


def map_fraction(cfg: ModelConfig, rank: int) -> float:
    """One learned map (`backfill_maps`: (D + 1) x r then r x 2KV) as a share of a layer."""
    return ((cfg.d_model + 1) * rank + rank * 2 * cfg.n_kv_heads * cfg.head_dim) / layer_macs(cfg)


# --------------------------------------------------------------------------- what a step runs


@dataclasses.dataclass(frozen=True)
class Count:
    """One piece of a step: `reads` passes over its weights, `rows` row computations."""

    reads: float = 0.0
    rows: float = 0.0

    def __add__(self, other: Count) -> Count:
        return Count(self.reads + other.reads, self.rows + other.rows)


NONE = Count()


@dataclasses.dataclass(frozen=True)
class StepWork:
    """What one decode step runs, per piece. Layer-sized pieces count layers: `fill` one
    layer's K/V projection, `maps` one layer's learned map, `ride` one layer's pending queries
    (rows: one per query)."""

    layers: Count = NONE
    ride: Count = NONE
    first_check: Count = NONE
    later_checks: Count = NONE
    exit_head: Count = NONE
    final_head: Count = NONE
    fill: Count = NONE
    maps: Count = NONE


def _pending_depths(pending, rows: int, riders: int, n_layers: int) -> list[list[int]]:
    """Each row's pending entries as the layers they have run (empty ones, L, left out)."""
    if not riders or pending is None:
        return [[] for _ in range(rows)]
    if len(pending) != rows:
        raise ValueError(f"pending gives {len(pending)} rows, exit_layers {rows}")
    out = []
    for p in pending:
        depths = [int(d) for d in np.atleast_1d(p) if int(d) < n_layers]
        if len(depths) > riders:
            raise ValueError(f"a row carries at most {riders} pending tokens, got {depths}")
        out.append(depths)
    return out


def step_work(ec: ExitConfig, n_layers: int, exit_layers: Sequence[int],
              pending: Sequence[int | Sequence[int]] | None = None, bucket: int | None = None,
              platform: str = "cpu") -> StepWork:
    """What one decode step under `ec` runs (the module's docstring says how it is counted).

    exit_layers: each active row's exit layer (L = n_layers: it ran every layer); under a
    batch-wide policy every row holds the batch's. pending: each row's pending tokens, as the
    layers they have run (L: none): under back-fill "deferred" / "deferred_learned" the exit
    of the row's previous token, under verified exits the depth of every draft in its run;
    ignored where nothing rides along. bucket: the rows of the program (default: the rows
    given; padding rows cost what the step spends on them). platform: where the learned maps
    are gathered a row at a time (`backfill_maps.gathers`) and whether policy "per_row"
    compacts its rows (`served_min_row_bucket`: as the runner there serves it)."""
    L = n_layers
    rows = [int(e) for e in exit_layers]
    if not rows:
        return StepWork()
    B = len(rows) if bucket is None else int(bucket)
    if len(rows) > B:
        raise ValueError(f"a bucket of {B} rows cannot hold {len(rows)}")
    if min(rows) < 1 or max(rows) > L:
        raise ValueError(f"exit layers are in [1, {L}], got {sorted(set(rows))}")
    batch_wide = ec.policy in ("all", "quorum")
    if batch_wide and len(set(rows)) > 1:
        raise ValueError(f"policy {ec.policy!r} leaves as a batch: every row holds the "
                         f"batch's exit layer, got {sorted(set(rows))}")
    riders = ec.max_draft if ec.verify else int(rides_along(ec.backfill))
    pend = _pending_depths(pending, len(rows), riders, L)
    # the stages the runner on `platform` serves (an accelerator never compacts)
    sizes = (B,) if batch_wide else ec.row_buckets(
        B, served_min_row_bucket(platform, B, ec.min_row_bucket))

    layers = ride = NONE
    bucket_at = []  # the rows layer n runs over
    stage, lowest = 0, L
    for n in range(max(rows)):
        running = [r for r, e in enumerate(rows) if e > n]
        z = min(s for s in sizes if s >= len(running))
        if z != stage:  # a stage starts: the lowest pending depth among the rows running now
            stage = z
            lowest = min((d for r in running for d in pend[r]), default=L)
        bucket_at.append(z)
        layers += Count(1, z)
        if n >= lowest:
            ride += Count(1, z * riders)

    # With force_exit_layer a check computes nothing unless it keeps the exit's logits.
    keep = ec.needs_vocab and (ec.force_exit_layer is None or ec.head == "branch")
    first_check = later_checks = NONE
    if ec.force_exit_layer is None or keep:
        for i, c in enumerate(checked_layers(ec, L)):
            if c > max(rows):
                break
            if i == 0:
                first_check = Count(1, bucket_at[c - 1])
            else:
                later_checks += Count(1, bucket_at[c - 1])

    left, full = min(rows) < L, max(rows) >= L
    every = Count(1, B)
    exit_head = final_head = NONE
    shared = not (ec.vocab_subset or ec.exit_output or keep)
    if batch_wide:
        if left:
            exit_head = NONE if keep else every
        elif not ec.verify:
            final_head = every
    elif shared:  # one product over the exit rows' states and the others' final ones
        if full and not ec.verify:
            final_head = every
        else:
            exit_head = every
    else:
        if left and not keep:
            exit_head = every
        if full and not ec.verify:
            final_head = every
    if ec.verify and full:  # the verified runs' entries and the rows' own token, one product
        need = max(len(pend[r]) for r, e in enumerate(rows) if e >= L)
        w = min(x for x in run_widths(ec.max_draft) if x >= need)
        final_head += Count(1, B * (w + 1))

    fill = maps = NONE
    first = ec.first_exit
    if left and not ec.verify and first is not None:
        J = L - first
        T = 2 if rides_along(ec.backfill) else 1
        fill = Count(J, B * T * J)
        if uses_maps(ec.backfill):
            if backfill_maps.gathers(platform, B):
                few = max(1, B // 2)
                corrected = few if sum(e < L for e in rows) <= few else B
                maps = Count(corrected * J, corrected * T * J)
            else:
                X = len(ec.exit_layers)
                maps = Count(X * J, X * B * T * J)
    return StepWork(layers, ride, first_check, later_checks, exit_head, final_head, fill, maps)


def full_depth_work(n_layers: int, batch: int) -> StepWork:
    """The full-depth program (`step.FullDepth`): every layer and the final head over the
    batch's rows."""
    return StepWork(layers=Count(n_layers, n_layers * batch), final_head=Count(1, batch))


# --------------------------------------------------------------------------- prices


@dataclasses.dataclass(frozen=True)
class CostModel:
    """What each piece of a step costs, in layer-equivalents (multiply-adds / `layer_macs`).

    A token leaving at exit e costs e layers + its checks + the exit head (+ its skipped
    layers at `completion` each, an average cost of back-fill "deferred" completing them in
    later steps); at full depth L layers + every check + the final head. `ideal_speedup` is
    the honest ideal per token: (L + final head) / mean cost; `price` prices a step's work."""

    n_layers: int
    checked: tuple[int, ...]  # the layers a step checks after (`checked_layers`)
    final_head: float  # final norm + LM head over the whole vocabulary
    # exit norm/adapter + LM head over the exit vocabulary, where the step runs it after its
    # check (0 under a vocabulary measure: the check computed the exit's logits, kept)
    exit_head: float
    first_check: float
    later_check: float
    fill: float = 0.0  # one skipped layer's K/V projection of one query (`kv_fraction`)
    maps: float = 0.0  # one layer's learned map for one query (`map_fraction`)
    completion: float = 0.0  # one skipped layer run later for the token (back-fill "deferred")

    def checks_upto(self, layer: int) -> float:
        n = sum(1 for c in self.checked if c <= layer)
        return self.first_check + (n - 1) * self.later_check if n else 0.0

    def token_cost(self, exit_layer: int) -> float:
        done = self.checks_upto(exit_layer)
        if exit_layer >= self.n_layers:
            return exit_layer + done + self.final_head
        return (exit_layer + done + self.exit_head
                + (self.n_layers - exit_layer) * self.completion)

    def mean_cost(self, exit_counts) -> float:
        """exit_counts: {exit layer (n_layers = full depth): tokens}."""
        n = sum(exit_counts.values())
        if not n:
            return self.token_cost(self.n_layers)
        return sum(self.token_cost(int(e)) * c for e, c in exit_counts.items()) / n

    def ideal_speedup(self, exit_counts) -> float:
        return (self.n_layers + self.final_head) / self.mean_cost(exit_counts)

    def price(self, work: StepWork, regime: Regime, ride: float = 0.0) -> float:
        """A step's work in layer-equivalents: memory-bound each piece once a pass over its
        weights, compute-bound once a row. ride: what a layer's pending queries add where the
        weights are read anyway (memory-bound; 0 where the weights' bytes are the cost, ~0.7
        on a CPU dequantizing GGUF block weights a row at a time, `ControllerConfig.ride_cost`);
        compute-bound each riding query costs a layer."""
        if regime not in REGIMES:
            raise ExitConfigError(f"regime {regime!r}: expected one of {REGIMES}")
        memory = regime == "memory"

        def n(c: Count) -> float:
            return c.reads if memory else c.rows

        return (n(work.layers) + (ride if memory else 1.0) * n(work.ride)
                + self.first_check * n(work.first_check) + self.later_check * n(work.later_checks)
                + self.exit_head * n(work.exit_head) + self.final_head * n(work.final_head)
                + self.fill * n(work.fill) + self.maps * n(work.maps))


def cost_model(cfg: ModelConfig, ec: ExitConfig, completion: float = 0.0,
               maps_rank: int = 0) -> CostModel:
    """The cost model of these exits on this model (pure arithmetic on the shapes).

    completion: the cost, per skipped layer, of completing a back-fill "deferred" token
    later, in layer-equivalents; default 0. The engine completes a token only in the layers
    its row's next token runs anyway (a second query riding along), so what that costs
    depends on the next token: `step_work` counts it per step (nothing memory-bound; the
    second query's arithmetic compute-bound). Pass a measured per-layer fraction here to fold
    an average into the per-token count. maps_rank: the learned back-fill maps' rank (0: no
    maps)."""
    D, lay = cfg.d_model, float(layer_macs(cfg))
    vocab = ec.vocab_subset or cfg.vocab_size
    hidden = D + (2 * D * ec.adapter_rank if ec.head in ("adapter", "mlp") else 0)
    if ec.head == "branch":  # EE-LLM's exit MLP: a whole SwiGLU MLP of the model's width
        hidden = D + 3 * D * cfg.ffn_dim
    if ec.measure in VOCAB_MEASURES:
        later = first = hidden + vocab * D + 2 * vocab
    elif ec.measure == "candidates":
        tail = N_FEATURES * DECISION_HIDDEN + DECISION_HIDDEN + 4 * ec.candidates
        first = hidden + vocab * D + tail
        later = hidden + ec.candidates * D + tail
    else:  # saturation, classifier: one D-wide dot product (plus a norm)
        later = first = 2 * D
    if not ec.enabled:
        later = first = 0
    exit_head = 0.0 if ec.needs_vocab else hidden + vocab * D
    return CostModel(cfg.n_layers, checked_layers(ec, cfg.n_layers) if ec.enabled else (),
                     (D + cfg.vocab_size * D) / lay, exit_head / lay, first / lay, later / lay,
                     kv_fraction(cfg), map_fraction(cfg, maps_rank) if maps_rank else 0.0,
                     completion if ec.enabled and rides_along(ec.backfill) else 0.0)


def ideal_speedup_with_head(cfg: ModelConfig, ec: ExitConfig, exit_counts,
                            completion: float = 0.0) -> float:
    """(L + final head) / mean per-token cost, all in layer-equivalents, for tokens leaving
    per `exit_counts` {exit layer (L = full depth): count}. What `EngineStats` should report
    next to the measured speed-up (the plain L / mean layers leaves the heads out).
    completion: see `cost_model`."""
    return cost_model(cfg, ec, completion).ideal_speedup(exit_counts)


# --------------------------------------------------------------------------- steps priced


def step_cost(cm: CostModel, ec: ExitConfig, exit_layers: Sequence[int],
              pending: Sequence[int | Sequence[int]] | None, regime: Regime, ride: float = 0.0,
              bucket: int | None = None, platform: str = "cpu") -> float:
    """One decode step's cost in layer-equivalents: `step_work` priced by `cm`."""
    return cm.price(step_work(ec, cm.n_layers, exit_layers, pending, bucket, platform), regime,
                    ride)


def full_step_cost(cm: CostModel, batch: int, regime: Regime) -> float:
    return cm.price(full_depth_work(cm.n_layers, batch), regime)


def sequence_speedup(cm: CostModel, ec: ExitConfig, steps: Sequence[Sequence[int]],
                     regime: Regime, ride: float = 0.0, platform: str = "cpu") -> float:
    """Full depth over early exit for decode steps whose rows (the same rows, in order, every
    step) left at steps[t][r]; a row's pending token is its previous step's (deferred)."""
    total, prev = 0.0, None
    for rows in steps:
        total += step_cost(cm, ec, rows, prev, regime, ride, platform=platform)
        prev = rows
    full = sum(full_step_cost(cm, len(r), regime) for r in steps)
    return full / total if total else 1.0


def step_speedup(cm: CostModel, ec: ExitConfig, counts: dict[int, int], batch: int,
                 regime: Regime, ride: float = 0.0, samples: int = 512, seed: int = 0,
                 platform: str = "cpu") -> float:
    """Expected speed-up of steps of `batch` rows whose exit layers are drawn independently
    from `counts` {exit layer: rows} (each row's pending token drawn the same way). Under a
    batch-wide policy `counts` are batch exit layers (every row of a step leaves at the
    step's), so one draw per step serves all its rows. Sampled with a fixed seed:
    deterministic."""
    layers = np.asarray(sorted(counts), np.int64)
    if not len(layers):
        return 1.0
    p = np.asarray([counts[k] for k in sorted(counts)], np.float64)
    p /= p.sum()
    rng = np.random.default_rng(seed)
    draws = rng.choice(layers, size=(samples, 2, batch), p=p)
    total = 0.0
    for now, before in draws:
        if ec.policy in ("all", "quorum"):
            now, before = np.full(batch, now[0]), np.full(batch, before[0])
        total += step_cost(cm, ec, now.tolist(), before.tolist(), regime, ride,
                           platform=platform)
    return samples * full_step_cost(cm, batch, regime) / total


def histogram(exits: Sequence[int]) -> dict[int, int]:
    return dict(collections.Counter(int(e) for e in exits))


# --------------------------------------------------------------------------- verified exits


def _verifying(ec: ExitConfig) -> ExitConfig:
    if not ec.verify:
        raise ExitConfigError("verified-exit costs need an exit config with verify=True "
                              "(ExitConfig.verified())")
    return ec


def verified_speedup(cm: CostModel, ec: ExitConfig, step_counts: dict[int, int], emitted: int,
                     batch: float = 1.0) -> float:
    """Full depth over verified exits, memory-bound (riding drafts free): decode steps whose
    (deepest) exit layers are `step_counts` {layer: steps} emitted `emitted` tokens in all.
    A draft step costs its layers, its checks and the exit head; a verify step (L) every
    layer, the checks and the final head over the run (one read of its weights). Rejected
    drafts' work is in the steps it took. batch: rows a step holds on average (a full-depth
    step emits that many tokens)."""
    ec = _verifying(ec)
    cost = sum(n * step_cost(cm, ec, [int(e)], None, "memory") for e, n in step_counts.items())
    return emitted * full_step_cost(cm, 1, "memory") / batch / cost if cost else 1.0


def verified_steps_speedup(cm: CostModel, ec: ExitConfig, steps, batch: int, regime: Regime,
                           ride: float = 0.0, platform: str = "cpu") -> float:
    """Full depth over verified exits for decode steps of `batch` rows given as
    (exit layers, drafts riding, tokens emitted) per step: full depth emits `batch` tokens a
    step (memory-bound: one step's cost for them all; compute-bound: each row's). The host
    knows how many drafts a row carries, not how deep they are: a verifying row's are taken
    at the first exit (the most they can ride), a drafting row's at its own exit (they ride
    nothing below it)."""
    ec = _verifying(ec)
    first = ec.first_exit or cm.n_layers
    cost = emitted = 0.0
    for layers, riding, n in steps:
        pend = [[first if e >= cm.n_layers else e] * k for e, k in zip(layers, riding,
                                                                      strict=True)]
        cost += step_cost(cm, ec, layers, pend, regime, ride, bucket=batch, platform=platform)
        emitted += n
    if not cost or not emitted:  # no evidence yet (every step drafted)
        return 1.0
    return emitted * full_step_cost(cm, batch, regime) / batch / cost


def verified_sequence_speedup(cm: CostModel, ec: ExitConfig, exits: Sequence[int],
                              agrees: Sequence[bool], regime: Regime = "memory",
                              ride: float = 0.0, in_run: tuple[Sequence[int], Sequence[bool]]
                              | None = None) -> tuple[float, float, int]:
    """Full depth over verified exits for one answer decoded at batch 1: position t's token
    would leave at exits[t] (L: not confident) and its draft there equals full depth's token
    where agrees[t]. A run drafts while tokens leave (at most `ec.max_draft`), each draft
    step carrying the run so far (its drafts ride up to the step's exit and are then that
    deep), then a verify step runs the next position at full depth with the run riding;
    it keeps the leading agreeing drafts and emits the full model's token after them;
    decoding goes on after what it emitted. Drafts after a rejected one are paid (their
    decisions taken as teacher-forced ones: an approximation). in_run: (exits, agrees) of
    a second draft rule for a position that would extend a run (a rule that reads whether
    the row is drafting); the first rule then starts runs. Returns (speed-up, acceptance,
    drafts)."""
    ec = _verifying(ec)
    L = cm.n_layers
    n = len(exits)
    run_exits, run_agrees = in_run if in_run is not None else (exits, agrees)
    i = 0
    cost = 0.0
    drafted = accepted = 0
    while i < n:
        run: list[int] = []  # the depths of the run's drafts
        ok: list[bool] = []  # whether each draft equals full depth's token
        while len(run) < ec.max_draft and i + len(run) < n - 1:
            j = i + len(run)
            e, good = (run_exits[j], run_agrees[j]) if run else (exits[j], agrees[j])
            if e >= L:
                break
            cost += step_cost(cm, ec, [int(e)], [run], regime, ride)
            run = [max(d, int(e)) for d in run] + [int(e)]
            ok.append(bool(good))
        cost += step_cost(cm, ec, [L], [run], regime, ride)  # the verify step
        k = len(run)
        a = 0
        while a < k and ok[a]:
            a += 1
        drafted += k
        accepted += a
        i += a + 1
    speedup = n * full_step_cost(cm, 1, regime) / cost if cost else 1.0
    return speedup, (accepted / drafted if drafted else float("nan")), drafted
