"""Exits that never cost (ee_jax/serving/controller.py): per batch bucket the
engine runs the exit program only where the cost model says its checks pay, the full-depth
program elsewhere, and looks again from time to time."""

from __future__ import annotations

import dataclasses

import jax
import pytest

from ee_jax.models import llama
from ee_jax.models.exits.config import ExitConfig
from ee_jax.models.exits.threshold import exit_prior
from ee_jax.serving.controller import ControllerConfig, ControllerConfigError, ExitController
from ee_jax.serving.engine import EngineConfig, LLMEngine
from ee_jax.serving.params import greedy
from ee_jax.testing import tiny_config
from tests.reference import run_requests

CFG = tiny_config(eos_token_ids=())
PARAMS = llama.init_params(CFG, jax.random.PRNGKey(4), scale=0.4)
L = CFG.n_layers
PROMPTS = [[5, 6, 7, 8, 9], [3, 4, 10]]
NEW = 12


def _engine(control: ControllerConfig, threshold: float = 0.0):
    # threshold 0: every row is confident at the first exit (layer 1); 1.0: none ever is
    ec = ExitConfig(exit_layers=(1, 2, 3), measure="max_prob", threshold=threshold,
                    backfill="propagate")
    return LLMEngine(CFG, PARAMS, None, EngineConfig.make(
        max_num_seqs=2, max_model_len=64, page_size=8, num_pages=20, batch_buckets=(2,),
        exit_control=control), ec)


def _programs(engine):
    """(exit-program decode shapes, full-depth decode shapes) this engine's runner ran (its
    `traces` keys: one program each, compiled once whoever compiled it)."""
    dec = [s for s in engine.runner.traces if s.kind == "decode"]
    return sum(s.exits for s in dec), sum(not s.exits for s in dec)


def test_where_checks_cannot_pay_the_full_depth_program_runs():
    # the exit loop's overhead alone (5 full-depth steps) outweighs any exit
    engine = _engine(ControllerConfig(probe_steps=2, probe_every=1000, check_overhead=5.0))
    outs = run_requests(engine, PROMPTS, greedy(NEW))
    assert _programs(engine) == (1, 1)  # both programs, once each
    assert max(engine.runner.traces.values()) <= 1  # no shape traced twice
    for o in outs:
        # the probe's steps (2, one more in flight while the host reads the second) left at
        # layer 1; every later decode step ran full depth
        k = o.exit_layers.index(L, 1)
        assert 2 <= k - 1 <= 3 and set(o.exit_layers[1:k]) == {1}, o.exit_layers
        assert set(o.exit_layers[k:]) == {L}, o.exit_layers
        assert len(o.token_ids) == NEW
    assert "batch 2: full depth" in engine.controller.summary()


def test_where_checks_pay_the_exit_program_runs():
    engine = _engine(ControllerConfig(probe_steps=2, check_overhead=0.0))
    outs = run_requests(engine, PROMPTS, greedy(NEW))
    assert _programs(engine) == (1, 0)
    assert all(set(o.exit_layers[1:]) == {1} for o in outs)
    assert "batch 2: exits" in engine.controller.summary()


def test_mode_exits_never_decides():
    engine = _engine(ControllerConfig(mode="exits", check_overhead=5.0))
    run_requests(engine, PROMPTS, greedy(4))
    assert _programs(engine) == (1, 0)


def test_a_change_of_load_moves_the_decision():
    # predicted speed-up: 2x while rows leave early, 0.5x at full depth, and only in batch 1
    def predict(batch, counts):
        early = sum(v for k, v in counts.items() if k < L) / sum(counts.values())
        return 2.0 if batch == 1 and early > 0.5 else 0.5

    c = ExitController(ControllerConfig(window=4, probe_steps=2, probe_every=3), predict)
    seen = []
    for rows in [[1], [1], [1], [L], [L], [L], [L], [L], [L], [L], [L], [L], [1], [1], [1]]:
        use = c.use_exits(1)
        seen.append(use)
        c.observe(1, use, rows if use else [L])
    # probe (2 steps, early rows) -> exits; rows stop leaving -> full depth after the window
    # turns; every 3 full-depth steps a 2-step probe; the probe that sees early rows again
    # switches back
    assert seen[:5] == [True] * 5
    assert False in seen[5:12]
    assert seen[-1] is True
    # batch 8 never pays under this prediction
    for _ in range(3):
        use = c.use_exits(8)
        c.observe(8, use, [1] * 8)
    assert c.use_exits(8) is False


def test_a_prior_that_cannot_pay_starts_at_full_depth_and_never_compiles_the_exit_program():
    # the calibration expects every row at full depth: no step can save a layer
    engine = _engine(ControllerConfig(probe_steps=2, probe_every=1000, prior=((L, 1.0),)))
    outs = run_requests(engine, PROMPTS, greedy(NEW))
    assert _programs(engine) == (0, 1)  # the exit program never traced
    assert all(set(o.exit_layers[1:]) == {L} for o in outs)
    assert "batch 2: full depth (calibration predicts" in engine.controller.summary()


def test_a_prior_that_pays_still_probes_and_then_decides_from_what_it_saw():
    # the calibration promises exits at layer 1, but no row is ever confident: the probe
    # runs the exit program, its rows decide, the bucket falls to full depth
    engine = _engine(ControllerConfig(probe_steps=2, probe_every=1000, prior=((1, 1.0),)),
                     threshold=1.0)
    c = engine.controller
    assert c.use_exits(2) and c.buckets[2].prior  # before any step: the prior's decision
    run_requests(engine, PROMPTS, greedy(NEW))
    assert _programs(engine) == (1, 1)
    assert "batch 2: full depth (predicted" in c.summary()


def test_the_prior_pools_a_calibration_tables_groups():
    # two groups at threshold 0.9 (L = 30): 50 of 100 tokens leave, mean layers 25 (so the
    # ones that left average (2500 - 50 * 30) / 50 = 20); none of 300 leave
    table = dict(thresholds=[0.95, 0.9], errors=[0, 0], mean_layers=[30.0, 25.0])
    cal = {"groups": {"a": dict(table, exited=[0, 50], n=100),
                      "b": dict(table, exited=[0, 0], mean_layers=[30.0, 30.0], n=300)}}
    assert exit_prior(cal, 0.9, 30) == ((20, 50 / 400), (30, 350 / 400))
    assert exit_prior(cal, 0.95, 30) == ((30, 1.0),)
    assert exit_prior(cal, 0.5, 30) == ()  # no row at that threshold: no prior
    assert exit_prior(dict(table, exited=[0, 50], n=100), 0.9, 30) == ((20, 0.5), (30, 0.5))


@pytest.mark.parametrize("kw, match", [
    (dict(prior=((0, 1.0),)), "prior must be"),
    (dict(prior=((3, 0.5),)), "prior must be"),
    (dict(prior=[(3, 1.0)]), "prior must be"),
    (dict(mode="sometimes"), "mode 'sometimes'"),
    (dict(window=0), "window must be an integer >= 1"),
    (dict(probe_every=2.5), "probe_every must be an integer"),
    (dict(margin=1.5), "margin must be in"),
    (dict(check_overhead=-0.1), "check_overhead must be in"),
    (dict(memory_bound_batch=-1), "memory_bound_batch"),
    (dict(ride_cost=-0.5), "ride_cost must be in"),
])
def test_bad_controller_settings_are_named(kw, match):
    with pytest.raises(ControllerConfigError, match=match):
        ControllerConfig(**kw)


def test_deferred_second_query_cost_moves_the_prediction():
    """Memory-bound, deferred's pending token riding along costs no weight (ride 0: the
    prediction is propagate's); on a CPU serving block weights it costs arithmetic per row
    (`ride_cost`), and the same rows then predict less."""
    from ee_jax.serving.controller import exit_predictor

    ec = ExitConfig(exit_layers=(1, 2, 3), measure="max_prob", threshold=0.5)
    counts = {1: 5, 4: 5}  # half the rows leave at 1: the next token often rides 1..3
    kw = dict(memory_bound_batch=1, check_overhead=0.0)
    prop = exit_predictor(CFG, dataclasses.replace(ec, backfill="propagate"),
                          ControllerConfig(**kw))(1, counts)
    free = exit_predictor(CFG, ec, ControllerConfig(ride_cost=0.0, **kw))(1, counts)
    paid = exit_predictor(CFG, ec, ControllerConfig(ride_cost=0.7, **kw))(1, counts)
    assert free == pytest.approx(prop)
    assert paid < free
