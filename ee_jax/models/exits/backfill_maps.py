"""Learned back-fill maps (ExitConfig.backfill "learned"): fitted corrections that
bring the K/V a skipped layer gets from a token's exit state close to what full depth writes.

Propagate back-fill writes, for a token that left after e layers, `kv_project(layer j, h_e)`
for every skipped layer j >= e. Layer e's input *is* h_e, so that entry is exact; above it
the input to layer j would have been h_j, not h_e, and the K/V are off (on SmolLM2 relative
error 0.2-0.8 on K and 0.5-1.6 on V, docs/early_exit.md). A learned map adds, per exit slot s
and skipped layer j > e_s, a rank-r linear correction of the *pre-RoPE* K/V, read from the
normalised exit state:

    n      = h_e / rms(h_e), with a 1 appended                        [..., D + 1]
    dk, dv = split(n @ a[s, j] @ b[s, j])                             [..., K*hd] each
    K_j    = kv_project(layer j, h_e).k + RoPE(dk),   V_j = ... .v + dv

RoPE is linear, so rotating the correction and adding it equals correcting before the
rotation; a zero map (layer e itself, and the identity maps) adds exactly zero: "learned"
with zero maps writes propagate's K/V bit for bit. The maps are a pytree beside the heads:

    a  [X, L - first, D + 1, r]    b  [X, L - first, r, 2 * K * hd]

X = len(exit_layers), first = exit_layers[0]; the slot of layer j is j - first. Entries with
j <= e_s are never used and held at zero. On disk (`save_maps`) only the used pairs are
stored, in bf16 (safetensors, with the model, exit layers and rank in its metadata); in
memory they stay bf16 (`MAP_DTYPE`), the correction computing in f32.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ee_jax.errors import EEJaxError
from ee_jax.models import llama, safetensors_io
from ee_jax.models.config import ModelConfig

FILE = "backfill_maps.safetensors"
# The maps in memory: bf16, as on disk (the correction computes in f32 from them, so a served
# map is the saved one exactly, in half the bytes a step's gather or read moves).
MAP_DTYPE = jnp.bfloat16
DEFAULT_RANK = 48  # what `ee-jax tune` fits (TuneConfig.backfill_rank) and AOT plans with


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Maps:
    """The fitted maps (module docstring); a mapping with keys "a" and "b" converts
    (`as_maps`), as heads given as mappings do."""

    a: Any  # [X, L - first, D + 1, r]
    b: Any  # [X, L - first, r, 2 * K * hd]

    def replace(self, **leaves) -> Maps:
        return dataclasses.replace(self, **leaves)


LEAVES = tuple(f.name for f in dataclasses.fields(Maps))


class BackfillMapsError(EEJaxError, ValueError):
    """Back-fill maps that do not fit this model or these exits."""


def kv_dim(cfg: ModelConfig) -> int:
    return cfg.n_kv_heads * cfg.head_dim


def map_shapes(cfg: ModelConfig, exit_layers: tuple[int, ...], rank: int
               ) -> dict[str, jax.ShapeDtypeStruct]:
    """The abstract maps tree for these exits (`MAP_DTYPE` in memory)."""
    if not exit_layers:
        raise BackfillMapsError("back-fill maps need at least one exit layer")
    X, span = len(exit_layers), cfg.n_layers - exit_layers[0]
    return Maps(a=jax.ShapeDtypeStruct((X, span, cfg.d_model + 1, rank), MAP_DTYPE),
                b=jax.ShapeDtypeStruct((X, span, rank, 2 * kv_dim(cfg)), MAP_DTYPE))


def zero_maps(cfg: ModelConfig, exit_layers: tuple[int, ...], rank: int = 1) -> Maps:
    """Maps that correct nothing: "learned" back-fill with them is propagate, bit for bit."""
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), map_shapes(cfg, exit_layers, rank))


def as_maps(maps: Maps | Mapping[str, Any]) -> Maps:
    """maps as `Maps` (a mapping of "a" and "b" converted), or BackfillMapsError naming what
    it holds instead."""
    if isinstance(maps, Maps):
        return maps
    if isinstance(maps, Mapping) and set(maps) == set(LEAVES):
        return Maps(**maps)
    got = sorted(maps) if isinstance(maps, Mapping) else type(maps).__name__
    raise BackfillMapsError(f"back-fill maps are a Maps (or a mapping) with leaves 'a' and "
                            f"'b', got {got}")


def rank_of(maps: Maps) -> int:
    return int(np.shape(maps.a)[-1])


def used(exit_layers: tuple[int, ...], n_layers: int) -> list[tuple[int, int]]:
    """(exit slot, layer) pairs a map corrects: every skipped layer above the exit's own."""
    return [(s, j) for s, e in enumerate(exit_layers) for j in range(e + 1, n_layers)]


def check_maps(cfg: ModelConfig, exit_layers: tuple[int, ...], maps: Maps) -> None:
    """Raise BackfillMapsError naming the mismatch unless `maps` fit these exits and model."""
    maps = as_maps(maps)
    r = rank_of(maps)
    want = map_shapes(cfg, exit_layers, r)
    for k in LEAVES:
        s, got = getattr(want, k), tuple(np.shape(getattr(maps, k)))
        if got != s.shape:
            raise BackfillMapsError(
                f"back-fill map {k!r} has shape {got}, but exit layers "
                f"{list(exit_layers)} on this model (L={cfg.n_layers}, d_model={cfg.d_model}, "
                f"K/V width {kv_dim(cfg)}) at rank {r} need {s.shape}: fit maps for these "
                f"exits (ee-jax tune) or serve back-fill 'propagate'")


def normed_input(h: jax.Array, cfg: ModelConfig) -> jax.Array:
    """[..., D] -> [..., D + 1] f32: h / rms(h) and a constant 1 (the maps' regressors)."""
    h = h.astype(jnp.float32)
    n = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + cfg.rms_eps)
    return jnp.concatenate([n, jnp.ones((*n.shape[:-1], 1), n.dtype)], axis=-1)


# On TPU a per-row gather of the maps ([B, J, D+1, r], the rank's 48 padded to 128 lanes)
# moved 5-7x its bytes at batch >= 8 (SmolLM2, v5e, maps in f32: 154 MB for 21 MB of maps at
# batch 8, bench/roofline.py's pieces); every slot's correction, then each row's pick, reads
# each map once (51 MB at batch 8, 89 at 32: more flops, which a TPU has to spare). Elsewhere
# the gather is the cheaper one (CPU: compute-bound at batch 8; H100: 11 MB at batch 8, the
# rows' maps by hand 10.5).
TPU_GATHER_MAX_ROWS = 4


def gathers(platform: str, rows: int) -> bool:
    """Whether `kv_correction` gathers each row's maps (else: every slot, then a pick) on
    `platform` ("tpu", "gpu"/"cuda", "cpu") for a step of `rows` rows."""
    return platform != "tpu" or rows <= TPU_GATHER_MAX_ROWS


def _correction(maps: Maps, slots: jax.Array, n: jax.Array, gather: bool = True) -> jax.Array:
    """[J, B, T, 2KV] f32: each row's correction from its normed input n [B, T, D+1] and exit
    slot [B] (< 0: zeros). gather (static): the rows' maps are gathered ([B, J, D+1, r]: at
    batch 8 on CPU this copy costs about a fifth of the step, hence `kv_correction` passes
    only the rows that left); else every slot's correction is computed and each row picks
    its own (`gathers`)."""
    live = slots >= 0
    s = jnp.where(live, slots, 0)
    if gather:
        a, b = maps.a[s], maps.b[s]  # [B, J, D+1, r], [B, J, r, 2KV]
        z = jnp.einsum("btd,bjdr->jbtr", n, a.astype(jnp.float32))
        c = jnp.einsum("jbtr,bjro->jbto", z, b.astype(jnp.float32))  # [J, B, T, 2KV]
    else:
        z = jnp.einsum("btd,xjdr->xjbtr", n, maps.a.astype(jnp.float32))
        c = jnp.einsum("xjbtr,xjro->xjbto", z, maps.b.astype(jnp.float32))  # [X, J, B, T, O]
        c = jnp.moveaxis(c[s, :, jnp.arange(s.shape[0])], 0, 1)  # each row's slot: [J, B, T, O]
    return jnp.where(live[None, :, None, None], c, 0.0)


def kv_correction(maps: Maps, slots: jax.Array, h: jax.Array, positions: jax.Array,
                  cfg: ModelConfig, gather: bool = True) -> tuple[jax.Array, jax.Array]:
    """(dk with RoPE, dv), each [L - first, B, T, K, hd] in f32, for rows whose exit slot is
    `slots` [B] (int32; rows with slot < 0 get zero). h: [B, T, D]; positions: [B, T].

    gather (static, `gathers`): at B >= 2 only the rows that left are corrected (a static
    half of the batch, the leaving rows moved first; all B rows when more left): the same
    values, without gathering maps for rows that stay. Not gathering: every slot's
    correction for every row, each row keeping its own's."""
    n = normed_input(h, cfg)  # [B, T, D+1]
    B = slots.shape[0]
    few = max(1, B // 2)
    if not gather:
        c = _correction(maps, slots, n, gather=False)
    elif few == B:
        c = _correction(maps, slots, n)
    else:  # the rows that left this step, when they are at most half the batch
        live = slots >= 0
        rows = jnp.argsort(~live, stable=True)[:few]  # [few]: the leaving rows first

        def leaving():
            c = _correction(maps, slots[rows], n[rows])  # [J, few, T, 2KV]
            return jnp.zeros((*c.shape[:1], B, *c.shape[2:]), c.dtype).at[:, rows].set(c)

        c = jax.lax.cond(jnp.sum(live) <= few, leaving, lambda: _correction(maps, slots, n))
    kv = kv_dim(cfg)
    dk = c[..., :kv].reshape(*c.shape[:-1], cfg.n_kv_heads, cfg.head_dim)
    dv = c[..., kv:].reshape(*c.shape[:-1], cfg.n_kv_heads, cfg.head_dim)
    return llama.apply_rope(dk, positions, llama.rope_inv_freq(cfg)), dv


# --------------------------------------------------------------------------- on disk


def _model_id(cfg: ModelConfig) -> dict:
    return {"n_layers": cfg.n_layers, "d_model": cfg.d_model, "n_kv_heads": cfg.n_kv_heads,
            "head_dim": cfg.head_dim, "vocab_size": cfg.vocab_size}


def save_maps(folder, cfg: ModelConfig, exit_layers: tuple[int, ...], maps: Maps,
              info: dict | None = None) -> Path:
    """Write the used pairs of `maps` in bf16 to folder/FILE (one tensor per exit and leaf),
    with the model, exit layers, rank and `info` (how they were fitted) as metadata."""
    check_maps(cfg, exit_layers, maps)
    first, L = exit_layers[0], cfg.n_layers
    tensors = {}
    for s, e in enumerate(exit_layers):
        if e + 1 < L:
            for k in LEAVES:
                tensors[f"{k}.{e}"] = np.asarray(
                    jnp.asarray(getattr(maps, k)[s, e + 1 - first:]).astype(jnp.bfloat16))
    meta = {"model": json.dumps(_model_id(cfg)), "exit_layers": json.dumps(list(exit_layers)),
            "rank": str(rank_of(maps)), "info": json.dumps(info or {})}
    return safetensors_io.save_file(tensors, Path(folder) / FILE, metadata=meta)


def load_maps(folder, cfg: ModelConfig, exit_layers: tuple[int, ...]) -> tuple[Maps, dict]:
    """(maps in `MAP_DTYPE`, info) from folder/FILE; a clear error if they were fitted for
    another model or other exits."""
    import ml_dtypes  # noqa: F401  (bfloat16 for safetensors' numpy reader)
    from safetensors import safe_open

    path = Path(folder) / FILE
    if not path.is_file():
        raise BackfillMapsError(f"{path} is missing: these exit heads have no learned "
                                f"back-fill maps; fit them (ee-jax tune) or serve back-fill "
                                f"'propagate' or 'deferred'")
    with safe_open(str(path), "numpy") as f:
        meta = f.metadata() or {}
        try:
            model, saved_exits = json.loads(meta["model"]), tuple(json.loads(meta["exit_layers"]))
            rank, info = int(meta["rank"]), json.loads(meta.get("info", "{}"))
        except (KeyError, ValueError) as err:
            raise BackfillMapsError(f"{path} has no valid back-fill map metadata ({err}); "
                                    f"write it with backfill_maps.save_maps") from err
        if model != _model_id(cfg):
            raise BackfillMapsError(f"back-fill maps in {path} were fitted for a model with "
                                    f"{model}, not {_model_id(cfg)}")
        if saved_exits != tuple(exit_layers):
            raise BackfillMapsError(f"back-fill maps in {path} were fitted for exit layers "
                                    f"{list(saved_exits)}, not {list(exit_layers)}")
        shapes = map_shapes(cfg, exit_layers, rank)
        out = {k: np.zeros(getattr(shapes, k).shape, getattr(shapes, k).dtype) for k in LEAVES}
        first = exit_layers[0]
        for s, e in enumerate(exit_layers):
            if e + 1 < cfg.n_layers:
                for k in LEAVES:
                    t = f.get_tensor(f"{k}.{e}").astype(out[k].dtype)
                    want = out[k][s, e + 1 - first:].shape
                    if t.shape != want:
                        raise BackfillMapsError(f"back-fill map {k}.{e} in {path} has shape "
                                                f"{t.shape}, expected {want}")
                    out[k][s, e + 1 - first:] = t
    return Maps(**{k: jnp.asarray(v) for k, v in out.items()}), info
