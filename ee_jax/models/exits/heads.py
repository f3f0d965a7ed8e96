"""Exit-head parameters and the exit heads' logits, as pure functions.

Exit heads live in their own params tree (`ExitHeads`), stacked on a leading exit axis in the
order of `ExitConfig.exit_layers`:

    norm        [E, D]        per-exit RMSNorm weight (EE-LLM's default head; no training needed)
    adapter     LowRank: down [E, D, r], up [E, r, D]   (head "adapter": residual low-rank)
    mlp         LowRank: down [E, D, r], up [E, r, D]   (head "mlp": residual SiLU MLP, width r)
    classifier  Classifier: w [E, D], b [E]    (measure "classifier": CALM's learned "meta")
    vocab       [K] int32                      (vocab_subset K > 0: the ids exit heads score)
    decision    Decision: w1 [E, F, H], b1 [E, H], w2 [E, H], b2 [E]  (measure "candidates")
    branch      Branch: norm [E, D], w_gate [E, D, F], w_up [E, D, F], w_down [E, F, D]
                                               (head "branch": EE-LLM's exit MLP, read from
                                               the layer's state after attention)
    output      [E, V, D]                      (exit_output: each exit's own output matrix)

A part the config does not use is None (`head_shapes` says which); `norm` is None when
`ExitConfig.exit_norm` is False (the exit's state goes to its output unnormed). A part with
leaves of its own is a typed pytree (`SUBPARTS`); a mapping of its field names converts.
On GPU the parts indexed by exit are held per exit (`unstack_heads`, below).

Every head but an `exit_output` one ends in the model's own LM head (`llama.unembed`), so
an exit adds no vocabulary matrix. On SmolLM2 that head (49,152 x 576) costs about 8 decoder
layers, so a *vocabulary subset* keeps it off the path: an exit head may score only K
frequent token ids (the rows of the LM head at `ExitHeads.vocab`); a token outside the subset
can only come from full depth. The exit head runs in full once, at the exit taken
(`row_exit_logits`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ee_jax.models import llama, quant
from ee_jax.models.config import ModelConfig
from ee_jax.models.exits import backfill_maps
from ee_jax.models.exits.config import (
    DECISION_HIDDEN,
    N_FEATURES,
    ExitConfig,
    ExitConfigError,
    uses_maps,
)
from ee_jax.models.quant import out_major_matmul

MASKED = -1e9  # logit of a token an exit head does not score (exp underflows to exactly 0)


class _Part:
    """What every typed head part offers beside its fields."""

    def replace(self, **leaves):
        return dataclasses.replace(self, **leaves)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LowRank(_Part):
    """Head "adapter" (hn + hn @ down @ up) or "mlp" (hn + silu(hn @ down) @ up)."""

    down: jax.Array  # [E, D, r]
    up: jax.Array  # [E, r, D]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Classifier(_Part):
    """Measure "classifier": CALM's learned confidence, sigmoid(norm(h) @ w + b)."""

    b: jax.Array  # [E] f32
    w: jax.Array  # [E, D] f32


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Decision(_Part):
    """Measure "candidates": a tiny MLP an exit, sigmoid(tanh(f @ w1 + b1) @ w2 + b2)."""

    b1: jax.Array  # [E, H] f32
    b2: jax.Array  # [E] f32
    w1: jax.Array  # [E, F, H] f32
    w2: jax.Array  # [E, H] f32


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Branch(_Part):
    """Head "branch": EE-LLM's exit MLP on the layer's state after attention."""

    norm: jax.Array  # [E, D]
    w_down: jax.Array  # [E, F, D]
    w_gate: jax.Array  # [E, D, F]
    w_up: jax.Array  # [E, D, F]


# The parts with leaves of their own, and their types (each type's fields in name order: the
# leaves flatten in the order of the dicts they replace, so seeded random heads are
# unchanged). A mapping of a type's field names (as a caller or an older checkpoint holds
# one) converts to it where heads are made.
SUBPARTS: dict[str, type] = {"adapter": LowRank, "mlp": LowRank, "classifier": Classifier,
                             "decision": Decision, "branch": Branch}


def _typed(name: str, value):
    """A part as its type (`SUBPARTS`): a mapping converted, the rest as given."""
    cls = SUBPARTS.get(name)
    if cls is None or not isinstance(value, Mapping):
        return value
    fields = [f.name for f in dataclasses.fields(cls)]
    if set(value) != set(fields):
        raise ExitConfigError(f"exit head part {name!r} holds {sorted(value)}; it needs "
                              f"{fields}")
    return cls(**value)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ExitHeads:
    """Every exit's head parameters (shapes: the module docstring). A field is None where the
    ExitConfig has no such part; `check_heads` holds the present ones to the config's shapes
    once, where heads are loaded or built (`as_heads`), and the step reads them as they are.
    Held per exit (`unstack_heads`, GPU) a part indexed by exit is a tuple of one an exit."""

    norm: jax.Array | None = None  # [E, D]
    adapter: LowRank | None = None
    mlp: LowRank | None = None
    classifier: Classifier | None = None
    vocab: jax.Array | None = None  # [K] int32
    decision: Decision | None = None
    branch: Branch | None = None
    output: jax.Array | None = None  # [E, V, D]
    # learned back-fill maps (`backfill_maps`): beside the heads, saved in their own file
    backfill: backfill_maps.Maps | None = None
    # derived from the LM head for serving (`with_vocab_rows`), never saved
    vocab_rows: jax.Array | None = None  # [K, D]
    vocab_rows_q: jax.Array | None = None  # [K, D] int8
    vocab_rows_scale: jax.Array | None = None  # [K] f32

    def __post_init__(self):  # a part given as a mapping of its fields: as its type
        for name in SUBPARTS:
            value = getattr(self, name)
            if isinstance(value, Mapping):
                object.__setattr__(self, name, _typed(name, value))
        if isinstance(self.backfill, Mapping):
            object.__setattr__(self, "backfill", backfill_maps.as_maps(self.backfill))

    def replace(self, **parts) -> ExitHeads:
        return dataclasses.replace(self, **parts)

    def parts(self) -> dict[str, Any]:
        """The present parts by name (what the heads' file keys its tensors by)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) is not None}

    def as_dicts(self) -> dict[str, Any]:
        """The present parts as nested dicts (a typed part's fields by name): the tree orbax
        items of heads were written in before the parts were typed."""
        return {k: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v
                for k, v in self.parts().items()}

    @classmethod
    def from_parts(cls, parts: Mapping[str, Any]) -> ExitHeads:
        unknown = sorted(set(parts) - set(PARTS))
        if unknown:
            raise ExitConfigError(f"exit heads have no part(s) {unknown}: the parts are "
                                  f"{list(PARTS)}")
        return cls(**parts)


PARTS = tuple(f.name for f in dataclasses.fields(ExitHeads))


def as_heads(heads: ExitHeads | Mapping[str, Any] | None) -> ExitHeads | None:
    """Heads as `ExitHeads` (a mapping of part names, as a caller may hold them, converted)."""
    if heads is None or isinstance(heads, ExitHeads):
        return heads
    if isinstance(heads, Mapping):
        return ExitHeads.from_parts(heads)
    raise ExitConfigError(f"exit heads are an ExitHeads (or a mapping of its part names), not "
                          f"{type(heads).__name__}")


def head_shapes(cfg: ModelConfig, ec: ExitConfig) -> ExitHeads:
    E, D, F, dt = len(ec.exit_layers), cfg.d_model, cfg.ffn_dim, cfg.jnp_dtype
    tree: dict[str, Any] = {}
    if ec.exit_norm:
        tree["norm"] = jax.ShapeDtypeStruct((E, D), dt)
    if ec.head == "branch":
        tree["branch"] = Branch(norm=jax.ShapeDtypeStruct((E, D), dt),
                                w_gate=jax.ShapeDtypeStruct((E, D, F), dt),
                                w_up=jax.ShapeDtypeStruct((E, D, F), dt),
                                w_down=jax.ShapeDtypeStruct((E, F, D), dt))
    if ec.exit_output:
        tree["output"] = jax.ShapeDtypeStruct((E, cfg.vocab_size, D), dt)
    if ec.head in ("adapter", "mlp"):
        r = ec.adapter_rank
        tree[ec.head] = LowRank(down=jax.ShapeDtypeStruct((E, D, r), dt),
                                up=jax.ShapeDtypeStruct((E, r, D), dt))
    if ec.measure == "classifier":
        tree["classifier"] = Classifier(w=jax.ShapeDtypeStruct((E, D), jnp.float32),
                                        b=jax.ShapeDtypeStruct((E,), jnp.float32))
    if ec.vocab_subset:
        tree["vocab"] = jax.ShapeDtypeStruct((ec.vocab_subset,), jnp.int32)
    if ec.measure == "candidates":
        F, H, f32 = N_FEATURES, DECISION_HIDDEN, jnp.float32
        tree["decision"] = Decision(w1=jax.ShapeDtypeStruct((E, F, H), f32),
                                    b1=jax.ShapeDtypeStruct((E, H), f32),
                                    w2=jax.ShapeDtypeStruct((E, H), f32),
                                    b2=jax.ShapeDtypeStruct((E,), f32))
    return ExitHeads(**tree)


def init_heads(cfg: ModelConfig, ec: ExitConfig, params: llama.Params,
               key: jax.Array | None = None) -> ExitHeads:
    """Untrained heads: each exit's norm starts as the final norm (usable as is), the adapter
    as the identity (up = 0), the classifier as "confidence 0.5"; a branch as a copy of its
    layer's MLP and post-attention norm and an own output as a copy of the LM head (so an
    untrained branch exit reads the layer's output, as EE-Tuning initialises them)."""
    E, D = len(ec.exit_layers), cfg.d_model
    key = jax.random.PRNGKey(0) if key is None else key
    heads: dict[str, Any] = {}
    if ec.exit_norm:
        heads["norm"] = jnp.broadcast_to(params.final_norm, (E, D)).copy()
    if ec.head == "branch":
        at = np.asarray(ec.exit_layers) - 1
        layers = params.layers
        heads["branch"] = Branch(norm=layers.mlp_norm[at], w_gate=layers.w_gate[at],
                                 w_up=layers.w_up[at], w_down=layers.w_down[at])
    if ec.exit_output:
        head = (quant.dequantize(params.embed, cfg.jnp_dtype) if cfg.tie_embeddings
                else params.lm_head.T)  # [V, D]
        heads["output"] = jnp.broadcast_to(head, (E, *head.shape)).copy()
    if ec.head in ("adapter", "mlp"):
        r = ec.adapter_rank
        heads[ec.head] = LowRank(
            down=(jax.random.normal(key, (E, D, r)) / np.sqrt(D)).astype(cfg.jnp_dtype),
            up=jnp.zeros((E, r, D), cfg.jnp_dtype))
    if ec.measure == "classifier":
        heads["classifier"] = Classifier(w=jnp.zeros((E, D), jnp.float32),
                                         b=jnp.zeros((E,), jnp.float32))
    if ec.vocab_subset:  # placeholder ids; tuning puts the most frequent tokens here
        heads["vocab"] = jnp.arange(ec.vocab_subset, dtype=jnp.int32)
    if ec.measure == "candidates":  # "confidence 0.5" until trained
        F, H = N_FEATURES, DECISION_HIDDEN
        heads["decision"] = Decision(
            w1=(jax.random.normal(jax.random.fold_in(key, 1), (E, F, H)) / np.sqrt(F)
                ).astype(jnp.float32),
            b1=jnp.zeros((E, H), jnp.float32), w2=jnp.zeros((E, H), jnp.float32),
            b2=jnp.zeros((E,), jnp.float32))
    return ExitHeads(**heads)


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


def attach_vocab_subset(heads: ExitHeads, subset: VocabSubset, cfg: ModelConfig,
                        model: str | None = None) -> ExitHeads:
    """heads with `vocab` set to the subset's ids, after checking that the subset
    was counted on this model (same name when `model` is given, same vocabulary size)."""
    if subset.vocab_size != cfg.vocab_size or (model is not None and subset.model != model):
        raise ExitConfigError(
            f"vocabulary subset was made for {subset.model!r} ({subset.vocab_size} tokens), "
            f"but the heads are for {model or 'a model'!r} ({cfg.vocab_size} tokens): count "
            f"the subset on this model's tokens")
    ids = check_vocab_subset(subset.ids, cfg.vocab_size)
    if heads.vocab is not None and np.shape(heads.vocab) != ids.shape:
        raise ExitConfigError(f"the heads score {np.shape(heads.vocab)[0]} ids, the "
                              f"subset holds {ids.size}: set ExitConfig.vocab_subset={ids.size}")
    return heads.replace(vocab=jnp.asarray(ids))


CANDIDATE_DTYPES = ("int8",)  # `with_vocab_rows(candidate_dtype=...)`; None: exact search
# Parts `with_vocab_rows` derives from the model's LM head: held for serving, never saved.
DERIVED_LEAVES = ("vocab_rows", "vocab_rows_q", "vocab_rows_scale")
NOT_DERIVED = {k: None for k in DERIVED_LEAVES}


def with_vocab_rows(params: llama.Params, heads: ExitHeads, cfg: ModelConfig,
                    candidate_dtype: str | None = "int8") -> ExitHeads:
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
    if heads.vocab is None:
        return heads
    ids = jnp.asarray(heads.vocab)
    rows = llama.head_rows(params, ids, cfg)
    if candidate_dtype is None:
        return heads.replace(**dict(NOT_DERIVED, vocab_rows=rows))
    q, scale = quantize_rows(rows)
    return heads.replace(vocab_rows=rows, vocab_rows_q=q, vocab_rows_scale=scale)


def without_derived(heads: ExitHeads) -> ExitHeads:
    """heads without the parts `with_vocab_rows` derives and without the back-fill maps
    (what the heads' file holds; the maps have their own file)."""
    return heads.replace(**NOT_DERIVED, backfill=None)


@jax.jit
def quantize_rows(rows: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Symmetric int8 per row: rows [K, D] -> (q int8 [K, D], scale f32 [K]), rows ~= q *
    scale[:, None], scale = max |row| / 127 (an all-zero row gets scale 1, q 0)."""
    rows = rows.astype(jnp.float32)
    amax = jnp.max(jnp.abs(rows), axis=-1)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0).astype(jnp.float32)
    q = jnp.clip(jnp.round(rows / scale[:, None]), -127, 127).astype(jnp.int8)
    return q, scale


def check_heads(cfg: ModelConfig, ec: ExitConfig, heads: ExitHeads | Mapping[str, Any]
                ) -> ExitHeads:
    """`heads` as ExitHeads (`as_heads`), or ExitConfigError unless they have exactly the
    shapes this config needs (plus, optionally, the derived parts of `with_vocab_rows` and
    learned back-fill maps, which back-fill "learned" requires; `backfill_maps.check_maps`)."""
    heads = as_heads(heads)
    if heads is None:
        raise ExitConfigError("exit heads are needed for this ExitConfig: pass exit_heads "
                              "(init_heads for untrained ones, load_exit_heads for saved ones)")
    if heads.backfill is not None:
        backfill_maps.check_maps(cfg, ec.exit_layers, heads.backfill)
    elif uses_maps(ec.backfill):
        raise ExitConfigError("back-fill 'learned' needs fitted maps beside the heads "
                              "(ExitHeads.backfill, saved as backfill_maps.safetensors by "
                              "ee-jax tune): fit them, or serve back-fill 'propagate' or "
                              "'deferred'")
    want = {jax.tree_util.keystr(p): tuple(s.shape) for p, s in
            jax.tree_util.tree_leaves_with_path(head_shapes(cfg, ec))}
    derived = {"vocab_rows": (ec.vocab_subset, cfg.d_model),
               "vocab_rows_q": (ec.vocab_subset, cfg.d_model),
               "vocab_rows_scale": (ec.vocab_subset,)}
    if ec.vocab_subset:
        want.update({f".{k}": shape for k, shape in derived.items()
                     if getattr(heads, k) is not None})
    got = {jax.tree_util.keystr(p): tuple(np.shape(a)) for p, a in
           jax.tree_util.tree_leaves_with_path(heads.replace(backfill=None))}
    if want != got:
        diff = sorted(set(want.items()) ^ set(got.items()))
        raise ExitConfigError(
            f"exit heads do not match exit_layers={ec.exit_layers}, head={ec.head!r}, "
            f"measure={ec.measure!r} on a d_model={cfg.d_model} model: differing leaves "
            f"(name, shape): {diff}")
    return heads


def at_slot(tree, slot):
    """The leaves of a stacked heads subtree at exit `slot` (a traced index)."""
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, slot, keepdims=False), tree)


# How heads are held follows the layer layout (`llama.LAYOUTS`, docs/architecture.md "Layer
# layouts"). Stacked: a part indexed by exit holds [E, ...] leaves, an exit read by a dynamic
# index. Per exit (GPU, with the per-layer layout): each such part a tuple of one subtree an
# exit, each leaf a buffer of its own, read inside a `lax.switch` over the exits. XLA's GPU
# compiler copies a dynamic slice of a stacked weight out before its GEMMs, and a switch over
# static slices of one stack copies each branch's slice: only buffers of their own are read
# in place. The subset's ids and rows and the back-fill maps are shared or gathered per row:
# they stay as they are.
EXIT_PARTS = ("norm", "adapter", "mlp", "classifier", "decision", "branch", "output")


def per_exit(heads: ExitHeads) -> bool:
    """Whether the heads hold their exits' parts per exit (tuples) rather than stacked."""
    return any(isinstance(getattr(heads, n), tuple) for n in EXIT_PARTS)


def unstack_heads(heads: ExitHeads | None) -> ExitHeads | None:
    """Heads with each part indexed by exit as a tuple of per-exit subtrees (`llama.unstack`:
    abstract leaves and shardings kept); the per-layer layout's heads."""
    if heads is None or per_exit(heads):
        return heads
    return heads.replace(**{n: llama.unstack(getattr(heads, n)) for n in EXIT_PARTS
                            if getattr(heads, n) is not None})


def n_exits(heads: ExitHeads) -> int:
    """How many exits the heads hold (stacked or per exit)."""
    for n in EXIT_PARTS:
        part = getattr(heads, n)
        if part is not None:
            return len(part) if isinstance(part, tuple) else jax.tree.leaves(part)[0].shape[0]
    raise ExitConfigError("these exit heads hold no part indexed by exit")


def at_exit(heads: ExitHeads, slot, fn, *names: str):
    """fn(*the parts `names` at exit `slot`), a part None where the heads have none. Stacked:
    the parts' leaves read at the slot; per exit: a `lax.switch` over the exits whose branch
    e reads exit e's own buffers (a Python int slot: that exit's, no switch). Every reading
    of an exit's parts goes through here, so both ways of holding them give the same math."""
    parts = [getattr(heads, n) for n in names]
    if not per_exit(heads):
        return fn(*(None if p is None else at_slot(p, slot) for p in parts))

    def branch(e: int):
        return fn(*(None if p is None else p[e] for p in parts))

    if isinstance(slot, int | np.integer):
        return branch(int(slot))
    return jax.lax.switch(slot, [functools.partial(branch, e) for e in range(n_exits(heads))])


def exit_input(heads, slot, h: jax.Array, mid: jax.Array | None, cfg: ModelConfig
               ) -> jax.Array:
    """The state exit `slot` reads: h, the layer's output, or under head "branch" the layer's
    state after attention `mid` plus the exit's own MLP on it (EE-LLM's exit MLP; h, the
    trunk's output, is then not read). h, mid: [..., D]."""
    if heads.branch is None:
        return h
    if mid is None:
        raise ValueError("a branch exit reads its layer's state after attention: pass mid")
    return at_exit(heads, slot, lambda b: mid + llama.gated_mlp(
        llama.norm(mid, b.norm, cfg), b.w_gate, b.w_up, b.w_down, cfg), "branch")


def exit_hidden(heads, slot, h: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The normed (and adapted) hidden state of exit `slot`, ready for the shared LM head (or
    the exit's own output). h: what the exit reads (`exit_input`)."""
    def hidden(norm, adapter, mlp):
        hn = llama.norm(h, norm, cfg) if norm is not None else h
        if adapter is not None:
            hn = hn + (hn @ adapter.down) @ adapter.up
        if mlp is not None:
            hn = hn + jax.nn.silu(hn @ mlp.down) @ mlp.up
        return hn

    return at_exit(heads, slot, hidden, "norm", "adapter", "mlp")


def unembed_rows(params: llama.Params, xn: jax.Array, ids: jax.Array, cfg: ModelConfig,
                 rows: jax.Array | None = None) -> jax.Array:
    """The LM head's logits at token ids only: xn [..., D], ids [K] -> [..., K] f32 (equal to
    `llama.unembed(...)[..., ids]`, at K x D multiply-adds instead of V x D). rows: the head's
    rows at ids [K, D] when the caller holds them (`with_vocab_rows`); else gathered here,
    behind an optimization barrier (fused into the product, the gather became a scalar
    reduction loop on CPU)."""
    if rows is None:
        rows = jax.lax.optimization_barrier(llama.head_rows(params, ids, cfg))  # [K, D]
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
    q, scale = heads.vocab_rows_q, heads.vocab_rows_scale  # [K, D] int8, [K] f32
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


def _own_output(heads, slot, hn: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Exit `slot`'s own output matrix ([V, D]) on hn [..., D] -> [..., V] f32."""
    return at_exit(heads, slot, lambda w: llama.cap_logits(
        out_major_matmul(hn, w, preferred_element_type=jnp.float32), cfg), "output")


def temperature_at(temperatures: tuple[float, ...], slot) -> jax.Array | float:
    """Exit `slot`'s temperature (`ExitConfig.temperatures`; () is 1)."""
    return jnp.asarray(temperatures, jnp.float32)[slot] if temperatures else 1.0


def exit_logits(params: llama.Params, heads, slot, h: jax.Array, cfg: ModelConfig,
                temperatures: tuple[float, ...] = ()):
    """Logits [..., V] (f32) of exit `slot` for the states it reads h [..., D]
    (`exit_input`); with a vocabulary subset only its ids are scored (the rest are MASKED).
    temperatures: `ExitConfig.temperatures`."""
    hn = exit_hidden(heads, slot, h, cfg)
    if heads.vocab is not None:
        return scatter_vocab(unembed_rows(params, hn, heads.vocab, cfg, heads.vocab_rows),
                             heads.vocab, cfg.vocab_size)
    if heads.output is not None:
        return _own_output(heads, slot, hn, cfg) / temperature_at(temperatures, slot)
    return llama.unembed(params, hn, cfg) / temperature_at(temperatures, slot)


def row_exit_logits(params: llama.Params, heads, slots: jax.Array, h: jax.Array,
                    cfg: ModelConfig, final: bool = True,
                    temperatures: tuple[float, ...] = ()) -> jax.Array:
    """Logits [B, V] (f32) with a head per row: row b's exit `slots[b]`, or the final head
    where slots[b] < 0. h: [B, D]. `exit_hidden` is vmapped over rows (each row gathers its
    own head weights); the vocabulary projection is one matmul shared by all rows. With a
    vocabulary subset the exit rows get MASKED logits outside it, and each projection runs
    only when some row needs it (all rows left: no full-vocabulary matmul). final=False:
    rows with slots < 0 get zeros (their final head runs elsewhere: verified exits)."""
    hn = jax.vmap(lambda slot, x: exit_hidden(heads, slot, x, cfg))(jnp.maximum(slots, 0), h)
    final_h = llama.norm(h, params.final_norm, cfg)
    left = slots >= 0

    def tempered(logits):  # each exit row divided by its exit's temperature (final rows: 1)
        if not temperatures:
            return logits
        return logits / jnp.where(left, temperature_at(temperatures, jnp.maximum(slots, 0)),
                                  1.0)[:, None]

    if heads.output is not None:  # an exit's own output: one product for each exit some row took
        out = jax.lax.cond(jnp.any(~left) & final, lambda: llama.unembed(params, final_h, cfg),
                           lambda: jnp.zeros((h.shape[0], cfg.vocab_size), jnp.float32))
        for e in range(n_exits(heads)):
            at_e = slots == e
            out = jax.lax.cond(
                jnp.any(at_e),
                lambda o, e=e, at_e=at_e: jnp.where(at_e[:, None], _own_output(heads, e, hn, cfg),
                                                    o), lambda o: o, out)
        return tempered(out)
    if heads.vocab is None:
        return tempered(llama.unembed(params, jnp.where(left[:, None], hn, final_h), cfg))
    ids = heads.vocab  # [K]
    sub = jax.lax.cond(jnp.any(left),
                       lambda: unembed_rows(params, hn, ids, cfg, heads.vocab_rows),
                       lambda: jnp.zeros((h.shape[0], ids.shape[0]), jnp.float32))
    full = jax.lax.cond(jnp.any(~left) & final, lambda: llama.unembed(params, final_h, cfg),
                        lambda: jnp.zeros((h.shape[0], cfg.vocab_size), jnp.float32))
    return jnp.where(left[:, None], scatter_vocab(sub, ids, cfg.vocab_size), full)
