"""Early-exit configuration: `ExitConfig` (jit-static), its vocabularies of names, and errors.

An *exit layer* `e` means "after `e` decoder layers have run" (1 <= e < n_layers); the full
model is exit `n_layers`. The heads these settings describe live in `exit_heads`, the
confidence checks in `exit_checks`, the per-token cost in `exit_cost`.

Policies: "all" (the paper's batch-wide rule), "quorum", "never", and "per_row": every row
leaves at its own first confident exit and takes that exit's head, while the rows still
running are compacted into smaller row buckets (`ee_jax.serving.step`).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np

from ee_jax.errors import EEJaxError
from ee_jax.models.config import ModelConfig

HeadType = Literal["norm", "adapter", "mlp", "branch"]
Measure = Literal["max_prob", "margin", "entropy", "saturation", "classifier", "candidates"]
Policy = Literal["all", "quorum", "never", "per_row"]
Backfill = Literal["propagate", "deferred", "learned", "deferred_learned"]
VerifySampling = Literal["coupled", "rejection"]
MEASURES = ("max_prob", "margin", "entropy", "saturation", "classifier", "candidates")
VOCAB_MEASURES = ("max_prob", "margin", "entropy")
HEADS = ("norm", "adapter", "mlp", "branch")
POLICIES = ("all", "quorum", "never", "per_row")
BACKFILLS = ("propagate", "deferred", "learned", "deferred_learned")
VERIFY_SAMPLINGS = ("coupled", "rejection")


def rides_along(backfill: str) -> bool:
    """Whether a token that left early rides along in its row's next decode step (a second
    query completing the layers that step runs anyway)."""
    return backfill in ("deferred", "deferred_learned")


def uses_maps(backfill: str) -> bool:
    """Whether the K/V of skipped layers nobody runs are corrected by the fitted maps
    (`ee_jax.models.exits.backfill_maps`, ExitHeads.backfill)."""
    return backfill in ("learned", "deferred_learned")

# The policy shipped heads are served with (LLM and the CLI alike), whatever policy they were
# calibrated under: each row leaves at its own first confident exit. Under "all" a batch waits
# for its least confident row, so at a faithful threshold it almost never leaves (the CLI
# demo's 4 rows: 0 of 149 under "all", 21 per row); at batch 1 the two are the same. Where
# the checks still do not pay, the engine's controller runs full depth (serving.controller).
SERVING_POLICY = "per_row"
NEVER = float("inf")  # a threshold no confidence reaches: exits checked but never taken
N_FEATURES = 9  # candidate features per check (`candidate_features`)
DECISION_HIDDEN = 16  # width of the per-exit decision MLP


class ExitConfigError(EEJaxError, ValueError):
    """An early-exit configuration that cannot work with this model."""


@dataclasses.dataclass(frozen=True)
class ExitConfig:
    """Static early-exit settings (jit-static, hashable).

    threshold: a row is confident at an exit when its confidence >= threshold; must lie in
    [0, 1] (use policy "never" to switch exits off). Per-request thresholds override it.
    A row that was confident at some exit check is *done* from then on (it would have
    left there on its own), so the batch exit layer under policy "all" (the paper's rule)
    is the latest of the active rows' first confident exits; under policy "quorum" the
    batch leaves once at least `quorum` of the active rows are done (faster, lossier: the
    rest take the exit head's token although they were not confident). Under policy
    "per_row" each row leaves at its own first confident exit and takes that exit's head; the
    step ends when every active row has left. Exits below `min_exit_layer` are never taken
    (saturation still records the hidden state there).
    min_row_bucket: "per_row" only — the smallest row bucket the running rows are compacted
    into (buckets are B, B/2, ..., min_row_bucket). None (the default): the serving runner
    picks it where fewer rows cost less (`served_min_row_bucket`): 1 on CPU; on
    accelerators the runner never compacts, whatever is asked (weight reads dominate a layer
    there). On CPU an integer is served as given (fewer stages: less to compile).
    force_exit_layer: benchmarks and tests only — leave at that exit regardless of confidence.
    vocab_subset: K > 0 — exit heads score only the K token ids in `ExitHeads.vocab` (logits of
    every other id are MASKED); 0 — the whole vocabulary.
    candidates: measure "candidates" only — how many of the first check's top tokens later
    checks score.
    target_agreement: the teacher-forced agreement with full depth that the shipped threshold
    was calibrated to meet (`ee_jax.models.exits.threshold`); in (0, 1].
    backfill: what the skipped layers of a token that left early hold. "deferred" (the
    default): K/V projected from its exit state at once, then the row's next decode step
    runs the token's skipped layers for real beside its own token (one more query per row,
    riding along in the layers the new token runs anyway: above its own exit it runs none)
    and overwrites them with the exact K/V; later tokens then see what full depth would have
    written, unless that next token leaves early too (the older token then keeps the K/V of
    its deepest state) or the row's next step is a prefill step (mixed steps run decode rows
    at full depth and drop what they complete). "propagate" (CALM's state propagation, the
    reference design's fill): the projected K/V, for good; on SmolLM2 they cost later tokens
    3-12x more agreement with full depth (docs/benchmarks.md). "learned": propagate's cost
    (the skipped layers are never run) with fitted maps correcting the projected K/V towards
    full depth's (`ee_jax.models.exits.backfill_maps`; the heads carry them as ExitHeads.backfill).
    "deferred_learned": deferred's exact ride-along where the next step runs the layers, the
    learned K/V (not the projected ones) for the layers it does not: deferred's cost with
    agreement at least deferred's (on accelerators, where the second query rides on weights
    read anyway, propagate's cost). All four run only the layers the step's new tokens run
    (docs/early_exit.md, "Back-fill"); the deferred two add their second query's arithmetic in
    them (free where decode is memory-bound, paid per row where it is compute-bound).
    """

    exit_layers: tuple[int, ...] = ()  # where exits are: after this many layers, increasing
    # what an exit computes: "norm" (the final norm), "adapter" / "mlp" (a residual MLP of
    # width adapter_rank before it), "branch" (an MLP of its own on the layer's attention
    # output, EE-LLM's); each then the model's LM head unless exit_output
    head: HeadType = "norm"
    # a row's confidence at an exit: the head's top probability, margin, entropy; the
    # hidden state's saturation; a trained classifier; candidates (a decision MLP, below)
    measure: Measure = "max_prob"
    threshold: float = 0.9
    min_exit_layer: int = 1  # exits below this layer are never taken
    policy: Policy = "all"  # how a batch leaves: "all", "quorum", "per_row" or "never"
    quorum: float = 0.75  # policy "quorum": the share of active rows done before it leaves
    adapter_rank: int = 64  # head "adapter" / "mlp": the residual MLP's hidden width
    force_exit_layer: int | None = None
    min_row_bucket: int | None = None
    vocab_subset: int = 0
    candidates: int = 8
    target_agreement: float = 0.95
    backfill: Backfill = "deferred"
    # Verified exits (docs/early_exit.md, "Verified exits"): a token that leaves at its exit is
    # a *draft*; the row's run of drafts rides along in later steps and is checked by the full
    # model in the first step that runs the row to the last layer (its token not confident, or
    # the run at max_draft, or a length or stop limit within reach). Only what the full model
    # confirms is emitted: the output is full depth's, the threshold a speed knob. The K/V come
    # from riding along alone (backfill "deferred"; nothing propagated or learned).
    verify: bool = False
    # verify: the longest run of drafts before a verify step (LayerSkip's num_speculations
    # with force_exit_layer): longer runs save more steps when accepted and waste more when
    # not. 4: for the shipped SmolLM2 heads the ceiling at 4 equals 8's and beats 2's on every
    # workload (docs/benchmarks.md, "Verified exits"), with fewer drafts riding a step
    max_draft: int = 4
    # verify, rows with temperature > 0: how the full model checks a draft (greedy rows keep
    # a draft where it is the full model's argmax under both). "coupled": each position is
    # sampled with the request's key for its token index, from the exit's logits (the draft)
    # and from the final head's (the full model's token); a draft is kept where the two
    # agree, so a seeded request emits exactly full depth's tokens whatever shares its batch.
    # "rejection": standard speculative sampling, keep d with probability min(1, p(d)/q(d)),
    # else sample the normalised max(0, p - q): the full model's distribution at the highest
    # acceptance any check can have, but the tokens depend on where drafts fall (under
    # policy "all", on the batch). Its runs carry each draft's exit logits ([max_draft, V]
    # f32 a row) to the verify.
    verify_sampling: VerifySampling = "coupled"
    # Exits trained with parts of their own (EE-LLM and EE-Tuning checkpoints,
    # `ee_jax.models.formats.megatron`). head "branch": the exit reads its layer's state after
    # attention, m, and adds an MLP of its own, m + mlp_branch(rms(m)) (EE-LLM's exit MLP:
    # the layer's MLP is its trunk). exit_norm False: the exit's state goes to the output
    # unnormed (EE-LLM without --use-exit-norm). exit_output: each exit has its own output
    # matrix, ExitHeads.output [E, V, D], instead of the model's LM head. temperatures: one per
    # exit, each exit's logits divided by it (what its training calibrated; () is 1).
    exit_norm: bool = True
    exit_output: bool = False  # each exit its own output matrix (above)
    temperatures: tuple[float, ...] = ()  # one per exit, its logits' divisor (above)

    def __post_init__(self):
        object.__setattr__(self, "exit_layers", tuple(int(e) for e in self.exit_layers))
        object.__setattr__(self, "temperatures", tuple(float(t) for t in self.temperatures))
        if list(self.exit_layers) != sorted(set(self.exit_layers)):
            raise ExitConfigError(f"exit_layers must be strictly increasing, got "
                                  f"{self.exit_layers}")
        if self.head not in HEADS:
            raise ExitConfigError(f"unknown exit head {self.head!r}; choose one of {HEADS}")
        if self.measure not in MEASURES:
            raise ExitConfigError(f"unknown confidence measure {self.measure!r}; choose one "
                                  f"of {MEASURES}")
        if self.policy not in POLICIES:
            raise ExitConfigError(f"unknown exit policy {self.policy!r}; choose one of "
                                  f"{POLICIES}")
        if not (0.0 <= self.threshold <= 1.0 or self.threshold == NEVER):
            raise ExitConfigError(f"threshold must be in [0, 1] (or exit_config.NEVER), got "
                                  f"{self.threshold}; to disable exits use policy='never'")
        if self.backfill not in BACKFILLS:
            raise ExitConfigError(f"unknown backfill {self.backfill!r}; choose one of "
                                  f"{BACKFILLS}")
        if not (isinstance(self.max_draft, int) and not isinstance(self.max_draft, bool)
                and self.max_draft >= 1):
            raise ExitConfigError(f"max_draft must be an integer >= 1 (drafts in a run before "
                                  f"it is verified), got {self.max_draft!r}")
        if self.verify_sampling not in VERIFY_SAMPLINGS:
            raise ExitConfigError(f"unknown verify_sampling {self.verify_sampling!r}; choose "
                                  f"one of {VERIFY_SAMPLINGS}")
        if self.verify and self.backfill != "deferred":
            raise ExitConfigError(
                f"verify=True cannot use backfill {self.backfill!r}: verified exits write "
                f"exact K/V only, from the run riding along in later steps; set "
                f"backfill='deferred' (ExitConfig.verified() does)")
        if self.temperatures and (len(self.temperatures) != len(self.exit_layers)
                                  or min(self.temperatures) <= 0):
            raise ExitConfigError(f"temperatures must be one positive number per exit layer "
                                  f"{self.exit_layers}, got {self.temperatures}")
        if self.own_parts and (self.measure not in VOCAB_MEASURES or self.vocab_subset):
            raise ExitConfigError(
                f"exits with parts of their own (head 'branch', exit_output, exit_norm=False "
                f"or temperatures) are served with a measure of their logits over the whole "
                f"vocabulary: measure one of {VOCAB_MEASURES} and vocab_subset 0, not "
                f"measure {self.measure!r} with vocab_subset {self.vocab_subset}")
        if self.min_row_bucket is not None and not (
                isinstance(self.min_row_bucket, int) and self.min_row_bucket >= 1):
            raise ExitConfigError(f"min_row_bucket must be an integer >= 1 or None (the "
                                  f"runner's choice), got {self.min_row_bucket!r}")
        if not (isinstance(self.vocab_subset, int) and self.vocab_subset >= 0):
            raise ExitConfigError(f"vocab_subset must be an integer >= 0 (0: the whole "
                                  f"vocabulary), got {self.vocab_subset!r}")
        if not (isinstance(self.candidates, int) and self.candidates >= 2):
            raise ExitConfigError(f"candidates must be an integer >= 2, got "
                                  f"{self.candidates!r}")
        if self.vocab_subset and self.candidates > self.vocab_subset:
            raise ExitConfigError(f"candidates ({self.candidates}) cannot exceed vocab_subset "
                                  f"({self.vocab_subset})")
        if not 0.0 < self.target_agreement <= 1.0:
            raise ExitConfigError(f"target_agreement must be in (0, 1] (a fraction of tokens "
                                  f"equal to full depth), got {self.target_agreement}")
        if not 0.0 < self.quorum <= 1.0:
            raise ExitConfigError(f"quorum must be in (0, 1], got {self.quorum}")
        if (self.measure == "candidates" and self.exit_layers
                and self.min_exit_layer > self.exit_layers[0]):
            raise ExitConfigError(
                f"measure 'candidates' picks its candidates at the first exit "
                f"({self.exit_layers[0]}), so min_exit_layer ({self.min_exit_layer}) cannot "
                f"skip it: drop the exits below min_exit_layer instead")
        if self.force_exit_layer is not None and self.force_exit_layer not in self.exit_layers:
            raise ExitConfigError(f"force_exit_layer {self.force_exit_layer} is not one of "
                                  f"the exit layers {self.exit_layers}")
        if self.force_exit_layer is not None and self.force_exit_layer < self.min_exit_layer:
            raise ExitConfigError(f"force_exit_layer {self.force_exit_layer} is below "
                                  f"min_exit_layer {self.min_exit_layer}: that exit is never "
                                  f"checked, so it could never be taken")

    def validate_for(self, cfg: ModelConfig) -> None:
        bad = [e for e in self.exit_layers if not 1 <= e < cfg.n_layers]
        if bad:
            raise ExitConfigError(
                f"exit layers {bad} are out of range: an exit layer counts the layers run "
                f"before it, so it must be in [1, {cfg.n_layers - 1}] for this "
                f"{cfg.n_layers}-layer model")
        if self.vocab_subset > cfg.vocab_size:
            raise ExitConfigError(f"vocab_subset {self.vocab_subset} exceeds the model's "
                                  f"vocabulary of {cfg.vocab_size} tokens")
        if self.measure == "candidates" and self.candidates > cfg.vocab_size:
            raise ExitConfigError(f"candidates {self.candidates} exceeds the model's "
                                  f"vocabulary of {cfg.vocab_size} tokens")

    def verified(self, max_draft: int | None = None,
                 sampling: VerifySampling | None = None) -> ExitConfig:
        """These exits as verified drafts (lossless): back-fill "deferred", `max_draft`
        drafts a run, drafts sampled at temperature > 0 checked by `sampling` (None: keep
        this config's)."""
        return dataclasses.replace(
            self, verify=True, backfill="deferred",
            max_draft=self.max_draft if max_draft is None else max_draft,
            verify_sampling=self.verify_sampling if sampling is None else sampling)

    @property
    def own_parts(self) -> bool:
        """Whether the exits have parts beyond a norm and an adapter on the model's LM head
        (EE-LLM's: a branch MLP, their own outputs, no norm, temperatures)."""
        return (self.head == "branch" or not self.exit_norm or self.exit_output
                or bool(self.temperatures))

    @property
    def enabled(self) -> bool:
        return self.policy != "never" and bool(self.exit_layers)

    @property
    def needs_vocab(self) -> bool:
        return self.measure in VOCAB_MEASURES

    @property
    def head_vocab(self) -> int | None:
        """How many token ids an exit head scores (None: the model's whole vocabulary)."""
        return self.vocab_subset or None

    @property
    def first_exit(self) -> int | None:
        """The lowest exit layer that can ever be taken (None: none can)."""
        if self.force_exit_layer is not None:
            return self.force_exit_layer
        return next((e for e in self.exit_layers if e >= self.min_exit_layer), None)

    def row_buckets(self, batch: int, floor: int | None = None) -> tuple[int, ...]:
        """Static row buckets of policy "per_row" for a batch of `batch` rows, largest first:
        ceil(batch / 2**k) down to `floor` (default min_row_bucket; None: 1; always holding
        `batch` itself)."""
        sizes, floor = [batch], floor or self.min_row_bucket or 1
        while sizes[-1] > 1 and -(-sizes[-1] // 2) >= floor:
            sizes.append(-(-sizes[-1] // 2))
        return tuple(sizes)

    def exit_index_table(self, n_layers: int) -> np.ndarray:
        """[n_layers + 1] int32: slot of exit e in the heads tree, -1 where e is no exit."""
        table = np.full(n_layers + 1, -1, np.int32)
        for slot, e in enumerate(self.exit_layers):
            table[e] = slot
        return table


def served_min_row_bucket(platform: str, max_batch: int, asked: int | None = None) -> int:
    """The smallest row bucket policy "per_row" compacts into on `platform`; `asked`:
    `ExitConfig.min_row_bucket`. Compaction pays only where a layer over fewer rows costs
    less. On CPU it does (GGUF blocks, the default model's, are dequantized row by row inside
    each product: 2 rows cost twice one, `python -m bench.kernels q4-unpack`): every bucket
    down to 1 unless an integer was asked, which is served as given. On a TPU or GPU a decode
    layer reads its weights whatever the rows (the ridge point is ~240 rows on TPU v5e, ~300
    on H100: 197 TFLOP/s / 819 GB/s, 989 / 3.35): no compaction whatever was asked (heads
    saved with min_row_bucket 1, the shipped ones among them, included), and no extra stage,
    each another copy of the layer loop to compile (a SmolLM2 per_row step at batch 8: 37 s
    for TPU v5e, 3 stages, against 13 s under policy "all")."""
    if platform != "cpu":
        return max_batch
    return 1 if asked is None else asked


def checked_layers(ec: ExitConfig, n_layers: int) -> tuple[int, ...]:
    """The layers (static) after which a step with checks runs one: every exit layer from
    `min_exit_layer` on (measure "saturation" also below it, to record the hidden state its
    next check compares with). With `force_exit_layer` no check computes anything."""
    if ec.measure == "saturation" and ec.force_exit_layer is None:
        return tuple(e for e in ec.exit_layers if e < n_layers)
    return tuple(e for e in ec.exit_layers if ec.min_exit_layer <= e < n_layers)


def run_widths(P: int) -> tuple[int, ...]:
    """Entries a verify step's final head reads, bucketed: 0, 1, 2, 4, ..., P."""
    out, w = [0], 1
    while w < P:
        out.append(w)
        w *= 2
    return (*out, P)


def every(n_layers: int, step: int, start: int | None = None) -> tuple[int, ...]:
    """Exit layers every `step` layers: every(30, 4) -> (4, 8, ..., 28)."""
    return tuple(range(start or step, n_layers, step))
