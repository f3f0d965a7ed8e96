"""Exit heads: confidence measures against closed forms, head math, and the round trip on disk."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from ee_jax.models import llama
from ee_jax.models.exits import checkpoint as exit_checkpoint
from ee_jax.models.exits import checks as exit_checks
from ee_jax.models.exits import heads as exit_heads
from ee_jax.models.exits.checkpoint import load_exit_heads, save_exit_heads
from ee_jax.models.exits.config import ExitConfig, ExitConfigError
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


def test_heads_round_trip_through_safetensors(tmp_path):
    ec = ExitConfig(exit_layers=(1, 2), head="adapter", measure="classifier",
                    adapter_rank=8, threshold=0.8)
    heads = exit_heads.init_heads(CFG, ec, PARAMS, jax.random.PRNGKey(1))
    heads = heads.replace(classifier=heads.classifier.replace(b=jnp.asarray([0.25, -1.5])))
    save_exit_heads(tmp_path / "heads", CFG, ec, heads)
    ec2, restored = load_exit_heads(tmp_path / "heads", CFG)
    assert ec2 == ec
    for a, b in zip(jax.tree.leaves(heads), jax.tree.leaves(restored), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    other = CFG.replace(d_model=64, head_dim=16)
    with pytest.raises(ExitConfigError, match="made for a model"):
        load_exit_heads(tmp_path / "heads", other)
    # a heads file that does not fit its exit_config.json: a clear error naming the leaf
    import safetensors.numpy as stn
    f = tmp_path / "heads" / exit_checkpoint.HEADS
    leaves = stn.load_file(str(f))
    stn.save_file(dict(leaves, norm=leaves["norm"][:1]), str(f))
    with pytest.raises(ExitConfigError, match=r"'norm'.*shape"):
        load_exit_heads(tmp_path / "heads", CFG)
    stn.save_file({k: v for k, v in leaves.items() if k != "norm"}, str(f))
    with pytest.raises(ExitConfigError, match="missing \\['norm'\\]"):
        load_exit_heads(tmp_path / "heads", CFG)


def test_heads_saved_by_orbax_before_still_load(tmp_path):
    """Heads written as an orbax item (ee-jax before heads.safetensors) load unchanged."""
    import orbax.checkpoint as ocp

    ec = ExitConfig(exit_layers=(1, 2), head="mlp", adapter_rank=4, threshold=0.8)
    heads = exit_heads.init_heads(CFG, ec, PARAMS, jax.random.PRNGKey(3))
    save_exit_heads(tmp_path / "h", CFG, ec, heads)
    (tmp_path / "h" / exit_checkpoint.HEADS).unlink()
    with ocp.StandardCheckpointer() as ckptr:
        # as ee-jax wrote them then: a dict of the parts
        ckptr.save(tmp_path / "h" / exit_checkpoint.ORBAX_HEADS, heads.as_dicts())
        ckptr.wait_until_finished()
    ec2, restored = load_exit_heads(tmp_path / "h", CFG)
    assert ec2 == ec
    for a, b in zip(jax.tree.leaves(heads), jax.tree.leaves(restored), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_serving_the_shipped_heads_imports_no_orbax():
    """Loading the shipped heads (what `make run` does) leaves orbax unimported: its import
    alone took 0.57 s of the main job."""
    code = ("import sys\n"
            "from ee_jax.models import registry\n"
            "from ee_jax.models.exits import checkpoint as exit_checkpoint\n"
            "from ee_jax.random_model import random_config\n"
            "cfg = random_config(n_layers=30, d_model=576, vocab_size=49152, n_heads=9, "
            "n_kv_heads=3, head_dim=64)\n"
            "exit_checkpoint.load_exit_heads(registry.shipped_exit_heads("
            "'smollm2-135m-instruct'), cfg)\n"
            "print(sorted(m for m in sys.modules if m.startswith('orbax')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
