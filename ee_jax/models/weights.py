"""Every weight of the model, declared once.

A weight's shape in the config's terms, its logical axes (what sharding splits), whether it is
a layer matmul weight (what int8 and GGUF blocks hold), the config switch that adds it, and its
names in Hugging Face and GGUF files. The abstract parameter tree (`llama.param_shapes`),
`quant.QUANTIZED_KEYS`, `sharding.PARAM_AXES` and both loaders' standard name maps derive from
`WEIGHTS`: adding a weight (a bias, a norm) is one line here, and its field on the typed tree
(`params.LayerParams` or `params.Params`; tests/test_weights.py holds the fields to `WEIGHTS`).
Family-specific names (Gemma 2's norms in Hugging Face files) stay in their format module as
overrides.
"""

from __future__ import annotations

import dataclasses

from ee_jax.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Weight:
    key: str  # its field in the params tree (`params.Params`; of params.layers for a layer's)
    dims: tuple[str, ...]  # its shape in the config's terms (`DIMS`), input-major
    axes: tuple[str | None, ...]  # its logical axes, one a dim (`sharding.LOGICAL_RULES`)
    layer: bool = True  # one a layer (stacked: a leading layer axis)
    # the ModelConfig switch that adds it ("untied": not tie_embeddings); None: always there
    when: str | None = None
    matmul: bool = False  # a layer's matmul weight: int8 (`quant`) and GGUF blocks hold it
    hf: str | None = None  # Hugging Face name (a layer's after "model.layers.{i}.")
    gguf: tuple[str, str] | None = None  # GGUF (base, "weight" | "bias"): "blk.{i}.base.kind"


DIMS = {"V": "vocab_size", "D": "d_model", "F": "ffn_dim", "hd": "head_dim"}

WEIGHTS: tuple[Weight, ...] = (
    Weight("embed", ("V", "D"), ("vocab", "embed"), layer=False,
           hf="model.embed_tokens.weight", gguf=("token_embd", "weight")),
    Weight("final_norm", ("D",), ("embed",), layer=False, hf="model.norm.weight",
           gguf=("output_norm", "weight")),
    Weight("lm_head", ("D", "V"), ("embed", "vocab"), layer=False, when="untied",
           hf="lm_head.weight", gguf=("output", "weight")),
    Weight("attn_norm", ("D",), ("embed",), hf="input_layernorm.weight",
           gguf=("attn_norm", "weight")),
    Weight("wq", ("D", "Q"), ("embed", "heads"), matmul=True, hf="self_attn.q_proj.weight",
           gguf=("attn_q", "weight")),
    Weight("wk", ("D", "KV"), ("embed", "kv_heads"), matmul=True, hf="self_attn.k_proj.weight",
           gguf=("attn_k", "weight")),
    Weight("wv", ("D", "KV"), ("embed", "kv_heads"), matmul=True, hf="self_attn.v_proj.weight",
           gguf=("attn_v", "weight")),
    Weight("wo", ("Q", "D"), ("heads", "embed"), matmul=True, hf="self_attn.o_proj.weight",
           gguf=("attn_output", "weight")),
    Weight("mlp_norm", ("D",), ("embed",), hf="post_attention_layernorm.weight",
           gguf=("ffn_norm", "weight")),
    Weight("w_gate", ("D", "F"), ("embed", "mlp"), matmul=True, hf="mlp.gate_proj.weight",
           gguf=("ffn_gate", "weight")),
    Weight("w_up", ("D", "F"), ("embed", "mlp"), matmul=True, hf="mlp.up_proj.weight",
           gguf=("ffn_up", "weight")),
    Weight("w_down", ("F", "D"), ("mlp", "embed"), matmul=True, hf="mlp.down_proj.weight",
           gguf=("ffn_down", "weight")),
    Weight("bq", ("Q",), ("heads",), when="qkv_bias", hf="self_attn.q_proj.bias",
           gguf=("attn_q", "bias")),
    Weight("bk", ("KV",), ("kv_heads",), when="qkv_bias", hf="self_attn.k_proj.bias",
           gguf=("attn_k", "bias")),
    Weight("bv", ("KV",), ("kv_heads",), when="qkv_bias", hf="self_attn.v_proj.bias",
           gguf=("attn_v", "bias")),
    Weight("q_norm", ("hd",), (None,), when="qk_norm", hf="self_attn.q_norm.weight",
           gguf=("attn_q_norm", "weight")),
    Weight("k_norm", ("hd",), (None,), when="qk_norm", hf="self_attn.k_norm.weight",
           gguf=("attn_k_norm", "weight")),
    Weight("post_attn_norm", ("D",), ("embed",), when="post_norms",
           gguf=("post_attention_norm", "weight")),
    Weight("post_mlp_norm", ("D",), ("embed",), when="post_norms",
           gguf=("post_ffw_norm", "weight")),
)
BY_KEY = {w.key: w for w in WEIGHTS}


def present(w: Weight, cfg: ModelConfig) -> bool:
    """Whether the model of `cfg` has weight `w`."""
    if w.when is None:
        return True
    if w.when == "untied":
        return not cfg.tie_embeddings
    return bool(getattr(cfg, w.when))


def shape(w: Weight, cfg: ModelConfig) -> tuple[int, ...]:
    """`w`'s shape for `cfg`, a layer weight's with the leading layer axis."""
    size = {"Q": cfg.n_heads * cfg.head_dim, "KV": cfg.n_kv_heads * cfg.head_dim,
            **{d: getattr(cfg, attr) for d, attr in DIMS.items()}}
    dims = tuple(size[d] for d in w.dims)
    return (cfg.n_layers, *dims) if w.layer else dims


def keys(*, layer: bool | None = None, matmul: bool | None = None) -> tuple[str, ...]:
    """The keys of the weights that match (None: any)."""
    return tuple(w.key for w in WEIGHTS
                 if (layer is None or w.layer == layer) and (matmul is None or w.matmul == matmul))


def hf_names(*, layer: bool, when: str | None = None) -> dict[str, str]:
    """Hugging Face name -> key, of the layer (or global) weights `when` adds."""
    return {w.hf: w.key for w in WEIGHTS if w.layer == layer and w.when == when and w.hf}


def gguf_names(*, layer: bool, when: str | None = None) -> dict[tuple[str, str], str]:
    """GGUF (base, "weight" | "bias") -> key, of the layer (or global) weights `when` adds."""
    return {w.gguf: w.key for w in WEIGHTS if w.layer == layer and w.when == when and w.gguf}
