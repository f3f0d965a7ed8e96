"""Issue #12: vocabulary-subset exit heads, exit decisions from candidate features, the
calibrated threshold and the cost model, against independent truths (the dense reference
`llama.forward`, numpy, scipy, closed forms)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from ee_jax.models import llama
from ee_jax.models.exits import checks as exit_checks
from ee_jax.models.exits import cost as exit_cost
from ee_jax.models.exits import heads as exit_heads
from ee_jax.models.exits import threshold as exit_threshold
from ee_jax.models.exits.checkpoint import load_exit_heads, save_exit_heads
from ee_jax.models.exits.config import (
    DECISION_HIDDEN,
    N_FEATURES,
    NEVER,
    ExitConfig,
    ExitConfigError,
)
from ee_jax.testing import tiny_config, tiny_model
from ee_jax.training import calibrate

CFG, PARAMS = tiny_model(seed=5)
TIED_CFG, TIED_PARAMS = tiny_model(seed=6, tie_embeddings=True)
SUBSET = np.array([7, 3, 100, 64, 5, 99, 12, 40, 41, 77, 2, 1], np.int32)


def subset_heads(cfg, params, measure="candidates", k=4, seed=0):
    ec = ExitConfig(exit_layers=(1, 2, 3), head="mlp", adapter_rank=8, measure=measure,
                    vocab_subset=len(SUBSET), candidates=k)
    heads = exit_heads.init_heads(cfg, ec, params, jax.random.PRNGKey(seed))
    subset = exit_heads.VocabSubset(SUBSET, "tiny", cfg.vocab_size)
    heads = exit_heads.attach_vocab_subset(heads, subset, cfg, "tiny")
    key = jax.random.PRNGKey(seed + 1)
    heads = heads.replace(mlp=heads.mlp.replace(
        up=0.3 * jax.random.normal(key, heads.mlp.up.shape)))
    if heads.decision is not None:  # a decision MLP with some spread, so thresholds matter
        heads = heads.replace(decision=heads.decision.replace(w2=jax.random.normal(
            jax.random.fold_in(key, 2), heads.decision.w2.shape)))
    return ec, heads


@pytest.mark.parametrize("cfg,params", [(CFG, PARAMS), (TIED_CFG, TIED_PARAMS)],
                         ids=["untied", "tied"])
def test_subset_logits_equal_the_full_head_at_the_subset_ids(cfg, params):
    _, heads = subset_heads(cfg, params)
    h = jax.random.normal(jax.random.PRNGKey(3), (5, cfg.d_model))
    hn = exit_heads.exit_hidden(heads, 1, h, cfg)
    full = np.asarray(llama.unembed(params, hn, cfg))  # [5, V]
    np.testing.assert_allclose(np.asarray(exit_heads.unembed_rows(params, hn, jnp.asarray(SUBSET),
                                                                  cfg)), full[:, SUBSET],
                               rtol=1e-6, atol=1e-6)
    got = np.asarray(exit_heads.exit_logits(params, heads, 1, h, cfg))
    np.testing.assert_allclose(got[:, SUBSET], full[:, SUBSET], rtol=1e-6, atol=1e-6)
    outside = np.setdiff1d(np.arange(cfg.vocab_size), SUBSET)
    assert (got[:, outside] == exit_heads.MASKED).all()
    # per-row heads: exit rows score the subset only, final rows the whole vocabulary
    slots = jnp.asarray([1, -1, 0, -1, 2])
    rows = np.asarray(exit_heads.row_exit_logits(params, heads, slots, h, cfg))
    final = np.asarray(llama.final_head(params, h, cfg))
    for b, s in enumerate(np.asarray(slots)):
        if s < 0:
            np.testing.assert_allclose(rows[b], final[b], rtol=1e-6, atol=1e-6)
        else:
            want = np.asarray(exit_heads.exit_logits(params, heads, int(s), h[b:b + 1], cfg))[0]
            np.testing.assert_allclose(rows[b], want, rtol=1e-6, atol=1e-6)
            assert int(np.argmax(rows[b])) in SUBSET


@functools.partial(jax.jit, static_argnames=("cfg", "ec"))
def reference_decode(cfg, params, ec, heads, tokens, threshold):
    """Teacher-forced per-position exits, written plainly: the dense reference's hidden states,
    `check_confidence` at every exit in order, the first confident exit taken, that row's
    logits from `row_exit_logits`. Returns (logits [T, V], exit slot [T] (-1: full depth))."""
    _, hidden = llama.forward(params, tokens[None], cfg, return_hidden=True)
    state = exit_checks.init_check_state(llama.embed(params, tokens, cfg), ec)
    slot = jnp.full(tokens.shape[0], -1)
    h_exit = hidden[-1, 0]
    for s, e in enumerate(ec.exit_layers):
        conf, _, state = exit_checks.check_confidence(params, heads, s, hidden[e - 1, 0], state,
                                                      cfg, ec)
        leave = (conf >= threshold) & (slot < 0)
        slot = jnp.where(leave, s, slot)
        h_exit = jnp.where(leave[:, None], hidden[e - 1, 0], h_exit)
    return exit_heads.row_exit_logits(params, heads, slot, h_exit, cfg), slot


def test_candidate_decisions_emit_only_scored_tokens_and_never_is_full_depth():
    cfg, params = CFG, PARAMS  # (the tied head's row gathers: the subset-logits test)
    ec, heads = subset_heads(cfg, params)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, 24), jnp.int32)
    full = np.asarray(llama.forward(params, tokens[None], cfg))[0]
    logits, slot = map(np.asarray, reference_decode(cfg, params, ec, heads, tokens,
                                                    NEVER))
    assert (slot == -1).all()
    np.testing.assert_allclose(logits, full, rtol=1e-5, atol=1e-5)
    assert np.array_equal(logits.argmax(-1), full.argmax(-1))
    for thr in (0.0, 0.5):  # 0: every token leaves at the first exit
        logits, slot = map(np.asarray, reference_decode(cfg, params, ec, heads, tokens, thr))
        if thr == 0.0:
            assert (slot == 0).all()
        left = slot >= 0
        assert left.any()
        assert np.isin(logits[left].argmax(-1), SUBSET).all()
        # sampling can only reach the subset too: the rest has probability exactly 0
        p = np.asarray(jax.nn.softmax(jnp.asarray(logits[left]), axis=-1))
        assert (p[:, np.setdiff1d(np.arange(cfg.vocab_size), SUBSET)] == 0).all()


def test_candidate_features_follow_their_definition():
    ec, heads = subset_heads(CFG, PARAMS, k=3)
    h = jax.random.normal(jax.random.PRNGKey(9), (4, CFG.d_model))
    h2 = jax.random.normal(jax.random.PRNGKey(10), (4, CFG.d_model))
    st0 = exit_checks.init_check_state(jnp.zeros_like(h), ec)
    f0, st1 = exit_checks.candidate_features(PARAMS, heads, 0, h, st0, CFG, ec)
    sub = np.asarray(exit_heads.exit_logits(PARAMS, heads, 0, h, CFG))[:, SUBSET]
    want = SUBSET[np.argsort(-sub, axis=-1)[:, :3]]
    np.testing.assert_array_equal(np.asarray(st1.cand), want)
    p = np.exp(sub - sub.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(f0[:, 8]), p.max(-1), rtol=1e-5)  # exact top-1 prob
    f1, st2 = exit_checks.candidate_features(PARAMS, heads, 1, h2, st1, CFG, ec)
    z = np.asarray(exit_heads.exit_logits(PARAMS, heads, 1, h2, CFG))
    zc = np.take_along_axis(z, want, axis=-1)
    np.testing.assert_allclose(np.asarray(st2.cand_logit), zc, rtol=1e-5, atol=1e-5)
    pc = np.exp(zc - zc.max(-1, keepdims=True))
    pc /= pc.sum(-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(f1[:, 0]), pc.max(-1), rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(st2.cand), want)  # candidates persist


@settings(max_examples=40, deadline=None)
@given(shape=st.sampled_from([(130,), (3, 8192), (2, 1, 500), (4, 96)]),
       k=st.integers(1, 12), levels=st.integers(2, 50), seed=st.integers(0, 2**16))
def test_block_top_k_is_lax_top_k(shape, k, levels, seed):
    """`exit_checks.top_k` (block maxima first) returns exactly what `jax.lax.top_k` returns, ties
    included: values drawn from a few levels, so many entries tie."""
    z = np.random.default_rng(seed).integers(0, levels, shape).astype(np.float32)
    z = jnp.asarray(z - 1e3 * (np.arange(shape[-1]) % 7 == 3))  # and some far below
    want_v, want_i = jax.lax.top_k(z, k)
    got_v, got_i = exit_checks.top_k(z, k)
    np.testing.assert_array_equal(np.asarray(got_v), np.asarray(want_v))
    np.testing.assert_array_equal(np.asarray(got_i), np.asarray(want_i))
    assert got_i.dtype == jnp.int32


def test_later_checks_score_from_the_subset_rows_bit_for_bit():
    """A later check scores its candidates from the subset's rows at their positions
    (`CheckState.cand_pos`; on TPU a gather from the whole head copies the head first): the
    positions are where the candidate ids sit in the subset, and the logits are bit for bit
    those of the LM head's own rows at the ids (heads without the rows gather from the head),
    after the f32 and the int8 first check alike."""
    for cfg, params in ((CFG, PARAMS), (TIED_CFG, TIED_PARAMS)):
        ec, heads = subset_heads(cfg, params)
        h = jax.random.normal(jax.random.PRNGKey(7), (3, cfg.d_model))
        st0 = exit_checks.init_check_state(h, ec)
        for dtype in (None, "int8"):
            rows = exit_heads.with_vocab_rows(params, heads, cfg, candidate_dtype=dtype)
            _, st1 = exit_checks.candidate_features(params, rows, 0, h, st0, cfg, ec)
            np.testing.assert_array_equal(SUBSET[np.asarray(st1.cand_pos)],
                                          np.asarray(st1.cand))
            no_rows = rows.replace(vocab_rows=None)
            got, want = (exit_checks.candidate_features(params, hv, 1, 2 * h, st1, cfg, ec,
                                                        first=False)[1]
                         for hv in (rows, no_rows))
            np.testing.assert_array_equal(np.asarray(got.cand_logit),
                                          np.asarray(want.cand_logit))
            np.testing.assert_array_equal(np.asarray(got.cand_pos), np.asarray(st1.cand_pos))


def test_vocab_rows_gathered_once_change_nothing():
    """Heads holding the subset's LM-head rows (`with_vocab_rows`, f32 search) score, decide
    and pass `check_heads` exactly as heads that gather them per call. (The int8 candidate
    search: tests/test_exit_candidates.py.)"""
    for cfg, params in ((CFG, PARAMS), (TIED_CFG, TIED_PARAMS)):
        ec, heads = subset_heads(cfg, params)
        rows = exit_heads.with_vocab_rows(params, heads, cfg, candidate_dtype=None)
        exit_heads.check_heads(cfg, ec, rows)
        np.testing.assert_array_equal(
            np.asarray(rows.vocab_rows),
            np.asarray(llama.unembed(params, jnp.eye(cfg.d_model), cfg)).T[SUBSET])
        h = jax.random.normal(jax.random.PRNGKey(4), (3, cfg.d_model))
        st0 = exit_checks.init_check_state(h, ec)
        for hv in (heads, rows):
            f, st1 = exit_checks.candidate_features(params, hv, 0, h, st0, cfg, ec)
            f2, _ = exit_checks.candidate_features(params, hv, 1, 2 * h, st1, cfg, ec, first=False)
            if hv is heads:
                want = (f, st1.cand, f2)
            else:
                for a, b in zip(want, (f, st1.cand, f2), strict=True):
                    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6,
                                               atol=1e-6)
        np.testing.assert_allclose(np.asarray(exit_heads.exit_logits(params, rows, 1, h, cfg)),
                                   np.asarray(exit_heads.exit_logits(params, heads, 1, h, cfg)),
                                   rtol=1e-6, atol=1e-6)
    with pytest.raises(ExitConfigError, match="vocab_rows"):
        exit_heads.check_heads(CFG, ec, heads.replace(vocab_rows=jnp.zeros((3, CFG.d_model))))


def test_bad_subsets_targets_and_mismatched_models_are_clear_errors():
    _, heads = subset_heads(CFG, PARAMS)
    with pytest.raises(ExitConfigError, match="duplicate"):
        exit_heads.check_vocab_subset([1, 2, 2], CFG.vocab_size)
    with pytest.raises(ExitConfigError, match="outside"):
        exit_heads.check_vocab_subset([1, CFG.vocab_size], CFG.vocab_size)
    with pytest.raises(ExitConfigError, match="outside"):
        exit_heads.check_vocab_subset([-1, 3], CFG.vocab_size)
    with pytest.raises(ExitConfigError, match="made for"):
        other = exit_heads.VocabSubset(SUBSET, "other", CFG.vocab_size)
        exit_heads.attach_vocab_subset(heads, other, CFG, "tiny")
    with pytest.raises(ExitConfigError, match="made for"):
        bigger = exit_heads.VocabSubset(SUBSET, "tiny", 50_000)
        exit_heads.attach_vocab_subset(heads, bigger, CFG, "tiny")
    for bad in (0.0, -0.1, 1.01):
        with pytest.raises(ExitConfigError, match="target_agreement"):
            ExitConfig(exit_layers=(1,), target_agreement=bad)
        with pytest.raises(ExitConfigError, match="target agreement"):
            exit_threshold.check_target(bad)
    with pytest.raises(ExitConfigError, match="vocab_subset"):
        ExitConfig(exit_layers=(1,), vocab_subset=CFG.vocab_size + 1).validate_for(CFG)
    with pytest.raises(ExitConfigError, match="candidates"):
        ExitConfig(exit_layers=(1, 2), measure="candidates", min_exit_layer=2)


def test_subset_heads_round_trip_and_pick_a_threshold_per_target(tmp_path):
    ec, heads = subset_heads(CFG, PARAMS)
    conf = np.linspace(0, 1, 300)[None].repeat(3, 0)
    agree = conf > 0.3
    table = exit_threshold.calibration_table(conf, agree, ec.exit_layers, CFG.n_layers)
    save_exit_heads(tmp_path / "h", CFG, ec, heads, calibration=table.to_json())
    ec2, back = load_exit_heads(tmp_path / "h", CFG)
    np.testing.assert_array_equal(np.asarray(back.vocab), SUBSET)
    assert ec2 == ec
    ec3, _ = load_exit_heads(tmp_path / "h", CFG, target_agreement=0.9)
    assert ec3.threshold == exit_threshold.pick_threshold(table, 0.9)
    assert ec3.target_agreement == 0.9
    with pytest.raises(ExitConfigError, match="target agreement"):
        load_exit_heads(tmp_path / "h", CFG, target_agreement=1.5)
    # a subset whose ids this model does not have: heads from another vocabulary
    other = tiny_config(vocab_size=64)
    with pytest.raises(ExitConfigError):
        load_exit_heads(tmp_path / "h", other)


@settings(max_examples=40, deadline=None)
@given(bad=st.floats(0.05, 0.9), n_good=st.integers(20, 3000), bad_share=st.floats(0.15, 0.6),
       target=st.sampled_from([0.9, 0.95, 0.99]), delta=st.sampled_from([0.05, 0.1, 0.2]))
def test_learn_then_test_picks_the_threshold_the_guarantee_says(bad, n_good, bad_share,
                                                                target, delta):
    """Tokens whose exit is wrong all sit at confidence `bad`, a share far above 1 - target;
    every other token is right. Any threshold above `bad` has no error, so it is certified
    iff (1 - eps)^n <= delta (the binomial p-value of 0 errors); any threshold at or below
    `bad` has ~bad_share errors and is never certified. So the answer is the lowest grid point
    above `bad` when n is large enough, and no exit (NEVER) otherwise."""
    n_bad = max(1, round(bad_share * n_good / (1 - bad_share)))
    rng = np.random.default_rng(0)
    conf = np.concatenate([np.full(n_bad, bad), rng.uniform(bad + 1e-3, 1.0, n_good)])
    agree = np.concatenate([np.zeros(n_bad, bool), np.ones(n_good, bool)])
    grid = tuple(np.round(np.arange(0.99, 0.0, -0.01), 2))
    table = exit_threshold.calibration_table(conf[None], agree[None], (1,), 4, grid=grid)
    n, eps = n_bad + n_good, 1 - target
    got = exit_threshold.pick_threshold(table, target, delta)
    if stats.binom.cdf(0, n, eps) <= delta and n_bad / n > 2 * eps + 3 / np.sqrt(n):
        want = min(t for t in grid if t > bad)
        assert got == want
    elif stats.binom.cdf(0, n, eps) > delta:
        assert got == NEVER
    # whatever it picked, its errors on the calibration set pass the test it states
    if got != NEVER:
        i = table.thresholds.index(got)
        assert stats.binom.cdf(table.errors[i], n, eps) <= delta


@settings(max_examples=30, deadline=None)
@given(bads=st.lists(st.floats(0.05, 0.9), min_size=1, max_size=3),
       n_good=st.integers(100, 2000))
def test_group_rule_is_the_highest_groups_certified_threshold(bads, n_good):
    """Group g: n_good right tokens above confidence bad_g and as many wrong ones at bad_g.
    At target 0.9 (delta 0.1) a threshold above bad_g has no error and is certified (0.9^n
    <= 0.1), one at or below it has 50% errors and is not; so group g certifies the lowest
    grid point above bad_g, and the rule ships the one above the highest bad_g: the group
    that needs the most caution decides, whatever the groups' sizes."""
    rng = np.random.default_rng(0)
    grid = tuple(np.round(np.arange(0.99, 0.0, -0.01), 2))
    tables = {}
    for g, bad in enumerate(bads):
        n = n_good * (g + 1)  # sizes differ: pooling would let the largest group dominate
        conf = np.concatenate([np.full(n, bad), rng.uniform(bad + 1e-3, 1.0, n)])
        agree = np.concatenate([np.zeros(n, bool), np.ones(n, bool)])
        tables[f"g{g}"] = exit_threshold.calibration_table(conf[None], agree[None], (1,), 4,
                                                           grid=grid)
    got = exit_threshold.pick_threshold_groups(tables, 0.9, 0.1)
    assert got == min(t for t in grid if t > max(bads))
    cal = {"delta": 0.1, "groups": {k: t.to_json() for k, t in tables.items()}}
    assert exit_threshold.threshold_from_json(cal, 0.9) == got
    with pytest.raises(ValueError, match="no calibration groups"):
        exit_threshold.pick_threshold_groups({}, 0.9)


def test_correlated_errors_are_not_certified_by_the_cluster_test():
    """1,000 tokens in 10 clusters of 100, 30 errors (3%) at every threshold, target 0.95:
    the binomial test certifies (P(Binom(1000, 0.05) <= 30) ~ 0.002). Spread 3 per cluster,
    the cluster-robust variance is 0 and the low threshold is certified; all 30 in one
    cluster, the ratio's variance is 10/9 * (27^2 + 9 * 3^2) / 1000^2 = 9e-4, z = (0.03 -
    0.05) / 0.03, p = Phi(-2/3) ~ 0.25 > 0.1: only the threshold nobody reaches is."""
    clusters = np.repeat(np.arange(10), 100)
    conf = np.full((1, 1000), 0.9)
    grid = (0.99, 0.5)  # 0.99: nobody leaves, no error; 0.5: everyone (at 0.9) leaves
    assert stats.binom.cdf(30, 1000, 0.05) < 0.01
    for wrong_at, want in ((np.arange(0, 1000, 100)[:, None] + np.arange(3), 0.5),
                           (np.arange(30), 0.99)):
        agree = np.ones((1, 1000), bool)
        agree[0, wrong_at.reshape(-1)] = False
        table = exit_threshold.calibration_table(conf, agree, (1,), 4, grid=grid,
                                                 clusters=clusters)
        assert table.errors == (0, 30)
        assert exit_threshold.pick_threshold(table, 0.95, 0.1) == want
        # without clusters the binomial test alone certifies the low threshold both times
        plain = exit_threshold.calibration_table(conf, agree, (1,), 4, grid=grid)
        assert exit_threshold.pick_threshold(plain, 0.95, 0.1) == 0.5
    assert exit_threshold.p_value_clustered([30] + [0] * 9, [100] * 10, 0.05) == pytest.approx(
        stats.norm.cdf(-2 / 3), rel=1e-9)


def test_cost_model_counts_heads_and_checks_in_layer_equivalents():
    smol = tiny_config(vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3,
                       head_dim=64, ffn_dim=1536, tie_embeddings=True)
    layer = 576 * 576 * 2 + 2 * 576 * 192 + 3 * 576 * 1536
    assert exit_cost.layer_macs(smol) == layer
    head = (576 + 49152 * 576) / layer
    never = ExitConfig(exit_layers=(27,), policy="never")
    cm = exit_cost.cost_model(smol, never)
    assert cm.final_head == pytest.approx(head)  # about 8 layers: why the ideal counts it
    assert 7.9 < head < 8.1
    assert exit_cost.ideal_speedup_with_head(smol, never, {30: 10}) == pytest.approx(1.0)
    ec = ExitConfig(exit_layers=(15, 20, 25), head="mlp", adapter_rank=128,
                    measure="candidates", vocab_subset=8192, candidates=8,
                    backfill="propagate")
    cm = exit_cost.cost_model(smol, ec)
    hidden = 576 + 2 * 576 * 128
    tail = N_FEATURES * DECISION_HIDDEN + DECISION_HIDDEN + 4 * 8
    first = (hidden + 8192 * 576 + tail) / layer
    later = (hidden + 8 * 576 + tail) / layer
    exit_head = (hidden + 8192 * 576) / layer
    assert cm.token_cost(20) == pytest.approx(20 + first + later + exit_head)
    assert cm.token_cost(30) == pytest.approx(30 + first + 2 * later + head)
    counts = {15: 1, 20: 2, 30: 1}
    mean = (cm.token_cost(15) + 2 * cm.token_cost(20) + cm.token_cost(30)) / 4
    assert exit_cost.ideal_speedup_with_head(smol, ec, counts) == pytest.approx((30 + head) / mean)
    # with a full-vocabulary head checked at every exit, the plain L / mean layers overstates
    full = ExitConfig(exit_layers=(15, 20, 25), measure="max_prob")
    assert exit_cost.ideal_speedup_with_head(smol, full, counts) < 30 / ((15 + 40 + 30) / 4)
    # back-fill "deferred" completes a token only where its row's next token runs anyway:
    # per token it costs what propagate does (step_cost prices the second query per step),
    # or the per-layer fraction a caller measured
    deferred = dataclasses.replace(ec, backfill="deferred")
    assert exit_cost.cost_model(smol, deferred).token_cost(20) == pytest.approx(
        cm.token_cost(20))
    assert exit_cost.cost_model(smol, deferred, completion=0.4).token_cost(20) == pytest.approx(
        cm.token_cost(20) + 4)
    assert exit_cost.cost_model(smol, deferred).token_cost(30) == pytest.approx(cm.token_cost(30))
    assert exit_cost.ideal_speedup_with_head(smol, deferred, counts, completion=0.4) < \
        exit_cost.ideal_speedup_with_head(smol, deferred, counts) == pytest.approx(
            exit_cost.ideal_speedup_with_head(smol, ec, counts))


def test_restricted_dataclass_state_is_a_pytree():
    ec, _ = subset_heads(CFG, PARAMS)
    st0 = exit_checks.init_check_state(jnp.zeros((2, CFG.d_model)), ec)
    leaves = jax.tree.leaves(st0)
    assert len(leaves) == len(dataclasses.fields(st0))
    assert st0.cand.shape == (2, ec.candidates)


def _reference_calibration(params, ec, heads, rows, scored):
    """Per exit and scored position of rows [N, T]: (confidence [E, n], agree [E, n]) written
    plainly: the dense reference's hidden states (rounded to bf16, the precision the
    calibration cache keeps), `check_confidence` chained over the exits from the embedding,
    each exit's (subset) top-1 against full depth's top-1."""
    logits, hidden = llama.forward(params, jnp.asarray(rows), CFG, return_hidden=True)
    full_top = np.asarray(logits.argmax(-1))
    state = exit_checks.init_check_state(llama.embed(params, jnp.asarray(rows), CFG), ec)
    conf, agree = [], []
    row = np.broadcast_to(np.arange(rows.shape[0])[:, None], rows.shape)[scored]
    for s, e in enumerate(ec.exit_layers):
        h = hidden[e - 1].astype(jnp.bfloat16).astype(jnp.float32)
        c, _, state = exit_checks.check_confidence(params, heads, s, h, state, CFG, ec)
        top = np.asarray(exit_heads.exit_logits(params, heads, s, h, CFG).argmax(-1))
        conf.append(np.asarray(c)[scored])
        agree.append((top == full_top)[scored])
    return np.stack(conf), np.stack(agree), row


def _reference_threshold(conf, agree, row, grid, target, delta):
    """Fixed-sequence Learn-then-Test from the safest threshold down, errors counted by hand
    per token and per cluster (packed row); a threshold is certified when both the binomial
    test and the cluster-robust z-test reject. Returns (threshold, errors per threshold)."""
    n, eps, chosen, errors, walking = conf.shape[1], 1 - target, NEVER, [], True
    sizes = np.bincount(row).astype(float)
    k = len(sizes)
    for t in sorted(grid, reverse=True):
        wrong = np.zeros(k)
        for j in range(n):
            for s in range(conf.shape[0]):
                if conf[s, j] >= t:
                    wrong[row[j]] += int(not agree[s, j])
                    break
        errors.append(int(wrong.sum()))
        r = wrong.sum() / n
        var = k / (k - 1) * ((wrong - r * sizes) ** 2).sum() / n**2
        p_cluster = (stats.norm.cdf((r - eps) / np.sqrt(var)) if var > 0
                     else float(r >= eps))
        walking = (walking and stats.binom.cdf(errors[-1], n, eps) <= delta
                   and p_cluster <= delta)
        if walking:
            chosen = t
    return chosen, errors


def test_calibrate_heads_picks_the_threshold_a_plain_reference_certifies(tmp_path):
    """`calibrate_heads` (bf16 state cache, chained candidate features, decision MLPs,
    per-group tables, the groups' highest threshold) on saved heads, against the plain
    reference above: same errors per threshold in every group, same shipped threshold, the
    heads themselves untouched, the run record kept."""
    from ee_jax.models.loading import LoadedModel
    from ee_jax.training.tune import calibrate_heads
    from ee_jax.training.tune_config import TuneConfig, TuneConfigError

    params = jax.tree.map(jnp.asarray, PARAMS)
    layers = params.layers  # layers 3 and 4 add nothing: exits 2 and 3 agree with full
    params = params.replace(layers=layers.replace(  # depth wherever its top-1 is in the subset
        wo=layers.wo.at[2:].set(0.0), w_down=layers.w_down.at[2:].set(0.0)))
    sub = np.random.default_rng(0).permutation(CFG.vocab_size)[:64].astype(np.int32)
    ec = ExitConfig(exit_layers=(1, 2, 3), head="mlp", adapter_rank=8,
                    measure="candidates", vocab_subset=len(sub), candidates=4)
    heads = exit_heads.init_heads(CFG, ec, params, jax.random.PRNGKey(0))
    subset = exit_heads.VocabSubset(sub, "tiny", CFG.vocab_size)
    heads = exit_heads.attach_vocab_subset(heads, subset, CFG, "tiny")
    heads = heads.replace(decision=heads.decision.replace(
        w2=2.0 * jax.random.normal(jax.random.PRNGKey(1), heads.decision.w2.shape)))
    save_exit_heads(tmp_path / "h", CFG, ec, heads)
    (tmp_path / "h" / "tune_config.json").write_text('{"run": "kept"}\n')
    rng = np.random.default_rng(2)
    calib = {}
    for g, n in (("easy", 6), ("hard", 4)):
        rows = rng.integers(3, CFG.vocab_size, (n, 24)).astype(np.int32)
        scored = np.ones(rows.shape, bool)
        scored[:, :5] = False  # prompt positions never count
        if g == "easy":  # only positions whose full-depth token an exit can produce
            full_top = np.asarray(llama.forward(params, jnp.asarray(rows), CFG).argmax(-1))
            scored &= np.isin(full_top, sub)
        calib[g] = (rows, scored)
    target, delta = 0.75, 0.2
    tc = TuneConfig.make(exit_layers=ec.exit_layers, measure="candidates", method="cached",
                         adapter_rank=8, vocab_subset=len(sub), candidates=4,
                         target_agreement=target, calib_delta=delta)
    model = LoadedModel(CFG, params, None, "tiny")
    cal = calibrate_heads(tc, model, tmp_path / "h", progress=False, calib=calib)

    want = {}
    for g, (rows, scored) in calib.items():
        conf, agree, row = _reference_calibration(params, ec, heads, rows, scored)
        got = cal["groups"][g]
        assert got["n"] == scored.sum()
        want[g], errors = _reference_threshold(conf, agree, row, got["thresholds"], target,
                                               delta)
        assert list(got["errors"]) == errors
        assert got["threshold"] == want[g]
    assert cal["threshold"] == max(want.values())
    assert len(set(want.values())) == 2 and NEVER not in want.values()  # not trivial
    ec2, back = load_exit_heads(tmp_path / "h", CFG)
    assert ec2.threshold == cal["threshold"] and ec2.target_agreement == target
    for a, b in zip(jax.tree.leaves(heads), jax.tree.leaves(back), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert (tmp_path / "h" / "tune_config.json").read_text() == '{"run": "kept"}\n'
    # the shipped table re-picks per target with the same rule
    ec3, _ = load_exit_heads(tmp_path / "h", CFG, target_agreement=0.6)
    assert ec3.threshold == exit_threshold.pick_threshold_groups(
        {g: exit_threshold.CalibrationTable.from_json(v) for g, v in cal["groups"].items()}, 0.6,
        delta)
    # bad input: nothing to calibrate on, or heads without decision MLPs
    with pytest.raises(TuneConfigError, match="no calibration answers"):
        calibrate_heads(tc, model, tmp_path / "h", progress=False,
                        calib={"easy": (rows, np.zeros(rows.shape, bool))})
    plain = ExitConfig(exit_layers=(1, 2), head="mlp", adapter_rank=8)
    save_exit_heads(tmp_path / "p", CFG, plain, exit_heads.init_heads(CFG, plain, params))
    with pytest.raises(TuneConfigError, match="measure"):
        calibrate_heads(tc, model, tmp_path / "p", progress=False, calib=calib)


def test_served_tables_count_what_the_engine_serves_one_request_at_a_time():
    """`served_tables` (every answer x threshold in one per_row engine run, per-request
    thresholds) against serving each (answer, threshold) alone at batch 1: the same errors
    per answer, exits and mean layers; threshold NEVER gives no error and no exit."""
    from ee_jax.models.loading import LoadedModel
    from ee_jax.serving.controller import ControllerConfig
    from ee_jax.serving.llm import LLM
    from ee_jax.serving.params import SamplingParams
    from ee_jax.training.tune import served_tables

    ec, heads = subset_heads(CFG, PARAMS)
    model = LoadedModel(CFG, PARAMS, None, "tiny")
    rng = np.random.default_rng(3)
    full = LLM(model, early_exit=False, max_num_seqs=4, max_model_len=64, progress=False,
               batch_buckets=(4,))  # one decode program
    answers = {}
    for g, n in (("a", 3), ("b", 2)):  # the model's own full-depth greedy answers
        prompts = [rng.integers(3, CFG.vocab_size, int(rng.integers(4, 12))).tolist()
                   for _ in range(n)]
        outs = full.generate(prompts, [SamplingParams(temperature=0.0, ignore_eos=True,
                                                      max_tokens=int(rng.integers(6, 14)))
                                       for _ in prompts], use_tqdm=False)
        answers[g] = [(p, list(o.token_ids)) for p, o in zip(prompts, outs, strict=True)]
    grid = (NEVER, 0.6, 0.3)
    tables = served_tables(model, ec, heads, answers, grid, batch=4, progress=False)
    alone = LLM(model, exit_config=dataclasses.replace(ec, policy="per_row"), exit_heads=heads,
                max_num_seqs=1, max_model_len=64, progress=False,
                exit_control=ControllerConfig(mode="exits"))  # the exits, as served_tables
    for g, pairs in answers.items():
        t = tables[g]
        assert t.thresholds == tuple(sorted(grid, reverse=True))
        assert t.cluster_sizes == tuple(len(a) - 1 for _, a in pairs)
        for k, thr in enumerate(t.thresholds):
            errs, exited, layers = [], 0, 0
            for p, a in pairs:
                o = alone.generate([p], SamplingParams(
                    temperature=0.0, max_tokens=len(a), ignore_eos=True, forced_tokens=tuple(a),
                    exit_threshold=thr), use_tqdm=False)[0]
                errs.append(sum(x != y for x, y in zip(o.predicted_token_ids[1:], a[1:],
                                                       strict=True)))
                exited += sum(e < CFG.n_layers for e in o.exit_layers[1:])
                layers += sum(o.exit_layers[1:])
            assert t.cluster_errors[k] == tuple(errs) and t.errors[k] == sum(errs)
            assert t.exited[k] == exited
            assert t.mean_layers[k] == pytest.approx(layers / t.n)
        assert t.errors[0] == 0 and t.exited[0] == 0  # NEVER: full depth, as served
    assert tables["a"].exited[-1] > 0  # the low threshold really exits


def test_shipping_a_served_calibration_sets_the_default_threshold_and_says_how(tmp_path):
    """`served_calibration` + `ship_calibration`: groups built so that group g certifies the
    lowest grid point above bad_g at target 0.9 (as in the group-rule test above) become the
    heads' calibration.json; the heads then load at the highest of those picks by default,
    the file names the rule, target, confidence and per-group picks, the dense tables it
    replaced stay under "previous" (once, however often it is shipped), and the heads'
    arrays are untouched."""
    import json

    rng = np.random.default_rng(0)
    grid = tuple(np.round(np.arange(0.99, 0.5, -0.01), 2))
    bads = {"instructions": 0.62, "code": 0.7, "everyday": 0.655}
    tables = {}
    for g, bad in bads.items():
        n = 500
        conf = np.concatenate([np.full(n, bad), rng.uniform(bad + 1e-3, 1.0, n)])
        agree = np.concatenate([np.zeros(n, bool), np.ones(n, bool)])
        tables[g] = exit_threshold.calibration_table(conf[None], agree[None], (1,), 4, grid=grid)
    want = {g: min(t for t in grid if t > bad) for g, bad in bads.items()}  # 0.63 0.71 0.66

    ec, heads = subset_heads(CFG, PARAMS)
    dense = {"delta": 0.1, "target_agreement": 0.9, "threshold": 0.5,
             "groups": {g: t.to_json() for g, t in tables.items()}}
    save_exit_heads(tmp_path / "h", CFG, ec, heads, calibration=dense)
    cal = calibrate.served_calibration(tables, 0.9, 0.1, command="made here")
    assert cal["picks"] == want and cal["threshold"] == 0.71
    calibrate.ship_calibration(tmp_path / "h", cal)
    calibrate.ship_calibration(tmp_path / "h", cal)  # again: "previous" is not nested

    ec2, back = load_exit_heads(tmp_path / "h", CFG)
    assert (ec2.threshold, ec2.target_agreement) == (0.71, 0.9)
    assert dataclasses.replace(ec2, threshold=ec.threshold,
                               target_agreement=ec.target_agreement) == ec
    for a, b in zip(jax.tree.leaves(heads), jax.tree.leaves(back), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    shipped = json.loads((tmp_path / "h" / "calibration.json").read_text())
    assert shipped["measure"] == "served" and "served" in shipped["rule"]
    assert (shipped["confidence"], shipped["command"]) == (0.9, "made here")
    assert shipped["picks"] == want
    assert shipped["previous"] == json.loads(json.dumps({"measure": "dense", **dense}))
    # another target re-picks from the served tables with the same rule
    ec3, _ = load_exit_heads(tmp_path / "h", CFG, target_agreement=0.6)
    assert ec3.threshold == exit_threshold.pick_threshold_groups(tables, 0.6, 0.1)
    # bad input: a threshold the tables do not certify, a folder without heads, a bad target
    with pytest.raises(ValueError, match="not what its tables certify"):
        calibrate.ship_calibration(tmp_path / "h", dict(cal, threshold=0.63))
    with pytest.raises(ExitConfigError, match="no exit heads"):
        calibrate.ship_calibration(tmp_path / "none", cal)
    with pytest.raises(ExitConfigError, match="target agreement"):
        calibrate.served_calibration(tables, 1.5)


def test_calibrate_is_a_cli_command_that_ships_a_served_pick(tmp_path, capsys):
    """`ee-jax calibrate --served --tables FILE --ship` re-picks from served tables written
    before (no decoding) and ships the pick: the heads then load at the threshold the tables
    certify (`pick_threshold_groups`, the statistics' own rule), the printed pick says so, and
    the shipped calibration.json records the command."""
    import json

    from ee_jax.cli import main as cli_main

    grid = tuple(np.round(np.arange(0.99, 0.5, -0.01), 2))
    rng = np.random.default_rng(1)
    tables = {}
    for g, bad in {"instructions": 0.62, "code": 0.7}.items():
        conf = np.concatenate([np.full(400, bad), rng.uniform(bad + 1e-3, 1.0, 400)])
        agree = np.concatenate([np.zeros(400, bool), np.ones(400, bool)])
        tables[g] = exit_threshold.calibration_table(conf[None], agree[None], (1,), 4, grid=grid)
    ec, heads = subset_heads(CFG, PARAMS)
    save_exit_heads(tmp_path / "h", CFG, ec, heads)
    saved = calibrate.served_calibration(tables, 0.9, 0.1, command="made before")
    (tmp_path / "tables.json").write_text(json.dumps(saved))
    (tmp_path / "preset.yaml").write_text(f"output: {tmp_path / 'h'}\ntarget_agreement: 0.9\n")
    argv = ["calibrate", "--config", str(tmp_path / "preset.yaml"), "--served", "--tables",
            str(tmp_path / "tables.json"), "--ship"]
    assert cli_main(argv) == 0
    want = exit_threshold.pick_threshold_groups(tables, 0.9, 0.1)
    assert want == 0.71  # the code group's: the lowest grid point above 0.7
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["threshold"] == want
    ec2, _ = load_exit_heads(tmp_path / "h", CFG)
    assert ec2.threshold == want
    shipped = json.loads((tmp_path / "h" / "calibration.json").read_text())
    assert shipped["command"].startswith("ee-jax calibrate --config")
    assert "made before" in shipped["command"]
    # --ship without --served is refused in one line
    assert cli_main(["calibrate", "--config", str(tmp_path / "preset.yaml"), "--ship"]) == 2
    assert "go with --served" in capsys.readouterr().err
