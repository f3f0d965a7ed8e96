"""The step-program cache (`compilation.ProgramCache`): a restarted engine loads every program
`precompile` kept, traces and compiles none, and serves the tokens a freshly compiled engine
serves; a program another build, config or device made is never loaded; a damaged file costs
a compile, never a crash. And precompile stops with a clear error before XLA's CPU backend
runs the process out of memory maps."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from ee_jax.errors import MemoryMapsExhausted
from ee_jax.models.exits.config import ExitConfig
from ee_jax.serving import compilation
from ee_jax.serving.engine import EngineConfig, LLMEngine
from ee_jax.serving.model_runner import step_program
from ee_jax.serving.params import greedy
from ee_jax.testing import tiny_model
from tests.reference import dense_greedy, run_requests

CFG, PARAMS = tiny_model(seed=7, n_heads=8, n_kv_heads=2, head_dim=8, eos_token_ids=())
RNG = np.random.default_rng(4)
PROMPTS = [RNG.integers(3, CFG.vocab_size, n).tolist() for n in (5, 13, 2)]
NEW = 6
FORCED = ExitConfig(exit_layers=(1, 2, 3), policy="all", force_exit_layer=2)


def _engine(mesh=None, exit_config=None) -> LLMEngine:
    return LLMEngine(CFG, PARAMS, None, EngineConfig.make(
        max_num_seqs=2, max_model_len=32, page_size=8, batch_buckets=(1, 2),
        max_num_batched_tokens=16, mesh=mesh), exit_config=exit_config)


def _restart() -> None:
    """What a new process starts without: the shared step programs and jit's caches."""
    step_program.cache_clear()
    jax.clear_caches()


@pytest.fixture
def compile_events():
    events: list[str] = []
    active = [True]
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, _secs, **kw: events.append(event)
        if active[0] and event == "/jax/core/compile/backend_compile_duration" else None)
    yield events
    active[0] = False


@pytest.mark.parametrize("mesh, exit_config", [(None, None), ("tp=2", FORCED)],
                         ids=["one-device-full-depth", "tp2-forced-exit"])
def test_a_restart_loads_every_program_and_serves_the_same_tokens(
        tmp_path, compile_events, mesh, exit_config):
    if mesh and len(jax.devices()) < 2:
        pytest.skip("needs 2 devices (XLA_FLAGS, set in conftest.py)")
    if exit_config is None:  # full depth: the dense forward is the truth
        truth = [dense_greedy(CFG, PARAMS, p, NEW) for p in PROMPTS]
    else:  # a forced exit: an engine serving through jit, no program cache
        truth = [o.token_ids for o in run_requests(_engine(mesh, exit_config), PROMPTS,
                                                   greedy(NEW))]
    first = _engine(mesh, exit_config)
    n = first.precompile(progress=False, program_cache=str(tmp_path))
    assert first.stats.num_compiles == n and first.stats.num_programs_loaded == 0
    assert len(list(tmp_path.glob("*.bin"))) == n
    assert [o.token_ids for o in run_requests(first, PROMPTS, greedy(NEW))] == truth

    _restart()
    second = _engine(mesh, exit_config)
    del compile_events[:]  # (building the engine compiles its small set-up programs)
    assert second.precompile(progress=False, program_cache=str(tmp_path)) == n
    assert second.stats.num_programs_loaded == n and second.stats.num_compiles == 0
    outs = run_requests(second, PROMPTS, greedy(NEW))
    assert [o.token_ids for o in outs] == truth
    assert sum(second.runner.program.traces.values()) == 0  # nothing traced, ...
    assert compile_events == []  # ... nothing compiled, steps included
    assert len(second.runner.traces) == n


def test_a_program_of_another_build_or_config_is_never_loaded(tmp_path, monkeypatch):
    _engine().precompile(("decode",), progress=False, program_cache=str(tmp_path))
    n = len(list(tmp_path.glob("*.bin")))
    _restart()
    other_exits = _engine(exit_config=FORCED)  # another step configuration
    other_exits.precompile(("decode",), progress=False, program_cache=str(tmp_path))
    assert other_exits.stats.num_programs_loaded == 0
    _restart()
    monkeypatch.setattr(compilation, "source_digest", lambda: "another build of ee_jax")
    rebuilt = _engine()
    assert rebuilt.precompile(("decode",), progress=False, program_cache=str(tmp_path)) == n
    assert rebuilt.stats.num_programs_loaded == 0 and rebuilt.stats.num_compiles == n


def test_a_damaged_program_is_removed_warned_about_and_compiled_again(tmp_path):
    _engine().precompile(("decode",), progress=False, program_cache=str(tmp_path))
    files = sorted(tmp_path.glob("*.bin"))
    files[0].write_bytes(b"not a program")
    _restart()
    engine = _engine()
    with pytest.warns(UserWarning, match="unreadable compiled program"):
        n = engine.precompile(("decode",), progress=False, program_cache=str(tmp_path))
    assert engine.stats.num_programs_loaded == n - 1 and engine.stats.num_compiles == 1
    assert files[0].stat().st_size > len(b"not a program")  # compiled and kept again
    outs = run_requests(engine, PROMPTS, greedy(NEW))
    assert [o.token_ids for o in outs] == [dense_greedy(CFG, PARAMS, p, NEW) for p in PROMPTS]


def test_precompile_stops_with_a_clear_error_before_the_memory_maps_run_out(monkeypatch):
    """XLA's CPU backend crashes (a segmentation fault inside a compile) when the process
    reaches vm.max_map_count; precompile stops first, saying what to do."""
    monkeypatch.setattr(compilation, "memory_maps", lambda: (95_000, 100_000))
    with pytest.raises(MemoryMapsExhausted, match=r"vm\.max_map_count.*fewer step shapes"):
        _engine().precompile(("decode",), progress=False)
    monkeypatch.setattr(compilation, "memory_maps", lambda: (50_000, 100_000))
    assert _engine().precompile(("decode",), progress=False) > 0
