"""Early-exit heads, confidence measures and the batch exit rule, as pure functions.

An *exit layer* `e` means "after `e` decoder layers have run" (1 <= e < n_layers); the
full model is exit `n_layers`. Exit heads live in their own params tree, stacked on a
leading exit axis in the order of `ExitConfig.exit_layers`:

    norm        [E, D]        per-exit RMSNorm weight (EE-LLM's default head; no training needed)
    adapter/    down [E, D, r], up [E, r, D]     (head "adapter": residual low-rank adapter)
    mlp/        down [E, D, r], up [E, r, D]     (head "mlp": residual SiLU MLP of width r)
    classifier/ w [E, D], b [E]                  (measure "classifier": CALM's learned "meta")
    vocab       [K] int32                        (vocab_subset K > 0: the ids exit heads score)
    decision/   w1 [E, F, H], b1 [E, H], w2 [E, H], b2 [E]   (measure "candidates")

Every head ends in the model's own LM head (`llama.unembed`), so an exit adds no vocabulary
matrix. On SmolLM2 that head (49,152 x 576) costs about 8 decoder layers, so two things keep
it off the path (issue #12):

* a *vocabulary subset*: an exit head may score only K frequent token ids (the rows of the
  LM head at `heads["vocab"]`); a token outside the subset can only come from full depth.
* measure "candidates" (SpecEE-style, arXiv 2504.08850): the first exit check projects onto
  the exit head's vocabulary once and keeps its top-k ids as candidates; every later check
  scores only those k rows of the LM head and feeds a few features (candidate probabilities
  and margins, their change since the previous check, the hidden state's change) to one tiny
  MLP per exit, whose output is a calibrated probability that the exit's token equals the
  final layer's. The exit head runs in full once, at the exit taken (`row_exit_logits`).

`cost_model` / `ideal_speedup_with_head` count all of it in layer-equivalents.

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
from ee_jax.models.quant import out_major_matmul

HeadType = Literal["norm", "adapter", "mlp"]
Measure = Literal["max_prob", "margin", "entropy", "saturation", "classifier", "candidates"]
Policy = Literal["all", "quorum", "never", "per_row"]
Backfill = Literal["propagate", "deferred"]
MEASURES = ("max_prob", "margin", "entropy", "saturation", "classifier", "candidates")
VOCAB_MEASURES = ("max_prob", "margin", "entropy")
HEADS = ("norm", "adapter", "mlp")
POLICIES = ("all", "quorum", "never", "per_row")
BACKFILLS = ("propagate", "deferred")
NEVER = float("inf")  # a threshold no confidence reaches: exits checked but never taken
MASKED = -1e9  # logit of a token an exit head does not score (exp underflows to exactly 0)
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
    into (buckets are B, B/2, ..., min_row_bucket). On accelerators a layer over one row
    costs about what it costs over eight (weight reads dominate), so raising it there saves
    compile time and gathers for nothing lost.
    force_exit_layer: benchmarks and tests only — leave at that exit regardless of confidence.
    vocab_subset: K > 0 — exit heads score only the K token ids in `heads["vocab"]` (logits of
    every other id are MASKED); 0 — the whole vocabulary.
    candidates: measure "candidates" only — how many of the first check's top tokens later
    checks score.
    target_agreement: the teacher-forced agreement with full depth that the shipped threshold
    was calibrated to meet (`ee_jax.training.calibrate`); in (0, 1].
    backfill: what the skipped layers of a token that left early hold. "deferred" (the
    default): K/V projected from its exit state at once, then the row's next decode step
    runs the token's skipped layers for real beside its own token (one more query per row in
    the layers above the exit, where the weights are read anyway) and overwrites them with
    the exact K/V; later tokens then see what full depth would have written, unless that
    next token leaves early too (the older token then keeps the K/V of its deepest state) or
    the row's next step is a prefill step (mixed steps run decode rows at full depth and
    drop what they complete). "propagate" (CALM's state propagation, the reference design's
    fill): the projected K/V, for good; on SmolLM2 they cost later tokens 3-12x more
    agreement with full depth (docs/benchmarks.md).
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
    vocab_subset: int = 0
    candidates: int = 8
    target_agreement: float = 0.95
    backfill: Backfill = "deferred"

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
        if self.backfill not in BACKFILLS:
            raise ExitConfigError(f"unknown backfill {self.backfill!r}; choose one of "
                                  f"{BACKFILLS}")
        if not (isinstance(self.min_row_bucket, int) and self.min_row_bucket >= 1):
            raise ExitConfigError(f"min_row_bucket must be an integer >= 1, got "
                                  f"{self.min_row_bucket!r}")
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
    if ec.vocab_subset:
        tree["vocab"] = jax.ShapeDtypeStruct((ec.vocab_subset,), jnp.int32)
    if ec.measure == "candidates":
        F, H, f32 = N_FEATURES, DECISION_HIDDEN, jnp.float32
        tree["decision"] = {"w1": jax.ShapeDtypeStruct((E, F, H), f32),
                            "b1": jax.ShapeDtypeStruct((E, H), f32),
                            "w2": jax.ShapeDtypeStruct((E, H), f32),
                            "b2": jax.ShapeDtypeStruct((E,), f32)}
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
    if ec.vocab_subset:  # placeholder ids; tuning puts the most frequent tokens here
        heads["vocab"] = jnp.arange(ec.vocab_subset, dtype=jnp.int32)
    if ec.measure == "candidates":  # "confidence 0.5" until trained
        F, H = N_FEATURES, DECISION_HIDDEN
        heads["decision"] = {
            "w1": (jax.random.normal(jax.random.fold_in(key, 1), (E, F, H)) / np.sqrt(F)
                   ).astype(jnp.float32),
            "b1": jnp.zeros((E, H), jnp.float32), "w2": jnp.zeros((E, H), jnp.float32),
            "b2": jnp.zeros((E,), jnp.float32)}
    return heads


@dataclasses.dataclass(frozen=True)
class VocabSubset:
    """The token ids exit heads score, and the model they were counted on."""

    ids: np.ndarray  # [K] int32, most frequent first
    model: str  # the model's name (its tokenizer defines what the ids mean)
    vocab_size: int


def check_vocab_subset(ids, vocab_size: int) -> np.ndarray:
    """[K] int32 ids, or ExitConfigError naming what is wrong (shape, duplicates, range)."""
    arr = np.asarray(ids)
    if arr.ndim != 1 or arr.size == 0:
        raise ExitConfigError(f"a vocabulary subset is a non-empty 1-D list of token ids, got "
                              f"shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise ExitConfigError(f"vocabulary subset ids must be integers, got {arr.dtype}")
    bad = arr[(arr < 0) | (arr >= vocab_size)]
    if bad.size:
        raise ExitConfigError(f"vocabulary subset ids {bad[:5].tolist()} are outside [0, "
                              f"{vocab_size}): the subset was made for another vocabulary")
    uniq, counts = np.unique(arr, return_counts=True)
    if uniq.size != arr.size:
        dup = uniq[counts > 1][:5].tolist()
        raise ExitConfigError(f"vocabulary subset has duplicate ids {dup}: each id may "
                              f"appear once")
    return arr.astype(np.int32)


def attach_vocab_subset(heads: dict, subset: VocabSubset, cfg: ModelConfig,
                        model: str | None = None) -> dict:
    """heads with `heads["vocab"]` set to the subset's ids, after checking that the subset
    was counted on this model (same name when `model` is given, same vocabulary size)."""
    if subset.vocab_size != cfg.vocab_size or (model is not None and subset.model != model):
        raise ExitConfigError(
            f"vocabulary subset was made for {subset.model!r} ({subset.vocab_size} tokens), "
            f"but the heads are for {model or 'a model'!r} ({cfg.vocab_size} tokens): count "
            f"the subset on this model's tokens")
    ids = check_vocab_subset(subset.ids, cfg.vocab_size)
    if "vocab" in heads and np.shape(heads["vocab"]) != ids.shape:
        raise ExitConfigError(f"the heads score {np.shape(heads['vocab'])[0]} ids, the "
                              f"subset holds {ids.size}: set ExitConfig.vocab_subset={ids.size}")
    return dict(heads, vocab=jnp.asarray(ids))


CANDIDATE_DTYPES = ("int8",)  # `with_vocab_rows(candidate_dtype=...)`; None: exact search
# Leaves `with_vocab_rows` derives from the model's LM head: held for serving, never saved.
DERIVED_LEAVES = ("vocab_rows", "vocab_rows_q", "vocab_rows_scale")


def with_vocab_rows(params: llama.Params, heads: dict, cfg: ModelConfig,
                    candidate_dtype: str | None = "int8") -> dict:
    """heads plus `vocab_rows` [K, D]: the LM head's rows at the subset's ids, gathered once;
    with candidate_dtype "int8" (the default) also `vocab_rows_q` [K, D] int8 and
    `vocab_rows_scale` [K] f32, the same rows quantized for the first check's candidate search
    (`candidate_features`; one symmetric scale per row, `quantize_rows`).

    Derived, never saved (`DERIVED_LEAVES`: `head_shapes` does not hold them, `check_heads`
    accepts them, `save_exit_heads` drops them). Serving should hold them: inside a step,
    gathering K = 8,192 rows of the 49,152 x 576 head costs more than the projection itself on
    CPU (and XLA fuses the gather into the product as a slow reduction at batch 1), every first
    check and every exit head; and the first check's search over the subset is memory-bound
    (19 MB of f32 rows every step), so it reads the int8 copy (a quarter of that) and rescores
    only its k candidates exactly. `vocab_rows` stays f32 for the exit head at the exit taken
    (`exit_logits`, `row_exit_logits`): the emitted token is the exact subset argmax. Heads
    without a subset are returned as they are."""
    if candidate_dtype is not None and candidate_dtype not in CANDIDATE_DTYPES:
        raise ExitConfigError(f"candidate_dtype={candidate_dtype!r}: expected one of "
                              f"{CANDIDATE_DTYPES} or None (search the f32 rows)")
    if "vocab" not in heads:
        return heads
    heads = without_derived(heads)
    ids = jnp.asarray(heads["vocab"])
    rows = (jnp.take(params["embed"], ids, axis=0) if cfg.tie_embeddings
            else jnp.take(params["lm_head"], ids, axis=1).T)
    if candidate_dtype is None:
        return dict(heads, vocab_rows=rows)
    q, scale = quantize_rows(rows)
    return dict(heads, vocab_rows=rows, vocab_rows_q=q, vocab_rows_scale=scale)


def without_derived(heads):
    """heads without the leaves `with_vocab_rows` derives (what a checkpoint holds)."""
    if not isinstance(heads, dict):
        return heads
    return {k: v for k, v in heads.items() if k not in DERIVED_LEAVES}


@jax.jit
def quantize_rows(rows: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Symmetric int8 per row: rows [K, D] -> (q int8 [K, D], scale f32 [K]), rows ~= q *
    scale[:, None], scale = max |row| / 127 (an all-zero row gets scale 1, q 0)."""
    rows = rows.astype(jnp.float32)
    amax = jnp.max(jnp.abs(rows), axis=-1)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0).astype(jnp.float32)
    q = jnp.clip(jnp.round(rows / scale[:, None]), -127, 127).astype(jnp.int8)
    return q, scale


def check_heads(cfg: ModelConfig, ec: ExitConfig, heads) -> None:
    """Raise ExitConfigError unless `heads` has exactly the shapes this config needs (plus,
    optionally, the derived leaves of `with_vocab_rows`)."""
    want = {jax.tree_util.keystr(p): tuple(s.shape) for p, s in
            jax.tree_util.tree_leaves_with_path(head_shapes(cfg, ec))}
    derived = {"vocab_rows": (ec.vocab_subset, cfg.d_model),
               "vocab_rows_q": (ec.vocab_subset, cfg.d_model),
               "vocab_rows_scale": (ec.vocab_subset,)}
    if ec.vocab_subset and isinstance(heads, dict):
        want.update({f"['{k}']": shape for k, shape in derived.items() if k in heads})
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


def unembed_rows(params: llama.Params, xn: jax.Array, ids: jax.Array, cfg: ModelConfig,
                 rows: jax.Array | None = None) -> jax.Array:
    """The LM head's logits at token ids only: xn [..., D], ids [K] -> [..., K] f32 (equal to
    `llama.unembed(...)[..., ids]`, at K x D multiply-adds instead of V x D). rows: the head's
    rows at ids [K, D] when the caller holds them (`with_vocab_rows`); else gathered here,
    behind an optimization barrier (fused into the product, the gather became a scalar
    reduction loop on CPU)."""
    if rows is None:
        rows = jax.lax.optimization_barrier(
            jnp.take(params["embed"], ids, axis=0) if cfg.tie_embeddings
            else jnp.take(params["lm_head"], ids, axis=1).T)  # [K, D]
    # rows are output-major [K, D], as the tied head is: the product the model's own head
    # uses for them (`quant.out_major_matmul`: E @ x.T at 2-64 rows, 1.7-2x faster on CPU)
    return llama.cap_logits(out_major_matmul(xn, rows, preferred_element_type=jnp.float32), cfg)


def approx_subset_logits(heads, xn: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Approximate logits at the subset's ids from its int8 rows (`with_vocab_rows`):
    xn [..., D] -> [..., K] f32, within about 0.03 (median; 0.5 at most) of `unembed_rows` on
    SmolLM2's layer-16 exit states (logits ~30): what the first check searches for candidates.

    The product is one int8 x int8 -> int32 matmul: each row of xn is split as
    xn ~= sx * (hi + lo / 254) with hi, lo int8 (absmax scale sx; hi the rounded value, lo its
    rounding error in 1/254 steps, ~15 bits in all), both halves multiplied in one product that
    reads the int8 rows once, then the row scales applied to the sum. Only the weights' per-row
    rounding remains. Why not the weights converted to f32 inside the product: XLA CPU writes
    the converted [K, D] f32 array first (no faster than the f32 rows); and a single-row int8
    product runs as a slow loop, so batch 1 needs the second (lo) row anyway."""
    q, scale = heads["vocab_rows_q"], heads["vocab_rows_scale"]  # [K, D] int8, [K] f32
    lead, d = xn.shape[:-1], xn.shape[-1]
    x = xn.reshape(-1, d).astype(jnp.float32)
    n = x.shape[0]
    sx = jnp.max(jnp.abs(x), axis=-1, keepdims=True) / 127.0
    sx = jnp.where(sx > 0, sx, 1.0)  # [n, 1]
    u = x / sx
    hi = jnp.round(u)
    lo = jnp.round((u - hi) * 254.0)  # |u - hi| <= 1/2: lo in [-127, 127]
    y = jax.lax.dot_general(jnp.concatenate([hi, lo]).astype(jnp.int8), q,
                            (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)
    y = y.astype(jnp.float32)  # [2n, K]
    z = (y[:n] + y[n:] * (1.0 / 254.0)) * sx * scale
    return llama.cap_logits(z.reshape(*lead, q.shape[0]), cfg)


def scatter_vocab(sub: jax.Array, ids: jax.Array, vocab_size: int) -> jax.Array:
    """[..., K] logits at ids -> [..., V] with MASKED everywhere else."""
    full = jnp.full((*sub.shape[:-1], vocab_size), MASKED, jnp.float32)
    return full.at[..., ids].set(sub.astype(jnp.float32))


def exit_logits(params: llama.Params, heads, slot, h: jax.Array, cfg: ModelConfig):
    """Logits [..., V] (f32) of exit `slot` for hidden states h [..., D]; with a vocabulary
    subset only its ids are scored (the rest are MASKED)."""
    hn = exit_hidden(heads, slot, h, cfg)
    if "vocab" in heads:
        return scatter_vocab(unembed_rows(params, hn, heads["vocab"], cfg,
                                          heads.get("vocab_rows")),
                             heads["vocab"], cfg.vocab_size)
    return llama.unembed(params, hn, cfg)


def row_exit_logits(params: llama.Params, heads, slots: jax.Array, h: jax.Array,
                    cfg: ModelConfig) -> jax.Array:
    """Logits [B, V] (f32) with a head per row: row b's exit `slots[b]`, or the final head
    where slots[b] < 0. h: [B, D]. `exit_hidden` is vmapped over rows (each row gathers its
    own head weights); the vocabulary projection is one matmul shared by all rows. With a
    vocabulary subset the exit rows get MASKED logits outside it, and each projection runs
    only when some row needs it (all rows left: no full-vocabulary matmul)."""
    hn = jax.vmap(lambda slot, x: exit_hidden(heads, slot, x, cfg))(jnp.maximum(slots, 0), h)
    final = llama.norm(h, params["final_norm"], cfg)
    if "vocab" not in heads:
        return llama.unembed(params, jnp.where((slots >= 0)[:, None], hn, final), cfg)
    ids, left = heads["vocab"], slots >= 0  # [K], [B]
    sub = jax.lax.cond(jnp.any(left),
                       lambda: unembed_rows(params, hn, ids, cfg, heads.get("vocab_rows")),
                       lambda: jnp.zeros((h.shape[0], ids.shape[0]), jnp.float32))
    full = jax.lax.cond(jnp.any(~left), lambda: llama.unembed(params, final, cfg),
                        lambda: jnp.zeros((h.shape[0], cfg.vocab_size), jnp.float32))
    return jnp.where(left[:, None], scatter_vocab(sub, ids, cfg.vocab_size), full)


def confidence_from_logits(logits: jax.Array, measure: str) -> jax.Array:
    """[..., V] -> [...] in [0, 1]; higher is more confident."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    if measure == "max_prob":
        return jnp.exp(jnp.max(logp, axis=-1))
    if measure == "margin":
        top2 = top_k(logp, 2)[0]
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


def top_k(z: jax.Array, k: int, block: int = 32) -> tuple[jax.Array, jax.Array]:
    """Exactly `jax.lax.top_k(z, k)` over the last axis (values, int32 indices; ties to the
    lower index), at a fraction of its cost on CPU, where XLA sorts the whole axis (K = 8,192:
    1.3 ms at batch 1 and 16 ms at batch 8, against 0.04 / 0.3 ms here).

    Two stages: the maximum of every block of `block` entries, the k best blocks (ties to
    the lower block), then top_k over those k blocks put back in index order. Exact: an
    entry of the top k lies in a block whose maximum ranks at least as high as it does, and
    k blocks ranked above its own would hold k entries ranked above it."""
    K = z.shape[-1]
    nb = -(-K // block)
    if nb <= k:  # nothing to gain
        v, i = jax.lax.top_k(z, k)
        return v, i.astype(jnp.int32)
    pad = nb * block - K
    if pad:
        z = jnp.concatenate([z, jnp.full((*z.shape[:-1], pad), -jnp.inf, z.dtype)], -1)
    z3 = z.reshape(*z.shape[:-1], nb, block)
    _, blk = jax.lax.top_k(jnp.max(z3, axis=-1), k)  # [..., k]
    blk = jnp.sort(blk, axis=-1)  # index order: ties keep going to the lower index
    zb = jnp.take_along_axis(z3, blk[..., None], axis=-2).reshape(*z.shape[:-1], k * block)
    v, j = jax.lax.top_k(zb, k)
    idx = jnp.take_along_axis(blk, j // block, axis=-1) * block + j % block
    return v, idx.astype(jnp.int32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CheckState:
    """What an exit check carries from one check to the next within a step (per row).

    Measures that look back (saturation; candidate features) keep their memory here, so the
    decode step carries one opaque pytree whatever the measure. The step must call
    `check_confidence` at every exit layer in order (slot 0 first), as the layer-wise
    evaluation does: measure "candidates" picks its candidates at slot 0."""

    h_prev: jax.Array  # [..., D] hidden state at the previous exit check
    cand: jax.Array  # [..., k] int32 candidate token ids (measure "candidates")
    cand_logit: jax.Array  # [..., k] f32 their logits at the previous check
    p0: jax.Array  # [...] f32 the first check's top-1 probability over the head's vocabulary


def init_check_state(h0: jax.Array, ec: ExitConfig) -> CheckState:
    """The state before the first check; h0 [..., D] is the embedding (layer 0's input)."""
    lead = h0.shape[:-1]
    return CheckState(h_prev=h0, cand=jnp.zeros((*lead, ec.candidates), jnp.int32),
                      cand_logit=jnp.zeros((*lead, ec.candidates), jnp.float32),
                      p0=jnp.zeros(lead, jnp.float32))


def _score_candidates(params: llama.Params, hn: jax.Array, cand: jax.Array, cfg: ModelConfig
                      ) -> jax.Array:
    """Exact logits of each row's own candidates: hn [..., D], cand [..., k] -> [..., k] f32
    (the LM head's own rows at cand, gathered: k rows, not the subset)."""
    w = (jnp.take(params["embed"], cand, axis=0) if cfg.tie_embeddings
         else jnp.moveaxis(jnp.take(params["lm_head"], cand, axis=1), 0, -1))  # [..., k, D]
    return llama.cap_logits(jnp.einsum("...d,...kd->...k", hn, w,
                                       preferred_element_type=jnp.float32), cfg)


def _int8_first_check(params: llama.Params, heads, hn: jax.Array, cfg: ModelConfig, k: int
                      ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The first check from the int8 rows: (candidates [..., k] int32, their exact logits
    [..., k] f32, p0 [...]), candidates in order of exact logit (ties to the search's order).

    The k best ids of the approximate subset logits become the candidates, and their logits
    are recomputed from the f32 head rows (`_score_candidates`), so the top candidate is the
    exact subset argmax whenever the search kept it (on all 3,416 SmolLM2 layer-16 states
    measured, docs/benchmarks.md "Cheaper first check").
    p0 = exp(exact top logit) / (sum of exp over the subset), the sum taken from the
    approximate logits with the k candidates' terms replaced by their exact ones: the
    candidates hold nearly all the mass, so p0 is within 0.003 of the exact search's
    (0.17 with the approximate sum left as it is)."""
    za = approx_subset_logits(heads, hn, cfg)  # [..., K]
    top_a, idx = top_k(za, k)
    cand = jnp.take(heads["vocab"], idx)
    ze = _score_candidates(params, hn, cand, cfg)  # [..., k] exact
    top, j = jax.lax.top_k(ze, k)  # k entries: sorting them is cheap
    cand = jnp.take_along_axis(cand, j, axis=-1)
    m = jnp.maximum(top_a[..., :1], top[..., :1])  # [..., 1]
    rest = jnp.sum(jnp.exp(za - m), axis=-1) - jnp.sum(jnp.exp(top_a - m), axis=-1)
    total = jnp.maximum(rest, 0.0) + jnp.sum(jnp.exp(top - m), axis=-1)
    p0 = jnp.exp(top[..., 0] - m[..., 0]) / total
    return cand.astype(jnp.int32), top, p0


def candidate_features(params: llama.Params, heads, slot, h: jax.Array, state: CheckState,
                       cfg: ModelConfig, ec: ExitConfig, first: bool | None = None
                       ) -> tuple[jax.Array, CheckState]:
    """(features [..., N_FEATURES] f32, next state) of exit `slot` for h [..., D].

    At slot 0 the exit head scores its whole vocabulary (subset) once and its top-k become the
    candidates; later slots score only those k rows of the LM head. Features: the candidates'
    softmax top-1, top-1 - top-2, 1 - normalised entropy, top logit / 10, change of the top-1
    probability since the previous check, whether the top candidate is unchanged, this check's
    probability of the previous check's top candidate, cosine to the previous check's hidden
    state, the first check's top-1 probability over the whole subset (p0).

    Heads holding the int8 rows of `with_vocab_rows` search the subset with them
    (`approx_subset_logits`, a quarter of the f32 rows' bytes) and then score their k
    candidates exactly (`_int8_first_check`): the features see exact logits; which ids are
    candidates (one or two of the lowest-ranked on 17% of SmolLM2's layer-16 states, the top
    one never) and p0 (by < 0.003) can differ from the f32 search's.

    first: whether this is the first check (slot 0), when the caller knows it statically;
    None reads it from `slot` (a traced slot then branches with a lax.cond, which costs as
    much as the later check itself on CPU)."""
    k = ec.candidates
    hn = exit_hidden(heads, slot, h, cfg)

    def first_check():
        if "vocab_rows_q" in heads:
            return _int8_first_check(params, heads, hn, cfg, k)
        if "vocab" in heads:
            z = unembed_rows(params, hn, heads["vocab"], cfg, heads.get("vocab_rows"))
            top, idx = top_k(z, k)
            cand = jnp.take(heads["vocab"], idx)
        else:
            z = llama.unembed(params, hn, cfg)
            top, cand = top_k(z, k)
        p0 = jnp.exp(top[..., 0] - jax.nn.logsumexp(z, axis=-1))
        return cand.astype(jnp.int32), top, p0

    def later():
        return state.cand, _score_candidates(params, hn, state.cand, cfg), state.p0

    if first is None and isinstance(slot, int):
        first = slot == 0
    if first is None:
        cand, z, p0 = jax.lax.cond(slot == 0, first_check, later)
    else:
        cand, z, p0 = first_check() if first else later()
    pc = jax.nn.softmax(z, axis=-1)  # [..., k]
    top2 = jax.lax.top_k(pc, 2)[0]
    ent = -jnp.sum(pc * jnp.log(pc + 1e-20), axis=-1) / np.log(k)
    prev_pc = jax.nn.softmax(state.cand_logit, axis=-1)
    prev_top = jnp.argmax(prev_pc, axis=-1)
    top = jnp.argmax(pc, axis=-1)
    feats = jnp.stack([
        top2[..., 0], top2[..., 0] - top2[..., 1], 1.0 - ent, jnp.max(z, axis=-1) / 10.0,
        top2[..., 0] - jnp.max(prev_pc, axis=-1), (top == prev_top).astype(jnp.float32),
        jnp.take_along_axis(pc, prev_top[..., None], axis=-1)[..., 0],
        saturation(h, state.h_prev), p0], axis=-1).astype(jnp.float32)
    return feats, CheckState(h_prev=h, cand=cand, cand_logit=z, p0=p0.astype(jnp.float32))


def decision_logit(heads, slot, feats: jax.Array) -> jax.Array:
    """The exit's decision MLP before the sigmoid: feats [..., F] -> [...]."""
    d = _slot(heads["decision"], slot)
    hid = jnp.tanh(feats @ d["w1"] + d["b1"])
    return hid @ d["w2"] + d["b2"]


def check_confidence(params: llama.Params, heads, slot, h: jax.Array, state: CheckState,
                     cfg: ModelConfig, ec: ExitConfig, first: bool | None = None
                     ) -> tuple[jax.Array, jax.Array | None, CheckState]:
    """The one confidence dispatch: (confidence [...] f32 in [0, 1], the exit's logits [..., V]
    when the measure had to compute them (else None), the next state). h: [..., D].

    The decode step, the layer-wise evaluation and the tests all call this, so a measure
    is written once. first: measure "candidates" only, see `candidate_features`."""
    logits = None
    if ec.measure == "candidates":
        feats, state = candidate_features(params, heads, slot, h, state, cfg, ec, first)
        return jax.nn.sigmoid(decision_logit(heads, slot, feats)), None, state
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


# --------------------------------------------------------------------------- cost model


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
