"""Layer weights stored other than as plain arrays, and `linear`, the one matmul rule.

- `BlockQ`: a GGUF file's Q4_0 / Q4_1 / Q8_0 blocks kept as they are and dequantized inside
  the step, bit-exactly (what a GGUF model is served from by default: `load_model`).
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

The embedding and the LM head stay in the model dtype: the exit heads read rows of the
shared head (candidate sets), and the embedding's gather stays exact.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from ee_jax.models.config import ConfigError

QUANTIZE_MODES = ("int8",)
# The layer weights that are quantized: every matmul of a decoder layer.
QUANTIZED_KEYS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


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
        f"(per-output-channel scales). Pass quantize='int8' (CLI: --quantize int8), or leave "
        f"it unset to serve the weights in the model dtype.")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockQ:
    """A weight kept in a GGUF file's own blocks (Q4_0 / Q4_1 / Q8_0): w = q * scale + offset,
    one scale (and offset) per `BLOCK` consecutive inputs of each output channel.

    Why: a decode step reads every layer weight once, so at a few rows its time is the bytes
    it reads: 1 + 1/4 per weight (int8 q, f32 scale and offset per 32) instead of 4. The
    product of an f16 scale and a 4- or 8-bit q is exact in f32, and one rounding then adds
    the offset, so the weight `block_dequantize` builds inside the step is bit-identical to
    the f32 array the `gguf` package's dequantization gives: the model served is the file's
    model, not an approximation of it (unlike `QArray`, which quantizes again). Kept
    output-major, the file's own order (the `_t` fields; `sharding` reads the suffix)."""

    q_t: jax.Array  # int8 [..., out, in]
    scale_t: jax.Array  # f32 [..., out, in // BLOCK]
    offset_t: jax.Array | None = None  # f32 [..., out, in // BLOCK] (Q4_1; None otherwise)

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the weight it stands for, [..., in, out] (what `check_params` reads)."""
        *lead, out, inp = self.q_t.shape
        return (*lead, inp, out)

    @property
    def dtype(self):
        return self.scale_t.dtype

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in (self.q_t, self.scale_t, self.offset_t)
                   if a is not None)


BLOCK = 32  # inputs per scale in Q4_0 / Q4_1 / Q8_0


def block_dequantize(w: BlockQ) -> jax.Array:
    """The output-major f32 weight [..., out, in] a `BlockQ` stands for (exact). Inside a
    step XLA fuses this with the layer's slice of the stacked blocks: the f32 weight is
    written once from a quarter of its bytes, where a plain f32 weight's slice is copied."""
    *lead, out, inp = w.q_t.shape
    q = w.q_t.astype(jnp.float32).reshape(*lead, out, inp // BLOCK, BLOCK)
    t = q * w.scale_t[..., None]
    if w.offset_t is not None:
        t = t + w.offset_t[..., None]
    return t.reshape(*lead, out, inp)


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
    """The input-major weight [..., in, out] an int8 or block weight stands for, in `dtype`."""
    if isinstance(w, BlockQ):
        return jnp.swapaxes(block_dequantize(w), -1, -2).astype(dtype)
    return (w.q.astype(jnp.float32) * w.scale[..., None, :]).astype(dtype)


def quantize_params(params: dict, quantize: str | None = "int8", *,
                    consume: bool = False) -> dict:
    """The layer weights (`QUANTIZED_KEYS`) as QArrays; everything else (embedding, LM head,
    norms, biases) unchanged. quantize None: `params` as they are. Already quantized
    weights are kept. consume=True (a loader's fresh tree): `params["layers"]` is updated in
    place, so each weight in the model dtype can be freed as soon as its int8 replaces it
    (peak: the model in its dtype plus one int8 leaf, not plus the whole int8 model)."""
    if check_quantize(quantize) is None:
        return params
    layers = params["layers"] if consume else dict(params["layers"])
    for key in QUANTIZED_KEYS:
        if isinstance(layers[key], BlockQ):  # int8 of the weight the file's blocks hold
            layers[key] = dequantize(layers[key])
        if not isinstance(layers[key], QArray):
            layers[key] = quantize_weight(layers[key])
    return params if consume else dict(params, layers=layers)


def dequantize_params(params: dict, dtype=jnp.float32) -> dict:
    """Every QArray / BlockQ replaced by its dequantized weight in `dtype` (a plain model that
    computes what the packed one does: the tests' reference, and what sharded serving and
    checkpoints take)."""
    return jax.tree.map(lambda a: dequantize(a, dtype) if isinstance(a, QArray | BlockQ)
                        else a, params, is_leaf=lambda a: isinstance(a, QArray | BlockQ))


def has_blocks(params: dict) -> bool:
    return any(isinstance(a, BlockQ) for a in
               jax.tree.leaves(params, is_leaf=lambda a: isinstance(a, BlockQ)))


def is_quantized(params: dict) -> bool:
    return any(isinstance(a, QArray) for a in jax.tree.leaves(params, is_leaf=is_qarray))


def param_bytes(params: Any) -> int:
    """Bytes the parameter arrays hold (an int8 weight: its q plus its scales)."""
    return sum(int(a.nbytes) for a in jax.tree.leaves(params))
