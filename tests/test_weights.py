"""`weights.WEIGHTS`, each weight's one declaration, is what the params tree, sharding,
quantization and both loaders' name maps read (the maps' truths: the Hugging Face and GGUF
names transformers and llama.cpp write, as tests/test_loaders.py and test_families.py load)."""

from __future__ import annotations

import dataclasses

from ee_jax.models import llama, quant, weights
from ee_jax.models.formats import gguf, hf
from ee_jax.serving import sharding
from ee_jax.testing import tiny_config


def test_every_declared_weight_is_in_the_params_of_a_config_that_asks_for_it():
    base = tiny_config()
    every = dataclasses.replace(base, qkv_bias=True, qk_norm=True, post_norms=True,
                                tie_embeddings=False)
    shapes = llama.param_shapes(every)
    keys = set(shapes) - {"layers"} | set(shapes["layers"])
    assert keys == {w.key for w in weights.WEIGHTS}
    plain = llama.param_shapes(dataclasses.replace(base, tie_embeddings=True))
    assert set(plain["layers"]) == {w.key for w in weights.WEIGHTS if w.layer and not w.when}
    assert "lm_head" not in plain
    for w in weights.WEIGHTS:
        leaf = shapes["layers"][w.key] if w.layer else shapes[w.key]
        assert leaf.shape == weights.shape(w, every)
        assert len(w.axes) == len(w.dims) == leaf.ndim - w.layer
        assert sharding.PARAM_AXES[w.key] == w.axes


def test_quantization_and_the_loaders_read_the_declaration():
    assert quant.QUANTIZED_KEYS == ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
    assert hf.LAYER_TENSORS["self_attn.q_proj.weight"] == "wq"
    assert hf.GLOBAL_TENSORS["lm_head.weight"] == "lm_head"
    assert gguf.LAYER_TENSORS["ffn_down"] == "w_down"
    assert gguf.ARCHS["qwen2"].tensors[("attn_k", "bias")] == "bk"
    named = set(hf.LAYER_TENSORS.values()) | set(gguf.LAYER_TENSORS.values())
    assert named == set(weights.keys(layer=True)) - {w.key for w in weights.WEIGHTS if w.when}
