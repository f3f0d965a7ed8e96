"""Properties of the pure model functions (tiny random model)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ee_jax.models import llama
from ee_jax.models.config import ConfigError, ModelConfig
from ee_jax.testing import tiny_model

CFG, PARAMS = tiny_model(seed=1)
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 40)), jnp.int32)


def test_kv_project_is_what_the_layer_attends_to():
    lp = llama.layer_params(PARAMS, 2)
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 7, CFG.d_model))
    pos = jnp.broadcast_to(jnp.arange(5, 12), (2, 7))
    seen = {}

    def attend(q, k, v):
        seen["k"], seen["v"] = k, v
        return jnp.zeros_like(q), None

    llama.decoder_layer(lp, x, pos, CFG, attend)
    k, v = llama.kv_project(lp, x, pos, CFG)
    np.testing.assert_array_equal(np.asarray(k), np.asarray(seen["k"]))
    np.testing.assert_array_equal(np.asarray(v), np.asarray(seen["v"]))


def test_hidden_states_and_head_agree_with_logits():
    logits, hidden = llama.forward(PARAMS, TOKENS, CFG, return_hidden=True)
    assert hidden.shape == (CFG.n_layers, *TOKENS.shape, CFG.d_model)
    np.testing.assert_allclose(np.asarray(llama.final_head(PARAMS, hidden[-1], CFG)),
                               np.asarray(logits), atol=1e-6)


def test_causal_future_tokens_do_not_change_the_past():
    changed = TOKENS.at[:, 25:].set((TOKENS[:, 25:] + 7) % CFG.vocab_size)
    a = llama.forward(PARAMS, TOKENS, CFG)
    b = llama.forward(PARAMS, changed, CFG)
    np.testing.assert_allclose(np.asarray(a[:, :25]), np.asarray(b[:, :25]), atol=1e-6)
    assert not np.allclose(np.asarray(a[:, 25:]), np.asarray(b[:, 25:]))


def test_rope_makes_scores_depend_only_on_relative_position():
    inv = llama.rope_inv_freq(CFG)
    q = jax.random.normal(jax.random.PRNGKey(1), (1, 1, CFG.head_dim))
    k = jax.random.normal(jax.random.PRNGKey(2), (1, 1, CFG.head_dim))

    def score(pq, pk):
        rq = llama.apply_rope(q, jnp.asarray([pq]), inv)
        rk = llama.apply_rope(k, jnp.asarray([pk]), inv)
        return float(jnp.sum(rq * rk))

    assert score(10, 3) == pytest.approx(score(507, 500), rel=1e-4, abs=1e-4)


def test_bfloat16_forward_tracks_float32():
    cfg16 = CFG.replace(dtype="bfloat16")
    p16 = llama.cast_params(PARAMS, jnp.bfloat16)
    llama.check_params(cfg16, p16)
    a = np.asarray(llama.forward(PARAMS, TOKENS, CFG))
    b = np.asarray(llama.forward(p16, TOKENS, cfg16))
    assert b.dtype == np.float32  # logits stay f32
    assert np.abs(a - b).max() < 0.05 * np.abs(a).max() + 0.05
    assert (a.argmax(-1) == b.argmax(-1)).mean() > 0.8


def test_full_size_shapes_without_allocating():
    cfg = ModelConfig(vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3,
                      head_dim=64, ffn_dim=1536, tie_embeddings=True)
    params = llama.param_shapes(cfg)
    out = jax.eval_shape(lambda p, t: llama.forward(p, t, cfg, return_hidden=True), params,
                         jax.ShapeDtypeStruct((2, 300), jnp.int32))
    assert out[0].shape == (2, 300, 49152) and out[1].shape == (30, 2, 300, 576)


@pytest.mark.parametrize("kw, field", [
    (dict(n_heads=9, n_kv_heads=4), "n_kv_heads"), (dict(head_dim=15), "head_dim"),
    (dict(d_model=0), "d_model"), (dict(dtype="int8"), "dtype"),
    (dict(activation="relu"), "activation"), (dict(sliding_window=0), "sliding_window"),
    (dict(sliding_window=4, layer_types=("full_attention",) * 2), "layer_types"),
    (dict(layer_types=("sliding_attention",)), "sliding_window"),
    (dict(sliding_window=4, layer_types=("chunked_attention",)), "layer_types"),
    (dict(attn_logit_softcap=0.0), "attn_logit_softcap"),
])
def test_bad_config_names_the_field(kw, field):
    base = dict(vocab_size=10, d_model=8, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=4,
                ffn_dim=8)
    base.update(kw)
    with pytest.raises(ConfigError, match=field):
        ModelConfig(**base)


def test_check_params_reports_missing_extra_and_misshaped():
    bias = jnp.zeros((CFG.n_layers, CFG.n_heads * CFG.head_dim))  # a weight CFG has not
    bad = PARAMS.replace(layers=PARAMS.layers.replace(wq=None, bq=bias),
                         final_norm=jnp.zeros(5))
    with pytest.raises(llama.ParamsMismatchError) as e:
        llama.check_params(CFG, bad)
    msg = str(e.value)
    assert "missing ['layers.wq']" in msg and "unexpected ['layers.bq']" in msg
    assert "final_norm has shape (5,), expected (48,)" in msg
    # the dict form: a key that is no weight is named where it is converted
    extra = {**PARAMS.to_dict(), "extra": jnp.zeros(3)}
    with pytest.raises(llama.ParamsMismatchError, match=r"no weight\(s\) \['extra'\]"):
        llama.check_params(CFG, extra)


@pytest.mark.parametrize("lead", [(1,), (8,), (2, 3), (100,)])
def test_tied_head_equals_numpy_and_differentiates(lead):
    """The tied LM head (the embedding, output-major) in every product `unembed` picks by
    rows: logits and their gradient with respect to the hidden state equal numpy's."""
    cfg, params = tiny_model(seed=6, tie_embeddings=True)
    rng = np.random.default_rng(len(lead))
    xn = rng.normal(size=(*lead, cfg.d_model)).astype(np.float32)
    E = np.asarray(params.embed, np.float64)  # [V, D]
    got = np.asarray(jax.jit(llama.unembed, static_argnums=2)(params, jnp.asarray(xn), cfg))
    np.testing.assert_allclose(got, xn @ E.T, rtol=1e-5, atol=1e-5)
    c = rng.normal(size=(*lead, cfg.vocab_size)).astype(np.float32)
    grad = jax.jit(jax.grad(lambda x: jnp.sum(llama.unembed(params, x, cfg) * c)))(
        jnp.asarray(xn))
    np.testing.assert_allclose(np.asarray(grad), c @ E, rtol=1e-4, atol=1e-4)
