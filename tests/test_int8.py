"""Weight-only int8 serving against independent truths: numpy for the
quantizer and the matmul rule, the f32 dense forward for the logits, the dense forward of the
same int8 model (no cache, no paging) and an f32 engine on the dequantized weights for the
engine. Tiny models only; engines use one page and one batch bucket."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ee_jax.cli import main as cli_main
from ee_jax.models import llama, quant
from ee_jax.models.exits.config import ExitConfig
from ee_jax.models.loading import LoadedModel, load_model, quantize_model
from ee_jax.serving.engine import EngineConfig, LLMEngine
from ee_jax.serving.llm import LLM
from ee_jax.serving.params import greedy
from ee_jax.testing import tiny_config, tiny_model
from tests.reference import dense_greedy, run_requests

CFG, PARAMS = tiny_model(eos_token_ids=())  # 4 layers, vocab 128, d 48, GQA 4/2, untied
QPARAMS = quant.quantize_params(PARAMS)
# Every family switch the int8 path must pass through, with a tied head.
MIXED = tiny_config(eos_token_ids=(), tie_embeddings=True, qkv_bias=True, qk_norm=True,
                    norm_offset=1.0, embed_scale=True, post_norms=True, activation="gelu_tanh",
                    attn_logit_softcap=50.0, final_logit_softcap=30.0,
                    query_pre_attn_scalar=16.0, sliding_window=8,
                    layer_types=("sliding_attention", "full_attention") * 2)
RNG = np.random.default_rng(3)
TOKENS = jnp.asarray(RNG.integers(3, CFG.vocab_size, (2, 40)), jnp.int32)
PROMPTS = [RNG.integers(3, CFG.vocab_size, n).tolist() for n in (5, 23, 1, 12)]
MAX_NEW = 10

# Stated tolerance of the int8 logits against f32, in units of the f32 logits' standard
# deviation. Rounding to 255 levels per output channel errs by at most max|w_col| / 254 per
# weight, about 0.6% of the weights' rms for these Gaussian columns of 48 to 96 inputs; four
# random layers amplify that to 2-3% of the logits (rms), so the bounds are about twice it.
RMS_TOL, MAX_TOL = 0.05, 0.25


_forward = jax.jit(llama.forward, static_argnames=("cfg",))


# --------------------------------------------------------------------------- the pieces


def test_quantize_weight_is_per_output_channel_int8():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(3, 20, 7)).astype(np.float32)  # [L, in, out]
    w[1, :, 4] = 0.0  # an all-zero channel
    qa = quant.quantize_weight(jnp.asarray(w))
    q, scale = np.asarray(qa.q), np.asarray(qa.scale)
    assert q.dtype == np.int8 and q.shape == w.shape and scale.shape == (3, 7)
    assert scale.dtype == np.float32 and np.abs(q).max() <= 127
    amax = np.abs(w).max(axis=1)  # [L, out]
    np.testing.assert_allclose(scale, np.where(amax > 0, amax / 127, 1.0), rtol=1e-6)
    # Round to nearest: every weight within half a step of its channel's scale.
    err = np.abs(q * scale[:, None, :] - w)
    assert np.all(err <= scale[:, None, :] / 2 * (1 + 1e-5))
    assert np.all(q[1, :, 4] == 0)
    # The largest weight of each (non-zero) channel is represented exactly: +-127.
    assert np.all(np.abs(q).max(axis=1)[amax > 0] == 127)
    np.testing.assert_allclose(np.asarray(quant.dequantize(qa)), q * scale[:, None, :])


def test_linear_equals_matmul_with_dequantized_weight():
    rng = np.random.default_rng(1)
    qa = quant.quantize_weight(jnp.asarray(rng.normal(size=(24, 10)), jnp.float32))
    x = rng.normal(size=(2, 5, 24)).astype(np.float32)
    want = x @ (np.asarray(qa.q, np.float64) * np.asarray(qa.scale, np.float64))
    got = quant.linear(jnp.asarray(x), qa)
    assert got.dtype == jnp.float32 and got.shape == (2, 5, 10)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    got16 = quant.linear(jnp.asarray(x, jnp.bfloat16), qa)
    assert got16.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got16, np.float32), want, rtol=0.05, atol=0.05)
    # A plain weight goes through the same function unchanged.
    w = np.asarray(quant.dequantize(qa))
    np.testing.assert_allclose(np.asarray(quant.linear(jnp.asarray(x), jnp.asarray(w))),
                               x @ w, rtol=1e-5, atol=1e-5)


def test_int8_params_use_a_quarter_of_the_f32_bytes():
    """Counted: each quantized weight is 1 byte per element plus one f32 scale per output
    channel and layer; the embedding, head and norms keep their f32 bytes."""
    f32 = quant.param_bytes(PARAMS)
    int8 = quant.param_bytes(QPARAMS)
    n_w = sum(PARAMS.weight(k).size for k in quant.QUANTIZED_KEYS)
    n_scales = sum(PARAMS.weight(k).shape[0] * PARAMS.weight(k).shape[-1]
                   for k in quant.QUANTIZED_KEYS)
    assert int8 == f32 - 4 * n_w + n_w + 4 * n_scales
    q_bytes = sum(QPARAMS.weight(k).nbytes for k in quant.QUANTIZED_KEYS)
    assert q_bytes == n_w + 4 * n_scales
    # 1/4 + 1/in for the smallest input width (48): at most 0.271 of the f32 bytes, half bf16.
    assert q_bytes / (4 * n_w) <= 0.25 + 1 / CFG.d_model
    assert q_bytes / (2 * n_w) <= 0.5 + 2 / CFG.d_model
    for k in quant.QUANTIZED_KEYS:
        assert QPARAMS.weight(k).q.dtype == jnp.int8
    for k in ("embed", "lm_head", "final_norm"):  # kept in the model dtype (exit heads read
        assert QPARAMS.weight(k) is PARAMS.weight(k)  # the head)


def test_check_params_accepts_the_int8_tree_and_still_checks_shapes():
    llama.check_params(CFG, QPARAMS)
    bad = QPARAMS.replace(layers=QPARAMS.layers.replace(
        wq=quant.quantize_weight(PARAMS.layers.wq[:, :-1])))
    with pytest.raises(llama.ParamsMismatchError, match="wq"):
        llama.check_params(CFG, bad)
    # a loader's own dict of weights is quantized in place, to the same int8 weights, and
    # the Params given are left as they were
    fresh = PARAMS.layers.to_dict()
    quant.quantize_layers(fresh, "int8")
    np.testing.assert_array_equal(np.asarray(fresh["w_up"].q),
                                  np.asarray(QPARAMS.layers.w_up.q))
    assert fresh["attn_norm"] is PARAMS.layers.attn_norm
    assert not isinstance(PARAMS.layers.w_up, quant.QArray)
    # Quantizing twice keeps the int8 weights; casting keeps them int8.
    assert quant.quantize_params(QPARAMS).layers.wq is QPARAMS.layers.wq
    cast = llama.cast_params(QPARAMS, jnp.bfloat16)
    assert cast.layers.wq.q.dtype == jnp.int8 and cast.embed.dtype == jnp.bfloat16


# --------------------------------------------------------------------------- logits


@pytest.mark.parametrize("which", ["llama", "mixed"])
def test_int8_logits_within_tolerance_of_f32(which):
    cfg = CFG if which == "llama" else MIXED
    params = PARAMS if which == "llama" else llama.init_params(MIXED, jax.random.PRNGKey(4),
                                                               scale=0.1)
    qparams = quant.quantize_params(params)
    ref = np.asarray(_forward(params, TOKENS, cfg=cfg))
    got = np.asarray(_forward(qparams, TOKENS, cfg=cfg))
    # The int8 model computes exactly what f32 does with the dequantized weights (the scale
    # commutes with the dot): every layer weight went through `linear`.
    same = np.asarray(_forward(quant.dequantize_params(qparams), TOKENS, cfg=cfg))
    np.testing.assert_allclose(got, same, rtol=1e-4, atol=1e-4 * ref.std())
    err = got - ref
    assert np.sqrt(np.mean(err ** 2)) <= RMS_TOL * ref.std(), np.sqrt(np.mean(err ** 2))
    assert np.abs(err).max() <= MAX_TOL * ref.std(), np.abs(err).max()
    # Greedy (teacher-forced) agreement: a flip needs the f32 top-2 margin below 2 max|err|;
    # on these random models few positions are that close.
    agree = (got.argmax(-1) == ref.argmax(-1)).mean()
    assert agree >= 0.9, agree
    top2 = np.sort(ref, axis=-1)[..., -2:]
    sure = (top2[..., 1] - top2[..., 0]) > 2 * MAX_TOL * ref.std()
    assert sure.any()
    assert np.all(got.argmax(-1)[sure] == ref.argmax(-1)[sure])


# --------------------------------------------------------------------------- engine


def engine_config(**kw) -> dict:
    base = dict(max_num_seqs=4, max_model_len=64, page_size=16, num_pages=24,
                max_prefill_chunk=32, max_num_batched_tokens=128, batch_buckets=(4,))
    base.update(kw)
    return base


def test_engine_full_depth_on_int8_equals_dense_int8_forward():
    """LLM(quantize="int8") at full depth == greedy by the dense forward of the same int8
    weights (no cache, no paging)."""
    llm = LLM(LoadedModel(CFG, PARAMS, None, "tiny"), quantize="int8", early_exit=False,
              progress=False, **engine_config())
    assert isinstance(llm.model.params.layers.w_down, quant.QArray)
    outs = llm.generate(PROMPTS, greedy(MAX_NEW), use_tqdm=False)
    want = [dense_greedy(CFG, QPARAMS, p, MAX_NEW, width=64) for p in PROMPTS]
    assert [o.token_ids for o in outs] == want
    llm.generate(PROMPTS[:2], greedy(4), use_tqdm=False)
    # no recompilation in steady state: a new batch may meet a new bucket (a prefill step's
    # packed tokens follow the prompts' lengths), never trace a shape twice
    assert set(llm.engine.runner.traces.values()) <= {0, 1}


def test_engine_forced_exit_and_backfill_on_int8():
    """Exits forced at layer 2: the int8 engine samples from the exit head and back-fills
    layers 2..3 through int8 `kv_project`; it must equal an f32 engine on the dequantized
    weights, tokens and every cache entry (the back-filled ones included). With 4 devices
    (conftest asks XLA for 8), the int8 engine sharded over tp=2, dp=2 must equal it too."""
    ec = ExitConfig(exit_layers=(1, 2, 3), force_exit_layer=2)
    runs = [(QPARAMS, None), (quant.dequantize_params(QPARAMS), None)]
    if len(jax.devices()) >= 4:
        runs.append((QPARAMS, "tp=2,dp=2"))
    engines = [LLMEngine(CFG, p, None, EngineConfig.make(**engine_config(mesh=mesh)), ec)
               for p, mesh in runs]
    outs = [run_requests(e, PROMPTS, greedy(MAX_NEW)) for e in engines]
    for other in outs[1:]:
        assert [o.token_ids for o in outs[0]] == [o.token_ids for o in other]
    for o in outs[0]:  # the first token comes from prefill, at full depth
        assert o.exit_layers == [CFG.n_layers] + [2] * (MAX_NEW - 1)
    k8, *ks = (np.asarray(e.runner.cache.k) for e in engines)
    v8, *vs = (np.asarray(e.runner.cache.v) for e in engines)
    assert np.abs(k8[2:]).sum() > 0  # back-fill wrote the skipped layers
    for k, v in zip(ks, vs, strict=True):
        np.testing.assert_allclose(k8, k, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(v8, v, rtol=1e-4, atol=1e-5)
    if len(engines) == 3:  # the int8 weight and its scales are split over the heads
        wq = engines[2].runner.params.layers.wq
        assert isinstance(wq, quant.QArray) and len(wq.q.sharding.device_set) == 4
        assert wq.q.addressable_shards[0].data.shape[-1] == wq.q.shape[-1] // 2
        assert wq.scale.addressable_shards[0].data.shape[-1] == wq.scale.shape[-1] // 2


# --------------------------------------------------------------------------- bad input


def test_unsupported_quantize_is_a_clear_error(capsys):
    with pytest.raises(quant.QuantizeError, match=r"fp8.*int8.*int4"):
        quant.check_quantize("fp8")
    with pytest.raises(quant.QuantizeError, match="int8"):
        load_model("no-such-model", quantize="fp8", progress=False)  # before any loading
    with pytest.raises(quant.QuantizeError, match="int8"):
        quantize_model(LoadedModel(CFG, PARAMS, None, "tiny"), "fp8")
    with pytest.raises(quant.QuantizeError, match="int8"):
        LLM(LoadedModel(CFG, PARAMS, None, "tiny"), quantize="fp8", progress=False)
    with pytest.raises(SystemExit) as exit_:  # argparse's choices: usage and status 2
        cli_main(["generate", "--model", "random", "--quantize", "fp8", "--prompt", "hi",
                  "--quiet"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'fp8'" in err and "int4" in err


# --------------------------------------------------------------------------- int4

CFG4 = tiny_config(d_model=64, ffn_dim=128, eos_token_ids=())  # inputs multiples of 32
PARAMS4 = llama.init_params(CFG4, jax.random.PRNGKey(0))


def test_int4_is_q4_1_blocks_served_exactly_within_the_stated_tolerance():
    """quantize="int4": every layer matmul weight in GGUF Q4_1 blocks of 32 (0.625 bytes a
    weight); the engine serves that model exactly (its greedy tokens are the dense forward's
    over the dequantized blocks), and on this tiny random model stays within the stated
    tolerance of f32: logits off by at most one logit standard deviation, argmax agreeing
    on >= 70 % of positions (int8: 4 %, 98 %)."""
    model = quantize_model(LoadedModel(CFG4, PARAMS4, None, "tiny"), "int4")
    layers = model.params.layers
    assert all(isinstance(getattr(layers, k), quant.BlockQ)
               and getattr(layers, k).kind == "Q4_1" for k in quant.QUANTIZED_KEYS)
    deq = quant.dequantize_params(model.params)
    toks = jnp.asarray(np.random.default_rng(0).integers(3, CFG4.vocab_size, (4, 24)))
    ref, out = (llama.forward(p, toks, CFG4) for p in (PARAMS4, deq))
    assert float(jnp.max(jnp.abs(out - ref)) / jnp.std(ref)) <= 1.0
    assert float(jnp.mean(jnp.argmax(out, -1) == jnp.argmax(ref, -1))) >= 0.7
    prompts = [[5, 9, 17, 3], [44, 2, 8]]
    want = [dense_greedy(CFG4, deq, p, 8) for p in prompts]
    # and sharded over tp=2 (conftest asks XLA for 8 devices), still in its blocks
    for mesh in (None, "tp=2") if len(jax.devices()) >= 2 else (None,):
        eng = LLMEngine(CFG4, model.params, None, EngineConfig.make(
            max_num_seqs=2, max_model_len=64, page_size=8, num_pages=20, batch_buckets=(1, 2),
            mesh=mesh))
        assert isinstance(eng.runner.params.layers.w_up, quant.BlockQ)
        outs = run_requests(eng, prompts, greedy(8))
        assert [o.token_ids for o in outs] == want, mesh


def test_int4_names_a_weight_it_cannot_block():
    with pytest.raises(quant.QuantizeError, match="'wq' has 48 inputs; use quantize='int8'"):
        quantize_model(LoadedModel(CFG, PARAMS, None, "tiny"), "int4")
