"""A server that says it is starting (`ee_jax.serving.server.startup`).

The server listens before its engine is built: /health answers "starting" (200) with the
phase, /ready 503, until the engine serves ("ok", 200 both); a request that comes meanwhile
waits for the engine (or, past `startup_wait`, gets 503 with Retry-After); a failed load is
"failed" on /health, with its error. Each step is held by an event the test opens (a build
function, or a warm-up, waiting on it), so what the server says is checked at a known moment,
never after a guessed delay. The tiny random model keeps the engines cheap.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from ee_jax.errors import ModelLoadError
from ee_jax.random_model import random_model
from ee_jax.serving.engine import LLMEngine
from ee_jax.serving.llm import LLM
from ee_jax.serving.params import SamplingParams
from ee_jax.serving.server import BackgroundServer, ServerConfig, Startup
from ee_jax.serving.server.run import free_port

MODEL = "tiny"
PROMPT = "alpha beta"
TIMEOUT = 120  # seconds any one wait may take on a loaded 2-core machine (a bound, not a sync)


def _tiny_llm() -> LLM:
    """Two batch buckets, a short context: a handful of step programs to warm up."""
    return LLM(random_model(), progress=False, max_num_seqs=2, batch_buckets=(1, 2),
               max_model_len=64, num_pages=32)


@pytest.fixture(scope="module")
def tiny():
    """An engine, and its greedy answer to PROMPT (what the server must send once serving)."""
    llm = _tiny_llm()
    ref = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)[0]
    return llm.engine, ref.text


def _gated(engine: LLMEngine, gate: threading.Event) -> Callable[[], LLMEngine]:
    """A build function that "loads" until the test opens `gate`."""
    def build() -> LLMEngine:
        assert gate.wait(TIMEOUT), "the test never opened the gate"
        return engine
    return build


@contextlib.contextmanager
def _server(startup: Startup, **config) -> Iterator[BackgroundServer]:
    server = BackgroundServer(startup, ServerConfig(port=0, model_name=MODEL, **config)).start()
    try:
        yield server
    finally:
        server.stop()


def _complete(url: str, **body) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=TIMEOUT, json={
        "model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, **body})


def _until(condition: Callable[[], bool], what: str) -> None:
    """Wait for an observable condition of the server (polled), failing after TIMEOUT."""
    deadline = time.monotonic() + TIMEOUT
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_health_says_starting_until_the_engine_serves(tiny):
    engine, ref = tiny
    gate = threading.Event()
    with _server(Startup(_gated(engine, gate))) as server:
        health, ready = httpx.get(server.url + "/health"), httpx.get(server.url + "/ready")
        assert health.status_code == 200, health.text
        assert health.json()["status"] == "starting" and health.json()["phase"] == "loading"
        assert ready.status_code == 503 and ready.json()["status"] == "starting"
        assert b"starting" in httpx.get(server.url + "/metrics").content
        gate.set()
        assert server.startup.wait(TIMEOUT)
        health, ready = httpx.get(server.url + "/health"), httpx.get(server.url + "/ready")
        assert health.status_code == ready.status_code == 200
        assert health.json()["status"] == "ok" and health.json()["phase"] == "serving"
        r = _complete(server.url)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref


def test_a_request_while_starting_waits_then_is_served(tiny):
    engine, ref = tiny
    gate = threading.Event()
    with _server(Startup(_gated(engine, gate)), startup_wait=TIMEOUT) as server:
        answer: list[httpx.Response] = []
        client = threading.Thread(target=lambda: answer.append(_complete(server.url)))
        client.start()
        _until(lambda: httpx.get(server.url + "/health").json().get("waiting_requests") == 1,
               "the request to wait for the engine")
        assert not answer  # held while the engine loads
        gate.set()
        client.join(TIMEOUT)
        assert answer and answer[0].status_code == 200, answer
        assert answer[0].json()["choices"][0]["text"] == ref


def test_past_startup_wait_a_request_gets_503_with_retry_after(tiny):
    engine, _ = tiny
    gate = threading.Event()
    with _server(Startup(_gated(engine, gate)), startup_wait=0, api_key="k") as server:
        auth = {"Authorization": "Bearer k"}
        r = httpx.post(server.url + "/v1/completions", headers=auth, json={
            "model": MODEL, "prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 503 and r.headers["retry-after"] == "10", r.text
        err = r.json()["error"]
        assert err["code"] == "starting" and "starting (loading)" in err["message"]
        # what needs no engine is answered at once, as when serving
        assert httpx.post(server.url + "/v1/completions", json={"model": MODEL}).status_code \
            == 401
        wrong = httpx.post(server.url + "/v1/completions", headers=auth, json={
            "model": "gpt-4", "prompt": PROMPT})
        assert wrong.status_code == 404 and wrong.json()["error"]["code"] == "model_not_found"
        gate.set()
        assert server.startup.wait(TIMEOUT)


def test_a_load_failure_shows_as_failed(tiny, capfd):
    def build() -> LLMEngine:
        raise ModelLoadError("no weights in /models/x")

    with _server(Startup(build)) as server:
        assert not server.startup.wait(TIMEOUT)
        health, ready = httpx.get(server.url + "/health"), httpx.get(server.url + "/ready")
        assert health.status_code == ready.status_code == 503
        assert health.json()["status"] == "failed" and health.json()["phase"] == "loading"
        assert health.json()["error"] == "ModelLoadError: no weights in /models/x"
        r = _complete(server.url)
        assert r.status_code == 503 and r.json()["error"]["code"] == "startup_failed"
        assert "no weights in /models/x" in r.json()["error"]["message"]
    err = capfd.readouterr().err
    assert "ee-jax: error: the server failed to start (loading): ModelLoadError: no weights" \
        in err
    assert "Traceback" not in err  # a user's mistake: one line, as the CLI's


def test_a_bug_while_starting_is_failed_with_its_traceback(capfd):
    def build() -> LLMEngine:
        raise RuntimeError("a bug")

    with _server(Startup(build)) as server:
        assert not server.startup.wait(TIMEOUT)
        assert httpx.get(server.url + "/health").json()["error"] == "RuntimeError: a bug"
    assert "Traceback" in capfd.readouterr().err


def test_serves_after_the_first_bucket_and_compiles_the_rest_while_idle():
    """The warm-up compiles the smallest batch bucket's programs, then serves; /health counts
    them as they are ready; the other buckets' programs compile while the engine is idle."""
    engine = _tiny_llm().engine
    shapes = engine.step_shapes()
    first = [s for s in shapes if s.batch == 1]
    assert 0 < len(first) < len(shapes) and shapes[:len(first)] == first
    one_ready, gate = threading.Event(), threading.Event()
    precompile = engine.precompile

    def held_precompile(*args, on_program=None, **kw):  # the first part stops after one
        def hold(done: int, total: int) -> None:
            if on_program is not None:
                on_program(done, total)
            if not gate.is_set():
                one_ready.set()
                assert gate.wait(TIMEOUT)
        return precompile(*args, on_program=hold, **kw)

    engine.precompile = held_precompile
    startup = Startup(engine, precompile=("decode", "prefill"))
    with _server(startup) as server:
        assert one_ready.wait(TIMEOUT)
        health = httpx.get(server.url + "/health").json()
        assert health["status"] == "starting" and health["phase"] == f"compiling 1/{len(first)}"
        assert health["programs"] == {"ready": 1, "total": len(shapes),
                                      "before_serving": len(first)}
        assert httpx.get(server.url + "/ready").status_code == 503
        gate.set()
        assert startup.wait(TIMEOUT)
        assert all(engine.is_compiled(s) for s in first)
        r = _complete(server.url)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] is not None
        _until(lambda: httpx.get(server.url + "/health").json()["programs"]["ready"]
               == len(shapes), "the idle warm-up to finish")
        assert all(engine.is_compiled(s) for s in shapes)
        # programs compiled ahead are not counted as steps that compiled
        metrics = httpx.get(server.url + "/metrics").text
        compiles = [line for line in metrics.splitlines()
                    if line.startswith("eejax_compiles_total")]
        assert compiles == ["eejax_compiles_total 0.0"], compiles


def test_startup_validates_its_arguments(tiny):
    with pytest.raises(ValueError, match="precompile kinds"):
        Startup(tiny[0], precompile=("decode", "mixed"))
    with pytest.raises(ValueError, match="startup_wait"):
        ServerConfig(startup_wait=-1)
    with pytest.raises(ValueError, match="keep_alive"):
        ServerConfig(keep_alive=0)


def _idle_connection(url: str) -> socket.socket:
    """A raw HTTP/1.1 connection that made one keep-alive request and read its answer."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=TIMEOUT)
    sock.sendall(f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(4096)
    assert head.startswith(b"HTTP/1.1 "), head
    return sock


def test_idle_connections_outlive_client_pools_then_close(capfd):
    """A client pool sends on an idle connection for up to 5 s (httpx's keepalive_expiry,
    the openai client's): a server that closed one as soon made a request fail before any
    byte of its answer (seen under load: one of 64 streams, a connection error). The server
    keeps an idle connection longer than that by default, and closes it after `keep_alive`.
    (No engine: a server whose load failed still answers /health.)"""
    assert ServerConfig().keep_alive > httpx.Limits().keepalive_expiry

    def build() -> LLMEngine:
        raise ModelLoadError("no weights")

    with _server(Startup(build), keep_alive=0.2) as short, \
            _server(Startup(build), keep_alive=60) as long:
        closing, staying = _idle_connection(short.url), _idle_connection(long.url)
        with closing, staying:
            assert closing.recv(1) == b""  # the server closed it (bounded by TIMEOUT)
            staying.settimeout(1.0)
            with pytest.raises(TimeoutError):  # open and silent a second later
                staying.recv(1)
    capfd.readouterr()  # the failed starts' one-line errors


def test_serve_checks_the_model_before_it_listens(capsys):
    """A mistyped model ends `ee-jax serve` at once, in one line (no port opened first)."""
    from ee_jax.cli import main

    assert main(["serve", "--model", "/no/such/model.gguf", "--port", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no such registry name or path" in err[0], err


@pytest.mark.slow
def test_ee_jax_serve_reports_a_failed_start(tmp_path):
    """`ee-jax serve` whose engine cannot be built (a KV cache too small for one sequence):
    /health says "failed" with the error, the log has it in one line, and the process, once
    stopped, exits 1."""
    port = free_port()
    log = open(tmp_path / "serve.log", "w+")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "ee_jax.cli", "serve", "--model", "random", "--port", str(port),
         "--num-pages", "2", "--quiet"], stdout=log, stderr=subprocess.STDOUT,
        cwd=Path(__file__).resolve().parent.parent)
    url = f"http://127.0.0.1:{port}"
    try:
        def failed() -> bool:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(url + "/health").json()["status"] == "failed"
            return False

        _until(failed, "/health to say failed")
        health = httpx.get(url + "/health")
        assert health.status_code == 503 and "cannot hold one sequence" in health.json()["error"]
    finally:
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(60)
    text = (tmp_path / "serve.log").read_text()
    assert rc == 1, text
    assert "ee-jax: error: the server failed to start (loading): ValueError: the KV cache" in text
    assert "Traceback" not in text
