"""Figures a user can trust: steps that compiled a program are left out of the decode step
time and of the time to first token, and counted (a compile in a timed step would
make the figure the compiler's, not the engine's).

The truth is the test's own: it times every `engine.step()` call (blocking steps, so a call is
one step) and counts the compiles JAX reports during it through its own `jax.monitoring`
listener, which also makes every compile inside `LLMEngine.step` take SLOW seconds longer, so
that a compile counted as decoding could not hide in the noise of a shared CPU.
"""

from __future__ import annotations

import re
import threading
import time

import pytest
from jax._src import monitoring

from ee_jax.cli import main as cli_main
from ee_jax.serving.engine import EngineConfig, LLMEngine
from ee_jax.serving.params import greedy
from ee_jax.testing import tiny_model

# Each test compiles a handful of real step programs (tens of seconds on the shared 2-core CPU).
pytestmark = pytest.mark.slow
SLOW = 1.0  # seconds every compile inside an engine step is made to take longer
COMPILE = "/jax/core/compile/backend_compile_duration"


@pytest.fixture
def slow_compiles(monkeypatch):
    """Each compile inside `LLMEngine.step` sleeps SLOW seconds; yields the names of every
    program compiled inside a step."""
    seen: list[str] = []
    in_step = threading.local()
    step = LLMEngine.step

    def timed_step(self):
        in_step.on = True
        try:
            return step(self)
        finally:
            in_step.on = False

    def on_event(event: str, duration: float, fun_name: str = "", **_kw) -> None:
        if event == COMPILE and getattr(in_step, "on", False):
            seen.append(fun_name)
            time.sleep(SLOW)

    monkeypatch.setattr(LLMEngine, "step", timed_step)
    monitoring.register_event_duration_secs_listener(on_event)
    yield seen
    monitoring.unregister_event_duration_listener(on_event)


def test_a_mid_run_compile_is_left_out_of_decode_time_and_first_tokens(slow_compiles):
    cfg, params = tiny_model(seed=1, eos_token_ids=())
    engine = LLMEngine(cfg, params, None, EngineConfig.make(
        max_num_seqs=4, max_model_len=64, page_size=4, num_pages=80, max_prefill_chunk=16,
        max_num_batched_tokens=64, batch_buckets=(1, 4), async_scheduling=False))
    walls = {"decode": [], "decode_compiled": []}

    def step():
        n_compiles, n_decode = len(slow_compiles), engine.stats.num_decode_steps
        t0 = time.perf_counter()
        outs = engine.step()
        wall = time.perf_counter() - t0
        if engine.stats.num_decode_steps > n_decode:  # this call ran a decode step
            walls["decode_compiled" if len(slow_compiles) > n_compiles else "decode"].append(
                wall)
        return outs

    engine.add_request("a", [5, 6, 7], greedy(16))
    for _ in range(6):  # prefill, then decode at batch 1 (its first decode step compiles)
        step()
    for r in "bcd":  # mid-run: three more rows, a batch-4 decode program to compile
        engine.add_request(r, [8, 9, 10, 11], greedy(6))
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in step() if o.finished})

    s = engine.stats
    assert len(walls["decode_compiled"]) >= 2  # batch 1 and batch 4 compiled mid-run
    assert s.num_decode_compiles == len(walls["decode_compiled"])
    assert s.num_decode_steps == len(walls["decode"]) + len(walls["decode_compiled"])
    warm = sum(walls["decode"]) / len(walls["decode"])
    assert min(walls["decode_compiled"]) > SLOW  # the truth: those steps were slow
    # the reported step time is the warm steps' (within the host work around the step)
    assert s.decode_step_time <= 1.2 * warm + 1e-3
    assert s.decode_step_time < SLOW / 4
    # first tokens: the rows that arrived mid-run waited on the batch-4 compiles
    for r in "bcd":
        m = done[r].metrics
        assert m.compile_wait > SLOW
        assert m.warm_time_to_first_token == pytest.approx(
            m.time_to_first_token - m.compile_wait)
        assert m.warm_time_to_first_token < SLOW / 2


def test_with_async_scheduling_a_compile_is_not_charged_to_the_step_in_flight(slow_compiles):
    """The default engine launches a step before it reads the one in flight: a launch that
    compiles (a new batch size or prompt shape mid-run) holds the host while that step has
    long finished on the device, and none of that wait is the step's."""
    cfg, params = tiny_model(seed=1, eos_token_ids=())
    engine = LLMEngine(cfg, params, None, EngineConfig.make(  # (page size 8: shapes of its own,
        max_num_seqs=4, max_model_len=64, page_size=8, num_pages=40,  # compiled here)
        max_prefill_chunk=16, max_num_batched_tokens=64, batch_buckets=(1, 4),
        async_scheduling=True))
    engine.add_request("a", [5, 6, 7], greedy(16))
    for _ in range(6):  # prefill, then decode at batch 1
        engine.step()
    for r in "bcd":  # mid-run, while a batch-1 decode step is in flight: new programs
        engine.add_request(r, [8, 9, 10, 11], greedy(6))
    n = len(slow_compiles)
    while engine.has_unfinished_requests():
        engine.step()
    s = engine.stats
    assert len(slow_compiles) > n and s.num_decode_compiles >= 2
    # each compile took more than SLOW; the tiny model's ~30 warm decode steps take far less
    assert s.decode_time < SLOW / 2, (s.decode_time, s.num_decode_steps)
    assert s.compile_time > SLOW * s.num_compiles


def test_the_cli_summary_leaves_compiling_steps_out_and_says_how_many(slow_compiles, capsys):
    """`ee-jax generate` without precompiling: the first decode step compiles mid-run; the
    summary's ms/step is the warm steps' and it says how many steps it left out."""
    rc = cli_main(["generate", "--model", "random", "--prompt", "hello", "--prompt", "hi",
                   "--max-tokens", "12", "--no-chat", "--no-early-exit", "--quiet",
                   "--no-async-scheduling"])
    assert rc == 0
    err = capsys.readouterr().err
    m = re.search(r"decode [\d.]+ tok/s, ([\d.]+) ms/step over (\d+) steps \((\d+) that "
                  r"compiled left out\)", err)
    assert m, err
    ms, warm_steps, compiled = float(m[1]), int(m[2]), int(m[3])
    assert compiled >= 1 and warm_steps >= 5
    assert ms < 1000 * SLOW / 4  # a compile counted in would add SLOW / steps at least
    # both requests waited on the prefill's compile: no warm figure is made up for them
    t = re.search(r"time to first token: every request \((\d+)\) waited on a compile, mean "
                  r"([\d.]+)s with it", err)
    assert t, err
    assert int(t[1]) == 2 and float(t[2]) > SLOW


@pytest.mark.parametrize("waits", [(0.0, 0.0, 2.0), (1.5, 2.0, 3.0)])
def test_first_token_figures_count_only_requests_that_waited_on_no_compile(waits):
    """The summary's warm time to first token is the mean over the requests that waited on
    no compile (not their times less the compiling steps, which on CPU also ran the prefill);
    with none such it says so. Requests arrive at 0 and get their first token at 1, 2, 3 s."""
    from types import SimpleNamespace

    from ee_jax.cli import _timing_lines
    from ee_jax.serving.params import RequestMetrics
    from ee_jax.serving.stats import EngineStats

    outs = [SimpleNamespace(metrics=RequestMetrics(0.0, 0.0, float(i + 1), compile_wait=w))
            for i, w in enumerate(waits)]
    line = _timing_lines(EngineStats(), outs)[1]
    if waits[0] == 0.0:  # the first two waited on none: mean and median of 1 and 2 s
        assert line.startswith("time to first token: mean 1.500s, median 1.500s over the 2 "
                               "requests that waited on no compile (1 of 3 waited on one; "
                               "with them: mean 2.000s)"), line
    else:
        assert line.startswith("time to first token: every request (3) waited on a compile, "
                               "mean 2.000s with it"), line
