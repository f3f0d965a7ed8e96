"""Meshes and shardings: tensor parallel over heads, MLP width and vocabulary; data parallel
over batch rows. Every array's sharding comes from one table of logical axes.

    mesh axes      ("dp", "tp")
    logical axis   batch -> dp; heads, kv_heads, mlp, vocab -> tp; everything else replicated

A parameter leaf is described by its logical axes (`PARAM_AXES`, by the leaf's name, the
same for every family), the rules map logical axes to mesh axes, and `NamedSharding`s follow;
nothing is written per array. KV heads fewer than (or not divisible by) tp are replicated, as
grouped-query attention needs: each tensor-parallel shard then holds every KV head and uses
the ones its query heads read. XLA (GSPMD) inserts the collectives: two all-reduces of [B, D]
per layer (after the attention output and the MLP down projection) in the Megatron layout,
and the batch exit decision is an all-reduce over dp where a policy needs one.

The KV cache is sharded over KV heads and replicated over dp (pages are shared by every
row of the batch, whichever data-parallel group the row runs on).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ee_jax.errors import EEJaxError
from ee_jax.models import weights
from ee_jax.models.config import ModelConfig
from ee_jax.serving.distributed import global_array


class MeshError(EEJaxError, ValueError):
    """A mesh that cannot serve this model on these devices."""


MESH_AXES = ("dp", "tp")

# Logical axes of every parameter leaf, by name (the trailing axes of the leaf; a leading
# stacked layer or exit axis is replicated).
PARAM_AXES: dict[str, tuple[str | None, ...]] = {
    **{w.key: w.axes for w in weights.WEIGHTS},  # the model's (`weights`: declared there)
    # exit heads (ee_jax.models.exits.heads): the adapter / MLP head's width is split like the
    # layers' MLP; norms, classifiers, decision MLPs and vocabulary subsets are replicated
    "down": ("embed", "mlp"), "up": ("mlp", "embed"),
    # an EE-LLM exit's own output matrix [V, D] (`exit_output`) is split like the LM head;
    # its branch MLP's w_gate / w_up / w_down like the layers' MLP (by name, above)
    "output": ("vocab", "embed"),
}
# The KV cache [layers, pages, page_size, kv_heads, head_dim].
CACHE_AXES = (None, None, None, "kv_heads", None)


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """How many devices along each mesh axis: `MeshSpec.parse("tp=4,dp=2")`."""

    tp: int = 1
    dp: int = 1

    def __post_init__(self):
        for axis in MESH_AXES:
            n = getattr(self, axis)
            if not isinstance(n, int) or n < 1:
                raise MeshError(f"mesh axis {axis} must be a positive integer, got {n!r}")

    @classmethod
    def parse(cls, spec: str | MeshSpec | None) -> MeshSpec:
        """"tp=4,dp=2" (either order, either may be left out; "" or None: one device)."""
        if isinstance(spec, MeshSpec):
            return spec
        sizes: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in (spec or "").split(","))):
            m = re.fullmatch(r"(\w+)\s*=\s*(\d+)", part)
            if m is None or m.group(1) not in MESH_AXES:
                raise MeshError(f"cannot read mesh spec {spec!r}: write it as 'tp=N,dp=M' "
                                f"(axes {MESH_AXES})")
            if m.group(1) in sizes:
                raise MeshError(f"mesh spec {spec!r} names axis {m.group(1)!r} twice")
            sizes[m.group(1)] = int(m.group(2))
        return cls(**sizes)

    @property
    def size(self) -> int:
        return self.tp * self.dp

    def __str__(self) -> str:
        return f"tp={self.tp},dp={self.dp}"

    def validate_for(self, cfg: ModelConfig) -> None:
        """Raise MeshError naming the dimension a tensor-parallel split would not divide."""
        tp = self.tp
        for name, n in (("n_heads", cfg.n_heads), ("ffn_dim", cfg.ffn_dim),
                        ("vocab_size", cfg.vocab_size)):
            if n % tp:
                g = math.gcd(math.gcd(cfg.n_heads, cfg.ffn_dim), cfg.vocab_size)
                raise MeshError(f"tp={tp} does not divide the model's {name} ({n}): tensor "
                                f"parallelism splits it evenly; choose tp among the divisors "
                                f"of {g}")

    def make_mesh(self, devices=None) -> Mesh:
        devices = list(jax.devices() if devices is None else devices)
        if self.size > len(devices):
            raise MeshError(f"mesh {self} needs {self.size} devices but only {len(devices)} "
                            f"are available ({devices[0].platform}); on CPU, simulate more with "
                            f"XLA_FLAGS=--xla_force_host_platform_device_count={self.size}")
        grid = np.asarray(devices[:self.size], dtype=object).reshape(self.dp, self.tp)
        return Mesh(grid, MESH_AXES)


def check_mesh(spec: MeshSpec, mesh: Mesh) -> Mesh:
    """`mesh` itself, or MeshError unless it has the spec's axes and sizes."""
    if dict(mesh.shape) != {"dp": spec.dp, "tp": spec.tp}:
        raise MeshError(f"the mesh given has axes {dict(mesh.shape)}, not the {spec} the "
                        f"engine is configured for")
    return mesh


def logical_rules(cfg: ModelConfig, mesh) -> dict[str, str | None]:
    """Logical axis -> mesh axis for this model on this mesh (the one table); `mesh`: a Mesh
    or its axis sizes {"dp": .., "tp": ..}."""
    tp = dict(mesh.shape)["tp"] if hasattr(mesh, "shape") else mesh["tp"]
    return {"batch": "dp", "heads": "tp", "mlp": "tp", "vocab": "tp",
            "kv_heads": "tp" if cfg.n_kv_heads % tp == 0 else None,  # GQA: replicate
            "embed": None}


def spec_for(axes: tuple[str | None, ...], ndim: int, rules: dict[str, str | None]
             ) -> PartitionSpec:
    """The PartitionSpec of an array whose trailing axes have these logical names."""
    trailing = [rules.get(a) if a else None for a in axes]
    return PartitionSpec(*([None] * (ndim - len(trailing)) + trailing))


# A GGUF block weight's fields (`quant.BlockQ`) are output-major, [..., out, in] (the input
# axis counted in bytes or blocks): a layer weight's axes swapped. A block *table* (the
# embedding, [V, D]) is the array it stands for, its axes as declared.
_BLOCK_FIELDS = ("q_t", "scale_t", "offset_t")
_TABLES = ("embed",)


def _leaf_axes(path) -> tuple[str | None, ...]:
    """Logical axes of a param leaf from its tree path: the innermost name in `PARAM_AXES`
    wins, a name being a dataclass field's (`Params`, `LayerParams`, `ExitHeads`, a packed
    weight's) or a dict key (an exit head part's); a quantized weight's `scale` has the
    weight's axes without the input axis."""
    names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
    for i in range(len(names) - 1, -1, -1):
        if names[i] in PARAM_AXES:
            axes = PARAM_AXES[names[i]]
            if names[-1] in _BLOCK_FIELDS:
                return axes if names[i] in _TABLES else axes[::-1]
            return axes[1:] if names[-1] == "scale" and len(axes) > 1 else axes
    return ()


def divisible(spec: PartitionSpec, shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
    """`spec` with every axis a mesh axis does not divide left replicated."""
    sizes = dict(mesh.shape)
    return PartitionSpec(*(a if a is None or shape[i] % sizes[a] == 0 else None
                           for i, a in enumerate(spec)))


def param_shardings(params: Any, cfg: ModelConfig, mesh: Mesh) -> Any:
    """NamedShardings for a params tree (the model's, or its exit heads': leaves whose name is
    not in `PARAM_AXES` are replicated, and so is any axis tp does not divide, e.g. an exit
    head's width)."""
    rules = logical_rules(cfg, mesh)
    return jax.tree_util.tree_map_with_path(
        lambda path, a: NamedSharding(mesh, divisible(
            spec_for(_leaf_axes(path), np.ndim(a), rules), np.shape(a), mesh)), params)


def shard(tree: Any, shardings: Any) -> Any:
    """Place every leaf on its sharding (host arrays go straight to their shards; with
    several processes, each process places its own devices' shards)."""
    if jax.process_count() > 1:
        return jax.tree.map(lambda a, s: global_array(np.asarray(a), s), tree, shardings)
    return jax.tree.map(jax.device_put, tree, shardings)


def placement(spec: str | MeshSpec, mesh: Mesh | None = None):
    """For loaders: cfg -> where(path, ndim), the sharding of each parameter leaf, so the
    loader puts it straight on its shards as it is read (`ee_jax.models.formats.hf.load_hf`): a
    sharded model is never whole on one device or in host memory. mesh: the spec's mesh when
    the caller built it already (`LLM` builds one for the loader and the engine)."""
    spec = MeshSpec.parse(spec)

    def for_config(cfg: ModelConfig):
        spec.validate_for(cfg)
        nonlocal mesh
        mesh = spec.make_mesh() if mesh is None else check_mesh(spec, mesh)
        rules = logical_rules(cfg, mesh)

        def where(path: tuple[str, ...], ndim: int) -> NamedSharding:
            return NamedSharding(mesh, spec_for(PARAM_AXES.get(path[-1], ()), ndim, rules))

        return where

    return for_config


def cache_spec(cfg: ModelConfig, mesh) -> PartitionSpec:
    return spec_for(CACHE_AXES, len(CACHE_AXES), logical_rules(cfg, mesh))


def cache_sharding(cfg: ModelConfig, mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, cache_spec(cfg, mesh))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    """Rows over dp, the rest replicated: what a step's activations are constrained to."""
    return NamedSharding(mesh, PartitionSpec("dp", *([None] * (ndim - 1))))
