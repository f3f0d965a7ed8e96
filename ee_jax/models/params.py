"""The model's parameters as a typed pytree: `Params` (the global weights and the layers) and
`LayerParams` (the layer weights), one field per weight of `weights.WEIGHTS` (a test holds the
fields to the declaration: adding a weight is its line there and its field here).

A field is None where the config has no such weight (`lm_head` of a tied head, the biases of
a model without them); None is an empty subtree, so it has no leaf: `jax.tree.map`, sharding
and checkpoints see only the weights the model has. `Params.layers` is one `LayerParams`
whose leaves carry a leading layer axis (the "stacked" layout), or a tuple of one
`LayerParams` a layer ("per_layer", `llama.unstack_layers`).

The plain-dict form ({"embed": ..., "layers": {"wq": ...}, ...}: a weight's key its name in
the tree) is what checkpoints hold and what a caller may pass; `as_params` converts it once,
where params enter (`llama.check_params` then holds them to the config's shapes), naming any
key that is not a weight.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax

from ee_jax.errors import ModelLoadError
from ee_jax.models import weights


class ParamsMismatchError(ModelLoadError):
    """A parameter tree that does not match the model configuration."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerParams:
    """The layer weights (stacked: each [L, ...]; per layer: without the L axis). Shapes in
    `llama`'s module docstring; None: a weight the config does not have."""

    attn_norm: Any = None  # [L, D]
    wq: Any = None  # [L, D, H*hd]
    wk: Any = None  # [L, D, K*hd]
    wv: Any = None  # [L, D, K*hd]
    wo: Any = None  # [L, H*hd, D]
    mlp_norm: Any = None  # [L, D]
    w_gate: Any = None  # [L, D, F]
    w_up: Any = None  # [L, D, F]
    w_down: Any = None  # [L, F, D]
    bq: Any = None  # [L, H*hd] (cfg.qkv_bias: Qwen2)
    bk: Any = None  # [L, K*hd]
    bv: Any = None  # [L, K*hd]
    q_norm: Any = None  # [L, hd] (cfg.qk_norm: Qwen3)
    k_norm: Any = None  # [L, hd]
    post_attn_norm: Any = None  # [L, D] (cfg.post_norms: Gemma 2)
    post_mlp_norm: Any = None  # [L, D]

    def replace(self, **w) -> LayerParams:
        return dataclasses.replace(self, **w)

    def to_dict(self) -> dict[str, Any]:
        """The present weights by key."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) is not None}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LayerParams:
        if isinstance(d, LayerParams):
            return d
        if not isinstance(d, Mapping):
            raise ParamsMismatchError(f"a layer's weights are a LayerParams or a mapping of "
                                      f"weight keys, not {type(d).__name__}")
        unknown = sorted(set(d) - set(LAYER_KEYS))
        if unknown:
            raise ParamsMismatchError(f"params have no layer weight(s) {unknown}: the layer "
                                      f"weights are {list(LAYER_KEYS)} (`weights.WEIGHTS`)")
        return cls(**d)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Params:
    """Every weight of the model: the layers (`LayerParams`, stacked or a tuple a layer) and
    the global weights. Built by the loaders and `llama.init_params`; a mapping becomes one
    through `as_params`."""

    layers: LayerParams | tuple[LayerParams, ...] = dataclasses.field(
        default_factory=LayerParams)
    embed: Any = None  # [V, D]
    final_norm: Any = None  # [D]
    lm_head: Any = None  # [D, V]; None when the head is tied to `embed`

    def replace(self, **w) -> Params:
        return dataclasses.replace(self, **w)

    def weight(self, key: str) -> Any:
        """The weight of `key` (`weights.WEIGHTS`; a layer weight from the stacked layers),
        None where the model has none."""
        if weights.BY_KEY[key].layer:
            if isinstance(self.layers, tuple | list):
                raise ValueError(f"weight({key!r}) reads the stacked layers; these are per "
                                 f"layer")
            return getattr(self.layers, key)
        return getattr(self, key)

    def to_dict(self) -> dict[str, Any]:
        """The nested dict of the present weights ({"layers": {...}, "embed": ...}; per-layer
        layers a tuple of dicts): the form checkpoints hold."""
        layers = (tuple(lp.to_dict() for lp in self.layers)
                  if isinstance(self.layers, tuple | list) else self.layers.to_dict())
        return {"layers": layers, **{k: getattr(self, k) for k in GLOBAL_KEYS
                                     if getattr(self, k) is not None}}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Params:
        """Params from the nested-dict form, or ParamsMismatchError naming a key that is not a
        weight (which weights the config needs, `llama.check_params` says)."""
        unknown = sorted(set(d) - {"layers", *GLOBAL_KEYS})
        if unknown:
            raise ParamsMismatchError(f"params have no weight(s) {unknown}: the weights are "
                                      f"{['layers', *GLOBAL_KEYS]}, the layers' "
                                      f"{list(LAYER_KEYS)} (`weights.WEIGHTS`)")
        layers = d.get("layers", {})
        if isinstance(layers, tuple | list):
            layers = tuple(LayerParams.from_dict(lp) for lp in layers)
        else:
            layers = LayerParams.from_dict(layers)
        return cls(layers=layers, **{k: d[k] for k in GLOBAL_KEYS if k in d})


LAYER_KEYS = tuple(f.name for f in dataclasses.fields(LayerParams))
GLOBAL_KEYS = tuple(f.name for f in dataclasses.fields(Params) if f.name != "layers")


def as_params(params: Params | Mapping[str, Any]) -> Params:
    """`params` as `Params` (a mapping of weight keys, the nested-dict form, converted)."""
    if isinstance(params, Params):
        return params
    if isinstance(params, Mapping):
        return Params.from_dict(params)
    raise ParamsMismatchError(f"params are a Params (or a mapping of weight keys), not "
                              f"{type(params).__name__}")
