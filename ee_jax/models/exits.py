"""Early-exit heads, confidence measures and the batch exit rule, as pure functions.

An *exit layer* `e` means "after `e` decoder layers have run" (1 <= e < n_layers); the
full model is exit `n_layers`. Exit heads live in their own params tree, stacked on a
leading exit axis in the order of `ExitConfig.exit_layers`:

    norm        [E, D]        per-exit RMSNorm weight (EE-LLM's default head; no training needed)
    adapter/    down [E, D, r], up [E, r, D]     (head "adapter": residual low-rank adapter)
    mlp/        down [E, D, r], up [E, r, D]     (head "mlp": residual SiLU MLP of width r)
    classifier/ w [E, D], b [E]                  (measure "classifier": CALM's learned "meta")

Every head ends in the model's own LM head (`llama.unembed`), so an exit adds no vocabulary
matrix. Measures that need no vocabulary projection (saturation, classifier) let the decode
step skip the projection at exit checks where the batch does not leave.

Policies: "all" (the paper's batch-wide rule), "quorum", "never", and "per_row": every row
leaves at its own first confident exit and takes that exit's head, while the rows still
running are compacted into smaller row buckets (`ee_jax.serving.early_exit.per_row_decode`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from ee_jax.errors import EEJaxError
from ee_jax.models import llama
from ee_jax.models.config import ModelConfig

HeadType = Literal["norm", "adapter", "mlp"]
Measure = Literal["max_prob", "margin", "entropy", "saturation", "classifier"]
Policy = Literal["all", "quorum", "never", "per_row"]
MEASURES = ("max_prob", "margin", "entropy", "saturation", "classifier")
VOCAB_MEASURES = ("max_prob", "margin", "entropy")
HEADS = ("norm", "adapter", "mlp")
POLICIES = ("all", "quorum", "never", "per_row")
NEVER = float("inf")  # a threshold no confidence reaches: exits checked but never taken


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
    into (buckets are B, B/2, ..., min_row_bucket). On accelerators a layer over one row
    costs about what it costs over eight (weight reads dominate), so raising it there saves
    compile time and gathers for nothing lost.
    force_exit_layer: benchmarks and tests only — leave at that exit regardless of confidence.
    """

    exit_layers: tuple[int, ...] = ()
    head: HeadType = "norm"
    measure: Measure = "max_prob"
    threshold: float = 0.9
    min_exit_layer: int = 1
    policy: Policy = "all"
    quorum: float = 0.75
    adapter_rank: int = 64
    force_exit_layer: int | None = None
    min_row_bucket: int = 1

    def __post_init__(self):
        object.__setattr__(self, "exit_layers", tuple(int(e) for e in self.exit_layers))
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
            raise ExitConfigError(f"threshold must be in [0, 1] (or exits.NEVER), got "
                                  f"{self.threshold}; to disable exits use policy='never'")
        if not (isinstance(self.min_row_bucket, int) and self.min_row_bucket >= 1):
            raise ExitConfigError(f"min_row_bucket must be an integer >= 1, got "
                                  f"{self.min_row_bucket!r}")
        if not 0.0 < self.quorum <= 1.0:
            raise ExitConfigError(f"quorum must be in (0, 1], got {self.quorum}")
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

    @property
    def enabled(self) -> bool:
        return self.policy != "never" and bool(self.exit_layers)

    @property
    def needs_vocab(self) -> bool:
        return self.measure in VOCAB_MEASURES

    @property
    def first_exit(self) -> int | None:
        """The lowest exit layer that can ever be taken (None: none can)."""
        if self.force_exit_layer is not None:
            return self.force_exit_layer
        return next((e for e in self.exit_layers if e >= self.min_exit_layer), None)

    def row_buckets(self, batch: int) -> tuple[int, ...]:
        """Static row buckets of policy "per_row" for a batch of `batch` rows, largest first:
        ceil(batch / 2**k) down to min_row_bucket (always holding `batch` itself)."""
        sizes = [batch]
        while sizes[-1] > 1 and -(-sizes[-1] // 2) >= self.min_row_bucket:
            sizes.append(-(-sizes[-1] // 2))
        return tuple(sizes)

    def exit_index_table(self, n_layers: int) -> np.ndarray:
        """[n_layers + 1] int32: slot of exit e in the heads tree, -1 where e is no exit."""
        table = np.full(n_layers + 1, -1, np.int32)
        for slot, e in enumerate(self.exit_layers):
            table[e] = slot
        return table


def every(n_layers: int, step: int, start: int | None = None) -> tuple[int, ...]:
    """Exit layers every `step` layers: every(30, 4) -> (4, 8, ..., 28)."""
    return tuple(range(start or step, n_layers, step))


# --------------------------------------------------------------------------- head params


def head_shapes(cfg: ModelConfig, ec: ExitConfig) -> dict[str, Any]:
    E, D, dt = len(ec.exit_layers), cfg.d_model, cfg.jnp_dtype
    tree: dict[str, Any] = {"norm": jax.ShapeDtypeStruct((E, D), dt)}
    if ec.head in ("adapter", "mlp"):
        r = ec.adapter_rank
        tree[ec.head] = {"down": jax.ShapeDtypeStruct((E, D, r), dt),
                           "up": jax.ShapeDtypeStruct((E, r, D), dt)}
    if ec.measure == "classifier":
        tree["classifier"] = {"w": jax.ShapeDtypeStruct((E, D), jnp.float32),
                              "b": jax.ShapeDtypeStruct((E,), jnp.float32)}
    return tree


def init_heads(cfg: ModelConfig, ec: ExitConfig, params: llama.Params,
               key: jax.Array | None = None) -> dict[str, Any]:
    """Untrained heads: each exit's norm starts as the final norm (usable as is), the adapter
    as the identity (up = 0), the classifier as "confidence 0.5"."""
    E, D = len(ec.exit_layers), cfg.d_model
    key = jax.random.PRNGKey(0) if key is None else key
    heads: dict[str, Any] = {"norm": jnp.broadcast_to(params["final_norm"], (E, D)).copy()}
    if ec.head in ("adapter", "mlp"):
        r = ec.adapter_rank
        heads[ec.head] = {
            "down": (jax.random.normal(key, (E, D, r)) / np.sqrt(D)).astype(cfg.jnp_dtype),
            "up": jnp.zeros((E, r, D), cfg.jnp_dtype)}
    if ec.measure == "classifier":
        heads["classifier"] = {"w": jnp.zeros((E, D), jnp.float32),
                               "b": jnp.zeros((E,), jnp.float32)}
    return heads


def check_heads(cfg: ModelConfig, ec: ExitConfig, heads) -> None:
    """Raise ExitConfigError unless `heads` has exactly the shapes this config needs."""
    want = {jax.tree_util.keystr(p): tuple(s.shape) for p, s in
            jax.tree_util.tree_leaves_with_path(head_shapes(cfg, ec))}
    got = {jax.tree_util.keystr(p): tuple(np.shape(a)) for p, a in
           jax.tree_util.tree_leaves_with_path(heads)}
    if want != got:
        diff = sorted(set(want.items()) ^ set(got.items()))
        raise ExitConfigError(
            f"exit heads do not match exit_layers={ec.exit_layers}, head={ec.head!r}, "
            f"measure={ec.measure!r} on a d_model={cfg.d_model} model: differing leaves "
            f"(name, shape): {diff}")


# --------------------------------------------------------------------------- head and measures


def _slot(tree, slot):
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, slot, keepdims=False), tree)


def exit_hidden(heads, slot, h: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The normed (and adapted) hidden state of exit `slot`, ready for the shared LM head."""
    hn = llama.norm(h, _slot(heads["norm"], slot), cfg)
    if "adapter" in heads:
        ad = _slot(heads["adapter"], slot)
        hn = hn + (hn @ ad["down"]) @ ad["up"]
    if "mlp" in heads:
        ad = _slot(heads["mlp"], slot)
        hn = hn + jax.nn.silu(hn @ ad["down"]) @ ad["up"]
    return hn


def exit_logits(params: llama.Params, heads, slot, h: jax.Array, cfg: ModelConfig):
    """Logits [..., V] (f32) of exit `slot` for hidden states h [..., D]."""
    return llama.unembed(params, exit_hidden(heads, slot, h, cfg), cfg)


def row_exit_logits(params: llama.Params, heads, slots: jax.Array, h: jax.Array,
                    cfg: ModelConfig) -> jax.Array:
    """Logits [B, V] (f32) with a head per row: row b's exit `slots[b]`, or the final head
    where slots[b] < 0. h: [B, D]. `exit_hidden` is vmapped over rows (each row gathers its
    own head weights); the vocabulary projection is one matmul shared by all rows."""
    hn = jax.vmap(lambda slot, x: exit_hidden(heads, slot, x, cfg))(jnp.maximum(slots, 0), h)
    final = llama.norm(h, params["final_norm"], cfg)
    return llama.unembed(params, jnp.where((slots >= 0)[:, None], hn, final), cfg)


def confidence_from_logits(logits: jax.Array, measure: str) -> jax.Array:
    """[..., V] -> [...] in [0, 1]; higher is more confident."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    if measure == "max_prob":
        return jnp.exp(jnp.max(logp, axis=-1))
    if measure == "margin":
        top2 = jax.lax.top_k(logp, 2)[0]
        return jnp.exp(top2[..., 0]) - jnp.exp(top2[..., 1])
    if measure == "entropy":
        ent = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
        return 1.0 - ent / np.log(logits.shape[-1])
    raise ValueError(f"{measure!r} is not a vocabulary measure")


def saturation(h: jax.Array, h_prev: jax.Array) -> jax.Array:
    """Cosine similarity of hidden states at consecutive exit checks, clipped to [0, 1]."""
    h, h_prev = h.astype(jnp.float32), h_prev.astype(jnp.float32)
    cos = jnp.sum(h * h_prev, -1) / (jnp.linalg.norm(h, axis=-1) *
                                     jnp.linalg.norm(h_prev, axis=-1) + 1e-6)
    return jnp.clip(cos, 0.0, 1.0)


def classifier_logit(heads, slot, h: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The learned confidence before the sigmoid (what tuning's BCE loss sees)."""
    c = _slot(heads["classifier"], slot)
    hn = llama.norm(h, _slot(heads["norm"], slot), cfg).astype(jnp.float32)
    return hn @ c["w"] + c["b"]


def classifier_confidence(heads, slot, h: jax.Array, cfg: ModelConfig) -> jax.Array:
    return jax.nn.sigmoid(classifier_logit(heads, slot, h, cfg))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CheckState:
    """What an exit check carries from one check to the next within a step (per row).

    Measures that look back (saturation; candidate features) keep their memory here, so the
    decode step carries one opaque pytree whatever the measure."""

    h_prev: jax.Array  # [..., D] hidden state at the previous exit check


def init_check_state(h0: jax.Array, ec: ExitConfig) -> CheckState:
    """The state before the first check; h0 [..., D] is the embedding (layer 0's input)."""
    del ec
    return CheckState(h_prev=h0)


def check_confidence(params: llama.Params, heads, slot, h: jax.Array, state: CheckState,
                     cfg: ModelConfig, ec: ExitConfig
                     ) -> tuple[jax.Array, jax.Array | None, CheckState]:
    """The one confidence dispatch: (confidence [...] f32 in [0, 1], the exit's logits [..., V]
    when the measure had to compute them (else None), the next state). h: [..., D].

    The decode step, the layer-wise evaluation and the tests all call this, so a measure
    is written once."""
    logits = None
    if ec.needs_vocab:
        logits = exit_logits(params, heads, slot, h, cfg)
        conf = confidence_from_logits(logits, ec.measure)
    elif ec.measure == "saturation":
        conf = saturation(h, state.h_prev)
    else:
        conf = classifier_confidence(heads, slot, h, cfg)
    return conf.astype(jnp.float32), logits, dataclasses.replace(state, h_prev=h)


def batch_exits(confident: jax.Array, active: jax.Array, policy: str, quorum: float
                ) -> jax.Array:
    """Whether the batch leaves now. confident, active: [B] bool. Padding rows (inactive)
    never hold the batch back; a batch with no active row leaves at the first check.
    Under "per_row" a row leaves when it is confident, so the step ends as under "all"."""
    if policy == "never":
        return jnp.asarray(False)
    if policy in ("all", "per_row"):
        return jnp.all(confident | ~active)
    n_active = jnp.sum(active)
    n_conf = jnp.sum(confident & active)
    return (n_conf >= quorum * n_active) | (n_active == 0)
