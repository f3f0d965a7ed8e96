"""Layer layouts (`EngineConfig.layer_layout`, `llama.LAYOUTS`): the layers' weights stacked
(one array a weight, a layer axis) or per layer (a buffer a weight a layer, what GPU steps
read in place). Same math: the truth is the dense forward (full depth, verified exits) and
the stacked engine (the lossy exits' tokens, which no dense reference gives), under every
policy and back-fill, on one device and on tp=2 (simulated devices).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ee_jax.models import llama
from ee_jax.models.exits.config import ExitConfig
from ee_jax.serving.controller import ControllerConfig
from ee_jax.serving.engine import EngineConfig, LLMEngine
from ee_jax.serving.params import SamplingParams
from ee_jax.testing import tiny_config
from tests.reference import dense_greedy, run_requests

CFG = tiny_config(eos_token_ids=())  # 4 layers
PARAMS = llama.init_params(CFG, jax.random.PRNGKey(7), scale=0.1)
RNG = np.random.default_rng(3)
PROMPTS = [RNG.integers(3, CFG.vocab_size, n).tolist() for n in (6, 19, 2, 11)]
GREEDY = SamplingParams(temperature=0, max_tokens=10)
# per_row in one row stage (min_row_bucket = the batch), as on a GPU, whose layout per_layer
# is: no compaction there (`served_min_row_bucket`); stages would only add loops to compile
EXITS = ExitConfig(exit_layers=(1, 2, 3), threshold=0.02, measure="max_prob", min_row_bucket=4)
# every other head form: per exit they must compute what stacked ones do
HEAD_FORMS = [
    ExitConfig(exit_layers=(1, 2, 3), head="adapter", adapter_rank=4, measure="classifier"),
    ExitConfig(exit_layers=(1, 2, 3), head="mlp", adapter_rank=4, measure="candidates",
               vocab_subset=32, candidates=4),
    ExitConfig(exit_layers=(1, 2, 3), head="branch", exit_output=True, measure="max_prob"),
]


def _engine(layout: str, ec: ExitConfig | None, mesh: str | None = None) -> LLMEngine:
    config = EngineConfig.make(max_num_seqs=4, max_model_len=64, page_size=8, num_pages=40,
                               max_prefill_chunk=32, max_num_batched_tokens=128,
                               batch_buckets=(1, 4), attention="reference", mesh=mesh,
                               layer_layout=layout, exit_control=ControllerConfig(mode="exits"))
    return LLMEngine(CFG, PARAMS, None, config, ec)


@pytest.fixture(scope="module")
def dense():
    return [dense_greedy(CFG, PARAMS, p, GREEDY.max_tokens) for p in PROMPTS]


def test_the_plan_picks_per_layer_on_gpu_and_stacked_elsewhere():
    from ee_jax.serving.plan import engine_plan

    config = EngineConfig.make(max_num_seqs=4, max_model_len=64, page_size=8)
    assert [engine_plan(CFG, config, p).layer_layout for p in ("cpu", "cuda", "tpu")] == \
        ["stacked", "per_layer", "stacked"]
    forced = EngineConfig.make(max_num_seqs=4, max_model_len=64, page_size=8,
                               layer_layout="per_layer")
    assert engine_plan(CFG, forced, "cpu").layer_layout == "per_layer"
    with pytest.raises(ValueError, match="layer_layout"):
        engine_plan(CFG, EngineConfig.make(max_model_len=64, layer_layout="by_row"), "cpu")


def test_per_layer_params_are_a_buffer_a_layer():
    eng = _engine("per_layer", None)
    layers = eng.runner.params.layers
    assert isinstance(layers, tuple) and len(layers) == CFG.n_layers
    for i, lp in enumerate(layers):
        np.testing.assert_array_equal(lp.wq, PARAMS.layers.wq[i])


@pytest.mark.parametrize("ec", [
    None,
    EXITS.verified(3),
    ExitConfig(exit_layers=(1, 2, 3), threshold=0.02, policy="all").verified(2),
], ids=["full", "verified-per_row", "verified-all"])
def test_lossless_steps_equal_the_dense_forward(dense, ec):
    outs = run_requests(_engine("per_layer", ec), PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == dense


@pytest.mark.parametrize("policy,backfill", [("all", "deferred"), ("all", "propagate"),
                                             ("per_row", "propagate"),
                                             ("per_row", "deferred")])
def test_lossy_exits_equal_the_stacked_engine(policy, backfill):
    ec = dataclasses.replace(EXITS, policy=policy, backfill=backfill)
    stacked, per_layer = (run_requests(_engine(layout, ec), PROMPTS, GREEDY)
                          for layout in ("stacked", "per_layer"))
    assert [o.token_ids for o in per_layer] == [o.token_ids for o in stacked]
    assert [o.exit_layers for o in per_layer] == [o.exit_layers for o in stacked]
    assert any(e < CFG.n_layers for o in stacked for e in o.exit_layers)  # rows left


def test_tp2_per_layer_equals_the_dense_forward(dense):
    """Per layer and per exit under tp=2: each layer's and exit's buffers keep their split
    (an MLP head's width over tp, as the stacked spec less its axis), the tokens the dense
    forward's (verified exits with subset MLP heads and candidate decisions)."""
    ec = dataclasses.replace(HEAD_FORMS[1], threshold=0.3, min_row_bucket=4).verified(2)
    eng = _engine("per_layer", ec, mesh="tp=2")
    assert [o.token_ids for o in run_requests(eng, PROMPTS, GREEDY)] == dense
    assert eng.stats.num_drafted > 0  # the heads drafted: their switches ran
    wq = eng.runner.params.layers[0].wq
    assert len(wq.sharding.device_set) == 2
    down = eng.runner.exit_heads.mlp[0].down  # [D, r]
    assert tuple(down.sharding.spec) == (None, "tp")


def test_llm_holds_the_per_layer_params_it_serves():
    """An `LLM` serving per layer keeps the runner's per-layer arrays, not the stacked ones it
    loaded (which would hold the weights twice in device memory)."""
    from ee_jax.models.loading import LoadedModel
    from ee_jax.serving.llm import LLM

    llm = LLM(LoadedModel(CFG, PARAMS, None, "tiny"), early_exit=False, max_num_seqs=2,
              max_model_len=64, page_size=8, num_pages=20, layer_layout="per_layer",
              progress=False)
    assert llm.model.params is llm.engine.runner.params
    assert isinstance(llm.model.params.layers, tuple)


@pytest.mark.parametrize("ec", HEAD_FORMS, ids=["adapter-classifier", "mlp-candidates",
                                                "branch-output"])
def test_per_exit_heads_compute_what_stacked_heads_do(ec):
    """Heads held per exit (the per-layer layout's: each exit's parts buffers of their own,
    read in a lax.switch) give what the stacked heads give (read at a dynamic index), for
    every part an exit reads, at a traced slot, a static one and one a row (vmapped)."""
    from ee_jax.models.exits import checks
    from ee_jax.models.exits import heads as eh

    key = jax.random.PRNGKey(5)
    stacked = eh.init_heads(CFG, ec, PARAMS, key)
    leaves, tree = jax.tree.flatten(stacked)  # every exit its own weights (untrained: equal)
    stacked = jax.tree.unflatten(tree, [
        a if a.dtype == np.int32 else 0.3 * jax.random.normal(jax.random.fold_in(key, i),
                                                              a.shape, a.dtype)
        for i, a in enumerate(leaves)])
    stacked = eh.with_vocab_rows(PARAMS, stacked, CFG)
    per = eh.unstack_heads(stacked)
    assert eh.per_exit(per) and not eh.per_exit(stacked)
    for n in eh.EXIT_PARTS:
        part = getattr(per, n)
        assert part is None or (isinstance(part, tuple) and len(part) == 3), n
    assert per.vocab is stacked.vocab  # shared by every exit: as it was
    h, mid = jax.random.normal(jax.random.fold_in(key, 99), (2, 4, CFG.d_model))

    def reads(hd, slot):
        x = eh.exit_input(hd, slot, h, mid, CFG)
        out = {"input": x, "logits": eh.exit_logits(PARAMS, hd, slot, x, CFG)}
        if ec.measure == "classifier":
            out["classifier"] = checks.classifier_logit(hd, slot, x, CFG)
        if ec.measure == "candidates":
            out["decision"] = checks.decision_logit(hd, slot, x[:, :9])
        return out

    slots = jnp.asarray([2, -1, 0, 1], jnp.int32)
    traced = jax.jit(reads)
    for slot in range(3):
        want = traced(stacked, jnp.int32(slot))
        for got in (traced(per, jnp.int32(slot)), reads(per, slot)):
            jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5),
                         got, want)
    rows = jax.jit(lambda hd: eh.row_exit_logits(PARAMS, hd, slots, h, CFG))
    np.testing.assert_allclose(rows(per), rows(stacked), rtol=1e-5, atol=1e-5)


def test_per_layer_engine_holds_its_heads_per_exit():
    eng = _engine("per_layer", HEAD_FORMS[1])
    heads = eng.runner.exit_heads
    assert isinstance(heads.mlp, tuple) and len(heads.mlp) == 3
    assert heads.mlp[1].down.shape == (CFG.d_model, 4)
    assert not isinstance(_engine("stacked", HEAD_FORMS[1]).runner.exit_heads.mlp, tuple)
