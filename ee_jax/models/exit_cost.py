"""The per-token cost of early exit in layer-equivalents (pure arithmetic on the shapes).

A token leaving at exit e costs e layers + its checks + the exit head; the honest ideal
counts the heads: (L + final head) / mean cost (DESIGN section 4, "Count the head").
"""

from __future__ import annotations

import dataclasses

from ee_jax.models.config import ModelConfig
from ee_jax.models.exit_config import DECISION_HIDDEN, N_FEATURES, VOCAB_MEASURES, ExitConfig


def layer_macs(cfg: ModelConfig) -> int:
    """Multiply-adds of one decoder layer's weights per token (attention over the context
    is not counted: at short contexts it is small next to the projections)."""
    D, q, kv = cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    return D * q + 2 * D * kv + q * D + 3 * D * cfg.ffn_dim


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Per-token cost of early exit in layer-equivalents (multiply-adds / `layer_macs`).

    A token leaving at exit e costs e layers + every check at exits <= e + the exit head
    (+ its skipped layers at `completion` each when back-fill "deferred" runs them in the
    next step); at full depth L layers + every check + the final head. `ideal_speedup` is the
    honest ideal: (L + final head) / mean cost."""

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


def cost_model(cfg: ModelConfig, ec: ExitConfig, completion: float | None = None) -> CostModel:
    """The cost model of these exits on this model (pure arithmetic on the shapes).

    completion: the cost of a layer a back-fill "deferred" token runs in its row's next step,
    in layer-equivalents; default its multiply-adds, a whole layer (1.0; 0 under
    "propagate"). In arithmetic, deferred exits save only the head: the layers are run
    anyway. Where decode is memory-bound the second query rides on weights the row's own
    token reads anyway (measured ~0.4 of a layer at batch 1 on a 2-core CPU,
    `bench.policy_steps --step`): pass that to model time rather than arithmetic."""
    D, lay = cfg.d_model, float(layer_macs(cfg))
    vocab = ec.vocab_subset or cfg.vocab_size
    hidden = D + (2 * D * ec.adapter_rank if ec.head in ("adapter", "mlp") else 0)
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
    if completion is None:
        completion = 1.0 if ec.backfill == "deferred" else 0.0
    return CostModel(cfg.n_layers, ec.exit_layers, (D + cfg.vocab_size * D) / lay,
                     (hidden + vocab * D) / lay, checks,
                     completion if ec.enabled and ec.backfill == "deferred" else 0.0)


def ideal_speedup_with_head(cfg: ModelConfig, ec: ExitConfig, exit_counts,
                            completion: float | None = None) -> float:
    """(L + final head) / mean per-token cost, all in layer-equivalents, for tokens leaving
    per `exit_counts` {exit layer (L = full depth): count}. What `EngineStats` should report
    next to the measured speed-up (the plain L / mean layers leaves the heads out).
    completion: see `cost_model`."""
    return cost_model(cfg, ec, completion).ideal_speedup(exit_counts)
