"""The evaluation (`ee-jax eval`): its measures against hand-computed values and naive
loops, and the whole pipeline on a tiny random model (engines built once per module)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ee_jax.cli import _eval_options, build_parser
from ee_jax.evaluation import (
    EvalOptions,
    FullModelNLL,
    common_prefix,
    evaluate,
    exit_predictions,
    expected_calibration_error,
    lcs_length,
    match_rate,
    prefix_agreement,
    reliability,
    rouge_l,
    simulate_exits,
)
from ee_jax.evaluation.layerwise import windows
from ee_jax.evaluation.report import LAYER_PLOT, MARKDOWN, SPEED_PLOT
from ee_jax.evaluation.sweep import FULL
from ee_jax.models import llama
from ee_jax.models.exits import checks as exit_checks
from ee_jax.models.exits import heads as exit_heads
from ee_jax.models.exits.config import ExitConfig
from ee_jax.models.loading import LoadedModel
from ee_jax.testing import tiny_config

CFG = tiny_config(eos_token_ids=())  # 4 layers, vocab 128: no EOS, so lengths are fixed
# Peaked distributions (as in test_early_exit), so confidences spread over (0, 1).
PARAMS = llama.init_params(CFG, jax.random.PRNGKey(5), scale=0.4)
L = CFG.n_layers
RNG = np.random.default_rng(3)
SEQS = [RNG.integers(3, CFG.vocab_size, n).tolist() for n in (9, 3, 16, 5)]
EC = ExitConfig(exit_layers=(1, 2, 3), head="adapter", measure="classifier", adapter_rank=8)


def random_heads(ec: ExitConfig, seed: int = 1):
    """Heads unlike the untrained ones: perturbed norms, a non-zero adapter, a classifier."""
    heads = exit_heads.init_heads(CFG, ec, PARAMS)
    k = iter(jax.random.split(jax.random.PRNGKey(seed), 4))
    heads = heads.replace(
        norm=heads.norm * (1 + 0.3 * jax.random.normal(next(k), heads.norm.shape)))
    if heads.adapter is not None:
        heads = heads.replace(adapter=heads.adapter.replace(
            up=0.2 * jax.random.normal(next(k), heads.adapter.up.shape)))
    if heads.classifier is not None:
        heads = heads.replace(classifier=heads.classifier.replace(
            w=jax.random.normal(next(k), heads.classifier.w.shape)))
    return heads


HEADS = random_heads(EC)


# --------------------------------------------------------------------------- sequence measures


def test_rouge_l_and_agreement_by_hand():
    ref = ["the", "cat", "sat", "on", "the", "mat"]
    out = ["the", "cat", "lay", "on", "a", "mat"]
    # LCS "the cat on mat" = 4; P = R = 4/6.
    assert lcs_length(out, ref) == 4
    assert rouge_l(out, ref) == pytest.approx(4 / 6)
    # P = 2/2, R = 2/4 -> F = 2 * 1 * 0.5 / 1.5.
    assert rouge_l([1, 2], [1, 3, 2, 4]) == pytest.approx(2 / 3)
    assert lcs_length("ABCBDAB", "BDCABA") == 4  # the textbook example
    assert rouge_l([1, 2, 3], [1, 2, 3]) == 1.0
    assert rouge_l([1, 2], [3, 4]) == 0.0
    assert rouge_l([], []) == 1.0 and rouge_l([], [1]) == 0.0
    assert common_prefix(out, ref) == 2
    assert prefix_agreement(out, ref) == pytest.approx(2 / 6)
    assert match_rate(out, ref) == pytest.approx(4 / 6)  # the, cat, on, mat
    assert match_rate([1, 2], [1, 2, 3, 4]) == pytest.approx(2 / 4)  # missing = mismatch


def test_reliability_and_ece_by_hand():
    conf = [0.95, 0.95, 0.15, 0.15, 1.0]
    right = [True, False, False, False, True]
    rel = reliability(conf, right, n_bins=10)
    assert rel.count.tolist() == [0, 2, 0, 0, 0, 0, 0, 0, 0, 3]  # 1.0 is in the last bin
    assert rel.accuracy[9] == pytest.approx(2 / 3)
    assert rel.confidence[9] == pytest.approx((0.95 + 0.95 + 1.0) / 3)
    want = 3 / 5 * abs(2 / 3 - 2.9 / 3) + 2 / 5 * 0.15
    assert rel.ece == pytest.approx(want)
    assert expected_calibration_error([0.5, 0.5], [True, False]) == pytest.approx(0.0)


# --------------------------------------------------------------------------- dense, per layer


@functools.partial(jax.jit, static_argnames=("width",))
def _padded_forward(params, tokens, width):
    buf = jnp.zeros((1, width), jnp.int32).at[0, :tokens.shape[0]].set(tokens)
    return (*llama.forward(params, buf, CFG, return_hidden=True), llama.embed(params, buf, CFG))


@functools.partial(jax.jit, static_argnames=("ec",))
def _one_exit(heads, slot, h, h_prev, final_top, ec):
    """One token, one exit: (confidence, exit top-1 == final top-1)."""
    lg = exit_heads.exit_logits(PARAMS, heads, slot, h, CFG)
    if ec.needs_vocab:
        c = exit_checks.confidence_from_logits(lg, ec.measure)
    elif ec.measure == "saturation":
        c = exit_checks.saturation(h, h_prev)
    else:
        c = exit_checks.classifier_confidence(heads, slot, h, CFG)
    return c, jnp.argmax(lg) == final_top


def _naive(ec: ExitConfig, heads, seq_len: int):
    """Per token and exit, one at a time: confidence and exit top-1 == final top-1."""
    conf, agree = [], []
    for w in windows(SEQS, seq_len):
        # Right padding is harmless: causal attention never looks forward.
        logits, hidden, emb = _padded_forward(PARAMS, jnp.asarray(w), width=seq_len)
        # The convention: hidden[i] is after i + 1 layers, so the final head of the last
        # is the model's output.
        np.testing.assert_allclose(llama.final_head(PARAMS, hidden[L - 1], CFG), logits,
                                   rtol=1e-5, atol=1e-5)
        logits, hidden, emb = np.asarray(logits), np.asarray(hidden), np.asarray(emb)
        for t in range(len(w)):
            final = int(np.argmax(logits[0, t]))
            c_t, a_t = [], []
            for slot, e in enumerate(ec.exit_layers):
                prev = emb[0, t] if slot == 0 else hidden[ec.exit_layers[slot - 1] - 1, 0, t]
                c, a = _one_exit(heads, slot, hidden[e - 1, 0, t], prev, final, ec)
                c_t.append(float(c))
                a_t.append(bool(a))
            conf.append(c_t)
            agree.append(a_t)
    return np.asarray(conf).T, np.asarray(agree).T


VARIANTS = {
    "tuned": (EC, HEADS),
    "norm": (ExitConfig(exit_layers=(1, 3), measure="max_prob"), None),
    "saturation": (ExitConfig(exit_layers=(2, 3), measure="saturation"), None),
}
VARIANTS = {k: (ec, h if h is not None else random_heads(ec, i))
            for i, (k, (ec, h)) in enumerate(VARIANTS.items())}
SEQ_LEN = 8  # cuts the 9- and 16-token sequences into windows; 3 calls of 2 rows


@pytest.fixture(scope="module")
def dense():
    return exit_predictions(CFG, PARAMS, SEQS, VARIANTS, seq_len=SEQ_LEN, rows=2,
                            progress=False)


def test_dense_predictions_equal_a_naive_per_token_loop(dense):
    for name, (ec, heads) in VARIANTS.items():
        conf, agree = _naive(ec, heads, SEQ_LEN)
        assert dense[name].confidence.shape == (len(ec.exit_layers), sum(map(len, SEQS)))
        np.testing.assert_allclose(dense[name].confidence, conf, rtol=1e-4, atol=1e-5)
        np.testing.assert_array_equal(dense[name].agree, agree)
    # Not a degenerate check: some exits agree with the final layer and some do not.
    assert 0 < dense["tuned"].agree.mean() < 1


def test_scored_positions_are_the_full_predictions_restricted(dense):
    starts = [4, 0, 10, 2]  # e.g. prompt lengths - 1: only answer positions count
    part = exit_predictions(CFG, PARAMS, SEQS, {"tuned": VARIANTS["tuned"]}, seq_len=SEQ_LEN,
                            rows=2, progress=False, score_from=starts)["tuned"]
    keep = np.concatenate([np.arange(len(s)) >= k for s, k in zip(SEQS, starts, strict=True)])
    np.testing.assert_array_equal(part.confidence, dense["tuned"].confidence[:, keep])
    np.testing.assert_array_equal(part.agree, dense["tuned"].agree[:, keep])


def test_simulation_threshold_above_one_runs_full_depth(dense):
    pred = dense["tuned"]
    never, always = simulate_exits(pred, [1.01, 0.0])
    assert never.mean_layers == L and never.ideal_speedup == 1.0
    assert never.agreement == 1.0 and never.exit_counts == {L: pred.num_tokens}
    # Threshold 0: every token leaves at the first exit at or above min_exit_layer.
    assert always.exit_counts == {1: pred.num_tokens}
    assert always.agreement == pytest.approx(pred.agree[0].mean())
    late = simulate_exits(pred, [0.0], min_exit_layer=2)[0]
    assert late.exit_counts == {2: pred.num_tokens}
    assert late.ideal_speedup == pytest.approx(L / 2)
    assert late.agreement == pytest.approx(pred.agree[1].mean())


def test_full_model_nll_of_generated_tokens():
    seq = SEQS[3]  # 5 tokens: 2 of prompt, 3 generated
    got = FullModelNLL(CFG, PARAMS)(seq[:2], seq[2:])
    logits = _padded_forward(PARAMS, jnp.asarray(seq), width=SEQ_LEN)[0]
    logp = np.asarray(jax.nn.log_softmax(logits[0], -1))
    want = [-logp[p - 1, seq[p]] for p in range(2, len(seq))]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- end to end


PROMPTS = [RNG.integers(3, CFG.vocab_size, n).tolist() for n in (5, 12, 2, 7, 9)]
INF = float("inf")


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    out = tmp_path_factory.mktemp("eval")
    opts = EvalOptions(model="tiny", batches=(2,), thresholds=(0.0, 0.5, INF),
                       policies=("all",), max_tokens=6, dense_seq_len=16, out_dir=str(out),
                       progress=False, command="pytest")
    engine = dict(max_model_len=32, page_size=16, num_pages=12, max_prefill_chunk=16,
                  max_num_batched_tokens=64, batch_buckets=(2,))
    report = evaluate(opts, model=LoadedModel(CFG, PARAMS, None, "random"),
                      heads=("random test heads", EC, HEADS),
                      workloads={"random prompts": PROMPTS},
                      corpora={"random text": SEQS}, engine_kwargs=engine)
    return report, out


def test_sweep_full_depth_and_infinite_threshold_agree_fully(evaluated):
    report, _ = evaluated
    rows = {r.label: r for r in report.sweep}
    assert list(rows) == [FULL, "all @ 0", "all @ 0.5", "all @ inf"]
    assert {r.batch for r in report.sweep} == {2}
    for label in (FULL, "all @ inf"):  # the exit engine that never exits = full depth
        r = rows[label]
        assert (r.tf_agreement, r.prefix_agreement, r.match_rate, r.rouge_l,
                r.identical) == (1.0, 1.0, 1.0, 1.0, 1.0), label
        assert list(r.step_exit_counts) == [L] and r.mean_layers == L
        assert list(r.token_exit_counts) == [L]
    zero = rows["all @ 0"]  # every row is confident at the first exit
    assert list(zero.step_exit_counts) == [1] and list(zero.token_exit_counts) == [1]
    assert zero.mean_layers == 1 and zero.ideal_speedup == L
    assert 0 <= zero.tf_agreement < 1 and 0 <= zero.rouge_l < 1  # random heads: lossy
    for r in (rows[FULL], zero):
        assert r.num_prompts == len(PROMPTS) and r.num_tokens == 6 * len(PROMPTS)
        assert r.decode_tokens_per_s > 0 and r.speedup > 0 and np.isfinite(r.nll)
    assert rows[FULL].speedup == 1.0
    # The full model finds its own greedy output likelier than the exits' output.
    assert rows[FULL].nll < zero.nll


def test_report_writes_tables_and_plots(evaluated):
    report, out = evaluated
    text = (out / MARKDOWN).read_text()
    assert "Command: `pytest`" in text
    assert "| random prompts | 2 | all @ 0.5 |" in text
    assert "### random text (33 tokens)" in text
    assert "agreement untrained | agreement tuned" in text
    assert "| random text | tuned | inf | 4.0 | 1.00x | 1.000 |" in text
    for name in (SPEED_PLOT, LAYER_PLOT):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(report.layers["random text"]) == {"untrained", "tuned"}


def test_cli_eval_flags_become_options():
    args = build_parser().parse_args(
        ["eval", "--limit", "3", "--batches", "1", "--thresholds", "0.8", "0.9",
         "--policies", "all", "--max-tokens", "16", "--skip-dense", "--out-dir", "x"])
    opts = _eval_options(args)
    assert (opts.limit, opts.batches, opts.thresholds, opts.policies, opts.max_tokens,
            opts.skip_dense, opts.out_dir) == (3, (1,), (0.8, 0.9), ("all",), 16, True, "x")
    assert opts.command.startswith("ee-jax eval --model smollm2-135m-instruct")
    assert "--limit 3" in opts.command and "--skip-dense" in opts.command
