"""EE-Tuning on a tiny random model: the loss falls, the backbone never moves, runs resume,
and the data splits keep evaluation text out of training."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ee_jax.models import exits
from ee_jax.models.exit_checkpoint import load_exit_heads, save_exit_heads
from ee_jax.models.loading import LoadedModel
from ee_jax.testing import tiny_model
from ee_jax.training import data
from ee_jax.training.losses import LossWeights, exit_losses
from ee_jax.training.tune import TuneConfig, TuneConfigError, tune

CFG, PARAMS = tiny_model(seed=4)
MODEL = LoadedModel(CFG, PARAMS, None, "tiny")
ROWS = np.random.default_rng(0).integers(0, CFG.vocab_size, (8, 24)).astype(np.int32)


def tiny_tune_config(tmp_path, **kw) -> TuneConfig:
    base = dict(exit_layers=(1, 2, 3), head="mlp", adapter_rank=8, measure="classifier",
                seq_len=24, batch_size=4, epochs=4, lr=3e-3, warmup_steps=2,
                work_dir=str(tmp_path / "work"), output=str(tmp_path / "heads"),
                checkpoint_every=2)
    base.update(kw)
    return TuneConfig(**base)


def test_tuning_lowers_the_loss_and_leaves_the_backbone_bit_identical(tmp_path):
    tc = tiny_tune_config(tmp_path)
    before = jax.tree.map(np.array, PARAMS)
    ec = tc.exit_config()
    loss_fn = jax.jit(lambda h: exit_losses(h, PARAMS, jnp.asarray(ROWS), CFG, ec,
                                            tc.loss_weights())[0])
    initial = float(loss_fn(exits.init_heads(CFG, ec, PARAMS, jax.random.PRNGKey(tc.seed))))
    res = tune(tc, model=MODEL, train=ROWS, held_out=ROWS[:2], progress=False, save=False)
    assert res.steps == 8
    assert float(loss_fn(res.heads)) < initial - 1e-3
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(PARAMS), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))
    assert set(res.eval_metrics) >= {"kl", "ce", "agree", "bce"}


def test_agreement_metric_is_top1_of_exit_head_vs_final_layer():
    from ee_jax.models import llama

    ec = exits.ExitConfig(exit_layers=(1, 3), head="mlp", adapter_rank=4)
    heads = exits.init_heads(CFG, ec, PARAMS, jax.random.PRNGKey(3))
    heads["mlp"]["up"] = 0.3 * jax.random.normal(jax.random.PRNGKey(4), heads["mlp"]["up"].shape)
    tokens = jnp.asarray(ROWS[:2])
    _, m = exit_losses(heads, PARAMS, tokens, CFG, ec, LossWeights())
    final, hidden = llama.forward(PARAMS, tokens, CFG, return_hidden=True)
    for slot, e in enumerate(ec.exit_layers):
        logits = exits.exit_logits(PARAMS, heads, slot, hidden[e - 1], CFG)
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
    assert ec == tc.exit_config()
    for a, b in zip(jax.tree.leaves(rest.heads), jax.tree.leaves(heads), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_heads_for_other_exit_layers_or_model_are_refused(tmp_path):
    ec = exits.ExitConfig(exit_layers=(1, 2), head="mlp", measure="classifier", adapter_rank=4)
    save_exit_heads(tmp_path / "h", CFG, ec, exits.init_heads(CFG, ec, PARAMS))
    with pytest.raises(exits.ExitConfigError, match=r"trained for exit layers \[1, 2\]"):
        load_exit_heads(tmp_path / "h", CFG, exit_layers=(1, 3))
    with pytest.raises(exits.ExitConfigError, match="made for a model"):
        load_exit_heads(tmp_path / "h", CFG.replace(n_layers=6))


def test_tune_config_yaml_rejects_unknown_settings(tmp_path):
    p = tmp_path / "t.yaml"
    p.write_text("exit_layers: [1, 2]\nlearning_rate: 0.1\n")
    with pytest.raises(TuneConfigError, match=r"unknown settings.*learning_rate"):
        TuneConfig.from_yaml(p)
    with pytest.raises(TuneConfigError, match="not found"):
        TuneConfig.from_yaml(tmp_path / "missing.yaml")


def test_shipped_preset_parses_and_fits_smollm2():
    from ee_jax.models.config import ModelConfig

    tc = TuneConfig.from_yaml("configs/tune-smollm2-135m.yaml")
    smollm2 = ModelConfig(vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3,
                          head_dim=64, ffn_dim=1536)
    tc.exit_config().validate_for(smollm2)
    assert tc.output.endswith("ee_jax/assets/smollm2-135m-instruct/exit_heads")


def test_data_splits_are_disjoint_and_deterministic():
    for fn in (data.instructions, data.code_prompts):
        train, held = fn("train"), fn("eval")
        assert train and held and not set(train) & set(held)
        assert fn("eval", 5, seed=1) == fn("eval", 5, seed=1)
    with pytest.raises(ValueError, match="split"):
        data.instructions("test")


def test_pack_cuts_the_stream_into_rows_with_separators():
    rows = data.pack([[1, 2, 3], [4, 5], [6, 7, 8, 9]], seq_len=4, sep=0)
    # stream: 1 2 3 0 4 5 0 6 7 8 9 0 -> three full rows
    np.testing.assert_array_equal(rows, [[1, 2, 3, 0], [4, 5, 0, 6], [7, 8, 9, 0]])
    assert data.pack([[1]], seq_len=4, sep=None).shape == (0, 4)
