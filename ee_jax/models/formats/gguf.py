"""Load a llama.cpp GGUF file into the layer-stacked parameter tree.

Every tensor is dequantized to f32 with the `gguf` package (F32, F16, BF16, Q4_0 ... Q8_0,
K-quants, ...), so the model runs on dequantized weights; quantized kernels are not the point.

Three things differ from the Hugging Face layout and are undone here:

* Shapes. GGUF stores dimensions in ggml order (fastest-varying first): a Linear weight that
  Hugging Face holds as `[out, in]` is listed as `[in, out]`. `GGUFReader` already hands the
  data back in numpy order, i.e. `[out, in]`; we transpose to our input-major `[in, out]`.
* Q/K rows. llama.cpp's converter (`convert_hf_to_gguf.py`, `LlamaModel.permute`) reorders the
  rows of `q_proj`/`k_proj` inside each head so that ggml's interleaved RoPE (pairs `2j, 2j+1`)
  computes what Hugging Face's rotate-half RoPE (pairs `j, j + hd/2`) computes:

      gguf = hf.reshape(n, 2, hd/2, D).swapaxes(1, 2).reshape(n*hd, D)
      i.e. gguf row (h, 2j) = hf row (h, j),  gguf row (h, 2j+1) = hf row (h, j + hd/2)

  with `n` = query heads for Q and kv heads for K. `unpermute_qk_rows` is the inverse.
* Llama-3 RoPE scaling is not metadata but a tensor, `rope_freqs.weight`: per-frequency
  divisors. `RopeScaling` is recovered from it and checked to reproduce it exactly.

Families (`ARCHS`, by `general.architecture`): llama (Llama, SmolLM2, Mistral), qwen2 (q/k/v
biases), qwen3 (q/k norms) and gemma2. llama.cpp runs the last three with NEOX (rotate-half)
RoPE, so their Q/K rows are stored unpermuted; its Gemma converter stores norm weights as
1 + w, which is undone here (exact for weights in [-0.5, 1]) so that `ModelConfig` and the
tree are those of the Hugging Face folder. llama.cpp keeps no query_pre_attn_scalar for
Gemma 2: it scales by 1/sqrt(head_dim), or by 1/sqrt(d_model / heads) for the 46-layer
(27B) model, and so does this loader.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from ee_jax.errors import ModelLoadError, UnsupportedModelError
from ee_jax.models import weights
from ee_jax.models.config import ConfigError, ModelConfig, RopeScaling
from ee_jax.models.gguf_file import open_reader
from ee_jax.models.llama import Params, ParamsMismatchError, check_params, param_shapes
from ee_jax.models.quant import BLOCK_KINDS, QUANTIZED_KEYS, BlockQ

# GGUF per-layer tensor name -> our key under params.layers (`weights`: declared there).
LAYER_TENSORS = {base: key for (base, _), key in weights.gguf_names(layer=True).items()}
GLOBAL_TENSORS = {w.gguf[0]: w.key for w in weights.WEIGHTS if not w.layer and w.gguf}
ROPE_FREQS = "rope_freqs.weight"


@dataclasses.dataclass(frozen=True)
class Arch:
    """A `general.architecture`: the ModelConfig switches it sets, its per-layer tensors
    beyond `LAYER_TENSORS` ((base, "weight" | "bias") -> our key), and whether llama.cpp
    permuted its Q/K rows and stored its norms as 1 + w."""

    switches: dict[str, Any] = dataclasses.field(default_factory=dict)
    tensors: dict[tuple[str, str], str] = dataclasses.field(default_factory=dict)
    permuted_qk: bool = False
    norms_plus_one: bool = False


ARCHS: dict[str, Arch] = {
    "llama": Arch(permuted_qk=True),
    "qwen2": Arch(switches={"qkv_bias": True},
                  tensors=weights.gguf_names(layer=True, when="qkv_bias")),
    "qwen3": Arch(switches={"qk_norm": True},
                  tensors=weights.gguf_names(layer=True, when="qk_norm")),
    "gemma2": Arch(switches={"norm_offset": 1.0, "embed_scale": True, "post_norms": True,
                             "activation": "gelu_tanh"},
                   tensors=weights.gguf_names(layer=True, when="post_norms"),
                   norms_plus_one=True),
}


def layer_tensors(arch: str) -> dict[tuple[str, str], str]:
    """(GGUF base name, "weight" | "bias") -> our layer key, for this architecture."""
    return {**{(base, "weight"): key for base, key in LAYER_TENSORS.items()},
            **ARCHS[arch].tensors}

_MISSING = object()


# --------------------------------------------------------------------------- the permutation


def permute_qk_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter permutation, Hugging Face rows -> GGUF rows. w: [n*hd, ...]."""
    hd = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, hd // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of `permute_qk_rows`, GGUF rows -> Hugging Face rows. w: [n*hd, ...].

    Within each head the GGUF rows alternate (first half, second half) of the Hugging Face
    head; taking the even rows then the odd rows restores it.
    """
    hd = w.shape[0] // n_heads
    return w.reshape(n_heads, hd // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _source(reader) -> str:
    return str(getattr(getattr(reader, "data", None), "filename", None) or "GGUF file")


def _value(reader, key: str, default: Any = _MISSING) -> Any:
    """A metadata value as a Python object (str, int, float, bool or a list of them)."""
    from gguf import GGUFValueType

    field = reader.fields.get(key)
    if field is None:
        if default is _MISSING:
            raise ModelLoadError(f"{_source(reader)} lacks the metadata key {key!r}, which a "
                                 "llama GGUF must have. Re-convert it with llama.cpp's "
                                 "convert_hf_to_gguf.py.")
        return default

    def one(part, vtype):
        if vtype == GGUFValueType.STRING:
            return bytes(part).decode("utf-8", errors="replace")
        value = part.tolist()[0]
        if vtype in (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64):
            # Shortest decimal that round-trips in f32 (stored 1e-5 reads back as 1e-05, not
            # 9.999999747378752e-06).
            return float(str(np.float32(value))) if vtype == GGUFValueType.FLOAT32 else value
        if vtype == GGUFValueType.BOOL:
            return bool(value)
        return value

    if field.types[0] == GGUFValueType.ARRAY:
        return [one(field.parts[i], field.types[-1]) for i in field.data]
    return one(field.parts[field.data[0]], field.types[0])


def _tensor_index(reader) -> dict[str, Any]:
    return {t.name: t for t in reader.tensors}


def _np_shape(tensor) -> tuple[int, ...]:
    """A tensor's shape in numpy order (GGUF lists dimensions in ggml order, reversed)."""
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


def _dequantize(tensor, source: str) -> np.ndarray:
    from gguf.quants import dequantize

    try:
        arr = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as e:
        raise _unsupported_type(tensor, source) from e
    arr = np.asarray(arr, dtype=np.float32).reshape(_np_shape(tensor))
    return arr


# Block types whose blocks a decode step reads as they are (`quant.BlockQ`): 32 inputs per
# f16 scale; Q4_1 adds an f16 offset, Q4_0 centres its nibbles at 8.
BLOCK_TYPES = BLOCK_KINDS


def _blocks(tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A Q4_0 / Q4_1 / Q8_0 tensor's own blocks (`blocks_from_raw`)."""
    out, inp = _np_shape(tensor)
    return blocks_from_raw(np.asarray(tensor.data, np.uint8), tensor.tensor_type.name, out, inp)


def served_blocks(path_or_reader) -> dict[str, str]:
    """The weights a GGUF's model is served in its own blocks (`load_gguf(blocks=True)`), by
    parameter key -> block kind, from the header alone: a layer matmul weight every layer of
    which is one of `BLOCK_TYPES`, and "embed" (the token embedding and tied head) if it is."""
    reader = path_or_reader if hasattr(path_or_reader, "tensors") else open_reader(path_or_reader)
    tensors = layer_tensors(_value(reader, "general.architecture"))
    types: dict[str, set[str]] = {}
    for t in reader.tensors:
        layer, base = _split_name(t.name)
        if layer is not None and base in tensors:
            types.setdefault(tensors[base], set()).add(t.tensor_type.name)
        elif base == "token_embd" and t.tensor_type.name in BLOCK_TYPES:
            types["embed"] = {t.tensor_type.name}
    return {key: next(iter(ts)) for key, ts in types.items()
            if (key in QUANTIZED_KEYS or key == "embed") and len(ts) == 1
            and ts <= set(BLOCK_TYPES)}


def blocks_from_raw(raw: np.ndarray, kind: str, out: int, inp: int
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """ggml blocks (uint8, `out` rows of `inp` inputs) -> the `quant.BlockQ` fields: q (Q4:
    the packed nibbles uint8 [out, in // 2]; Q8_0: int8 [out, in]), scale and offset f16
    [out, in // 32] (offset None but for Q4_1), as the file holds them; what they stand for
    equals the `gguf` package's dequantization bit for bit (tests/test_loaders.py). ggml's
    layouts: Q8_0 is (f16 d, 32 x int8); Q4_0 (f16 d, 16 bytes) and Q4_1 (f16 d, f16 m,
    16 bytes) hold inputs 0-15 of the block in the low nibbles and 16-31 in the high ones."""
    if kind not in BLOCK_TYPES:
        raise ValueError(f"{kind} is not one of the block types {BLOCK_TYPES}")
    raw = np.asarray(raw, np.uint8).reshape(out, inp // 32, -1)

    def f16(lo: int) -> np.ndarray:
        return np.ascontiguousarray(raw[..., lo:lo + 2]).view(np.float16)[..., 0]

    if kind == "Q8_0":
        return np.ascontiguousarray(raw[..., 2:]).view(np.int8).reshape(out, inp), f16(0), None
    qs = raw[..., 4:] if kind == "Q4_1" else raw[..., 2:]
    return (np.ascontiguousarray(qs).reshape(out, inp // 2), f16(0),
            f16(2) if kind == "Q4_1" else None)


def _block_q(parts: list, kind: str, table: bool = False) -> BlockQ:
    """Per-matrix `blocks_from_raw` fields stacked into one `quant.BlockQ` on the device (a
    `table`: one matrix, unstacked)."""
    import jax.numpy as jnp

    stack = (lambda a: a[0]) if table else np.stack
    return BlockQ(*(None if parts[0][i] is None else jnp.asarray(stack([p[i] for p in parts]))
                    for i in range(3)), kind=kind, packed=kind != "Q8_0", table=table)


def block_quantize(w: np.ndarray, kind: str = "Q4_1"):
    """An input-major weight [..., in, out] quantized by the `gguf` package to `kind`, as a
    `quant.BlockQ` (random same-shape weights for benchmarks, where no GGUF travels)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    if kind not in BLOCK_TYPES:
        raise ValueError(f"{kind} is not one of the block types {BLOCK_TYPES}")
    w = np.asarray(w, np.float32)
    *lead, inp, out = w.shape
    t = np.swapaxes(w, -1, -2).reshape(-1, out, inp)
    parts = [blocks_from_raw(quantize(m, GGMLQuantizationType[kind]), kind, out, inp)
             for m in t]
    q = _block_q(parts, kind)
    return BlockQ(*(None if a is None else a.reshape(*lead, *a.shape[1:])
                    for a in (q.q_t, q.scale_t, q.offset_t)), kind=kind, packed=q.packed)


def _unsupported_type(tensor, source: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"{source}: tensor {tensor.name!r} is stored as {tensor.tensor_type.name}, which the "
        "installed `gguf` package cannot dequantize. Use a GGUF quantized to a supported type "
        "(F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K..Q6_K), or upgrade `gguf`.")


def _check_types(reader, source: str) -> None:
    """Fail before any work if a tensor type cannot be dequantized: probe one zero block."""
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    seen = {}
    for t in reader.tensors:
        seen.setdefault(t.tensor_type, t)
    for qtype, t in seen.items():
        _, type_size = GGML_QUANT_SIZES[qtype]
        try:
            dequantize(np.zeros((1, type_size), np.uint8), qtype)
        except NotImplementedError as e:
            raise _unsupported_type(t, source) from e


# --------------------------------------------------------------------------- config


def _rope_scaling_from_freqs(factors: np.ndarray, rope_theta: float, head_dim: int,
                             source: str) -> RopeScaling | None:
    """Recover Llama-3 `RopeScaling` from llama.cpp's `rope_freqs.weight` divisors.

    The converter writes, per frequency f with wavelength w = 2π/f, the divisor 1 (short w),
    `factor` (long w) or 1 / ((1-s)/factor + s) with s = (orig/w - low) / (high - low). The
    divisors only depend on the ratios orig/low and orig/high, so low_freq_factor = 1 is
    assumed (Llama 3.x's value) and orig, high are solved from the medium band, then the whole
    tensor is recomputed from the result and must match.
    """
    factors = factors.astype(np.float64).reshape(-1)
    inv = 1.0 / rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if factors.shape != inv.shape:
        raise ModelLoadError(f"{source}: {ROPE_FREQS} has {factors.size} entries, expected "
                             f"head_dim/2 = {inv.size}.")
    if np.allclose(factors, 1.0, rtol=0, atol=1e-6):
        return None
    factor = float(factors.max())
    medium = (factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6))
    unsupported = UnsupportedModelError(
        f"{source}: {ROPE_FREQS} is not Llama-3 style RoPE scaling that ee-jax can reproduce. "
        "Load the original Hugging Face folder instead (its config.json names the scaling).")
    if medium.sum() < 2:
        raise unsupported
    wavelen = 2 * math.pi / inv
    smooth = (1 / factors[medium] - 1 / factor) / (1 - 1 / factor)  # = orig/w * a + b
    slope, intercept = np.polyfit(1 / wavelen[medium], smooth, 1)
    if intercept >= 0 or slope <= 0:
        raise unsupported
    orig = round(slope / -intercept)  # low_freq_factor = 1
    high = round(1 + orig / slope, 4)
    try:
        rs = RopeScaling(factor=round(factor, 6), low_freq_factor=1.0, high_freq_factor=high,
                         original_max_position_embeddings=orig)
    except ConfigError as e:
        raise unsupported from e
    # Recompute exactly as llama.cpp's converter does and compare.
    low_w, high_w = orig / rs.low_freq_factor, orig / rs.high_freq_factor
    s = (orig / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
    expect = np.where(wavelen < high_w, 1.0,
                      np.where(wavelen > low_w, rs.factor, 1 / ((1 - s) / rs.factor + s)))
    if not np.allclose(expect, factors, rtol=1e-4, atol=0):
        raise unsupported
    return rs


def gguf_config(path_or_reader, dtype: str = "float32") -> ModelConfig:
    """The `ModelConfig` a llama GGUF file describes (metadata plus a few tensor shapes)."""
    reader = path_or_reader if hasattr(path_or_reader, "tensors") else open_reader(path_or_reader)
    source = _source(reader)
    arch = _value(reader, "general.architecture")
    if arch not in ARCHS:
        raise UnsupportedModelError(
            f"{source}: general.architecture is {arch!r}; ee-jax implements "
            f"{' / '.join(repr(a) for a in ARCHS)} (Llama 2/3, SmolLM2, Mistral, Qwen2/2.5, "
            "Qwen3, Gemma 2). Use a GGUF of one of those.")
    p = arch + "."
    tensors = _tensor_index(reader)
    if "token_embd.weight" not in tensors:
        raise ModelLoadError(f"{source} has no 'token_embd.weight' tensor; it is not a complete "
                             "llama GGUF (a split file? pass the first part of a merged file).")
    if int(_value(reader, "split.count", 1)) > 1:
        raise UnsupportedModelError(f"{source} is one part of a split GGUF; merge the parts "
                                    "with `llama-gguf-split --merge` first.")
    d = int(_value(reader, p + "embedding_length"))
    n_heads = int(_value(reader, p + "attention.head_count"))
    n_kv = _value(reader, p + "attention.head_count_kv", n_heads)
    if isinstance(n_kv, list):  # per-layer kv heads: fine if all equal
        if len(set(n_kv)) != 1:
            raise UnsupportedModelError(f"{source}: per-layer kv head counts {n_kv} are not "
                                        "supported (every layer must have the same).")
        n_kv = n_kv[0]
    head_dim = int(_value(reader, p + "attention.key_length", 0)) or None
    rope_dim = _value(reader, p + "rope.dimension_count", None)
    if head_dim is None:
        head_dim = int(rope_dim) if rope_dim else d // n_heads
    v_dim = _value(reader, p + "attention.value_length", head_dim)
    if v_dim != head_dim or (rope_dim is not None and rope_dim != head_dim):
        raise UnsupportedModelError(
            f"{source}: key_length {head_dim}, value_length {v_dim}, rope.dimension_count "
            f"{rope_dim} differ; ee-jax needs full-width RoPE and equal K/V head sizes.")
    rope_theta = float(_value(reader, p + "rope.freq_base", 10000.0))

    scaling_type = _value(reader, p + "rope.scaling.type", "none")
    scaling_factor = float(_value(reader, p + "rope.scaling.factor", 1.0))
    if scaling_type not in ("none", "") and not (scaling_type == "linear"
                                                 and scaling_factor == 1.0):
        raise UnsupportedModelError(
            f"{source}: RoPE scaling {scaling_type!r} (factor {scaling_factor}) is not "
            "supported; ee-jax implements Llama-3 scaling only.")
    rope_scaling = None
    if ROPE_FREQS in tensors:
        rope_scaling = _rope_scaling_from_freqs(_dequantize(tensors[ROPE_FREQS], source),
                                                rope_theta, head_dim, source)

    switches = dict(ARCHS[arch].switches)
    n_layers = int(_value(reader, p + "block_count"))
    if arch == "gemma2":
        window = _value(reader, p + "attention.sliding_window", None)
        softcaps = {key: _value(reader, p + key, None)
                    for key in ("attn_logit_softcapping", "final_logit_softcapping")}
        switches.update(
            attn_logit_softcap=softcaps["attn_logit_softcapping"] or None,
            final_logit_softcap=softcaps["final_logit_softcapping"] or None,
            query_pre_attn_scalar=float(d // n_heads if n_layers == 46 else head_dim),
            sliding_window=int(window) if window else None,
            # llama.cpp: every even layer local, odd layers global
            layer_types=tuple("sliding_attention" if i % 2 == 0 else "full_attention"
                              for i in range(n_layers)) if window else None)

    eos = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        tok = _value(reader, "tokenizer.ggml." + key, None)
        if tok is not None and int(tok) not in eos:
            eos.append(int(tok))
    bos = _value(reader, "tokenizer.ggml.bos_token_id", None)
    name = _value(reader, "general.name", None) or Path(source).stem
    try:
        return ModelConfig(
            vocab_size=_np_shape(tensors["token_embd.weight"])[0],
            d_model=d,
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=int(n_kv),
            head_dim=head_dim,
            ffn_dim=int(_value(reader, p + "feed_forward_length")),
            rms_eps=float(_value(reader, p + "attention.layer_norm_rms_epsilon")),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_embeddings="output.weight" not in tensors,
            max_position=int(_value(reader, p + "context_length")),
            dtype=dtype,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=tuple(eos),
            name=str(name),
            **switches,
        )
    except ConfigError as e:
        raise ModelLoadError(f"{source}: its metadata does not describe a valid model: {e}") from e


# --------------------------------------------------------------------------- weights


def _expected_np_shapes(cfg: ModelConfig, tensors: dict[tuple[str, str], str]
                        ) -> dict[Any, tuple[int, ...]]:
    """Per GGUF tensor (global base name, or (layer base, kind) with the layer index
    dropped), the numpy-order shape ([out, in] for weights)."""
    shapes = param_shapes(cfg)
    out: dict[Any, tuple[int, ...]] = {}
    for gname, key in GLOBAL_TENSORS.items():
        if shapes.weight(key) is not None:
            out[gname] = tuple(reversed(shapes.weight(key).shape)) if key == "lm_head" else \
                shapes.weight(key).shape
    for gkey, key in tensors.items():
        shape = shapes.weight(key).shape[1:]
        out[gkey] = tuple(reversed(shape))
    return out


def _split_name(name: str) -> tuple[int | None, Any]:
    """'blk.3.attn_q.bias' -> (3, ('attn_q', 'bias')); 'output_norm.weight' ->
    (None, 'output_norm')."""
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and \
            parts[3] in ("weight", "bias"):
        return int(parts[1]), (parts[2], parts[3])
    if len(parts) == 2 and parts[1] == "weight":
        return None, parts[0]
    return None, name


def load_gguf(path: str | os.PathLike, dtype: str = "float32", *,
              blocks: bool = False) -> tuple[ModelConfig, Params]:
    """Read a llama GGUF file: its `ModelConfig` and the filled, checked parameter tree.

    Tensors are dequantized to f32 on the host, Q/K rows un-permuted, Linear weights
    transposed to input-major, then cast to `dtype` as jax arrays. blocks=True: a layer
    matmul weight stored in one of `BLOCK_TYPES` in every layer stays in its blocks
    (`quant.BlockQ`, dequantized bit-exactly inside the step; the file's own bytes).
    """
    reader = open_reader(path)
    source = str(path)
    cfg = gguf_config(reader, dtype=dtype)
    arch = ARCHS[_value(reader, "general.architecture")]
    tensors = layer_tensors(_value(reader, "general.architecture"))
    _check_types(reader, source)
    expected = _expected_np_shapes(cfg, tensors)
    L = cfg.n_layers


    block_kinds = served_blocks(reader) if blocks else {}
    kept = set(block_kinds) - {"embed"}
    layers = {key: np.empty((L, *param_shapes(cfg).weight(key).shape[1:]), np.float32)
              for key in tensors.values() if key not in kept}
    block_parts: dict[str, list] = {key: [None] * L for key in kept}
    seen: set[str] = set()
    bad_shape: set[str] = set()
    unexpected, misshaped = [], []
    out: dict[str, Any] = {}  # the global weights by key
    table_kind = None
    todo = [t for t in reader.tensors if t.name != ROPE_FREQS]
    for t in tqdm(todo, desc=f"dequantizing {Path(source).name}", unit="tensor",
                  file=sys.stderr, disable=None, leave=False):
        layer, base = _split_name(t.name)
        known = (tensors if layer is not None else GLOBAL_TENSORS)
        if base not in known or (layer is not None and layer >= L):
            unexpected.append(t.name)
            continue
        shape = _np_shape(t)
        if shape != expected[base]:
            misshaped.append(f"{t.name} has shape {list(reversed(shape))} (ggml order), expected "
                             f"{list(reversed(expected[base]))}")
            bad_shape.add(t.name)
            continue
        seen.add(t.name)
        name = base[0] if layer is not None else base
        if layer is not None and tensors[base] in kept:
            parts = _blocks(t)  # output-major, as the step reads them
            if arch.permuted_qk and name in ("attn_q", "attn_k"):
                n = cfg.n_heads if name == "attn_q" else cfg.n_kv_heads
                parts = tuple(None if a is None else unpermute_qk_rows(a, n) for a in parts)
            block_parts[tensors[base]][layer] = parts
            continue
        if base == "token_embd" and "embed" in block_kinds:
            # the tied head and the embedding in the file's blocks (`BlockQ.table`)
            table_kind = t.tensor_type.name
            out["embed"] = _blocks(t)
            continue
        w = _dequantize(t, source)  # numpy order: [out, in] for weights
        if arch.permuted_qk and name == "attn_q":
            w = unpermute_qk_rows(w, cfg.n_heads)
        elif arch.permuted_qk and name == "attn_k":
            w = unpermute_qk_rows(w, cfg.n_kv_heads)
        if arch.norms_plus_one and name.endswith("norm"):
            w = w - np.float32(1.0)  # llama.cpp stored 1 + w; llama.norm adds the 1
        if w.ndim == 2 and base != "token_embd":
            w = w.T  # -> input-major [in, out]
        if layer is None:
            out[GLOBAL_TENSORS[base]] = w
        else:
            layers[tensors[base]][layer] = w

    if unexpected:
        raise UnsupportedModelError(
            f"{source} has tensors a {_value(reader, 'general.architecture')} model does not "
            f"use: {unexpected[:8]}"
            f"{' ...' if len(unexpected) > 8 else ''} (biases, extra layers or another variant). "
            "ee-jax cannot load this model.")
    wanted = [g + ".weight" for g in GLOBAL_TENSORS if g in expected]
    wanted += [f"blk.{i}.{g}.{kind}" for i in range(L) for g, kind in tensors]
    missing = [n for n in wanted if n not in seen and n not in bad_shape]
    if missing or misshaped:
        problems = ([f"missing {missing[:8]}{' ...' if len(missing) > 8 else ''}"]
                    if missing else []) + misshaped[:8]
        raise ParamsMismatchError(f"{source} does not match its own metadata: "
                                  + "; ".join(problems) + ". The file is damaged or was written "
                                  "by a converter that does not follow llama.cpp's layout.")

    dt = cfg.jnp_dtype
    tree: dict[str, Any] = {k: _block_q([v], table_kind, table=True) if isinstance(v, tuple)
                            else jnp.asarray(v, dt) for k, v in out.items()}
    tree["layers"] = {k: jnp.asarray(v, dt) for k, v in layers.items()}
    for key, per_layer in block_parts.items():
        if all(p is not None for p in per_layer):  # else check_params names it missing
            tree["layers"][key] = _block_q(per_layer, block_kinds[key])
    return cfg, check_params(cfg, tree, source=source)
