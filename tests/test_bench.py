"""bench.common's drive loop and figures, checked against independent truths: the dense
reference's greedy tokens, hand-computed ideals, numpy. No timing is asserted."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from bench import exit_ceiling, kernels, load, roofline, step
from bench.common import (
    agreement,
    exit_summary,
    forced_params,
    head_layers,
    serve,
    smollm2_shaped_config,
    step_case,
    time_steps,
)
from bench.load import arrival_times, summarize, ttft_floors
from ee_jax.models.exits.config import ExitConfig
from ee_jax.models.loading import LoadedModel
from ee_jax.serving.llm import LLM
from ee_jax.serving.params import greedy
from ee_jax.testing import tiny_model
from tests.reference import dense_greedy

CFG, PARAMS = tiny_model(seed=3, eos_token_ids=())
RNG = np.random.default_rng(11)
PROMPTS = [RNG.integers(3, CFG.vocab_size, n).tolist() for n in (7, 19, 3, 12)]
NEW = 6


@pytest.fixture(scope="module")
def llm():
    return LLM(LoadedModel(CFG, PARAMS, None, "tiny"), early_exit=False, progress=False,
               max_num_seqs=4, max_model_len=64, batch_buckets=(2, 4))


@pytest.fixture(scope="module")
def want():
    return [dense_greedy(CFG, PARAMS, p, NEW, width=64) for p in PROMPTS]


def test_serve_with_arrivals_gives_the_reference_tokens_and_its_own_stats(llm, want):
    first = serve(llm, PROMPTS, greedy(NEW))
    total_before = llm.engine.stats.num_generated_tokens
    arrivals = [0.0, 0.01, 0.02, 0.03]
    res = serve(llm, PROMPTS, greedy(NEW), arrivals=arrivals)
    assert [o.token_ids for o in first.outputs] == want
    assert [o.token_ids for o in res.outputs] == want
    # Stats of this call only, and the engine's own stats left cumulative.
    assert res.stats.num_generated_tokens == len(PROMPTS) * NEW
    assert llm.engine.stats.num_generated_tokens == total_before + len(PROMPTS) * NEW
    assert res.completed == [True] * len(PROMPTS)
    for a, times in zip(res.arrival, res.token_times, strict=True):
        assert len(times) == NEW and times == sorted(times) and times[0] >= a
    assert res.arrival == arrivals


def test_static_admission_runs_one_batch_at_a_time(llm, want):
    def admit(engine):
        return 0 if engine.has_unfinished_requests() else 2

    res = serve(llm, PROMPTS, greedy(NEW), admit=admit)
    assert [o.token_ids for o in res.outputs] == want
    first_batch_end = max(res.token_times[0][-1], res.token_times[1][-1])
    assert min(res.token_times[2][0], res.token_times[3][0]) > first_batch_end


def test_time_limit_aborts_what_is_unfinished(llm):
    res = serve(llm, PROMPTS, greedy(NEW), arrivals=[0.0, 0.0, 30.0, 30.0], time_limit=0.0)
    assert res.completed == [False] * len(PROMPTS)
    assert not llm.engine.has_unfinished_requests()


def test_head_in_layer_equivalents_and_full_depth_ideal(llm):
    # docs/architecture.md: 49,152 x 576 = 28.3M multiply-adds, about 8 of SmolLM2-135M's layers.
    assert 7.5 < head_layers(smollm2_shaped_config()) < 8.5
    res = serve(llm, PROMPTS[:2], greedy(3))
    ex = exit_summary(res.stats, CFG)  # full depth: every row at L, ideal 1
    assert (ex["row_hist"], ex["mean_layers"], ex["ideal"]) == (f"{CFG.n_layers}:4", 4.0, 1.0)


def test_poisson_arrivals_summary_and_ttft_floor(llm):
    t = np.asarray(arrival_times(4.0, 4000, 1e9, seed=1))
    assert np.all(np.diff(t) > 0)
    assert np.mean(np.diff(t)) == pytest.approx(0.25, rel=0.05)
    assert max(arrival_times(4.0, 4000, 10.0, seed=1)) <= 10.0
    r = summarize("x", 1.0, [0.0, 1.0], [[0.5, 0.7, 1.0], [2.0, 2.5]], [True, True],
                  floors=[0.3, 0.4, 9.0])  # one floor per prompt; the run served two
    assert r["ttft50"] == pytest.approx(np.percentile([0.5, 1.0], 50))
    assert r["itl99"] == pytest.approx(np.percentile([0.2, 0.3, 0.5], 99))
    assert (r["done"], r["span"], r["tok_s"]) == (2, 2.5, 2.0)
    assert r["floor99"] == pytest.approx(np.percentile([0.3, 0.4], 99))
    assert r["queue50"] == pytest.approx(np.percentile([0.2, 0.6], 50))
    assert summarize("x", 1.0, [0.0], [[0.5]], [True])["queue99"] != r["queue99"]  # nan
    # Each prompt alone: a first-token time per prompt, and the engine left empty.
    floors = ttft_floors(llm, PROMPTS[:2], greedy(NEW))
    assert len(floors) == 2 and all(0 < f < 60 for f in floors)
    assert not llm.engine.has_unfinished_requests()


def test_exit_ceiling_rules_on_a_hand_made_case():
    from bench.exit_ceiling import best_at_budget, first_exit

    E, L = np.array([1, 2]), 3
    conf = np.array([[0.9, 0.2, 0.6, 0.1],    # exit 1
                     [0.95, 0.7, 0.9, 0.3]])  # exit 2
    agree = np.array([[True, False, False, False],
                      [True, True, True, False]])
    lay, slot = first_exit(conf, 0.65, E, L)
    np.testing.assert_array_equal(lay, [1, 2, 2, 3])
    np.testing.assert_array_equal(slot, [0, 1, 1, -1])
    # no error allowed: token 2 must not leave at exit 1 (conf 0.6), so t > 0.6: mean layers
    # (1 + 2 + 2 + 3) / 4 at t in (0.6, 0.7]; a quarter of the tokens wrong lets it go lower
    t, lay, wrong = best_at_budget(conf, agree, E, L, 0.0)
    assert 0.6 < t <= 0.7 and wrong == 0.0 and lay.mean() == 2.0
    t, lay, wrong = best_at_budget(conf, agree, E, L, 0.25)
    assert wrong == 0.25 and lay.mean() < 2.0


def test_exit_ceiling_logistic_fit_recovers_a_known_model():
    """Labels drawn from a known logistic model (numpy's generator): the fit's weights land
    near the true ones, and the history features see the previous token's agreement."""
    from bench.exit_ceiling import history_features, logistic_fit

    rng = np.random.default_rng(0)
    x = np.c_[rng.normal(size=(20000, 2)), np.ones(20000)]
    true = np.array([1.5, -2.0, 0.5])
    y = rng.random(20000) < 1 / (1 + np.exp(-x @ true))
    np.testing.assert_allclose(logistic_fit(x, y, ridge=0.0), true, atol=0.1)
    conf = np.array([[0.2, 0.9, 0.8], [0.3, 0.95, 0.9]])  # [E=2, n=3], one row
    agree = np.array([[False, True, False], [True, True, False]])
    feats = np.zeros((2, 3, 1))
    start = history_features(conf, feats, agree, np.zeros(3, int), "start")
    none = history_features(conf, feats, agree, np.zeros(3, int), "none")
    assert start.shape[-1] == none.shape[-1] + 4  # c0 of t-1, agree here / any, first token
    # token 2's "agreed here" column at exit 0 is token 1's agree[0] (True), token 1's is
    # token 0's (False): standardised, True sits above False
    here = start[0, :, none.shape[-1] - 1 + 1]
    assert here[2] > here[1]


def test_exit_ceiling_state_probe_reads_a_direction_the_labels_follow():
    """A label that follows one direction of the exits' states (the rest noise, much larger
    in every other direction but spread over them): the standardised principal directions
    hold it, and a logistic fit on them predicts held-out labels (numpy's generator)."""
    from bench.exit_ceiling import logistic_fit, state_features

    rng = np.random.default_rng(1)
    n, E, D = 4000, 2, 32
    u = rng.normal(size=D)
    u /= np.linalg.norm(u)
    s = rng.normal(size=(n, E))
    hs = 3.0 * s[..., None] * u + rng.normal(size=(n, E, D))  # [n, E, D]
    y = (s > 0).T  # [E, n]
    fit = np.arange(n) % 2 == 0
    z = state_features(hs, fit, dims=4)
    assert z.shape == (E, n, 4)
    np.testing.assert_allclose(z[:, fit].reshape(-1, 4).std(0), 1.0, atol=0.05)
    x = np.concatenate([z, np.ones((E, n, 1))], -1)
    w = logistic_fit(x[:, fit].reshape(-1, 5), y[:, fit].reshape(-1))
    held = (x[:, ~fit] @ w > 0) == y[:, ~fit]
    assert held.mean() > 0.9


def test_teacher_forced_agreement_counts_positions_after_the_first():
    class Out:  # what the engine returns: its own greedy choice at each forced position
        def __init__(self, predicted):
            self.predicted_token_ids = predicted

    refs = [[5, 6, 7, 8], [1, 2]]
    outs = [Out([9, 6, 0, 8]), Out([3, 4])]  # position 0 follows the prompt: not compared
    assert agreement(outs, refs) == pytest.approx(2 / 4)
    params = forced_params(refs, [None, 0.5])
    assert [p.forced_tokens for p in params] == [tuple(r) for r in refs]
    assert [p.max_tokens for p in params] == [4, 2] and params[1].exit_threshold == 0.5


def test_step_timer_times_every_variant_with_its_exit_histogram():
    """Full depth and a forced exit at layer 2: the timer's histogram holds every timed row
    at the layer the variant runs to, the first call apart; ratios are base / variant."""
    ec = ExitConfig(exit_layers=(2,), force_exit_layer=2)
    cases = {"full": step_case(CFG, PARAMS, 2, 10),
             "exit 2": step_case(CFG, PARAMS, 2, 10, exit_config=ec)}
    times = time_steps(cases, rounds=3, steps=2)
    assert times["full"].exit_layers == {CFG.n_layers: 3 * 2 * 2}
    assert times["exit 2"].exit_layers == {2: 3 * 2 * 2}
    assert all(len(t.wall) == len(t.cpu) == 3 and t.compile_s > 0 for t in times.values())
    base, other = times["full"], times["exit 2"]
    ratios = sorted(np.asarray(base.wall) / np.asarray(other.wall))
    assert other.ratio_to(base) == (ratios[0], ratios[1], ratios[2])
    assert base.ratio_to(base) == (1.0, 1.0, 1.0)



@pytest.mark.parametrize("module", [exit_ceiling, kernels, load, roofline, step],
                         ids=lambda m: m.__name__)
def test_every_mode_of_a_benchmark_parses_its_arguments(module, capsys):
    """`python -m bench.NAME MODE --help` reaches the mode's own parser (no run: argparse
    exits 0 after printing the mode's usage)."""
    assert module.MODES
    for mode in module.MODES:
        with pytest.raises(SystemExit) as e:
            module.main([mode, "--help"])
        assert e.value.code == 0
        assert f"{module.__name__} {mode}" in capsys.readouterr().out


def test_q4_unpack_forms_compute_the_dequantized_product():
    """Every way `python -m bench.kernels q4-unpack` holds the Q4 values is the same weight:
    each product equals x @ w with w dequantized by numpy from the file's bytes."""
    from ee_jax.models import quant

    rng = np.random.default_rng(0)
    L, F, D = 2, 64, 128
    q = rng.integers(0, 256, (L, F, D // 2), dtype=np.uint8)
    scale = rng.random((L, F, D // 32)).astype(np.float16)
    offset = rng.random((L, F, D // 32)).astype(np.float16)
    # numpy from the file's order: a block's 16 bytes hold inputs 0-15 low, 16-31 high
    b = q.reshape(L, F, D // 32, 16)
    v = np.concatenate([b & 15, b >> 4], -1).astype(np.float32)
    w = (v * scale[..., None] + offset[..., None]).reshape(L, F, D)  # [L, out, in]
    x = rng.standard_normal((3, D)).astype(np.float32)
    forms = kernels.q4_forms(quant.BlockQ(q, scale, offset, kind="Q4_1", packed=True))
    assert len(forms) == 4
    for name, (held, product) in forms.items():
        for i in range(L):
            got = np.asarray(product(x, jax.tree.map(lambda a, i=i: a[i], held)))
            np.testing.assert_allclose(got, x @ w[i].T, rtol=1e-5, atol=1e-4, err_msg=name)
