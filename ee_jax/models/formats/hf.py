"""Load a Hugging Face decoder folder (`config.json` + safetensors) into our tree.

Families: Llama (Llama 2/3, SmolLM2), Mistral (sliding window), Qwen2/Qwen2.5 (q/k/v biases),
Qwen3 (per-head q/k RMSNorm) and Gemma 2 (see `ee_jax.models.config.ModelConfig`). Each
family is a row in `FAMILIES`: the config switches it sets and the names of its tensors.

Hugging Face Linear weights are `[out, in]`; ours are input-major `[in, out]`, so every
projection and the untied LM head are transposed. Q/K rows need no permutation: Hugging Face
already uses the rotate-half RoPE that `ee_jax.models.llama.apply_rope` implements. Norm
weights are stored as the checkpoint holds them (Gemma's 1 + w is applied by `llama.norm`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy: safetensors' numpy reader needs it)
import numpy as np

from ee_jax.errors import ModelLoadError, UnsupportedModelError
from ee_jax.models import weights
from ee_jax.models.config import LAYER_TYPES, ConfigError, ModelConfig, RopeScaling
from ee_jax.models.llama import Params, ParamsMismatchError, check_params, param_shapes
from ee_jax.models.safetensors_io import save_file

# Hugging Face per-layer tensor (after "model.layers.{i}.") -> our key under params.layers,
# shared by every family (`weights`: declared there); `Family.tensors` adds or overrides.
LAYER_TENSORS = weights.hf_names(layer=True)
GLOBAL_TENSORS = {w.hf: w.key for w in weights.WEIGHTS if not w.layer and w.hf}
# Buffers some older checkpoints saved; recomputed from the config, so ignored.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_QKV_BIAS = weights.hf_names(layer=True, when="qkv_bias")


@dataclasses.dataclass(frozen=True)
class Family:
    """What a Hugging Face `model_type` means here: the ModelConfig switches it sets, its
    per-layer tensor names beyond `LAYER_TENSORS`, and the config.json defaults of its
    transformers config class (used when a key is absent)."""

    architecture: str
    switches: dict[str, Any] = dataclasses.field(default_factory=dict)
    tensors: dict[str, str] = dataclasses.field(default_factory=dict)
    defaults: dict[str, Any] = dataclasses.field(default_factory=dict)
    act_key: str = "hidden_act"
    activations: dict[str, str] = dataclasses.field(default_factory=lambda: {"silu": "silu"})
    # config.json keys that put a bias on o_proj too (unsupported when true)
    o_bias_keys: tuple[str, ...] = ()


FAMILIES: dict[str, Family] = {
    "llama": Family("LlamaForCausalLM", o_bias_keys=("attention_bias",),
                    defaults={"rms_norm_eps": 1e-6, "max_position_embeddings": 2048}),
    "mistral": Family("MistralForCausalLM",
                      defaults={"rms_norm_eps": 1e-6, "sliding_window": 4096,
                                "max_position_embeddings": 131072}),
    "qwen2": Family("Qwen2ForCausalLM", switches={"qkv_bias": True}, tensors=_QKV_BIAS,
                    defaults={"rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
                              "sliding_window": 4096, "max_window_layers": 28}),
    "qwen3": Family("Qwen3ForCausalLM", switches={"qk_norm": True},
                    tensors=weights.hf_names(layer=True, when="qk_norm"),
                    o_bias_keys=("attention_bias",),
                    defaults={"rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
                              "sliding_window": 4096, "max_window_layers": 28}),
    "gemma2": Family(
        "Gemma2ForCausalLM",
        switches={"norm_offset": 1.0, "embed_scale": True, "post_norms": True},
        tensors={"post_attention_layernorm.weight": "post_attn_norm",
                 "pre_feedforward_layernorm.weight": "mlp_norm",
                 "post_feedforward_layernorm.weight": "post_mlp_norm"},
        act_key="hidden_activation",
        activations={"gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"},
        o_bias_keys=("attention_bias",),
        defaults={"rms_norm_eps": 1e-6, "max_position_embeddings": 8192,
                  "tie_word_embeddings": True, "hidden_activation": "gelu_pytorch_tanh",
                  "sliding_window": 4096, "query_pre_attn_scalar": 256,
                  "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}),
}
SUPPORTED_ARCHITECTURES = tuple(f.architecture for f in FAMILIES.values())
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)


def layer_tensors(family: str) -> dict[str, str]:
    """Hugging Face per-layer tensor suffix -> our layer key, for this family."""
    return {**LAYER_TENSORS, **FAMILIES[family].tensors}


def _rope_from_hf(config: dict[str, Any], source: str) -> tuple[float, RopeScaling | None]:
    """rope_theta and scaling from either `rope_scaling` (transformers 4) or
    `rope_parameters` (transformers 5, which also holds rope_theta)."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or params
    theta = float(config.get("rope_theta") or params.get("rope_theta") or 10000.0)
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise UnsupportedModelError(
            f"{source}: rope scaling {rope_type!r} is not supported; ee-jax implements "
            "'default' and 'llama3' RoPE only.")
    try:
        return theta, RopeScaling(
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
            high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                scaling.get("original_max_position_embeddings", 8192)),
        )
    except KeyError as e:
        raise ModelLoadError(f"{source}: llama3 rope scaling lacks {e.args[0]!r}") from e
    except ConfigError as e:
        raise ModelLoadError(f"{source}: invalid rope scaling: {e}") from e


def family_of(config: dict[str, Any], source: str = "config.json") -> str:
    """The `FAMILIES` key of a config.json dict (by model_type, else by architecture)."""
    model_type = config.get("model_type")
    archs = config.get("architectures") or []
    if model_type in FAMILIES:
        return model_type
    by_arch = [name for name, f in FAMILIES.items() if f.architecture in archs]
    if by_arch and model_type is None:
        return by_arch[0]
    what = f"architecture {archs} (model_type {model_type!r})" if archs else \
        f"model_type {model_type!r}"
    raise UnsupportedModelError(
        f"{source}: {what} is not supported; ee-jax loads "
        f"{' / '.join(SUPPORTED_ARCHITECTURES)} checkpoints (model_type "
        f"{' / '.join(SUPPORTED_MODEL_TYPES)}).")


def _windows_from_hf(config: dict[str, Any], family: str, n_layers: int, source: str
                     ) -> tuple[int | None, tuple[str, ...] | None]:
    """(sliding_window, layer_types) as transformers derives them for this family."""
    get = lambda key: config.get(key, FAMILIES[family].defaults.get(key))  # noqa: E731
    window = get("sliding_window")
    if family in ("qwen2", "qwen3") and not config.get("use_sliding_window", False):
        window = None  # Qwen's config keeps a window size that only use_sliding_window enables
    if family == "llama":
        window = None
    layer_types = config.get("layer_types")
    if layer_types is not None:
        layer_types = tuple(layer_types)
        bad = sorted(set(layer_types) - set(LAYER_TYPES))
        if bad:
            raise UnsupportedModelError(
                f"{source}: layer_types {bad} are not supported; ee-jax implements "
                f"{' / '.join(LAYER_TYPES)} layers.")
        if len(layer_types) != n_layers:
            raise ModelLoadError(f"{source}: layer_types has {len(layer_types)} entries for "
                                 f"num_hidden_layers={n_layers}.")
    if not window:
        if layer_types is not None and "sliding_attention" in layer_types:
            raise ModelLoadError(f"{source}: layer_types marks sliding_attention layers but "
                                 "sliding_window is not set.")
        return None, None
    window = int(window)
    if layer_types is None:
        if family == "gemma2":  # even layers local, odd layers global
            layer_types = tuple("sliding_attention" if i % 2 == 0 else "full_attention"
                                for i in range(n_layers))
        elif family in ("qwen2", "qwen3"):
            first = int(get("max_window_layers"))
            layer_types = tuple("sliding_attention" if i >= first else "full_attention"
                                for i in range(n_layers))
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None, None
    if layer_types is not None and set(layer_types) == {"sliding_attention"}:
        layer_types = None  # every layer alike
    return window, layer_types


def config_from_hf(config: dict[str, Any], *, source: str = "config.json",
                   dtype: str = "float32", name: str | None = None) -> ModelConfig:
    """A `ModelConfig` from a `config.json` dict of a supported family. `source` names it in
    errors; an option ee-jax does not implement fails with its config.json key named.

    A sliding window is kept as `ModelConfig.sliding_window` and applied in attention; it
    never caps the context (`max_position` is max_position_embeddings)."""
    family = family_of(config, source)
    fam = FAMILIES[family]
    get = lambda key, default=None: config.get(key, fam.defaults.get(key, default))  # noqa: E731
    for key in fam.o_bias_keys:
        if config.get(key):
            raise UnsupportedModelError(f"{source}: {key}=true is not supported for "
                                        f"{family} (ee-jax has no bias on o_proj).")
    if config.get("mlp_bias"):
        raise UnsupportedModelError(f"{source}: mlp_bias=true is not supported (ee-jax "
                                    "implements bias-free MLP projections).")
    act = get(fam.act_key, "silu")
    if act not in fam.activations:
        raise UnsupportedModelError(f"{source}: {fam.act_key} {act!r} is not supported for "
                                    f"{family}; ee-jax implements {sorted(fam.activations)}.")
    if config.get("use_bidirectional_attention"):
        raise UnsupportedModelError(f"{source}: use_bidirectional_attention=true is not "
                                    "supported (ee-jax serves causal decoders).")
    if float(config.get("partial_rotary_factor") or 1.0) != 1.0:
        raise UnsupportedModelError(f"{source}: partial_rotary_factor="
                                    f"{config['partial_rotary_factor']} is not supported "
                                    "(ee-jax rotates the full head_dim).")
    try:
        d = int(config["hidden_size"])
        n_heads = int(config["num_attention_heads"])
        n_layers = int(config["num_hidden_layers"])
        ffn = int(config["intermediate_size"])
        vocab = int(config["vocab_size"])
    except KeyError as e:
        raise ModelLoadError(f"{source} lacks the required key {e.args[0]!r}") from e
    n_kv = int(config.get("num_key_value_heads") or n_heads)
    head_dim = config.get("head_dim")
    head_dim = int(head_dim) if head_dim else d // n_heads
    theta, scaling = _rope_from_hf(config, source)
    window, layer_types = _windows_from_hf(config, family, n_layers, source)
    eos = config.get("eos_token_id")
    eos = () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
    bos = config.get("bos_token_id")
    switches = dict(fam.switches)
    if family == "gemma2":
        switches.update(
            query_pre_attn_scalar=float(get("query_pre_attn_scalar")),
            attn_logit_softcap=(None if get("attn_logit_softcapping") is None
                                else float(get("attn_logit_softcapping"))),
            final_logit_softcap=(None if get("final_logit_softcapping") is None
                                 else float(get("final_logit_softcapping"))))
    try:
        return ModelConfig(
            vocab_size=vocab, d_model=d, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv,
            head_dim=head_dim, ffn_dim=ffn, rms_eps=float(get("rms_norm_eps", 1e-6)),
            rope_theta=theta, rope_scaling=scaling,
            tie_embeddings=bool(get("tie_word_embeddings", False)),
            max_position=int(get("max_position_embeddings", 8192)), dtype=dtype,
            bos_token_id=None if bos is None else int(bos), eos_token_ids=eos,
            name=str(name or config.get("_name_or_path") or family),
            activation=fam.activations[act], sliding_window=window, layer_types=layer_types,
            **switches,
        )
    except ConfigError as e:
        raise ModelLoadError(f"{source} does not describe a valid model: {e}") from e


# where(path, ndim) -> the sharding a parameter leaf goes to (None: the default device); path
# as in the params tree, e.g. ("layers", "wq").
Placer = Callable[[tuple[str, ...], int], Any]


@functools.partial(jax.jit, donate_argnums=(0,))
def _set_layer(stacked: jax.Array, x: jax.Array, i: jax.Array) -> jax.Array:
    return jax.lax.dynamic_update_index_in_dim(stacked, x.astype(stacked.dtype), i, 0)


def device_stack(pieces, shape: tuple[int, ...], dtype, sharding) -> jax.Array:
    """Stack host arrays into one device array [L, ...] a piece at a time, in place (the
    stacked leaf is never on the host, nor twice on the device)."""
    stacked = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()
    for i, x in enumerate(pieces):
        stacked = _set_layer(stacked, jax.device_put(x), jnp.int32(i))
        # One piece in flight at a time: dispatch is asynchronous, and a reader faster than
        # the device would otherwise queue many pieces' host buffers at once (the peak then
        # depends on the machine's timing).
        stacked.block_until_ready()
    return stacked


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    single = folder / "model.safetensors"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise ModelLoadError(f"{index} is not a valid safetensors index ({e}).") from e
        files = [folder / f for f in dict.fromkeys(weight_map.values())]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ModelLoadError(f"{index} lists shards that are missing: {absent}. Download "
                                 "the complete model folder.")
        return files
    if single.is_file():
        return [single]
    found = sorted(p.name for p in folder.glob("*.bin")) + sorted(
        p.name for p in folder.glob("*.safetensors"))
    hint = (f" Found {found}: convert them with transformers "
            "(`model.save_pretrained(dir, safe_serialization=True)`)." if found else "")
    raise ModelLoadError(f"{folder} has no model.safetensors or model.safetensors.index.json."
                         + hint)


def _expected_hf_shapes(cfg: ModelConfig, tensors: dict[str, str]) -> dict[str, tuple[int, ...]]:
    """Hugging Face shape of every tensor we read, from our (input-major) shapes."""
    shapes = param_shapes(cfg)
    out = {}
    for name, key in GLOBAL_TENSORS.items():
        if shapes.weight(key) is not None:
            shape = shapes.weight(key).shape
            out[name] = tuple(reversed(shape)) if key == "lm_head" else shape
    for i in range(cfg.n_layers):
        for suffix, key in tensors.items():
            out[f"model.layers.{i}.{suffix}"] = tuple(reversed(shapes.weight(key).shape[1:]))
    return out


def load_hf(folder: str | os.PathLike, dtype: str = "float32",
            placement: Callable[[ModelConfig], Placer] | None = None
            ) -> tuple[ModelConfig, Params]:
    """Read a Hugging Face folder of a supported family (`FAMILIES`): `config.json` plus
    `model.safetensors` or a sharded `model.safetensors.index.json`. Returns the config and
    the checked param tree.

    Weights go to the target dtype tensor by tensor and to the device one parameter leaf at a
    time, layer by layer into its stacked device array (`placement(cfg)(path, ndim)` names
    the leaf's sharding: `sharding.placement` puts each leaf straight on its shards), so the
    host never holds the whole model, nor anything in f32 beyond one tensor."""
    from safetensors import safe_open

    folder = Path(folder)
    if not folder.is_dir():
        raise ModelLoadError(f"Hugging Face model folder not found: {folder}. Pass a folder "
                             "holding config.json and model.safetensors.")
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{folder} has no config.json; a Hugging Face model folder needs "
                             "config.json next to its safetensors files.")
    try:
        config = json.loads(config_path.read_text())
    except ValueError as e:
        raise ModelLoadError(f"{config_path} is not valid JSON: {e}") from e
    cfg = config_from_hf(config, source=str(config_path), dtype=dtype, name=folder.name)
    family = family_of(config)
    tensors = layer_tensors(family)
    expected = _expected_hf_shapes(cfg, tensors)
    shapes = param_shapes(cfg)
    L = cfg.n_layers
    target = np.dtype(cfg.jnp_dtype)
    where_to = placement(cfg) if placement else (lambda _path, _ndim: None)

    where: dict[str, Any] = {}  # tensor name -> open file handle
    unexpected, misshaped = [], []
    with contextlib.ExitStack() as stack:
        for file in _weight_files(folder):
            try:
                handle = stack.enter_context(safe_open(str(file), framework="numpy"))
            except Exception as e:
                raise ModelLoadError(f"{file} is not a readable safetensors file ({e}). "
                                     "Download it again.") from e
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                if name.endswith(IGNORED_SUFFIXES) or (name == "lm_head.weight"
                                                       and cfg.tie_embeddings):
                    continue
                if name not in expected:
                    unexpected.append(name)
                    continue
                shape = tuple(handle.get_slice(name).get_shape())
                if shape != expected[name]:
                    misshaped.append(f"{name} has shape {list(shape)}, config.json implies "
                                     f"{list(expected[name])}")
                where[name] = handle
        if misshaped:
            raise ParamsMismatchError(f"{folder}: weights disagree with {config_path.name}: "
                                      + "; ".join(misshaped[:8]))
        if unexpected:
            raise UnsupportedModelError(
                f"{folder} has tensors a {family} model does not use: {unexpected[:8]}"
                f"{' ...' if len(unexpected) > 8 else ''} (biases, extra layers, another "
                f"variant?).")
        missing = [n for n in expected if n not in where]
        if missing:
            raise ParamsMismatchError(f"{folder}: tensors missing from the safetensors files: "
                                      f"{missing[:8]}{' ...' if len(missing) > 8 else ''}.")

        def read(name: str, transpose: bool) -> np.ndarray:  # one tensor, target dtype
            w = where[name].get_tensor(name)
            return np.ascontiguousarray((w.T if transpose else w).astype(target, copy=False))

        tree: dict[str, Any] = {"layers": {}}  # the nested-dict form, checked once below
        for name, key in GLOBAL_TENSORS.items():
            if name in where:  # HF's lm_head is [V, D]: ours is input-major [D, V]
                a = read(name, name == "lm_head.weight")
                tree[key] = jax.device_put(a, where_to((key,), a.ndim))
        for suffix, key in tensors.items():
            shape = (L, *shapes.weight(key).shape[1:])
            pieces = (read(f"model.layers.{i}.{suffix}", len(shape) == 3) for i in range(L))
            tree["layers"][key] = device_stack(pieces, shape, target,
                                               where_to(("layers", key), len(shape)))
    return cfg, check_params(cfg, tree, source=str(folder))


def save_hf(folder: str | os.PathLike, cfg: ModelConfig, params: Params) -> Path:
    """Write a Llama-family model as a Hugging Face folder (config.json + model.safetensors),
    the inverse of `load_hf` through the same tensor names: what `ee-jax convert` writes, and
    what ee-jax and transformers both load. Weights keep their dtype."""
    plain = (not cfg.qkv_bias and not cfg.qk_norm and not cfg.post_norms and not cfg.embed_scale
             and cfg.norm_offset == 0 and cfg.activation == "silu" and cfg.sliding_window is None
             and cfg.rope_scaling is None and cfg.final_logit_softcap is None)
    if not plain:
        raise UnsupportedModelError(f"save_hf writes plain Llama models; {cfg.name} has "
                                    f"options of another family (biases, extra norms, windows, "
                                    f"RoPE scaling): save it with checkpoint.save_checkpoint")
    params = check_params(cfg, params, source=cfg.name)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    host = lambda a: np.asarray(jax.device_get(a))  # noqa: E731
    tensors: dict[str, np.ndarray] = {}
    for name, key in GLOBAL_TENSORS.items():
        if params.weight(key) is not None:
            a = host(params.weight(key))
            tensors[name] = np.ascontiguousarray(a.T if key == "lm_head" else a)
    for suffix, key in LAYER_TENSORS.items():
        stacked = host(params.weight(key))
        for i in range(cfg.n_layers):
            a = stacked[i]
            tensors[f"model.layers.{i}.{suffix}"] = np.ascontiguousarray(a.T if a.ndim == 2
                                                                         else a)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": cfg.d_model, "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_eps, "rope_theta": cfg.rope_theta, "hidden_act": "silu",
        "tie_word_embeddings": cfg.tie_embeddings, "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position, "torch_dtype": cfg.dtype,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_ids) if cfg.eos_token_ids else None,
        "attention_bias": False, "mlp_bias": False}
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder
