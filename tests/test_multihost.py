"""Two processes on localhost (4 simulated CPU devices each) through `jax.distributed`:
the same tokens as one process; a process that dies ends the other with a clear error."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ee_jax.serving.engine import EngineConfig, LLMEngine
from ee_jax.serving.params import greedy
from ee_jax.testing import subprocess_env
from tests.multihost_case import CONFIG, EXITS, MODEL, NEW, PROMPTS
from tests.reference import run_requests

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "multihost_worker.py"


@pytest.fixture(scope="module")
def xla_cache(tmp_path_factory) -> str:
    """One persistent compilation cache for this module's worker processes: they build the
    same programs, so whichever test runs second loads them (each test passes alone too)."""
    return str(tmp_path_factory.mktemp("multihost_xla_cache"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(port: int, pid: int, cache: str, *extra: str) -> subprocess.Popen:
    env = subprocess_env()  # one CPU device each, not the suite's eight
    env["PYTHONPATH"] = str(ROOT)
    env["EE_JAX_TEST_XLA_CACHE"] = cache
    return subprocess.Popen([sys.executable, "-u", str(WORKER), str(port), "2", str(pid),
                             *extra], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_two_processes_give_one_process_tokens(xla_cache):
    cfg, params = MODEL
    one = LLMEngine(cfg, params, None, EngineConfig.make(**CONFIG), exit_config=EXITS)
    want = [o.token_ids for o in run_requests(one, PROMPTS, greedy(NEW))]
    port = _free_port()
    procs = [_start(port, pid, xla_cache) for pid in (0, 1)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    line = next(ln for ln in outs[0][0].splitlines() if ln.startswith("TOKENS "))
    assert json.loads(line[len("TOKENS "):]) == want
    assert "FOLLOWED" in outs[1][0]


@pytest.mark.slow
def test_a_dead_process_ends_the_other_with_a_clear_error(xla_cache):
    port = _free_port()
    t0 = time.monotonic()
    # the follower dies after 3 steps
    procs = [_start(port, 0, xla_cache), _start(port, 1, xla_cache, "3")]
    _out, err = procs[0].communicate(timeout=240)
    procs[1].wait(timeout=60)
    assert procs[1].returncode == 3
    assert procs[0].returncode != 0  # not a hang, not a silent success
    assert time.monotonic() - t0 < 200
    assert "heartbeat" in err or "task" in err.lower(), err[-2000:]
