"""Issue #12, the cheaper first check: the candidate search over the vocabulary subset reads
int8 copies of its LM-head rows (`exit_heads.with_vocab_rows`, `approx_subset_logits`), and the k
candidates are then scored exactly. Truths: the f32 head (`llama.unembed`, the f32 search),
numpy, the reference per-position decode of tests/test_exit_decision.py."""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ee_jax.models import llama
from ee_jax.models.exits import checks as exit_checks
from ee_jax.models.exits import heads as exit_heads
from ee_jax.models.exits.checkpoint import load_exit_heads, save_exit_heads
from ee_jax.models.exits.config import NEVER, ExitConfig, ExitConfigError
from ee_jax.testing import tiny_model

CFG, PARAMS = tiny_model(seed=5)
TIED_CFG, TIED_PARAMS = tiny_model(seed=6, tie_embeddings=True)
SUBSET = np.array([7, 3, 100, 64, 5, 99, 12, 40, 41, 77, 2, 1, 50, 51, 52, 60, 61, 90, 91, 120],
                  np.int32)
K = 8  # candidates, as shipped


def subset_heads(cfg, params, subset=SUBSET, k=K, seed=0):
    ec = ExitConfig(exit_layers=(1, 2, 3), head="mlp", adapter_rank=8,
                    measure="candidates", vocab_subset=len(subset), candidates=k)
    heads = exit_heads.init_heads(cfg, ec, params, jax.random.PRNGKey(seed))
    vocab = exit_heads.VocabSubset(subset, "tiny", cfg.vocab_size)
    heads = exit_heads.attach_vocab_subset(heads, vocab, cfg, "tiny")
    key = jax.random.PRNGKey(seed + 1)
    heads = heads.replace(
        mlp=heads.mlp.replace(up=0.3 * jax.random.normal(key, heads.mlp.up.shape)),
        decision=heads.decision.replace(w2=jax.random.normal(jax.random.fold_in(key, 2),
                                                             heads.decision.w2.shape)))
    return ec, heads


def head_rows(cfg, params) -> np.ndarray:
    return np.asarray(llama.unembed(params, jnp.eye(cfg.d_model), cfg)).T  # [V, D]


def first_check(params, heads, h, cfg, ec):
    st0 = exit_checks.init_check_state(h, ec)
    return exit_checks.candidate_features(params, heads, 0, h, st0, cfg, ec, first=True)


@pytest.mark.parametrize("cfg,params", [(CFG, PARAMS), (TIED_CFG, TIED_PARAMS)],
                         ids=["untied", "tied"])
def test_int8_rows_and_the_approximate_logits(cfg, params):
    _, heads = subset_heads(cfg, params)
    hv = exit_heads.with_vocab_rows(params, heads, cfg)
    w = head_rows(cfg, params)[SUBSET]  # [K, D]
    np.testing.assert_array_equal(np.asarray(hv.vocab_rows), w)  # the f32 rows kept as-is
    q, s = np.asarray(hv.vocab_rows_q), np.asarray(hv.vocab_rows_scale)
    assert q.dtype == np.int8 and s.dtype == np.float32 and s.shape == (len(SUBSET),)
    np.testing.assert_allclose(s, np.abs(w).max(1) / 127, rtol=1e-6)
    np.testing.assert_array_equal(q, np.round(w / s[:, None]))
    # the product: only the weights' rounding remains (x split into hi + lo/254)
    h = jax.random.normal(jax.random.PRNGKey(3), (5, cfg.d_model))
    hn = exit_heads.exit_hidden(heads, 0, h, cfg)
    x = np.asarray(hn, np.float64)
    deq = x @ (q.astype(np.float64) * s[:, None]).T
    for xs in (hn, hn[:1], hn[0]):  # batch 5, batch 1, no batch axis
        got = np.asarray(exit_heads.approx_subset_logits(hv, xs, cfg))
        want = deq[:len(np.atleast_2d(xs))].reshape(got.shape)
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=2e-3 * np.abs(deq).max())
    # and they approximate the exact logits within the rows' rounding: |x| . scale / 2
    exact = x @ w.T
    bound = np.abs(x).sum(1, keepdims=True) * s / 2 + 1e-4
    assert (np.abs(np.asarray(exit_heads.approx_subset_logits(hv, hn, cfg)) - exact) <= bound).all()


@pytest.mark.parametrize("cfg,params", [(CFG, PARAMS), (TIED_CFG, TIED_PARAMS)],
                         ids=["untied", "tied"])
def test_candidates_carry_their_exact_logits(cfg, params):
    """Whatever the int8 search picks, the candidates' logits (what the features and later
    checks see) are the f32 head's at those ids, in descending order; p0 is a probability
    close to the f32 search's."""
    ec, heads = subset_heads(cfg, params)
    hv = exit_heads.with_vocab_rows(params, heads, cfg)
    h = jax.random.normal(jax.random.PRNGKey(4), (6, cfg.d_model))
    feats, st = first_check(params, hv, h, cfg, ec)
    full = np.asarray(llama.unembed(params, exit_heads.exit_hidden(heads, 0, h, cfg), cfg))
    cand = np.asarray(st.cand)
    assert np.isin(cand, SUBSET).all()
    assert all(len(set(r)) == K for r in cand)
    zc = np.asarray(st.cand_logit)
    np.testing.assert_allclose(zc, np.take_along_axis(full, cand, 1), rtol=1e-5, atol=1e-5)
    assert (np.diff(zc, axis=1) <= 0).all()
    sub = full[:, SUBSET]
    p0_exact = np.exp(sub.max(1) - np.log(np.exp(sub - sub.max(1, keepdims=True)).sum(1))
                      - sub.max(1))
    p0 = np.asarray(st.p0)
    assert ((p0 > 0) & (p0 <= 1)).all()
    f32_feats, f32_st = first_check(params, exit_heads.with_vocab_rows(params, heads, cfg, None), h,
                                         cfg, ec)
    np.testing.assert_allclose(np.asarray(f32_st.p0), p0_exact, rtol=1e-5)
    np.testing.assert_allclose(p0, p0_exact, atol=5e-3)
    np.testing.assert_allclose(np.asarray(feats[:, 8]), p0)
    # where the two searches keep the same ids, every other feature is the same
    same = (cand == np.asarray(f32_st.cand)).all(1)
    assert same.any()
    np.testing.assert_allclose(np.asarray(feats)[same, :8], np.asarray(f32_feats)[same, :8],
                               rtol=1e-5, atol=1e-5)


def test_well_separated_top_k_is_found_exactly():
    """A hidden state whose exact top 8 stand far apart (gaps much larger than the int8
    rounding): the int8 search returns the f32 search's ids, in its order, and the same
    features but p0."""
    cfg, params = TIED_CFG, TIED_PARAMS
    subset = np.arange(3, 3 + 96, dtype=np.int32)  # 96 ids: 3 blocks of `exit_checks.top_k`
    ec, heads = subset_heads(cfg, params, subset)
    heads = heads.replace(mlp=heads.mlp.replace(up=jnp.zeros_like(heads.mlp.up)),
                          norm=jnp.ones_like(heads.norm))  # exit hidden: h / rms(h)
    rng = np.random.default_rng(0)
    v = rng.normal(size=cfg.d_model)
    v /= np.linalg.norm(v)
    top = rng.choice(subset, K, replace=False)
    embed = np.asarray(params.embed).copy()
    embed[top] = (2.0 + 0.5 * np.arange(K))[::-1, None] * v  # 5.5, 5.0, .. 2.0 times |hn|
    params = params.replace(embed=jnp.asarray(embed))
    h = jnp.asarray(np.stack([v, 3 * v, v + 0.01 * rng.normal(size=cfg.d_model)]),
                    jnp.float32)
    f8, s8 = first_check(params, exit_heads.with_vocab_rows(params, heads, cfg), h, cfg, ec)
    f32, s32 = first_check(params, exit_heads.with_vocab_rows(params, heads, cfg, None), h, cfg, ec)
    np.testing.assert_array_equal(np.asarray(s8.cand), np.asarray(s32.cand))
    np.testing.assert_array_equal(np.asarray(s8.cand)[0], top)
    np.testing.assert_allclose(np.asarray(s8.cand_logit), np.asarray(s32.cand_logit),
                               rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(f8)[:, :8], np.asarray(f32)[:, :8], rtol=1e-6,
                               atol=1e-6)
    np.testing.assert_allclose(np.asarray(f8)[:, 8], np.asarray(f32)[:, 8], atol=1e-4)


def test_derived_leaves_are_checked_and_never_saved(tmp_path):
    ec, heads = subset_heads(CFG, PARAMS)
    hv = exit_heads.with_vocab_rows(PARAMS, heads, CFG)
    assert set(hv.parts()) - set(heads.parts()) == set(exit_heads.DERIVED_LEAVES)
    exit_heads.check_heads(CFG, ec, hv)
    again = exit_heads.with_vocab_rows(PARAMS, hv, CFG)  # idempotent: derived from the head again
    assert set(again.parts()) == set(hv.parts())
    np.testing.assert_array_equal(np.asarray(again.vocab_rows_q), np.asarray(hv.vocab_rows_q))
    assert (set(exit_heads.with_vocab_rows(PARAMS, hv, CFG, None).parts())
            == set(heads.parts()) | {"vocab_rows"})
    with pytest.raises(ExitConfigError, match="vocab_rows_q"):
        exit_heads.check_heads(CFG, ec, hv.replace(vocab_rows_q=hv.vocab_rows_q[:3]))
    with pytest.raises(ExitConfigError, match="vocab_rows_scale"):
        exit_heads.check_heads(CFG, ec, hv.replace(vocab_rows_scale=jnp.ones((3,))))
    with pytest.raises(ExitConfigError, match="candidate_dtype"):
        exit_heads.with_vocab_rows(PARAMS, heads, CFG, "int4")
    save_exit_heads(tmp_path / "h", CFG, ec, hv)  # serving heads saved: the derived leaves drop
    saved = " ".join(os.listdir(tmp_path / "h"))
    ec2, back = load_exit_heads(tmp_path / "h", CFG)
    assert ec2 == ec and set(back.parts()) == set(heads.parts()), saved
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(heads), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    exit_heads.check_heads(CFG, ec, exit_heads.with_vocab_rows(PARAMS, back, CFG))
    plain = dataclasses.replace(ec, measure="max_prob", vocab_subset=0)  # no subset: as is
    ph = exit_heads.init_heads(CFG, plain, PARAMS)
    assert exit_heads.with_vocab_rows(PARAMS, ph, CFG) is ph


def test_decisions_from_the_int8_search_emit_exact_subset_tokens():
    """Per-position decode with the int8 search (every token leaves at the first exit at
    threshold 0): the emitted logits are the exit head's exact f32 subset logits, so the token
    is the exact subset argmax, and nothing outside the subset can be emitted or sampled."""
    from tests.test_exit_decision import reference_decode

    cfg, params = CFG, PARAMS
    ec, heads = subset_heads(cfg, params)
    hv = exit_heads.with_vocab_rows(params, heads, cfg)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, 24), jnp.int32)
    _, hidden = llama.forward(params, tokens[None], cfg, return_hidden=True)
    for thr in (0.0, 0.5):
        logits, slot = map(np.asarray, reference_decode(cfg, params, ec, hv, tokens, thr))
        left = slot >= 0
        assert left.any()
        assert np.isin(logits[left].argmax(-1), SUBSET).all()
        p = np.asarray(jax.nn.softmax(jnp.asarray(logits[left]), axis=-1))
        assert (p[:, np.setdiff1d(np.arange(cfg.vocab_size), SUBSET)] == 0).all()
        for t in np.flatnonzero(left):
            s = int(slot[t])
            want = np.asarray(exit_heads.exit_logits(params, heads, s,
                                                     hidden[ec.exit_layers[s] - 1, 0, t], cfg))
            np.testing.assert_allclose(logits[t], want, rtol=1e-5, atol=1e-5)
    logits, slot = map(np.asarray, reference_decode(cfg, params, ec, hv, tokens, NEVER))
    assert (slot == -1).all()
