"""A mixed-step service under Poisson-like arrivals compiles nothing after start-up's warm-up.

Arrivals form prefill and mixed steps of any row count, packed length and furthest position,
which no warm-up by example meets (it once left three ~2 s compiles inside a measured
Poisson run). Prefill steps take one page-table width and few batch buckets per packed length
(`SchedulerConfig.prefill_row_tokens`), so their shapes are few, and `LLMEngine.precompile`
compiles every shape ahead.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ee_jax.models.exits.backfill_maps import TPU_GATHER_MAX_ROWS
from ee_jax.serving.engine import EngineConfig, LLMEngine
from ee_jax.serving.kv_cache import allocate_cache
from ee_jax.serving.model_runner import (
    ModelRunner,
    StepConfig,
    StepProgram,
    StepShape,
    step_program,
)
from ee_jax.serving.params import greedy
from ee_jax.testing import tiny_model

CFG, PARAMS = tiny_model(seed=5, eos_token_ids=())


def _poisson_requests(rng, n: int, mean_gap: float, max_prompt: int, max_new: int):
    """(arrival step, prompt, max_tokens) of n requests with exponential gaps (in steps)."""
    steps = np.floor(np.cumsum(rng.exponential(mean_gap, n))).astype(int)
    return [(int(s), rng.integers(3, CFG.vocab_size, int(rng.integers(1, max_prompt + 1))
                                  ).tolist(), int(rng.integers(1, max_new + 1)))
            for s in steps]


def test_poisson_mixed_run_compiles_nothing_after_precompile():
    config = EngineConfig.make(max_num_seqs=4, max_model_len=64, page_size=8,
                               max_prefill_chunk=32, max_num_batched_tokens=64,
                               batch_buckets=(1, 2, 4), mixed_steps=True)
    engine = LLMEngine(CFG, PARAMS, None, config)
    shapes = engine.scheduler.config.step_shapes()
    prefill = [s for s in shapes if s.kind == "prefill"]
    assert {s.pages for s in prefill} == {8}  # one page-table width: pages_per_seq
    assert engine.precompile(progress=False) == len(shapes) == len(engine.runner.traces)
    traced = dict(engine.runner.traces)
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, _secs, **kw: compiles.append(event)
        if event == "/jax/core/compile/backend_compile_duration" else None)

    formed = []  # (kind, rows) of every step the scheduler formed
    schedule = engine.scheduler.schedule

    def recording():
        s = schedule()
        if s is not None:
            formed.append((s.kind, len(s.rows)))
        return s

    engine.scheduler.schedule = recording
    requests = _poisson_requests(np.random.default_rng(0), 40, mean_gap=2.0, max_prompt=48,
                                 max_new=16)
    done, step = {}, 0
    while len(done) < len(requests):
        for i, (at, prompt, new) in enumerate(requests):
            if at == step:
                engine.add_request(f"r{i}", prompt, greedy(new))
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        step += 1
    assert all(len(done[f"r{i}"].token_ids) == new for i, (_, _, new) in enumerate(requests))
    rows = {n for kind, n in formed if kind == "prefill"}
    assert engine.stats.num_mixed_steps > 0 and len(rows) >= 4, (formed, rows)
    assert engine.runner.traces == traced
    assert compiles == []


def test_exit_engine_compiles_each_shape_once():
    """An exit engine (candidate heads over a vocabulary subset) serving the same requests
    twice compiles one program per step shape: every argument of the step is committed to
    the device from the start (the donated cache and derived heads come back committed, and
    jit keys its programs on that; the second step of each shape compiled again, uncounted)."""
    from ee_jax.models.exits import heads as exit_heads
    from ee_jax.models.exits.config import ExitConfig

    ec = ExitConfig(exit_layers=(1, 2), head="mlp", adapter_rank=4,
                    measure="candidates", vocab_subset=40, candidates=4, threshold=0.5,
                    policy="per_row")
    heads = exit_heads.init_heads(CFG, ec, PARAMS).replace(
        vocab=jnp.arange(3, 43, dtype=jnp.int32))
    engine = LLMEngine(CFG, PARAMS, None, EngineConfig.make(
        max_num_seqs=4, max_model_len=64, page_size=8, max_prefill_chunk=32,
        batch_buckets=(1, 2, 4)), exit_config=ec, exit_heads=heads)
    prompts = [np.random.default_rng(1).integers(3, CFG.vocab_size, n).tolist()
               for n in (5, 17, 9)]
    for _ in range(2):
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}-{_}", p, greedy(12))
        while engine.has_unfinished_requests():
            engine.step()
    runner = engine.runner
    assert len(runner.traces) >= 2 and all(n <= 1 for n in runner.traces.values())
    # one executable per trace of the (shared) program: none compiled again uncounted
    assert runner._step._cache_size() == sum(runner.program.traces.values())


def test_engines_of_one_config_share_their_step_programs():
    """A second engine of the same model, exit settings and attention backend traces and
    compiles nothing the first one did (one jitted step per StepConfig, not per runner)."""
    config = EngineConfig.make(max_num_seqs=2, max_model_len=32, page_size=8, batch_buckets=(1, 2))
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13]]
    first = LLMEngine(CFG, PARAMS, None, config)
    for i, p in enumerate(prompts):
        first.add_request(f"a{i}", p, greedy(4))
    while first.has_unfinished_requests():
        first.step()
    second = LLMEngine(CFG, PARAMS, None, config)
    assert second.runner.program is first.runner.program
    traced = dict(first.runner.program.traces)
    for i, p in enumerate(prompts):
        second.add_request(f"b{i}", p, greedy(4))
    outs = []
    while second.has_unfinished_requests():
        outs += [o for o in second.step() if o.finished]
    assert second.runner.program.traces == traced and second.runner.num_traces == 0
    assert set(second.runner.traces) == set(first.runner.traces)
    assert second.stats.num_compiles == 0
    # "auto" is resolved where the config is built: on this CPU it is "xla", the same step
    assert first.runner.program.config.attention == "xla"
    same = LLMEngine(CFG, PARAMS, None, dataclasses.replace(config, attention="xla"))
    assert same.runner.program is first.runner.program
    # A different static config (attention backend) is a program of its own.
    other = LLMEngine(CFG, PARAMS, None, dataclasses.replace(config, attention="reference"))
    assert other.runner.program is not first.runner.program


def test_the_platform_and_the_backend_are_in_the_step_programs_key():
    """What a trace depends on is in its StepConfig: a config of another platform is another
    program, and the backend is a concrete name, valid on that platform."""
    cpu = StepConfig(CFG, None, "xla", "cpu", None)
    assert step_program(cpu) is step_program(StepConfig(CFG, None, "xla", "cpu", None))
    tpu = dataclasses.replace(cpu, platform="tpu")
    assert step_program(tpu) is not step_program(cpu)
    assert step_program(dataclasses.replace(cpu, attention="reference")) is not \
        step_program(cpu)
    with pytest.raises(ValueError, match=r"StepConfig\.attention is a concrete backend"):
        dataclasses.replace(cpu, attention="auto")
    with pytest.raises(ValueError, match=r"'pallas_tpu' needs a TPU.*'cpu'"):
        dataclasses.replace(cpu, attention="pallas_tpu")
    with pytest.raises(ValueError, match=r"StepConfig\.platform"):
        dataclasses.replace(cpu, platform="TPU")
    runner = ModelRunner(CFG, PARAMS, allocate_cache(CFG, 9, 8), attention="auto",
                         max_batch=2, platform="tpu")  # built for a TPU from this CPU host
    assert (runner.program.config.attention, runner.program.config.platform) == \
        ("pallas_tpu", "tpu")


def test_tracing_reads_no_ambient_platform(monkeypatch):
    """A step traced while JAX says it runs elsewhere is the same program: the platform and
    the backend come from the StepConfig, never from the process. The case is one where the
    platform decides the program (learned back-fill maps at 8 rows: gathered per row on CPU,
    every slot then a pick on TPU, `backfill_maps.gathers`), so a read would show."""
    from ee_jax.models.exits import heads as exit_heads
    from ee_jax.models.exits.config import ExitConfig
    from ee_jax.testing import random_backfill_maps

    ec = ExitConfig(exit_layers=(1, 2), backfill="learned", policy="all")
    heads = exit_heads.init_heads(CFG, ec, PARAMS).replace(
        backfill=random_backfill_maps(CFG, ec.exit_layers))
    runner = ModelRunner(CFG, PARAMS, allocate_cache(CFG, 17, 8), ec, heads,
                         attention="auto", max_batch=8)
    shape = StepShape(8, 1, 2)
    assert shape.batch > TPU_GATHER_MAX_ROWS

    def lowered(config: StepConfig) -> str:  # a fresh trace (not the shared program's)
        buf = jax.ShapeDtypeStruct((shape.size,), jnp.int32)
        return StepProgram(config).jitted.lower(
            shape, runner.params, runner.exit_heads, runner.cache, buf, runner.last_tokens,
            runner.pending).as_text()

    config = runner.program.config
    assert (config.attention, config.platform) == ("xla", "cpu")
    here = lowered(config)
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert lowered(config) == here
    monkeypatch.undo()
    # the same step configured for a TPU is another program: the platform does matter
    assert lowered(dataclasses.replace(config, platform="tpu")) != here
