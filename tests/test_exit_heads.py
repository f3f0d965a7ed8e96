"""Exit heads: confidence measures against closed forms, head math, and the orbax round trip."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from ee_jax.models import exit_checks, exit_heads, llama
from ee_jax.models.exit_checkpoint import load_exit_heads, save_exit_heads
from ee_jax.models.exit_config import ExitConfig, ExitConfigError
from ee_jax.testing import tiny_model

CFG, PARAMS = tiny_model(seed=2)
LOGITS = hnp.arrays(np.float32, (3, 17), elements=st.floats(-30, 30, width=32))


@settings(max_examples=30, deadline=None)
@given(LOGITS)
def test_measures_match_numpy_and_lie_in_unit_interval(logits):
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    srt = np.sort(p, -1)
    ent = -(p * np.log(np.maximum(p, 1e-30))).sum(-1)
    want = {"max_prob": srt[:, -1], "margin": srt[:, -1] - srt[:, -2],
            "entropy": 1 - ent / np.log(17)}
    for name, w in want.items():
        got = np.asarray(exit_checks.confidence_from_logits(jnp.asarray(logits), name))
        np.testing.assert_allclose(got, w, atol=2e-5)
        assert ((got >= -1e-6) & (got <= 1 + 1e-6)).all()


def test_saturation_is_cosine():
    h = jnp.asarray([[1.0, 0.0], [1.0, 1.0], [2.0, 0.0]])
    prev = jnp.asarray([[1.0, 0.0], [1.0, -1.0], [-1.0, 0.0]])
    np.testing.assert_allclose(np.asarray(exit_checks.saturation(h, prev)), [1.0, 0.0, 0.0],
                                     atol=1e-6)


def test_norm_head_at_last_slot_with_final_norm_is_the_final_head():
    ec = ExitConfig(exit_layers=(1, 3))
    heads = exit_heads.init_heads(CFG, ec, PARAMS)  # norms start as the final norm
    h = jax.random.normal(jax.random.PRNGKey(0), (5, CFG.d_model))
    np.testing.assert_allclose(np.asarray(exit_heads.exit_logits(PARAMS, heads, 1, h, CFG)),
                                    np.asarray(llama.final_head(PARAMS, h, CFG)), atol=1e-5)


def test_untrained_adapter_is_identity_and_classifier_is_half():
    ec = ExitConfig(exit_layers=(2,), head="adapter", measure="classifier",
                    adapter_rank=4)
    heads = exit_heads.init_heads(CFG, ec, PARAMS)
    h = jax.random.normal(jax.random.PRNGKey(1), (2, CFG.d_model))
    np.testing.assert_allclose(np.asarray(exit_heads.exit_logits(PARAMS, heads, 0, h, CFG)),
                                    np.asarray(llama.final_head(PARAMS, h, CFG)), atol=1e-5)
    np.testing.assert_allclose(np.asarray(exit_checks.classifier_confidence(heads, 0, h, CFG)), 0.5)


def test_heads_round_trip_through_orbax(tmp_path):
    ec = ExitConfig(exit_layers=(1, 2), head="adapter", measure="classifier",
                    adapter_rank=8, threshold=0.8)
    heads = exit_heads.init_heads(CFG, ec, PARAMS, jax.random.PRNGKey(1))
    heads["classifier"]["b"] = jnp.asarray([0.25, -1.5])
    save_exit_heads(tmp_path / "heads", CFG, ec, heads)
    ec2, restored = load_exit_heads(tmp_path / "heads", CFG)
    assert ec2 == ec
    for a, b in zip(jax.tree.leaves(heads), jax.tree.leaves(restored), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    other = CFG.replace(d_model=64, head_dim=16)
    with pytest.raises(ExitConfigError, match="made for a model"):
        load_exit_heads(tmp_path / "heads", other)
