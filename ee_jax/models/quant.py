"""Layer weights stored other than as plain arrays, and `linear`, the one matmul rule.

- `BlockQ`: a GGUF file's Q4_0 / Q4_1 / Q8_0 blocks kept at the file's size and dequantized
  inside the step, bit-exactly (what a GGUF model is served from by default: `load_model`).
- `QArray`: weight-only int8 with per-output-channel scales (`quantize="int8"`).

A quantized weight is a `QArray`: `q` int8 [..., in, out] and `scale` f32 [..., out], with
w ~= q * scale (symmetric, scale = max |w| over the input axis / 127). It is a registered
pytree of two leaves, so the stacked layer axis slices like any other leaf: `layer_params`,
`lax.scan`, the back-fill's `vmap` and `a[first:]` need no special case.

`linear(x, w)` is the one matmul rule: every weight of a layer (wq, wk, wv, wo, w_gate, w_up,
w_down) is applied through it, plain or quantized. The int8 weight is converted to the
activation dtype, multiplied in, and the scale applied to the f32 accumulator after the dot
(per output channel, so it commutes with the sum): XLA fuses the convert and the scale into
the dot, and a decode step reads a quarter of the f32 weight bytes (half of bf16's).

A GGUF's tied embedding in a block type is a block table (`BlockQ.table`): its rows are
gathered block by block (`take_rows`: the embedding, the exit heads' candidate rows) and the
LM head runs over it by vocabulary chunks (`table_matmul`). Other embeddings and LM heads stay
in the model dtype.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ee_jax.models import weights
from ee_jax.models.config import ConfigError
from ee_jax.models.params import Params

# weight-only: "int8" (per-output-channel scales, `QArray`); "int4" (GGUF Q4_1 blocks of 32
# inputs, an f16 scale and offset each, `BlockQ`: 0.625 bytes a weight, packed on TPU/GPU)
QUANTIZE_MODES = ("int8", "int4")
# The layer weights that are quantized: every matmul of a decoder layer.
QUANTIZED_KEYS = weights.keys(layer=True, matmul=True)  # the layers' matmul weights


class QuantizeError(ConfigError):
    """A quantization mode ee-jax does not implement."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QArray:
    """An int8 weight with per-output-channel scales: w ~= q * scale[..., None, :]."""

    q: jax.Array  # int8 [..., in, out]
    scale: jax.Array  # f32 [..., out]

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the weight it stands for (what `check_params` compares)."""
        return tuple(self.q.shape)

    @property
    def dtype(self):
        return self.q.dtype

    @property
    def nbytes(self) -> int:
        return int(self.q.nbytes) + int(self.scale.nbytes)


def is_qarray(x: Any) -> bool:
    return isinstance(x, QArray)


def is_packed(x: Any) -> bool:
    """A weight stored other than as a plain array (int8 or GGUF blocks)."""
    return isinstance(x, QArray | BlockQ)


def check_quantize(quantize: str | None) -> str | None:
    """`quantize` itself if ee-jax implements it, else a QuantizeError saying what does."""
    if quantize is None or quantize in QUANTIZE_MODES:
        return quantize
    raise QuantizeError(
        f"quantize={quantize!r} is not supported: ee-jax serves weight-only int8 "
        f"(per-output-channel scales) or int4 (GGUF Q4_1 blocks of 32). Pass quantize='int8' "
        f"or 'int4' (CLI: --quantize int8|int4), or leave "
        f"it unset to serve the weights in the model dtype.")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockQ:
    """A weight kept in a GGUF file's own blocks (Q4_0 / Q4_1 / Q8_0), at the file's size:
    w = q * scale + offset, one f16 scale (and offset) per `BLOCK` consecutive inputs of each
    output channel.

    Why: a decode step reads every layer weight once, so at a few rows its time is the bytes
    it reads. Held as the file holds them: Q4 two values a byte (ggml's order: a block's 16
    bytes carry its inputs 0-15 in the low nibbles, 16-31 in the high ones), Q8_0 one, and
    the scales and offsets in f16 -- 0.5625 bytes a weight for Q4_0, 0.625 for Q4_1, 1.0625
    for Q8_0, against 4 for f32. The product of an f16 scale and a 4- or 8-bit q is exact in
    f32, and one rounding then adds the offset, so the weight `block_dequantize` builds inside
    the step is bit-identical to the f32 array the `gguf` package's dequantization gives: the
    model served is the file's model, not an approximation of it (unlike `QArray`, which
    quantizes again). Kept output-major, the file's own order (the `_t` fields)."""

    # packed Q4: uint8 [..., out, in // 2], two values a byte; otherwise int8 [..., out, in],
    # one value a byte (Q8_0; a Q4 block unpacked for CPU, `for_platform`: Q4_0's centred)
    q_t: jax.Array
    scale_t: jax.Array  # f16 [..., out, in // BLOCK]
    offset_t: jax.Array | None = None  # f16 [..., out, in // BLOCK] (Q4_1; None otherwise)
    kind: str = dataclasses.field(default="Q8_0", metadata=dict(static=True))  # BLOCK_KINDS
    # q_t holds two values a byte (a Q4 kind as the file holds it)
    packed: bool = dataclasses.field(default=False, metadata=dict(static=True))
    # stands for t itself, [..., rows, in] (a token embedding, the tied LM head), not for the
    # input-major weight t.T a layer's matmul reads
    table: bool = dataclasses.field(default=False, metadata=dict(static=True))
    # a table's product with fewer rows runs padded to this many (`for_platform`)
    min_rows: int = dataclasses.field(default=1, metadata=dict(static=True))

    def __post_init__(self):
        if self.kind not in BLOCK_KINDS or (self.packed and self.kind == "Q8_0"):
            raise ValueError(f"BlockQ kind {self.kind!r} (packed={self.packed}) is not one of "
                             f"{BLOCK_KINDS} (Q8_0 never packed)")

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the array it stands for (what `check_params` reads): [..., in, out],
        a table's [..., rows, in]."""
        *lead, out, _ = self.q_t.shape
        inp = self.scale_t.shape[-1] * BLOCK
        return (*lead, out, inp) if self.table else (*lead, inp, out)

    @property
    def dtype(self):
        """What it dequantizes to."""
        return jnp.dtype(jnp.float32)

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in (self.q_t, self.scale_t, self.offset_t)
                   if a is not None)


BLOCK = 32  # inputs per scale in Q4_0 / Q4_1 / Q8_0
BLOCK_KINDS = ("Q4_0", "Q4_1", "Q8_0")  # the GGUF block types a step reads as they are


def abstract_blocks(shape: tuple[int, ...], kind: str, table: bool = False) -> BlockQ:
    """A `BlockQ` of `kind` standing for an array of `shape` ([..., in, out]; a table's
    [..., rows, in]) as the file holds it, in shapes and dtypes only: what the ahead-of-time
    compile plans a GGUF's blocks with."""
    *lead, a, b = shape
    out, inp = (a, b) if table else (b, a)
    packed = kind != "Q8_0"
    q = jax.ShapeDtypeStruct((*lead, out, inp // 2 if packed else inp),
                             jnp.uint8 if packed else jnp.int8)
    scale = jax.ShapeDtypeStruct((*lead, out, inp // BLOCK), jnp.float16)
    return BlockQ(q, scale, scale if kind == "Q4_1" else None, kind=kind, packed=packed,
                  table=table)


def block_values(w: BlockQ) -> jax.Array:
    """The blocks' q as f32 [..., out, in // BLOCK, BLOCK] (Q4_0's nibbles centred at 8)."""
    *lead, out, _ = w.q_t.shape
    nb = w.scale_t.shape[-1]
    if not w.packed:
        return w.q_t.astype(jnp.float32).reshape(*lead, out, nb, BLOCK)
    p = w.q_t.reshape(*lead, out, nb, BLOCK // 2)
    q = jnp.concatenate([p & 0x0F, p >> 4], axis=-1).astype(jnp.float32)
    return q - 8.0 if w.kind == "Q4_0" else q


@jax.jit
def unpack(w: BlockQ) -> BlockQ:
    """A packed Q4 block weight with one value a byte (int8; Q4_0's centred at 0), the same
    weight: what XLA's CPU dots read fastest (`for_platform`)."""
    if not w.packed:
        return w
    *lead, out, _ = w.q_t.shape
    q = block_values(w).astype(jnp.int8).reshape(*lead, out, -1)
    return dataclasses.replace(w, q_t=q, packed=False)


# XLA's CPU backend fuses a one-value-a-byte block's dequantization into a decode step's
# matrix-vector product, but not a packed Q4 block's nibble unpacking: a SmolLM2 step at batch
# 1 took 122 ms packed against 13.2 one a byte (`python -m bench.kernels blocks`, 2-core AMD
# EPYC). CPU holds Q4 one value a byte; TPU and GPU read the file's packed bytes.
UNPACKED_PLATFORMS = ("cpu",)


# TPU's compiler runs a one-row product with a block table (the tied LM head at batch 1) as a
# multiply-reduce fed an f32 operand the table's size (its scales broadcast, 113 MB for
# SmolLM2's Q8_0 head, in VMEM), and two rows as a dot. `ee-jax compile --model
# smollm2-135m-instruct --target tpu:v5e --decode-only --max-num-seqs 8 --max-model-len 256
# --no-early-exit`, batch 1: 306.8 -> 150.2 MB (99.5 by hand). The one-id embedding lookup is
# not padded: tried, it read less there but several times more with the layouts picked for a
# batch-2 step (`--max-num-seqs 2 --max-model-len 64`), where the chunked head then relaid
# the whole table out every chunk. CPU fuses the one row best.
TABLE_MIN_ROWS = {"tpu": 2}


def for_platform(params: Any, platform: str) -> Any:
    """`params` with each block weight in the storage `platform`'s steps read best (abstract
    params, `jax.ShapeDtypeStruct` leaves, too: the ahead-of-time compile's), block tables
    padded to the rows the platform's products want (`TABLE_MIN_ROWS`)."""
    unpacked = platform in UNPACKED_PLATFORMS
    min_rows = TABLE_MIN_ROWS.get(platform, 1)

    def one(a):
        if not isinstance(a, BlockQ):
            return a
        if a.table and a.min_rows != min_rows:
            a = dataclasses.replace(a, min_rows=min_rows)
        if not unpacked or not a.packed:
            return a
        if isinstance(a.q_t, jax.ShapeDtypeStruct):
            return jax.eval_shape(unpack, a)
        return unpack(a)
    return jax.tree.map(one, params, is_leaf=lambda a: isinstance(a, BlockQ))


def block_dequantize(w: BlockQ) -> jax.Array:
    """The output-major f32 weight [..., out, in] a `BlockQ` stands for (exact). Inside a
    step XLA fuses this with the layer's slice of the stacked blocks: the f32 weight is
    written once from the file's bytes, where a plain f32 weight's slice is copied."""
    t = block_values(w) * w.scale_t.astype(jnp.float32)[..., None]
    if w.offset_t is not None:
        t = t + w.offset_t.astype(jnp.float32)[..., None]
    *lead, out, nb, _ = t.shape
    return t.reshape(*lead, out, nb * BLOCK)


# Output-major products (t [out, in], w = t.T: the tied embedding as the LM head, a GGUF block
# weight dequantized) by row count (the decode micro-benchmark removed in f73b65e, SmolLM2's
# layer slices, 2-core CPU): one row, x @ t.T, which XLA runs as a matrix-vector loop over t's
# rows; up to _OUT_MAJOR_NN_ROWS rows, t @ x.T as its own product ([out, rows], t the left
# operand; the barrier keeps XLA from turning it back into x @ t.T, 20-30% slower there); above,
# prompt-sized row counts (512+), x @ t.T again: the [out, rows] result's transpose would cost
# more.
_OUT_MAJOR_NN_ROWS = 64


def out_major_matmul(x: jax.Array, t: jax.Array, preferred_element_type=None) -> jax.Array:
    """x [..., in] times w = t.T, for t [out, in] (the tied embedding [V, D] as the LM head,
    a dequantized block weight), in the product the row count runs best."""
    rows = math.prod(x.shape[:-1])
    kw = dict(preferred_element_type=preferred_element_type)
    if rows == 1 or rows > _OUT_MAJOR_NN_ROWS:
        return jnp.matmul(x, jnp.swapaxes(t, -1, -2), **kw)
    xt = x.reshape(rows, x.shape[-1]).T  # [in, rows]
    y = jax.lax.optimization_barrier(jnp.matmul(t, xt, **kw))  # [out, rows]
    return y.T.reshape(*x.shape[:-1], t.shape[-2])


def take_rows(table: jax.Array | BlockQ, ids: jax.Array, dtype=None) -> jax.Array:
    """table[ids] ([..., in]) for a plain or a block table (`BlockQ.table`): only the rows'
    blocks are read and dequantized (exact in f32; then in `dtype`, the model's)."""
    if not isinstance(table, BlockQ):
        return jnp.take(table, ids, axis=0)
    rows = BlockQ(jnp.take(table.q_t, ids, axis=0), jnp.take(table.scale_t, ids, axis=0),
                  None if table.offset_t is None else jnp.take(table.offset_t, ids, axis=0),
                  kind=table.kind, packed=table.packed, table=True)
    return block_dequantize(rows).astype(dtype or jnp.float32)


# A block table times x ([V, D] Q8_0: the tied head): one row fuses the dequantization into
# XLA's matrix-vector product, reading only the blocks; several rows would write the f32 table
# whole first, so they take it _TABLE_CHUNKS vocabulary slices at a time, each slice's f32
# small enough to stay in cache. A SmolLM2 step against the same blocks with an f32 head
# (`python -m bench.kernels blocks`, 2-core AMD EPYC): 13.2 vs 13.4 ms at batch 1, 26.1 vs
# 27.0 at 8, 77.0 vs 73.3 at 32, for 29 instead of 108 MiB.
_TABLE_CHUNKS = 16


def table_matmul(x: jax.Array, table: jax.Array | BlockQ, preferred_element_type=None
                 ) -> jax.Array:
    """x [..., in] times table.T ([rows, in]: the tied LM head) -> [..., rows]."""
    if not isinstance(table, BlockQ):
        return out_major_matmul(x, table, preferred_element_type=preferred_element_type)
    rows = math.prod(x.shape[:-1])
    if rows < table.min_rows:  # padded with copies of the first row, whose result is kept
        x2 = x.reshape(rows, x.shape[-1])
        x2 = jnp.concatenate([x2, jnp.broadcast_to(x2[:1], (table.min_rows - rows,
                                                            x2.shape[-1]))])
        # the barrier keeps XLA from seeing the copies and reducing the product to one row
        x2 = jax.lax.optimization_barrier(x2)
        y = table_matmul(x2, table, preferred_element_type=preferred_element_type)
        return y[:rows].reshape(*x.shape[:-1], y.shape[-1])
    V = table.q_t.shape[-2]
    n = max((c for c in range(1, _TABLE_CHUNKS + 1) if V % c == 0), default=1)
    if rows == 1 or n == 1:
        return out_major_matmul(x, block_dequantize(table).astype(x.dtype),
                                preferred_element_type=preferred_element_type)
    x2 = x.reshape(rows, x.shape[-1])
    parts = jax.tree.map(lambda a: a.reshape(n, V // n, *a.shape[1:]), table)

    def chunk(t: BlockQ) -> jax.Array:  # [rows, V // n]
        return jnp.matmul(x2, block_dequantize(t).astype(x.dtype).T,
                          preferred_element_type=preferred_element_type)
    y = jax.lax.map(chunk, parts)  # [n, rows, V // n]
    return jnp.moveaxis(y, 0, 1).reshape(*x.shape[:-1], V)


def linear(x: jax.Array, w: jax.Array | QArray | BlockQ) -> jax.Array:
    """x @ w for a plain, a GGUF-block or an int8 weight. x: [..., in]; w: [in, out] ->
    [..., out] in x's dtype. int8: the dot accumulates in f32 and the scale multiplies the
    result."""
    if isinstance(w, BlockQ):
        return out_major_matmul(x, block_dequantize(w).astype(x.dtype))
    if isinstance(w, QArray):
        y = jnp.matmul(x, w.q.astype(x.dtype), preferred_element_type=jnp.float32)
        return (y * w.scale).astype(x.dtype)
    return x @ w


@jax.jit
def quantize_weight(w: jax.Array) -> QArray:
    """Symmetric int8 over the input axis (-2), one scale per output channel (and layer).
    w: [..., in, out] -> QArray(q [..., in, out], scale [..., out]). An all-zero column gets
    scale 1 (its q is 0)."""
    w32 = jnp.asarray(w, jnp.float32)
    amax = jnp.max(jnp.abs(w32), axis=-2)  # [..., out]
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    q = jnp.clip(jnp.round(w32 / scale[..., None, :]), -127, 127).astype(jnp.int8)
    return QArray(q, scale)


def dequantize(w: QArray | BlockQ, dtype=jnp.float32) -> jax.Array:
    """The array an int8 or block weight stands for (`.shape`), in `dtype` (a plain array:
    itself)."""
    if not is_packed(w):
        return jnp.asarray(w)
    if isinstance(w, BlockQ):
        t = block_dequantize(w)
        return (t if w.table else jnp.swapaxes(t, -1, -2)).astype(dtype)
    return (w.q.astype(jnp.float32) * w.scale[..., None, :]).astype(dtype)


def quantize_params(params: Params, quantize: str | None = "int8", *,
                    block_quantize=None) -> Params:
    """The layer weights (`QUANTIZED_KEYS`) as QArrays ("int8") or Q4_1 blocks ("int4",
    through `block_quantize(w, kind)`: the GGUF format's, which the caller hands in);
    everything else (embedding, LM head, norms, biases) unchanged. quantize None: `params`
    as they are. Weights already in that form are kept (int4: a GGUF's blocks too). A loader
    that holds the only reference to its weights quantizes them one at a time instead
    (`quantize_layers`)."""
    if check_quantize(quantize) is None:
        return params
    layers = {k: getattr(params.layers, k) for k in QUANTIZED_KEYS}
    quantize_layers(layers, quantize, block_quantize=block_quantize)
    return params.replace(layers=params.layers.replace(**layers))


def quantize_layers(layers: dict[str, Any], quantize: str, *, block_quantize=None) -> None:
    """`quantize_params` on a dict of layer weights by key (a loader's own, before it becomes
    `Params`), each replaced in place as it is quantized: a weight in the model dtype is freed
    as soon as its quantized form replaces it (peak: the model in its dtype plus one
    quantized leaf, not plus the whole quantized model)."""
    if check_quantize(quantize) is None:
        return
    for key in QUANTIZED_KEYS:
        w = layers.get(key)
        if w is None:
            continue
        if quantize == "int4":
            if isinstance(w, BlockQ):
                continue
            if block_quantize is None:
                raise QuantizeError("quantize='int4' needs the GGUF block quantizer: load the "
                                    "model with load_model(..., quantize='int4')")
            if isinstance(w, QArray):
                w = dequantize(w)
            if w.shape[-2] % BLOCK:
                raise QuantizeError(
                    f"quantize='int4' quantizes each weight in blocks of {BLOCK} inputs, but "
                    f"layer weight {key!r} has {w.shape[-2]} inputs; use quantize='int8'")
            layers[key] = block_quantize(np.asarray(w, np.float32), "Q4_1")
        elif not isinstance(w, QArray):
            if isinstance(w, BlockQ):  # int8 of the weight the file's blocks hold
                w = dequantize(w)
            layers[key] = quantize_weight(w)
        del w  # the last reference to the weight in the model dtype


def dequantize_params(params: Params, dtype=jnp.float32) -> Params:
    """Every QArray / BlockQ replaced by its dequantized weight in `dtype` (a plain model that
    computes what the packed one does: the tests' reference, and what sharded serving and
    checkpoints take)."""
    return jax.tree.map(lambda a: dequantize(a, dtype) if isinstance(a, QArray | BlockQ)
                        else a, params, is_leaf=lambda a: isinstance(a, QArray | BlockQ))


def has_blocks(params: Params) -> bool:
    return any(isinstance(a, BlockQ) for a in
               jax.tree.leaves(params, is_leaf=lambda a: isinstance(a, BlockQ)))


def is_quantized(params: Params) -> bool:
    return any(isinstance(a, QArray) for a in jax.tree.leaves(params, is_leaf=is_qarray))


def param_bytes(params: Any) -> int:
    """Bytes the parameter arrays hold (an int8 weight: its q plus its scales)."""
    return sum(int(a.nbytes) for a in jax.tree.leaves(params))
