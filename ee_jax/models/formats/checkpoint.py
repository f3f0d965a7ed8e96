"""Orbax checkpoints of a model's parameters, its `ModelConfig`, and extra trees (exit heads).

Layout of a checkpoint folder:

    ee_jax_checkpoint.json   format tag, the ModelConfig, the structure of every extra tree
    state/                   one orbax StandardCheckpointer item: {"params": ..., "extra": ...}

The params are saved in their nested-dict form (`Params.to_dict`: {"layers": {"wq": ...},
"embed": ...}), the layout checkpoints have always had, and restored into `Params`.

The JSON file is written last, so a folder without it is an incomplete save. Restoring builds
the abstract tree from the stored config (`param_shapes`) and the stored extra structures, and
checks the saved arrays against it, so a shape or dtype that disagrees fails instead of being
silently cast.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from ee_jax.errors import ModelLoadError
from ee_jax.models import quant
from ee_jax.models.config import ConfigError, ModelConfig, RopeScaling
from ee_jax.models.llama import (
    Params,
    ParamsMismatchError,
    check_params,
    param_shapes,
    per_layer,
)

MARKER = "ee_jax_checkpoint.json"
FORMAT = "ee-jax-checkpoint"
VERSION = 1
STATE = "state"


def config_to_dict(cfg: ModelConfig) -> dict[str, Any]:
    d = dataclasses.asdict(cfg)
    d["eos_token_ids"] = list(cfg.eos_token_ids)
    return d


def config_from_dict(d: dict[str, Any]) -> ModelConfig:
    d = dict(d)
    if d.get("rope_scaling") is not None:
        d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
    d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
    return ModelConfig(**d)


# --------------------------------------------------------------------------- tree structure


def tree_spec(tree: Any) -> Any:
    """A JSON description of a tree of dicts / lists / tuples with array leaves."""
    if isinstance(tree, dict):
        if not all(isinstance(k, str) for k in tree):
            raise TypeError(f"checkpoint trees need str dict keys, got {list(tree)}")
        return {"dict": {k: tree_spec(v) for k, v in tree.items()}}
    if isinstance(tree, list | tuple):
        return {type(tree).__name__: [tree_spec(v) for v in tree]}
    if hasattr(tree, "shape") and hasattr(tree, "dtype"):
        return {"shape": [int(s) for s in tree.shape], "dtype": jnp.dtype(tree.dtype).name}
    raise TypeError(f"checkpoint trees hold dicts, lists, tuples and arrays; got "
                    f"{type(tree).__name__}")


def abstract_from_spec(spec: Any, sharding=None) -> Any:
    """The `jax.ShapeDtypeStruct` tree a `tree_spec` describes."""
    if "dict" in spec:
        return {k: abstract_from_spec(v, sharding) for k, v in spec["dict"].items()}
    if "list" in spec:
        return [abstract_from_spec(v, sharding) for v in spec["list"]]
    if "tuple" in spec:
        return tuple(abstract_from_spec(v, sharding) for v in spec["tuple"])
    return jax.ShapeDtypeStruct(tuple(spec["shape"]), jnp.dtype(spec["dtype"]), sharding=sharding)


# --------------------------------------------------------------------------- save / restore


def _check_dtypes(cfg: ModelConfig, params: Params) -> None:
    wrong = sorted({jnp.dtype(leaf.dtype).name for leaf in jax.tree.leaves(params)}
                   - {cfg.dtype})
    if wrong:
        raise ParamsMismatchError(
            f"params hold dtype(s) {wrong} but the config says {cfg.dtype!r}: cast them "
            f"(ee_jax.models.llama.cast_params) or save with cfg.replace(dtype=...).")


def save_checkpoint(path: str | os.PathLike, cfg: ModelConfig, params: Params,
                    extra: dict[str, Any] | None = None, *, overwrite: bool = False) -> Path:
    """Save `params` (checked against `cfg`) and named `extra` trees to the folder `path`.

    `overwrite` replaces an existing ee-jax checkpoint there; any other non-empty folder is
    refused. Returns the absolute path. Packed weights (a GGUF's blocks, int8) are saved
    dequantized to the config's dtype: a checkpoint holds plain arrays.
    """
    import orbax.checkpoint as ocp


    path = Path(path).absolute()
    params = check_params(cfg, params, source="params to save")
    if per_layer(params):  # saved stacked, as restored
        params = params.replace(layers=jax.tree.map(lambda *a: jnp.stack(a), *params.layers))
    params = quant.dequantize_params(params, cfg.jnp_dtype)
    _check_dtypes(cfg, params)
    extra = dict(extra or {})
    spec = {name: tree_spec(tree) for name, tree in extra.items()}
    if path.exists() and any(path.iterdir()):
        if not (overwrite and (path / MARKER).is_file()):
            raise FileExistsError(
                f"{path} is not empty; pass overwrite=True to replace an ee-jax checkpoint"
                if (path / MARKER).is_file() else
                f"{path} is not empty and is not an ee-jax checkpoint; choose another folder")
        shutil.rmtree(path)
    path.mkdir(parents=True, exist_ok=True)
    state: dict[str, Any] = {"params": params.to_dict()}
    if extra:
        state["extra"] = extra
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path / STATE, state)
        ckptr.wait_until_finished()
    meta = {"format": FORMAT, "version": VERSION, "config": config_to_dict(cfg), "extra": spec}
    (path / MARKER).write_text(json.dumps(meta, indent=2) + "\n")
    return path


def is_checkpoint(path: str | os.PathLike) -> bool:
    return (Path(path) / MARKER).is_file()


def _stored_metadata(ckptr, directory: Path) -> dict[str, tuple[tuple[int, ...], str]] | None:
    """Stored shape/dtype per leaf path, or None if this orbax version does not expose it."""
    try:
        meta = ckptr.metadata(directory)
        meta = getattr(meta, "item_metadata", meta)
        meta = getattr(meta, "tree", meta)
        leaves = jax.tree_util.tree_leaves_with_path(
            meta, is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"))
        return {jax.tree_util.keystr(p): (tuple(x.shape), jnp.dtype(x.dtype).name)
                for p, x in leaves}
    except Exception:
        return None


def restore_checkpoint(path: str | os.PathLike) -> tuple[ModelConfig, Params, dict[str, Any]]:
    """Load a folder written by `save_checkpoint`: (config, params, extra trees)."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    marker = path / MARKER
    if not marker.is_file():
        what = "does not exist" if not path.exists() else f"has no {MARKER}"
        raise ModelLoadError(f"{path} {what}: not an ee-jax checkpoint (or its save did not "
                             "finish). Write one with "
                             "ee_jax.models.formats.checkpoint.save_checkpoint.")
    try:
        meta = json.loads(marker.read_text())
        if meta.get("format") != FORMAT or meta.get("version") != VERSION:
            raise ModelLoadError(f"{marker}: format {meta.get('format')!r} version "
                                 f"{meta.get('version')!r}; this ee-jax reads {FORMAT} "
                                 f"version {VERSION}.")
        cfg = config_from_dict(meta["config"])
        extra_spec = meta.get("extra") or {}
    except (ValueError, KeyError, TypeError, ConfigError) as e:
        if isinstance(e, ModelLoadError):
            raise
        raise ModelLoadError(f"{marker} is damaged ({type(e).__name__}: {e}).") from e

    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract: dict[str, Any] = {
        "params": jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype,
                                                              sharding=sharding),
                               param_shapes(cfg).to_dict())}
    if extra_spec:
        abstract["extra"] = {k: abstract_from_spec(v, sharding) for k, v in extra_spec.items()}

    with ocp.StandardCheckpointer() as ckptr:
        stored = _stored_metadata(ckptr, path / STATE)
        if stored is not None:
            want = {jax.tree_util.keystr(p): (tuple(x.shape), jnp.dtype(x.dtype).name)
                    for p, x in jax.tree_util.tree_leaves_with_path(abstract)}
            problems = [f"{k}: stored {stored.get(k)}, expected {v}"
                        for k, v in want.items() if stored.get(k) != v]
            problems += [f"{k}: stored but not described by {MARKER}"
                         for k in stored.keys() - want.keys()]
            if problems:
                raise ParamsMismatchError(f"{path}: arrays disagree with the stored config: "
                                          + "; ".join(problems[:8]))
        try:
            state = ckptr.restore(path / STATE, abstract)
        except Exception as e:
            raise ModelLoadError(f"{path / STATE} could not be restored ({type(e).__name__}: "
                                 f"{e}).") from e
    params = check_params(cfg, state["params"], source=str(path))
    return cfg, params, dict(state.get("extra", {}))
