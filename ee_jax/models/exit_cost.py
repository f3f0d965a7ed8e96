"""The cost of early exit in layer-equivalents (pure arithmetic on the shapes).

Per token (`CostModel`): a token leaving at exit e costs e layers + its checks + the exit
head; the ideal counts the heads: (L + final head) / mean cost (leaving the final head out
would flatter every exit). That per-token count is exact only where each token's work is its own.

Per step (`step_cost`, docs/early_exit.md "Back-fill"): what a decode step really runs, per
back-fill mode. A step pays for the union of what its rows run. Under "deferred" a row's
pending token (its previous token, left early at p) rides along as a second query in the
layers its row's new token runs anyway (`step._with_checks`): layers p..e-1 when the new token
leaves at e > p, none when e <= p; the layers above e keep K/V propagated from the deepest
state the old token reached (refilled from it when it got deeper). So deferred never runs a
layer the new token does not. Two regimes:

* memory-bound (GPU/TPU at small batch, a CPU at batch 1): a weight is paid once per step if
  any row uses it. Layers: the deepest row's, under every back-fill (deferred's second query
  reads the same weights). The LM head's rows: once for the exit head if any row left early,
  once for the final head if any ran to L. Checks: each exit checked while any row was
  running. K/V back-fill: the skipped layers' K/V weights (`kv_fraction` of a layer each)
  from the shallowest exit up; "learned" adds its maps.
* compute-bound (a CPU at batch 8 and up): everything per row: its layers, its checks, its
  head, its back-fill; deferred adds its second query: from the step's lowest pending layer
  up every running row computes two queries (the band is one per step, `step.stage`), and a
  refilled old token's K/V projections.

Full depth is L + the final head per row (compute) or per step (memory). `step_speedup` is
what the engine's exit controller reads; `sequence_speedup` replays real per-row exit
sequences (deferred depends on each row's previous token).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Literal

import numpy as np

from ee_jax.models.config import ModelConfig
from ee_jax.models.exit_config import (
    BACKFILLS,
    DECISION_HIDDEN,
    N_FEATURES,
    VOCAB_MEASURES,
    ExitConfig,
    ExitConfigError,
    rides_along,
    uses_maps,
)

Regime = Literal["memory", "compute"]
REGIMES = ("memory", "compute")


def layer_macs(cfg: ModelConfig) -> int:
    """Multiply-adds of one decoder layer's weights per token (attention over the context
    is not counted: at short contexts it is small next to the projections)."""
    D, q, kv = cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    return D * q + 2 * D * kv + q * D + 3 * D * cfg.ffn_dim


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Per-token cost of early exit in layer-equivalents (multiply-adds / `layer_macs`).

    A token leaving at exit e costs e layers + every check at exits <= e + the exit head
    (+ its skipped layers at `completion` each, an average cost of back-fill "deferred"
    completing them in later steps); at full depth L layers + every check + the final head.
    `ideal_speedup` is the honest ideal: (L + final head) / mean cost."""

    n_layers: int
    exit_layers: tuple[int, ...]
    final_head: float  # final norm + LM head over the whole vocabulary
    exit_head: float  # exit norm/adapter + LM head over the exit vocabulary, at the exit taken
    checks: tuple[float, ...]  # cost of the check at each exit slot
    completion: float = 0.0  # one skipped layer run later for the token (back-fill "deferred")

    def token_cost(self, exit_layer: int) -> float:
        done = sum(c for e, c in zip(self.exit_layers, self.checks, strict=True)
                   if e <= exit_layer)
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


def cost_model(cfg: ModelConfig, ec: ExitConfig, completion: float = 0.0) -> CostModel:
    """The cost model of these exits on this model (pure arithmetic on the shapes).

    completion: the cost, per skipped layer, of completing a back-fill "deferred" token
    later, in layer-equivalents; default 0. The engine completes a token only in the layers
    its row's next token runs anyway (a second query riding along), so what that costs
    depends on the next token: `step_cost` prices it per step (nothing memory-bound; the
    second query's arithmetic compute-bound). Pass a measured per-layer fraction here to fold
    an average into the per-token count."""
    D, lay = cfg.d_model, float(layer_macs(cfg))
    vocab = ec.vocab_subset or cfg.vocab_size
    hidden = D + (2 * D * ec.adapter_rank if ec.head in ("adapter", "mlp") else 0)
    if ec.head == "branch":  # EE-LLM's exit MLP: a whole SwiGLU MLP of the model's width
        hidden = D + 3 * D * cfg.ffn_dim
    if ec.measure in VOCAB_MEASURES:
        check = first = hidden + vocab * D + 2 * vocab
    elif ec.measure == "candidates":
        tail = N_FEATURES * DECISION_HIDDEN + DECISION_HIDDEN + 4 * ec.candidates
        first = hidden + vocab * D + tail
        check = hidden + ec.candidates * D + tail
    else:  # saturation, classifier: one D-wide dot product (plus a norm)
        check = first = 2 * D
    checks = tuple((first if i == 0 else check) / lay for i in range(len(ec.exit_layers)))
    if not ec.enabled:
        checks = tuple(0.0 for _ in ec.exit_layers)
    return CostModel(cfg.n_layers, ec.exit_layers, (D + cfg.vocab_size * D) / lay,
                     (hidden + vocab * D) / lay, checks,
                     completion if ec.enabled and rides_along(ec.backfill) else 0.0)


def ideal_speedup_with_head(cfg: ModelConfig, ec: ExitConfig, exit_counts,
                            completion: float = 0.0) -> float:
    """(L + final head) / mean per-token cost, all in layer-equivalents, for tokens leaving
    per `exit_counts` {exit layer (L = full depth): count}. What `EngineStats` should report
    next to the measured speed-up (the plain L / mean layers leaves the heads out).
    completion: see `cost_model`."""
    return cost_model(cfg, ec, completion).ideal_speedup(exit_counts)


# --------------------------------------------------------------------------- per step


def kv_fraction(cfg: ModelConfig) -> float:
    """A layer's K/V projections as a share of the layer's multiply-adds."""
    return 2 * cfg.d_model * cfg.n_kv_heads * cfg.head_dim / layer_macs(cfg)


def map_fraction(cfg: ModelConfig, rank: int) -> float:
    """One learned map (`backfill_maps`: (D + 1) x r then r x 2KV) as a share of a layer."""
    return ((cfg.d_model + 1) * rank + rank * 2 * cfg.n_kv_heads * cfg.head_dim) / layer_macs(cfg)


def _checks_upto(cm: CostModel, layer: int) -> float:
    return sum(c for e, c in zip(cm.exit_layers, cm.checks, strict=True) if e <= layer)


def step_cost(cm: CostModel, exit_layers: Sequence[int], pending: Sequence[int] | None,
              backfill: str, regime: Regime, kv: float, maps: float = 0.0,
              ride: float = 0.0) -> float:
    """Cost of one decode step whose rows left at `exit_layers` (L: full depth), with their
    pending tokens' exits `pending` (deferred only; L or None: none). ride: what deferred's
    second query adds to a layer where decode is memory-bound, in layer-equivalents (0 where
    the weights' bytes are the cost; on a CPU serving GGUF block weights the dequantization
    is arithmetic per row: ~0.7 measured at batch 1, `ControllerConfig.ride_cost`)."""
    if backfill not in BACKFILLS:
        raise ExitConfigError(f"backfill {backfill!r}: expected one of {BACKFILLS}")
    if regime not in REGIMES:
        raise ExitConfigError(f"regime {regime!r}: expected one of {REGIMES}")
    L = cm.n_layers
    ex = [int(e) for e in exit_layers]
    if not ex:
        return 0.0
    pend = ([L] * len(ex) if pending is None or not rides_along(backfill)
            else [int(p) for p in pending])
    fill = kv + (maps if uses_maps(backfill) else 0.0)  # per skipped layer
    if regime == "compute":
        # deferred: the second query runs for every running row from the lowest pending
        # layer up (L: none); a token left at e above its row's pending one refills it
        lowest = min(pend)
        cost = 0.0
        for e, p in zip(ex, pend, strict=True):
            cost += e + max(0, e - lowest) + _checks_upto(cm, min(e, L - 1))
            refills = 2 if p < e < L else 1
            cost += cm.final_head if e >= L else cm.exit_head + refills * fill * (L - e)
        return cost
    deepest = max(ex)
    early = [e for e in ex if e < L]
    cost = deepest + ride * max(0, deepest - min(pend)) + _checks_upto(cm, min(deepest, L - 1))
    cost += cm.final_head if deepest >= L else 0.0
    if early:
        cost += cm.exit_head + fill * (L - min(early))
    return cost


def full_step_cost(cm: CostModel, batch: int, regime: Regime) -> float:
    return (cm.n_layers + cm.final_head) * (batch if regime == "compute" else 1)


def sequence_speedup(cm: CostModel, steps: Sequence[Sequence[int]], backfill: str,
                     regime: Regime, kv: float, maps: float = 0.0, ride: float = 0.0) -> float:
    """Full depth over early exit for decode steps whose rows (the same rows, in order, every
    step) left at steps[t][r]; a row's pending token is its previous step's (deferred)."""
    L = cm.n_layers
    total, prev = 0.0, None
    for rows in steps:
        pend = None if prev is None else [p if p < L else L for p in prev]
        total += step_cost(cm, rows, pend, backfill, regime, kv, maps, ride)
        prev = rows
    full = sum(full_step_cost(cm, len(r), regime) for r in steps)
    return full / total if total else 1.0


def step_speedup(cm: CostModel, counts: dict[int, int], batch: int, backfill: str, regime: Regime,
                 kv: float, maps: float = 0.0, policy: str = "per_row", samples: int = 512,
                 seed: int = 0, ride: float = 0.0) -> float:
    """Expected speed-up of steps of `batch` rows whose exit layers are drawn independently
    from `counts` {exit layer: rows} (each row's pending token drawn the same way). Policy
    "all": `counts` are batch exit layers (every row of a step leaves at the step's), so one
    draw per step serves all its rows. Sampled with a fixed seed: deterministic."""
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
            now, before = np.full(batch, now[0]), np.full(batch, before[0])
        total += step_cost(cm, now.tolist(), before.tolist(), backfill, regime, kv, maps, ride)
    return samples * full_step_cost(cm, batch, regime) / total


def histogram(exits: Sequence[int]) -> dict[int, int]:
    return dict(collections.Counter(int(e) for e in exits))


def verified_speedup(cm: CostModel, step_counts: dict[int, int], emitted: int,
                     ride: float = 0.0, ride_rows: float = 0.0, batch: float = 1.0) -> float:
    """Full depth over verified exits, memory-bound (batch 1): decode steps whose (deepest)
    exit layers are `step_counts` {layer: steps} emitted `emitted` tokens in all. A draft
    step costs its layers, its checks and the exit head; a verify step (L) every layer, the
    checks and the final head over the run (one read of its weights: the run's rows ride
    on it). ride: a riding query's cost per layer where weights are read anyway (0 where
    bytes are the cost; GGUF blocks on a CPU: ~0.7), ride_rows: riding queries per step on
    average, over the layers of a step. Rejected drafts' work is in the steps it took.
    batch: rows a step holds on average (a full-depth step emits that many tokens)."""
    L = cm.n_layers
    cost = 0.0
    for e, n in step_counts.items():
        e = int(e)
        step = e + _checks_upto(cm, min(e, L - 1)) + ride * ride_rows * e
        step += cm.final_head if e >= L else cm.exit_head
        cost += n * step
    return emitted * (L + cm.final_head) / batch / cost if cost else 1.0


def verified_step_cost(cm: CostModel, exit_layers: Sequence[int], riding: Sequence[int],
                       regime: Regime, ride: float = 0.0) -> float:
    """Cost of one verified-exits decode step whose rows reached `exit_layers` (L: the row
    verified) carrying `riding` drafts each. Memory-bound: the deepest row's layers and
    checks, the exit head if a row drafted, the final head (over every run: one read) if
    one verified; a riding draft costs `ride` per layer it rides (0 where weights' bytes are
    the cost), counted from the first exit up for verifying rows (drafting rows' runs are
    mostly at their exit already). Compute-bound: each row its own token's cost and a full
    row-layer per layer each of its drafts rides."""
    L = cm.n_layers
    first = min(cm.exit_layers) if cm.exit_layers else L
    rows = [(int(e), int(k)) for e, k in zip(exit_layers, riding, strict=True)]
    if not rows:
        return 0.0
    ridden = sum(k * (L - first) for e, k in rows if e >= L)
    if regime == "compute":
        return sum(cm.token_cost(e) for e, _ in rows) + ridden
    deepest = max(e for e, _ in rows)
    cost = deepest + _checks_upto(cm, min(deepest, L - 1)) + ride * ridden
    cost += cm.final_head if deepest >= L else 0.0
    cost += cm.exit_head if any(e < L for e, _ in rows) else 0.0
    return cost


def verified_steps_speedup(cm: CostModel, steps, batch: int, regime: Regime,
                           ride: float = 0.0) -> float:
    """Full depth over verified exits for decode steps of `batch` rows given as
    (exit layers, drafts riding, tokens emitted) per step: full depth emits `batch` tokens a
    step (memory-bound: one step's cost for them all; compute-bound: each row's)."""
    cost = emitted = 0.0
    for layers, riding, n in steps:
        cost += verified_step_cost(cm, layers, riding, regime, ride)
        emitted += n
    if not cost or not emitted:  # no evidence yet (every step drafted)
        return 1.0
    per_token = full_step_cost(cm, batch, regime) / batch
    return emitted * per_token / cost


def verified_sequence_speedup(cm: CostModel, exits: Sequence[int], agrees: Sequence[bool],
                              max_draft: int, ride: float = 0.0) -> tuple[float, float, int]:
    """Full depth over verified exits for one answer decoded at batch 1, memory-bound:
    position t's token would leave at exits[t] (L: not confident) and its draft there
    equals full depth's token where agrees[t]. A run drafts while tokens leave (at most
    max_draft), then a verify step runs the next position at full depth; it keeps the
    leading agreeing drafts and emits the full model's token after them; decoding goes on
    after what it emitted. Drafts after a rejected one are paid (their decisions taken as
    teacher-forced ones: an approximation). ride: what each draft riding a layer of its
    verify step costs (0 memory-bound; 1 compute-bound; GGUF blocks on a CPU ~0.7), from
    the first exit up. Returns (speed-up, acceptance, drafts)."""
    L = cm.n_layers
    first = min(cm.exit_layers) if cm.exit_layers else L
    n = len(exits)
    i = 0
    cost = 0.0
    drafted = accepted = 0
    while i < n:
        k = 0
        while k < max_draft and i + k < n - 1 and exits[i + k] < L:
            cost += cm.token_cost(int(exits[i + k]))
            k += 1
        cost += cm.token_cost(L) + ride * k * (L - first)  # the verify step
        a = 0
        while a < k and agrees[i + a]:
            a += 1
        drafted += k
        accepted += a
        i += a + 1
    speedup = n * (L + cm.final_head) / cost if cost else 1.0
    return speedup, (accepted / drafted if drafted else float("nan")), drafted
