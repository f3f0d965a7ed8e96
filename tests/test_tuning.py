"""EE-Tuning on a tiny random model: the loss falls, the backbone never moves, runs resume,
and the data splits keep evaluation text out of training."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ee_jax.models.exits import heads as exit_heads
from ee_jax.models.exits.checkpoint import load_exit_heads, save_exit_heads
from ee_jax.models.exits.config import NEVER, ExitConfig, ExitConfigError
from ee_jax.models.loading import LoadedModel
from ee_jax.testing import random_backfill_maps, tiny_model
from ee_jax.training import data
from ee_jax.training.losses import LossWeights, exit_losses
from ee_jax.training.tune import tune
from ee_jax.training.tune_config import TuneConfig, TuneConfigError

CFG, PARAMS = tiny_model(seed=4)
MODEL = LoadedModel(CFG, PARAMS, None, "tiny")
ROWS = np.random.default_rng(0).integers(0, CFG.vocab_size, (8, 24)).astype(np.int32)


def tiny_tune_config(tmp_path, **kw) -> TuneConfig:
    base = dict(exit_layers=(1, 2, 3), head="mlp", adapter_rank=8, measure="classifier",
                seq_len=24, batch_size=4, epochs=4, lr=3e-3, warmup_steps=2,
                work_dir=str(tmp_path / "work"), output=str(tmp_path / "heads"),
                checkpoint_every=2)
    base.update(kw)
    return TuneConfig.make(**base)


def test_tuning_lowers_the_loss_and_leaves_the_backbone_bit_identical(tmp_path):
    tc = tiny_tune_config(tmp_path)
    before = jax.tree.map(np.array, PARAMS)
    ec = tc.exit_config
    loss_fn = jax.jit(lambda h: exit_losses(h, PARAMS, jnp.asarray(ROWS), CFG, ec,
                                            tc.loss_weights())[0])
    initial = float(loss_fn(exit_heads.init_heads(CFG, ec, PARAMS, jax.random.PRNGKey(tc.seed))))
    res = tune(tc, model=MODEL, train=ROWS, held_out=ROWS[:2], progress=False, save=False)
    assert res.steps == 8
    assert float(loss_fn(res.heads)) < initial - 1e-3
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(PARAMS), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))
    assert set(res.eval_metrics) >= {"kl", "ce", "agree", "bce"}


def test_agreement_metric_is_top1_of_exit_head_vs_final_layer():
    from ee_jax.models import llama

    ec = ExitConfig(exit_layers=(1, 3), head="mlp", adapter_rank=4)
    heads = exit_heads.init_heads(CFG, ec, PARAMS, jax.random.PRNGKey(3))
    heads = heads.replace(mlp=heads.mlp.replace(
        up=0.3 * jax.random.normal(jax.random.PRNGKey(4), heads.mlp.up.shape)))
    tokens = jnp.asarray(ROWS[:2])
    _, m = exit_losses(heads, PARAMS, tokens, CFG, ec, LossWeights())
    final, hidden = llama.forward(PARAMS, tokens, CFG, return_hidden=True)
    for slot, e in enumerate(ec.exit_layers):
        logits = exit_heads.exit_logits(PARAMS, heads, slot, hidden[e - 1], CFG)
        want = np.mean(np.argmax(logits, -1) == np.argmax(final, -1))
        assert float(m["agree"][slot]) == pytest.approx(want)


def test_interrupted_run_resumes_to_the_same_heads(tmp_path):
    whole = tune(tiny_tune_config(tmp_path / "a"), model=MODEL, train=ROWS, progress=False)
    tc = tiny_tune_config(tmp_path / "b")
    part = tune(dataclasses.replace(tc, max_steps=4), model=MODEL, train=ROWS, progress=False)
    assert len(part.history) == 4
    rest = tune(tc, model=MODEL, train=ROWS, progress=False)
    assert [h["step"] for h in rest.history] == [5, 6, 7, 8]  # resumed, not restarted
    for a, b in zip(jax.tree.leaves(whole.heads), jax.tree.leaves(rest.heads), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    ec, heads = load_exit_heads(tc.output, CFG)
    assert ec == tc.exit_config
    for a, b in zip(jax.tree.leaves(rest.heads), jax.tree.leaves(heads), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_heads_for_other_exit_layers_or_model_are_refused(tmp_path):
    ec = ExitConfig(exit_layers=(1, 2), head="mlp", measure="classifier", adapter_rank=4)
    save_exit_heads(tmp_path / "h", CFG, ec, exit_heads.init_heads(CFG, ec, PARAMS))
    with pytest.raises(ExitConfigError, match=r"trained for exit layers \[1, 2\]"):
        load_exit_heads(tmp_path / "h", CFG, exit_layers=(1, 3))
    with pytest.raises(ExitConfigError, match="made for a model"):
        load_exit_heads(tmp_path / "h", CFG.replace(n_layers=6))


def test_tune_config_yaml_rejects_unknown_settings(tmp_path):
    p = tmp_path / "t.yaml"
    p.write_text("exit_layers: [1, 2]\nlearning_rate: 0.1\n")
    with pytest.raises(TuneConfigError, match=r"unknown settings.*learning_rate"):
        TuneConfig.from_yaml(p)
    with pytest.raises(TuneConfigError, match="not found"):
        TuneConfig.from_yaml(tmp_path / "missing.yaml")
    p.write_text("exit_layers: [1, 2]\nbackfill: copy\n")
    with pytest.raises(TuneConfigError, match=r"unknown backfill 'copy'"):
        TuneConfig.from_yaml(p)
    p.write_text("exit_config:\n  exit_layers: [1, 2]\n  epochs: 2\n")  # not an exit setting
    with pytest.raises(TuneConfigError, match=r"unknown settings \['epochs'\]"):
        TuneConfig.from_yaml(p)


def test_everyday_training_requests_change_the_data_key_only_when_asked_for():
    base = TuneConfig.make(exit_layers=(1, 2))
    more = TuneConfig.make(exit_layers=(1, 2), everyday_train=40)
    assert more.data_key() != base.data_key()
    # settings that do not touch the data keep the cached data
    assert TuneConfig.make(exit_layers=(1, 2), epochs=9, backfill="propagate").data_key() == \
        base.data_key()
    assert len(data.everyday_requests("train", 40)) == 40


@pytest.mark.parametrize("backfill", ["propagate", "deferred", "learned"])
def test_tune_config_backfill_reaches_the_exit_config(backfill):
    # the heads are calibrated for one back-fill; the exit_config.json they ship with says it
    ec = TuneConfig.make(exit_layers=(1, 2), backfill=backfill).exit_config
    assert ec.backfill == backfill


def test_shipped_preset_parses_and_fits_smollm2():
    from ee_jax.models.config import ModelConfig

    smollm2 = ModelConfig(vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3,
                          head_dim=64, ffn_dim=1536)
    for preset in ("configs/tune-smollm2-135m.yaml", "configs/tune-smollm2-135m-subset.yaml"):
        TuneConfig.from_yaml(preset).exit_config.validate_for(smollm2)
    tc = TuneConfig.from_yaml("configs/tune-smollm2-135m-subset.yaml")  # the shipped heads'
    assert tc.output.endswith("ee_jax/assets/smollm2-135m-instruct/exit_heads")
    assert tc.method == "cached" and tc.exit_config.measure == "candidates"


def test_data_splits_are_disjoint_and_deterministic():
    for fn in (data.instructions, data.code_prompts):
        train, held, calib = fn("train"), fn("eval"), fn("calib")
        assert train and held and calib
        assert not set(train) & set(held) and not set(train) & set(calib)
        assert not set(calib) & set(held)
        assert fn("eval", 5, seed=1) == fn("eval", 5, seed=1)
    with pytest.raises(ValueError, match="split"):
        data.instructions("test")
    # everyday chat: train and calib halves, and nothing the evaluation's everyday chat holds
    from ee_jax.evaluation.prompts import GENERAL_CHAT

    train, calib = data.everyday_requests("train"), data.everyday_requests("calib")
    assert len(calib) >= 48 and train and not set(train) & set(calib)
    assert not set(train + calib) & set(GENERAL_CHAT)
    with pytest.raises(ValueError, match="GENERAL_CHAT"):
        data.everyday_requests("eval")


def test_pack_cuts_the_stream_into_rows_with_separators():
    rows = data.pack([[1, 2, 3], [4, 5], [6, 7, 8, 9]], seq_len=4, sep=0)
    # stream: 1 2 3 0 4 5 0 6 7 8 9 0 -> three full rows
    np.testing.assert_array_equal(rows, [[1, 2, 3, 0], [4, 5, 0, 6], [7, 8, 9, 0]])
    assert data.pack([[1]], seq_len=4, sep=None).shape == (0, 4)


# --------------------------------------------------------------------------- method "cached"


def test_restricted_kl_over_the_whole_vocabulary_is_the_full_kl():
    from ee_jax.models import llama
    from ee_jax.training.cached import batch_vocab
    from ee_jax.training.losses import restricted_exit_losses

    ec = ExitConfig(exit_layers=(1, 3), head="mlp", adapter_rank=4)
    heads = exit_heads.init_heads(CFG, ec, PARAMS, jax.random.PRNGKey(3))
    heads = heads.replace(mlp=heads.mlp.replace(
        up=0.3 * jax.random.normal(jax.random.PRNGKey(4), heads.mlp.up.shape)))
    tokens = jnp.asarray(ROWS[:2])
    final, hidden = llama.forward(PARAMS, tokens, CFG, return_hidden=True)
    hs = hidden[np.asarray(ec.exit_layers) - 1]
    fin = llama.norm(hidden[-1], PARAMS.final_norm, CFG)
    V = CFG.vocab_size
    top = np.asarray(jax.lax.top_k(final, 4)[1])
    ids, valid, pos = batch_vocab(ROWS[:2, 1:], top, V, np.arange(V))
    assert valid.all() and sorted(ids) == list(range(V))
    np.testing.assert_array_equal(ids[pos], ROWS[:2, 1:])  # positions index the real tokens
    _, m = restricted_exit_losses(heads, PARAMS, hs, fin, jnp.asarray(ids), jnp.asarray(valid),
                                  jnp.asarray(pos), CFG, ec, LossWeights())
    for slot, e in enumerate(ec.exit_layers):  # numpy KL over the whole vocabulary
        lq = np.asarray(jax.nn.log_softmax(exit_heads.exit_logits(PARAMS, heads, slot,
                                                              hidden[e - 1], CFG)), np.float64)
        lp = np.asarray(jax.nn.log_softmax(final), np.float64)
        kl = (np.exp(lp) * (lp - lq)).sum(-1).mean()
        assert float(m["kl"][slot]) == pytest.approx(kl, rel=1e-4, abs=1e-6)
        ce = -np.take_along_axis(lq[:, :-1], ROWS[:2, 1:, None], -1).mean()
        assert float(m["ce"][slot]) == pytest.approx(ce, rel=1e-4)
    # a smaller restricted vocabulary holds every real next token first
    ids, valid, pos = batch_vocab(ROWS[:2, 1:], top, 40, np.arange(V))
    np.testing.assert_array_equal(ids[pos], ROWS[:2, 1:])
    assert valid.sum() == 40


def test_cached_tuning_lowers_the_loss_keeps_the_backbone_and_ships_calibration(tmp_path):
    from ee_jax.models import llama
    from ee_jax.training.cached import cache_states
    from ee_jax.training.losses import restricted_exit_losses

    before = jax.tree.map(np.array, PARAMS)
    tc = tiny_tune_config(tmp_path, method="cached", measure="candidates", vocab_subset=64,
                          candidates=4, kl_vocab=96, teacher_topk=4, epochs=3,
                          decision_steps=20, target_agreement=0.5, backfill_rank=4)
    calib = np.random.default_rng(1).integers(0, CFG.vocab_size, (4, 24)).astype(np.int32)
    res = tune(tc, model=MODEL, train=ROWS, held_out=ROWS[:2], calib=calib, progress=False)
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(PARAMS), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))
    # the loss on the training rows, over the whole vocabulary, went down
    ec = tc.exit_config
    cache = cache_states(CFG, PARAMS, ROWS, ec.exit_layers, 4, progress=False)
    V = CFG.vocab_size
    fin = llama.norm(llama.forward(PARAMS, jnp.asarray(ROWS), CFG, return_hidden=True)[1][-1],
                     PARAMS.final_norm, CFG)
    loss = jax.jit(lambda h: restricted_exit_losses(
        h, PARAMS, jnp.asarray(np.moveaxis(cache["hs"], 1, 0)), fin, jnp.arange(V),
        jnp.ones(V, bool), jnp.asarray(ROWS[:, 1:]), CFG, ec, tc.loss_weights())[0])
    start = exit_heads.init_heads(CFG, ec, PARAMS, jax.random.PRNGKey(tc.seed))
    assert float(loss(res.heads)) < float(loss(start)) - 1e-3
    # saved: subset of the most frequent ids, decision MLPs, calibrated threshold
    ec2, heads = load_exit_heads(tc.output, CFG)
    assert ec2.measure == "candidates" and heads.vocab.shape == (64,)
    assert ec2.threshold == res.exit_config.threshold
    assert ec2.threshold == NEVER or 0.0 < ec2.threshold < 1.0
    assert ec2.backfill == tc.exit_config.backfill
    # learned back-fill maps fitted and shipped beside the heads, recorded in exit_config.json
    assert heads.backfill.a.shape[-1] == tc.backfill_rank
    record = json.loads((Path(tc.output) / "exit_config.json").read_text())["backfill_maps"]
    assert record["rank"] == tc.backfill_rank and record["fit_tokens"] > 0
    ec3, _ = load_exit_heads(tc.output, CFG, target_agreement=1.0)
    assert ec3.threshold == NEVER  # agreement 1 cannot be certified with errors allowed


def test_answer_rows_score_the_states_that_predict_answer_tokens():
    """`ee-jax fit-backfill` fits maps on the states a served step could back-fill: those
    whose next token is an answer token (the prompt's last position onwards)."""
    from ee_jax.training.tune import _answer_rows

    rows, scored = _answer_rows([([5, 6, 7], [8, 9]), ([4], [3, 2, 1])], max_len=16)
    assert rows.tolist() == [[5, 6, 7, 8, 9], [4, 3, 2, 1, 0]]
    assert scored.tolist() == [[False, False, True, True, False],
                               [True, True, True, False, False]]
    rows, scored = _answer_rows([([1, 2, 3], [4, 5, 6])], max_len=4)  # cut at max_len
    assert rows.tolist() == [[1, 2, 3, 4]] and scored.tolist() == [[False, False, True, False]]


def test_fit_backfill_finetune_lowers_the_served_loss_and_records_it():
    """`ee-jax fit-backfill --finetune-epochs`: the maps fine-tuned on answers (here: the
    same ones held out, so the loss on them must fall) and the record of it."""
    from ee_jax.models import llama
    from ee_jax.models.exits import backfill_maps as bm
    from ee_jax.training import backfill_tune
    from ee_jax.training.tune import _finetune_maps

    # weights large enough that a back-filled token moves later ones (at scale 0.1 it does
    # not, in f32)
    params = llama.init_params(CFG, jax.random.PRNGKey(7), scale=0.4)
    model = LoadedModel(CFG, params, None, "tiny")
    ec = ExitConfig(exit_layers=(1, 2, 3), threshold=0.5)
    heads = exit_heads.init_heads(CFG, ec, params, jax.random.PRNGKey(0))
    maps = jax.tree.map(lambda m: m.astype(bm.MAP_DTYPE), random_backfill_maps(
        CFG, ec.exit_layers, rank=4, seed=1, scale=0.2))
    pairs = [(list(r[:8]), list(r[8:20])) for r in ROWS]
    # a threshold at the heads' median confidence: about half the answer tokens leave
    conf = np.asarray(backfill_tune._dense_pass(params, heads, jnp.asarray(ROWS[:, :20]), CFG,
                                                ec)[0])
    thr = float(np.median(conf[:, :, 8:19].max(axis=0)))
    new, rec = _finetune_maps(model, ec, heads, maps, pairs, {"answers": pairs}, epochs=8,
                              lr=1e-2, thresholds=(thr,), progress=False)
    assert rec["thresholds"] == [thr] and rec["epochs"] == 8
    before = rec["served_sim_held_out_before"]["answers"]
    after = rec["served_sim_held_out_after"]["answers"]
    assert before["tokens"] == after["tokens"] > 0
    assert after["kl"] < before["kl"]
    assert new.a.shape == maps.a.shape and new.a.dtype == bm.MAP_DTYPE
