"""The serving layout (`llama.serving_layout`: layer weights output-major, `quant.OutMajor`)
computes what the loaded, input-major weights compute: `linear` against numpy for every row
count it treats apart, and whole engines against the dense reference on the loaded params."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ee_jax.models import llama, quant
from ee_jax.models.exit_config import ExitConfig
from ee_jax.serving import sharding
from ee_jax.serving.engine import EngineConfig, LLMEngine
from ee_jax.serving.params import greedy
from ee_jax.testing import tiny_model
from tests.reference import dense_greedy, run_requests

CFG, PARAMS = tiny_model(seed=5, eos_token_ids=())
RNG = np.random.default_rng(1)
PROMPTS = [RNG.integers(3, CFG.vocab_size, n).tolist() for n in (5, 17, 1, 30)]
MAX_NEW = 8


@pytest.mark.parametrize("lead", [(1,), (1, 1), (2, 1), (3,), (8, 1), (64,), (65,), (4, 40)])
@pytest.mark.parametrize("d_in,d_out", [(12, 20), (20, 12)])
def test_out_major_linear_equals_numpy(lead, d_in, d_out):
    """One row (matrix-vector), 2..64 rows (t @ x.T), more (x @ t.T): x @ w every time."""
    rng = np.random.default_rng(sum(lead) + d_in)
    x = rng.normal(size=(*lead, d_in)).astype(np.float32)
    w = rng.normal(size=(d_in, d_out)).astype(np.float32)
    t = quant.OutMajor(jnp.asarray(w.T))
    assert t.shape == w.shape and t.nbytes == w.nbytes
    got = np.asarray(jax.jit(quant.linear)(jnp.asarray(x), t))
    assert got.shape == (*lead, d_out)
    np.testing.assert_allclose(got, x.astype(np.float64) @ w, rtol=1e-5, atol=1e-5)


def test_out_major_linear_vmapped_over_layers():
    """The back-fill vmaps `kv_project` over stacked layers: the output-major weight slices
    along the layer axis like any leaf."""
    rng = np.random.default_rng(0)
    w = rng.normal(size=(3, 12, 20)).astype(np.float32)
    x = rng.normal(size=(3, 2, 1, 12)).astype(np.float32)
    t = quant.OutMajor(jnp.asarray(np.swapaxes(w, -1, -2)))
    got = np.asarray(jax.jit(jax.vmap(quant.linear))(jnp.asarray(x), t))
    np.testing.assert_allclose(got, np.einsum("lbti,lio->lbto", x, w), rtol=1e-5, atol=1e-5)


def test_serving_layout_tree():
    """Every layer matmul weight becomes OutMajor with the weight's logical shape; the rest,
    and int8 weights, stay; consume=False leaves the given tree alone, True replaces in it."""
    served = llama.serving_layout(PARAMS)
    llama.check_params(CFG, served)  # same logical shapes, nothing missing or extra
    for key in quant.QUANTIZED_KEYS:
        assert isinstance(served["layers"][key], quant.OutMajor)
        assert not isinstance(PARAMS["layers"][key], quant.OutMajor)
        np.testing.assert_array_equal(np.swapaxes(np.asarray(served["layers"][key].t), -1, -2),
                                      np.asarray(PARAMS["layers"][key]))
    assert served["embed"] is PARAMS["embed"]
    assert served["layers"]["attn_norm"] is PARAMS["layers"]["attn_norm"]
    assert llama.serving_layout(served)["layers"]["wq"] is served["layers"]["wq"]

    q8 = quant.quantize_params(PARAMS)
    assert llama.serving_layout(q8)["layers"]["wq"] is q8["layers"]["wq"]

    fresh = jax.tree.map(jnp.array, PARAMS)
    layers = fresh["layers"]
    assert llama.serving_layout(fresh, consume=True) is fresh
    assert fresh["layers"] is layers and isinstance(layers["w_up"], quant.OutMajor)


def test_sharding_axes_of_out_major_weights():
    """An output-major weight's leaf `t` has the weight's logical axes in reverse."""
    served = llama.serving_layout(PARAMS)
    paths = {jax.tree_util.keystr(p): sharding._leaf_axes(p)
             for p, _ in jax.tree_util.tree_leaves_with_path(served)}
    assert paths["['layers']['wq'].t"] == ("heads", "embed")
    assert paths["['layers']['w_down'].t"] == ("embed", "mlp")
    assert paths["['layers']['attn_norm']"] == ("embed",)


def _engine(params, exit_config=None) -> LLMEngine:
    # mixed_steps off: every decode token runs a decode step, under the exit policy (a decode
    # row riding in a prefill step runs at full depth)
    cfg = EngineConfig(max_num_seqs=4, max_model_len=64, page_size=4, num_pages=80,
                       max_prefill_chunk=16, max_num_batched_tokens=64, batch_buckets=(1, 2, 4),
                       mixed_steps=False)
    return LLMEngine(CFG, params, None, cfg, exit_config)


def test_engine_on_serving_layout_equals_dense_reference():
    """Prefill chunks and decode at batch 1, 2 and 4 on output-major weights give the dense
    reference's greedy tokens computed on the loaded weights."""
    want = [dense_greedy(CFG, PARAMS, p, MAX_NEW) for p in PROMPTS]
    engine = _engine(llama.serving_layout(PARAMS))
    assert [o.token_ids for o in run_requests(engine, PROMPTS[:1], greedy(MAX_NEW))] == want[:1]
    assert [o.token_ids for o in run_requests(engine, PROMPTS, greedy(MAX_NEW))] == want


def test_forced_exit_backfill_on_serving_layout():
    """Exits forced at layer 2: the back-fill projects through output-major W_k / W_v; tokens
    and every cache entry equal the engine on the loaded weights."""
    ec = ExitConfig(exit_layers=(1, 2, 3), force_exit_layer=2)
    engines = [_engine(p, ec) for p in (PARAMS, llama.serving_layout(PARAMS))]
    outs = [run_requests(e, PROMPTS, greedy(MAX_NEW)) for e in engines]
    assert [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[1]]
    assert all(o.exit_layers[1:] == [2] * (MAX_NEW - 1) for o in outs[1])
    k0, k1 = (np.asarray(e.runner.cache.k) for e in engines)
    assert np.abs(k1[2:]).sum() > 0  # the back-fill wrote the skipped layers
    np.testing.assert_allclose(k0, k1, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(engines[0].runner.cache.v),
                               np.asarray(engines[1].runner.cache.v), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lead", [(1,), (8,), (2, 3), (100,)])
def test_tied_head_equals_numpy_and_differentiates(lead):
    """The tied LM head (the embedding, output-major) in every product `unembed` picks by
    rows: logits and their gradient with respect to the hidden state equal numpy's."""
    cfg, params = tiny_model(seed=6, tie_embeddings=True)
    rng = np.random.default_rng(len(lead))
    xn = rng.normal(size=(*lead, cfg.d_model)).astype(np.float32)
    E = np.asarray(params["embed"], np.float64)  # [V, D]
    got = np.asarray(jax.jit(llama.unembed, static_argnums=2)(params, jnp.asarray(xn), cfg))
    np.testing.assert_allclose(got, xn @ E.T, rtol=1e-5, atol=1e-5)
    c = rng.normal(size=(*lead, cfg.vocab_size)).astype(np.float32)
    grad = jax.jit(jax.grad(lambda x: jnp.sum(llama.unembed(params, x, cfg) * c)))(
        jnp.asarray(xn))
    np.testing.assert_allclose(np.asarray(grad), c @ E, rtol=1e-4, atol=1e-4)
