"""Exit heads on disk: the heads tree in safetensors plus the ExitConfig as JSON.

    <folder>/exit_config.json   the ExitConfig and the model it was trained for
    <folder>/heads.safetensors  the heads' leaves, one tensor per path ("mlp.down", "norm")
    <folder>/backfill_maps.safetensors
                                (optional) learned back-fill maps (`backfill_maps`)
    <folder>/calibration.json   (optional) errors per threshold on a held-apart split, so a
                                threshold can be picked for any target agreement at load
                                (`ee_jax.models.exits.threshold`)
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from ee_jax.errors import ModelLoadError
from ee_jax.models import safetensors_io
from ee_jax.models.config import ModelConfig
from ee_jax.models.exits import backfill_maps
from ee_jax.models.exits import heads as exit_heads
from ee_jax.models.exits.config import ExitConfig, ExitConfigError
from ee_jax.models.exits.threshold import check_target, exit_prior, threshold_from_json

CONFIG = "exit_config.json"
CALIBRATION = "calibration.json"
HEADS = "heads.safetensors"
# Heads saved before safetensors: an orbax StandardCheckpointer item, still read (orbax is
# imported only then; serving the shipped heads imports no orbax, which costs 0.6 s).
ORBAX_HEADS = "heads"


def _model_id(cfg: ModelConfig) -> dict:
    return {"n_layers": cfg.n_layers, "d_model": cfg.d_model, "vocab_size": cfg.vocab_size}


def save_exit_heads(path, cfg: ModelConfig, ec: ExitConfig, heads, *,
                    overwrite: bool = True, calibration: dict | None = None,
                    maps_info: dict | None = None) -> Path:
    """Write heads (and their learned back-fill maps, `ExitHeads.backfill`, with `maps_info`:
    how they were fitted) and the ExitConfig to folder `path`."""
    heads = exit_heads.check_heads(cfg, ec, heads)
    maps = heads.backfill
    heads = exit_heads.without_derived(heads)  # LM-head rows held for serving are not saved
    path = Path(path).absolute()
    if path.exists():
        if not overwrite:
            raise FileExistsError(f"{path} exists; pass overwrite=True to replace it")
        shutil.rmtree(path)
    path.mkdir(parents=True)
    write_heads(path, heads)
    meta = {"exit_config": dataclasses.asdict(ec), "model": _model_id(cfg)}
    if maps is not None:  # learned back-fill maps: their own file, recorded here
        backfill_maps.save_maps(path, cfg, ec.exit_layers, maps, info=maps_info)
        meta["backfill_maps"] = {"file": backfill_maps.FILE,
                                 "rank": backfill_maps.rank_of(maps), **(maps_info or {})}
    (path / CONFIG).write_text(json.dumps(meta, indent=2) + "\n")
    if calibration is not None:
        (path / CALIBRATION).write_text(json.dumps(calibration, indent=1) + "\n")
    return path


def load_exit_heads(path, cfg: ModelConfig, exit_layers: tuple[int, ...] | None = None,
                    target_agreement: float | None = None
                    ) -> tuple[ExitConfig, exit_heads.ExitHeads]:
    """Restore heads for `cfg`; fails clearly if they were made for another model, or for
    other exit layers than `exit_layers` (when the caller asks for specific ones). With
    `target_agreement`, the threshold is re-picked from the shipped calibration table."""
    path = Path(path).absolute()
    if not (path / CONFIG).is_file():
        raise ModelLoadError(f"{path} holds no exit heads ({CONFIG} missing); save them with "
                             f"ee_jax.models.exits.checkpoint.save_exit_heads")
    meta = json.loads((path / CONFIG).read_text())
    if meta["model"] != _model_id(cfg):
        raise ExitConfigError(
            f"exit heads in {path} were made for a model with {meta['model']}, not "
            f"{_model_id(cfg)}")
    d = meta["exit_config"]
    d["exit_layers"] = tuple(d["exit_layers"])
    if exit_layers is not None and tuple(exit_layers) != d["exit_layers"]:
        raise ExitConfigError(
            f"exit heads in {path} were trained for exit layers {list(d['exit_layers'])}, not "
            f"{list(exit_layers)}: use those exit layers, or tune heads for yours "
            f"(ee-jax tune)")
    ec = ExitConfig(**d)
    ec.validate_for(cfg)
    if target_agreement is not None:
        check_target(target_agreement)
        if not (path / CALIBRATION).is_file():
            raise ExitConfigError(
                f"exit heads in {path} have no {CALIBRATION}: they cannot pick a threshold "
                f"for target agreement {target_agreement}; set a threshold instead")
        cal = json.loads((path / CALIBRATION).read_text())
        thr = threshold_from_json(cal, target_agreement)
        ec = dataclasses.replace(ec, threshold=thr, target_agreement=target_agreement)
    heads = read_heads(path, exit_heads.head_shapes(cfg, ec))
    if (path / backfill_maps.FILE).is_file():  # fitted maps ship beside the heads
        heads = heads.replace(backfill=backfill_maps.load_maps(path, cfg, ec.exit_layers)[0])
    heads = exit_heads.check_heads(cfg, ec, heads)
    if heads.vocab is not None:
        exit_heads.check_vocab_subset(np.asarray(heads.vocab), cfg.vocab_size)
    return ec, jax.tree.map(lambda a: a, heads)


def _key(path) -> str:
    """A leaf's tensor name: its part and key ("mlp.down", "norm")."""
    return ".".join(str(getattr(k, "name", None) or k.key) for k in path)


def write_heads(folder: Path, heads) -> Path:
    """The heads' leaves to folder/HEADS, keyed by their tree path, in their own dtypes."""
    tensors = {_key(p): np.asarray(a) for p, a in jax.tree_util.tree_leaves_with_path(heads)}
    return safetensors_io.save_file(tensors, Path(folder) / HEADS)


def read_heads(folder: Path, target: exit_heads.ExitHeads) -> exit_heads.ExitHeads:
    """Heads shaped like `target` (`exit_heads.head_shapes`) from folder/HEADS, or from an
    orbax item folder/ORBAX_HEADS written before; a clear error naming a missing, extra or
    misshapen leaf."""
    file = Path(folder) / HEADS
    if not file.is_file():
        if (Path(folder) / ORBAX_HEADS).is_dir():
            import orbax.checkpoint as ocp

            with ocp.StandardCheckpointer() as ckptr:
                return exit_heads.ExitHeads.from_parts(
                    ckptr.restore(Path(folder) / ORBAX_HEADS, target.as_dicts()))
        raise ModelLoadError(f"{folder} holds no exit heads ({HEADS} missing); save them with "
                             f"ee_jax.models.exits.checkpoint.save_exit_heads")
    import ml_dtypes  # noqa: F401  (bfloat16 for safetensors' numpy reader)
    from safetensors import safe_open

    with safe_open(str(file), "numpy") as f:
        stored = set(f.keys())
        want = {_key(p): s for p, s in jax.tree_util.tree_leaves_with_path(target)}
        if stored != set(want):
            raise ExitConfigError(
                f"exit heads in {file} hold leaves {sorted(stored)}, but {CONFIG} needs "
                f"{sorted(want)}: missing {sorted(set(want) - stored)}, extra "
                f"{sorted(stored - set(want))}; save heads and config together "
                f"(save_exit_heads)")
        leaves = {}
        for k, s in want.items():
            a = f.get_tensor(k)
            if a.shape != s.shape:
                raise ExitConfigError(f"exit head leaf {k!r} in {file} has shape {a.shape}, "
                                      f"but {CONFIG} needs {s.shape}")
            leaves[k] = jnp.asarray(a, s.dtype)
    return jax.tree_util.tree_map_with_path(lambda p, _: leaves[_key(p)], target)


def load_exit_prior(path, cfg: ModelConfig, ec: ExitConfig) -> tuple[tuple[int, float], ...]:
    """The exit layers the heads in `path` are expected to give at `ec.threshold`, from their
    calibration.json (`exit_threshold.exit_prior`; measured under the table's back-fill, a
    first guess the exit controller corrects by observing); () without a table or a row at
    that threshold."""
    file = Path(path) / CALIBRATION
    if not file.is_file():
        return ()
    return exit_prior(json.loads(file.read_text()), ec.threshold, cfg.n_layers)
