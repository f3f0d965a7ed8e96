"""`weights.WEIGHTS`, each weight's one declaration, is what the params tree, sharding,
quantization and both loaders' name maps read (the maps' truths: the Hugging Face and GGUF
names transformers and llama.cpp write, as tests/test_loaders.py and test_families.py load)."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ee_jax.models import llama, quant, weights
from ee_jax.models.formats import checkpoint, gguf, hf
from ee_jax.models.params import LayerParams, Params
from ee_jax.serving import sharding
from ee_jax.testing import tiny_config, tiny_model


def test_every_declared_weight_is_in_the_params_of_a_config_that_asks_for_it():
    base = tiny_config()
    every = dataclasses.replace(base, qkv_bias=True, qk_norm=True, post_norms=True,
                                tie_embeddings=False)
    shapes = llama.param_shapes(every)
    names = {llama.weight_name(p) for p, _ in jax.tree_util.tree_leaves_with_path(shapes)}
    assert names == {("layers." if w.layer else "") + w.key for w in weights.WEIGHTS}
    plain = llama.param_shapes(dataclasses.replace(base, tie_embeddings=True))
    assert set(plain.layers.to_dict()) == {w.key for w in weights.WEIGHTS
                                           if w.layer and not w.when}
    assert plain.lm_head is None and "lm_head" not in plain.to_dict()
    for w in weights.WEIGHTS:
        leaf = shapes.weight(w.key)
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


def test_the_params_dataclasses_have_a_field_per_declared_weight():
    """One weight, one line in `WEIGHTS` and one field: the layer weights on LayerParams, the
    others on Params (beside `layers`), in the declaration's order."""
    layer = [f.name for f in dataclasses.fields(LayerParams)]
    glob = [f.name for f in dataclasses.fields(Params) if f.name != "layers"]
    assert layer == [w.key for w in weights.WEIGHTS if w.layer]
    assert glob == [w.key for w in weights.WEIGHTS if not w.layer]


def test_a_weight_the_config_lacks_is_none_and_no_leaf():
    """register_dataclass: a None field is an empty subtree, so a tied model's tree has no
    lm_head leaf, and maps over the tree keep it None."""
    cfg, params = tiny_model(seed=0, tie_embeddings=True)
    assert params.lm_head is None and params.layers.bq is None
    n = len([w for w in weights.WEIGHTS if weights.present(w, cfg)])
    assert len(jax.tree.leaves(params)) == n
    assert all(leaf is not None for leaf in jax.tree.leaves(params))
    doubled = jax.tree.map(lambda a: 2 * a, params)
    assert isinstance(doubled, Params) and doubled.lm_head is None
    np.testing.assert_array_equal(np.asarray(doubled.embed), 2 * np.asarray(params.embed))


def test_the_dict_form_converts_both_ways_and_names_an_unknown_key():
    cfg, params = tiny_model(seed=0)
    d = params.to_dict()
    assert set(d) == {"layers", "embed", "final_norm", "lm_head"}
    back = llama.check_params(cfg, d)
    assert isinstance(back, Params)
    assert all(a is b for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params),
                                      strict=True))
    with pytest.raises(llama.ParamsMismatchError, match=r"no weight\(s\) \['lm_heads'\]"):
        llama.check_params(cfg, {**d, "lm_heads": d["lm_head"]})
    with pytest.raises(llama.ParamsMismatchError, match=r"no layer weight\(s\) \['w_q'\]"):
        llama.check_params(cfg, {**d, "layers": {**d["layers"], "w_q": d["layers"]["wq"]}})


def test_a_missing_weight_is_named():
    cfg, params = tiny_model(seed=0)
    d = params.to_dict()
    del d["layers"]["w_up"]
    with pytest.raises(llama.ParamsMismatchError, match=r"missing \['layers\.w_up'\]"):
        llama.check_params(cfg, d, source="my weights")
    with pytest.raises(llama.ParamsMismatchError, match=r"my weights .*missing \['embed'\]"):
        llama.check_params(cfg, params.replace(embed=None), source="my weights")
    per_layer = llama.unstack_layers(params)
    llama.check_params(cfg, per_layer)  # per layer, each against the stacked shape
    short = per_layer.replace(layers=(*per_layer.layers[:2], per_layer.layers[2].replace(
        wk=None), *per_layer.layers[3:]))
    with pytest.raises(llama.ParamsMismatchError, match=r"missing \['layers\.2\.wk'\]"):
        llama.check_params(cfg, short)


def test_a_checkpoint_of_the_dict_layout_loads(tmp_path):
    """A checkpoint as ee-jax wrote it when params were a dict (the orbax item
    {"params": {"layers": {...}, "embed": ...}} beside its marker, written here by hand)
    restores into Params with the same arrays, and a new save writes that same layout."""
    import orbax.checkpoint as ocp

    cfg, params = tiny_model(seed=3)
    old = {"layers": {k: np.asarray(v) for k, v in params.layers.to_dict().items()},
           **{k: np.asarray(params.weight(k)) for k in ("embed", "final_norm", "lm_head")}}
    folder = tmp_path / "old"
    folder.mkdir()
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(folder / checkpoint.STATE, {"params": old})
        ckptr.wait_until_finished()
    (folder / checkpoint.MARKER).write_text(json.dumps({
        "format": checkpoint.FORMAT, "version": checkpoint.VERSION,
        "config": checkpoint.config_to_dict(cfg), "extra": {}}))
    cfg2, restored, extra = checkpoint.restore_checkpoint(folder)
    assert cfg2 == cfg and extra == {} and isinstance(restored, Params)
    for key in weights.BY_KEY:
        np.testing.assert_array_equal(np.asarray(restored.weight(key)),
                                      np.asarray(params.weight(key)), err_msg=key)
    new = checkpoint.save_checkpoint(tmp_path / "new", cfg, restored)
    with ocp.StandardCheckpointer() as ckptr:  # read back as the plain dict it holds
        state = ckptr.restore(new / checkpoint.STATE, {"params": jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), old)})
    assert jax.tree.structure(state["params"]) == jax.tree.structure(old)
    for a, b in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(old), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)
    assert jnp.dtype(restored.embed.dtype) == jnp.dtype(cfg.jnp_dtype)


def test_a_mapping_given_to_the_public_entry_points_is_converted_once():
    """ee_jax.Params is the public name; a LoadedModel or an engine given the dict form holds
    Params, and a key that is no weight is named before anything is built."""
    import ee_jax
    from ee_jax.models.loading import LoadedModel
    from ee_jax.serving.engine import LLMEngine
    from ee_jax.serving.plan import EngineConfig

    cfg, params = tiny_model(seed=0)
    assert ee_jax.Params is Params
    model = LoadedModel(cfg, params.to_dict(), None, "tiny")
    assert isinstance(model.params, Params) and model.params.layers.wq is params.layers.wq
    config = EngineConfig.make(max_num_seqs=1, max_model_len=32, page_size=8, num_pages=8,
                               batch_buckets=(1,))
    engine = LLMEngine(cfg, params.to_dict(), None, config)
    assert isinstance(engine.runner.params, Params)
    with pytest.raises(llama.ParamsMismatchError, match=r"\['lm_head_t'\]"):
        LLMEngine(cfg, {**params.to_dict(), "lm_head_t": params.lm_head.T}, None, config)
    with pytest.raises(llama.ParamsMismatchError, match=r"params given .*missing \[.lm_head.\]"):
        LLMEngine(cfg, params.replace(lm_head=None), None, config)
