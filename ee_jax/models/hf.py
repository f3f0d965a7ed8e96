"""Load a Hugging Face Llama/Mistral folder (`config.json` + safetensors) into our tree.

Hugging Face Linear weights are `[out, in]`; ours are input-major `[in, out]`, so every
projection and the untied LM head are transposed. Q/K rows need no permutation: Hugging Face
already uses the rotate-half RoPE that `ee_jax.models.llama.apply_rope` implements.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy: safetensors' numpy reader needs it)
import numpy as np

from ee_jax.errors import ModelLoadError, UnsupportedModelError
from ee_jax.models.config import ConfigError, ModelConfig, RopeScaling
from ee_jax.models.llama import Params, ParamsMismatchError, check_params, param_shapes

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
SUPPORTED_MODEL_TYPES = ("llama", "mistral")

# Hugging Face per-layer tensor (after "model.layers.{i}.") -> our key under params["layers"].
LAYER_TENSORS = {
    "input_layernorm.weight": "attn_norm",
    "self_attn.q_proj.weight": "wq",
    "self_attn.k_proj.weight": "wk",
    "self_attn.v_proj.weight": "wv",
    "self_attn.o_proj.weight": "wo",
    "post_attention_layernorm.weight": "mlp_norm",
    "mlp.gate_proj.weight": "w_gate",
    "mlp.up_proj.weight": "w_up",
    "mlp.down_proj.weight": "w_down",
}
GLOBAL_TENSORS = {
    "model.embed_tokens.weight": "embed",
    "model.norm.weight": "final_norm",
    "lm_head.weight": "lm_head",
}
# Buffers some older checkpoints saved; recomputed from the config, so ignored.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


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


def config_from_hf(config: dict[str, Any], *, source: str = "config.json",
                   dtype: str = "float32", name: str | None = None) -> ModelConfig:
    """A `ModelConfig` from a Llama/Mistral `config.json` dict. `source` names it in errors.

    Mistral's sliding window only changes attention beyond the window, so a window shorter
    than `max_position_embeddings` caps `max_position` at the window instead of failing.
    """
    archs = config.get("architectures") or []
    model_type = config.get("model_type")
    if not (set(archs) & set(SUPPORTED_ARCHITECTURES)) and not (
            not archs and model_type in SUPPORTED_MODEL_TYPES):
        raise UnsupportedModelError(
            f"{source}: architecture {archs or model_type!r} is not supported; ee-jax loads "
            f"{' / '.join(SUPPORTED_ARCHITECTURES)} checkpoints.")
    for flag in ("attention_bias", "mlp_bias"):
        if config.get(flag):
            raise UnsupportedModelError(f"{source}: {flag}=true is not supported (ee-jax "
                                        "implements bias-free Llama projections).")
    if config.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"{source}: hidden_act {config['hidden_act']!r} is not "
                                    "supported (SwiGLU with silu only).")
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
    max_position = int(config.get("max_position_embeddings", 8192))
    window = config.get("sliding_window") if config.get("use_sliding_window", True) else None
    if window:
        max_position = min(max_position, int(window))
    eos = config.get("eos_token_id")
    eos = () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
    bos = config.get("bos_token_id")
    try:
        return ModelConfig(
            vocab_size=vocab, d_model=d, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv,
            head_dim=head_dim, ffn_dim=ffn, rms_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=theta, rope_scaling=scaling,
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            max_position=max_position, dtype=dtype,
            bos_token_id=None if bos is None else int(bos), eos_token_ids=eos,
            name=str(name or config.get("_name_or_path") or model_type or "llama"),
        )
    except ConfigError as e:
        raise ModelLoadError(f"{source} does not describe a valid model: {e}") from e


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


def _expected_hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face shape of every tensor we read, from our (input-major) shapes."""
    shapes = param_shapes(cfg)
    out = {}
    for name, key in GLOBAL_TENSORS.items():
        if key in shapes:
            shape = shapes[key].shape
            out[name] = tuple(reversed(shape)) if key == "lm_head" else shape
    for i in range(cfg.n_layers):
        for suffix, key in LAYER_TENSORS.items():
            out[f"model.layers.{i}.{suffix}"] = tuple(reversed(shapes["layers"][key].shape[1:]))
    return out


def load_hf(folder: str | os.PathLike, dtype: str = "float32") -> tuple[ModelConfig, Params]:
    """Read a Hugging Face Llama/Mistral folder: `config.json` plus `model.safetensors` or a
    sharded `model.safetensors.index.json`. Returns the config and the checked param tree."""
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
    expected = _expected_hf_shapes(cfg)
    shapes = param_shapes(cfg)
    L = cfg.n_layers

    layers = {key: np.empty((L, *shapes["layers"][key].shape[1:]), np.float32)
              for key in LAYER_TENSORS.values()}
    out: dict[str, np.ndarray] = {}
    seen, unexpected, misshaped = set(), [], []
    for file in _weight_files(folder):
        try:
            handle = safe_open(str(file), framework="numpy")
        except Exception as e:
            raise ModelLoadError(f"{file} is not a readable safetensors file ({e}). Download "
                                 "it again.") from e
        with handle as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if name.endswith(IGNORED_SUFFIXES) or (name == "lm_head.weight"
                                                       and cfg.tie_embeddings):
                    continue
                if name not in expected:
                    unexpected.append(name)
                    continue
                shape = tuple(f.get_slice(name).get_shape())
                if shape != expected[name]:
                    misshaped.append(f"{name} has shape {list(shape)}, config.json implies "
                                     f"{list(expected[name])}")
                    seen.add(name)
                    continue
                seen.add(name)
                w = np.asarray(f.get_tensor(name), dtype=np.float32)
                if name in GLOBAL_TENSORS:
                    out[GLOBAL_TENSORS[name]] = w.T if name == "lm_head.weight" else w
                else:
                    _, _, i, suffix = name.split(".", 3)
                    layers[LAYER_TENSORS[suffix]][int(i)] = w.T if w.ndim == 2 else w

    if misshaped:
        raise ParamsMismatchError(f"{folder}: weights disagree with {config_path.name}: "
                                  + "; ".join(misshaped[:8]))
    if unexpected:
        raise UnsupportedModelError(
            f"{folder} has tensors a plain Llama model does not use: {unexpected[:8]}"
            f"{' ...' if len(unexpected) > 8 else ''} (biases, extra layers, another variant?).")
    missing = [n for n in expected if n not in seen]
    if missing:
        raise ParamsMismatchError(f"{folder}: tensors missing from the safetensors files: "
                                  f"{missing[:8]}{' ...' if len(missing) > 8 else ''}.")
    dt = cfg.jnp_dtype
    params: Params = {k: jnp.asarray(v, dt) for k, v in out.items()}
    params["layers"] = {k: jnp.asarray(v, dt) for k, v in layers.items()}
    check_params(cfg, params, source=str(folder))
    return cfg, params
