"""`ee-jax serve` against a live server on localhost, driven by the official `openai` client.

The truth is `LLM.generate` on the same engine, run before the server starts: greedy text from
the server must equal it, streamed or not, under 64 concurrent clients, and next to requests
that fail or disconnect. The tiny random model (ee_jax.random_model) keeps this quick; its
early-exit heads are untrained and off unless a request asks (threshold NEVER), so outputs do
not depend on what shares a batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ee_jax.models.exits.config import NEVER, ExitConfig
from ee_jax.random_model import random_model
from ee_jax.serving.controller import ControllerConfig
from ee_jax.serving.llm import LLM
from ee_jax.serving.params import SamplingParams
from ee_jax.serving.server import BackgroundServer, ServerConfig
from ee_jax.serving.server.run import free_port
from ee_jax.serving.stats import exit_summary

KEY = "test-key"
MODEL = "tiny"
MAX_TOKENS = 8
LONG = 60  # tokens of the request that runs beside failing ones
WORDS = ["alpha", "beta gamma", "delta, epsilon", "zeta eta theta", "iota kappa lambda mu"]
PROMPTS = [f"{i}: {WORDS[i % 5]}" for i in range(256)]
CHATS = [[{"role": "user", "content": w}] for w in WORDS[:3]]


def greedy(n: int = MAX_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, **kw)


@pytest.fixture(scope="module")
def served():
    """One engine: offline references first, then the server on it (one per module). One
    batch bucket keeps the number of compiled programs (and the module's time) small."""
    llm = LLM(random_model(), progress=False, max_num_seqs=64, batch_buckets=(64,),
              max_model_len=256, num_pages=1100,
              # per-request thresholds are the point here: always the exit program (the
              # controller's "auto" would run full depth once its probe saw no exits)
              exit_control=ControllerConfig(mode="exits"),
              exit_config=ExitConfig(exit_layers=(1, 2, 3), threshold=NEVER))
    ns = SimpleNamespace(llm=llm, engine=llm.engine, tok=llm.tokenizer)
    chats = [llm.tokenizer.apply_chat_template(c) for c in CHATS]
    extra = [PROMPTS[1], "\udcff", None]
    outs = llm.generate(PROMPTS + chats + extra,
                        [greedy()] * (len(PROMPTS) + len(chats))
                        + [greedy(LONG, ignore_eos=True), greedy(), greedy()], use_tqdm=False)
    ns.ref, ns.chat_ref = outs[:len(PROMPTS)], outs[len(PROMPTS):-len(extra)]
    ns.long_ref, ns.surrogate, ns.none = outs[-len(extra):]
    # Alone, as the server will serve it: under policy "all" a batch exits together.
    ns.exit_ref = llm.generate(PROMPTS[2], greedy(exit_threshold=0.0), use_tqdm=False)[0]
    server = BackgroundServer(llm.engine, ServerConfig(
        port=0, model_name=MODEL, api_key=KEY, max_body_bytes=64 * 1024,
        max_prompt_tokens=100)).start()
    ns.url, ns.server = server.url, server
    ns.client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    yield ns
    server.stop()


def _post(served, body, key: str | None = KEY, path: str = "/v1/completions"):
    headers = {"content-type": "application/json"}
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    content = body if isinstance(body, str | bytes) else json.dumps(body)
    return httpx.post(served.url + path, content=content, headers=headers, timeout=60)


def _post_with_timeout(served, body, timeout: float):
    return httpx.post(served.url + "/v1/completions", json=body, timeout=timeout,
                      headers={"authorization": f"Bearer {KEY}"})


def _metrics(served) -> dict[str, float]:
    text = httpx.get(served.url + "/metrics", timeout=30).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def _wait_idle(engine, timeout: float = 60.0) -> None:
    """Until the engine thread has nothing in flight (bounded; not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while engine.num_unfinished_requests and time.monotonic() < deadline:
        time.sleep(0.02)


# ------------------------------------------------------------------- the openai client


def test_completions_equal_generate(served):
    r = served.client.completions.create(model=MODEL, prompt=PROMPTS[:3], max_tokens=MAX_TOKENS,
                                         temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [o.text for o in served.ref[:3]]
    assert [c.finish_reason for c in r.choices] == [o.finish_reason for o in served.ref[:3]]
    n_out = sum(len(o.token_ids) for o in served.ref[:3])
    assert r.usage.completion_tokens == n_out
    assert r.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in served.ref[:3])
    # Full depth unless asked: every token ran all 4 layers.
    assert r.usage.early_exit == {"num_layers": 4, "layers_run": 4 * n_out,
                                  "mean_exit_layer": 4.0}


def test_streaming_completion_equals_generate(served):
    stream = served.client.completions.create(
        model=MODEL, prompt=PROMPTS[4], max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}, logprobs=0)
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs
              for t in c.choices[0].logprobs.tokens]
    ref = served.ref[4]
    assert text == ref.text
    assert tokens == [served.tok.decode([t], skip_special_tokens=False) for t in ref.token_ids]
    assert chunks[-2].choices[0].finish_reason == ref.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_equals_generate(served, stream):
    for chat, ref in zip(CHATS, served.chat_ref, strict=True):
        r = served.client.chat.completions.create(model=MODEL, messages=chat, temperature=0,
                                                  max_completion_tokens=MAX_TOKENS,
                                                  stream=stream)
        if stream:
            chunks = list(r)
            assert chunks[0].choices[0].delta.role == "assistant"
            text = "".join(c.choices[0].delta.content or "" for c in chunks)
        else:
            text = r.choices[0].message.content
        assert text == ref.text


def test_n_choices(served):
    # Greedy, so every choice is the offline output (sampling would compile another program).
    r = served.client.completions.create(model=MODEL, prompt=PROMPTS[5:7], max_tokens=MAX_TOKENS,
                                         temperature=0, n=2, seed=7)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [served.ref[i].text for i in (5, 5, 6, 6)]
    stream = served.client.completions.create(model=MODEL, prompt=PROMPTS[5:7], n=2,
                                              max_tokens=MAX_TOKENS, temperature=0, stream=True)
    texts = ["", "", "", ""]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [served.ref[i].text for i in (5, 5, 6, 6)]


def _stop_case(served) -> tuple[int, str]:
    """A prompt whose greedy text has a printable two-character piece first seen at >= 2."""
    for i, out in enumerate(served.ref):
        t = out.text
        for k in range(2, len(t) - 1):
            piece = t[k:k + 2]
            if piece.isprintable() and "\ufffd" not in piece and t.index(piece) == k:
                return i, piece
    pytest.skip("no greedy output has a usable stop string")


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cut_like_generate(served, stream):
    # The stop string and what follows are not sent, streamed or not (streams hold back text
    # that could start a stop string until it cannot).
    i, stop = _stop_case(served)
    r = served.client.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=MAX_TOKENS,
                                         temperature=0, stop=[stop], stream=stream)
    if stream:
        chunks = list(r)
        text = "".join(c.choices[0].text for c in chunks)
        reason = chunks[-1].choices[0].finish_reason
    else:
        text, reason = r.choices[0].text, r.choices[0].finish_reason
    ref = served.ref[i].text
    assert text == ref[:ref.index(stop)] and reason == "stop"


def test_models_and_health(served):
    assert [m.id for m in served.client.models.list().data] == [MODEL]
    health = httpx.get(served.url + "/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    ready = httpx.get(served.url + "/ready")
    assert ready.status_code == 200 and ready.json()["phase"] == "serving"


def test_exit_threshold_per_request_and_usage(served):
    r = served.client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=MAX_TOKENS,
                                         temperature=0, extra_body={"exit_threshold": 0.0})
    ref = served.exit_ref
    assert r.choices[0].text == ref.text
    usage = r.usage.early_exit
    assert usage["layers_run"] == sum(ref.exit_layers)
    assert usage["mean_exit_layer"] == pytest.approx(sum(ref.exit_layers) / len(ref.exit_layers),
                                                     abs=1e-3)
    assert usage["mean_exit_layer"] < 4  # threshold 0: decode tokens leave at the first exit


# --------------------------------------------------------------------------- under load


def test_64_concurrent_streams_256_requests(served):
    async def one(client, sem, i):
        async with sem:
            stream = await client.completions.create(
                model=MODEL, prompt=PROMPTS[i], max_tokens=MAX_TOKENS, temperature=0,
                stream=True, logprobs=0, stream_options={"include_usage": True})
            ids, text, tokens, usage, reasons = set(), [], [], None, []
            async for chunk in stream:
                ids.add(chunk.id)
                if chunk.usage is not None:
                    usage = chunk.usage
                for c in chunk.choices:
                    text.append(c.text)
                    tokens += c.logprobs.tokens if c.logprobs else []
                    reasons += [c.finish_reason] if c.finish_reason else []
            return i, ids, "".join(text), tokens, usage, reasons

    async def main():
        limits = httpx.Limits(max_connections=128, max_keepalive_connections=64)
        async with httpx.AsyncClient(limits=limits, timeout=300) as http:
            client = openai.AsyncOpenAI(base_url=served.url + "/v1", api_key=KEY,
                                        http_client=http, max_retries=0)
            sem = asyncio.Semaphore(64)
            return await asyncio.gather(*(one(client, sem, i) for i in range(256)))

    results = asyncio.run(main())
    assert sorted(r[0] for r in results) == list(range(256))  # none lost
    ids = [r[1] for r in results]
    assert all(len(s) == 1 for s in ids) and len(set().union(*ids)) == 256  # none duplicated
    for i, _, text, tokens, usage, reasons in results:
        ref = served.ref[i]
        assert text == ref.text, i
        assert tokens == [served.tok.decode([t], skip_special_tokens=False)
                          for t in ref.token_ids], i
        assert usage.completion_tokens == len(ref.token_ids)
        assert reasons == [ref.finish_reason]
    _wait_idle(served.engine)
    assert served.engine.blocks.num_used_pages == 0


# ------------------------------------------------------------------------------- faults


def _open_stream(served, client: httpx.Client, prompt: str, n: int):
    body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0,
            "ignore_eos": True, "stream": True}
    cm = client.stream("POST", served.url + "/v1/completions", json=body,
                       headers={"authorization": f"Bearer {KEY}"}, timeout=60)
    response = cm.__enter__()
    assert response.status_code == 200
    return cm, response.iter_lines()


def _stream_text(lines) -> str:
    text = []
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            text += [c["text"] for c in json.loads(line[6:])["choices"]]
    return "".join(text)


def test_disconnect_mid_stream_aborts_and_frees_pages(served):
    _wait_idle(served.engine)  # an earlier test's aborts are counted before `before`
    before = _metrics(served).get("eejax_requests_total{finish_reason=abort}", 0)
    with httpx.Client() as a, httpx.Client() as b:
        cm_a, lines_a = _open_stream(served, a, PROMPTS[0], 240)
        cm_b, lines_b = _open_stream(served, b, PROMPTS[1], LONG)
        assert next(lines_a).startswith("data: ")
        cm_a.__exit__(None, None, None)  # the client goes away mid-stream
        assert _stream_text(lines_b) == served.long_ref.text
        cm_b.__exit__(None, None, None)
    _wait_idle(served.engine)
    assert _metrics(served)["eejax_requests_total{finish_reason=abort}"] == before + 1
    assert served.engine.blocks.num_used_pages == 0
    # A non-streaming client that gives up is noticed too (the server polls while it waits).
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 240, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        _post_with_timeout(served, body, timeout=0.05)
    _wait_idle(served.engine)
    assert _metrics(served)["eejax_requests_total{finish_reason=abort}"] == before + 2
    assert served.engine.blocks.num_used_pages == 0


@pytest.mark.parametrize("body, key, status, param, words", [
    ("{not json", KEY, 400, None, "not valid JSON"),
    ("[1, 2]", KEY, 400, None, "JSON object"),
    ("[" * 10_000 + "]" * 10_000, KEY, 400, None, "nested too deeply"),
    ({"model": "gpt-4", "prompt": "hi"}, KEY, 404, "model", "does not exist"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, KEY, 400, "max_tokens", "positive"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": -5}, KEY, 400, "max_tokens", "positive"),
    ({"model": MODEL, "prompt": "hi", "temperature": "hot"}, KEY, 400, "temperature", "number"),
    ({"model": MODEL, "prompt": "hi", "top_p": 0}, KEY, 400, "top_p", "top_p"),
    ({"model": MODEL, "prompt": "hi", "top_k": 2**40}, KEY, 400, "top_k", "below 2**31"),
    ({"model": MODEL}, KEY, 400, "prompt", "required"),
    ({"model": MODEL, "prompt": [1, 2, 999]}, KEY, 400, "prompt", "vocabulary"),
    ({"model": MODEL, "prompt": "x" * 101}, KEY, 400, "prompt", "at most 100"),
    ({"model": MODEL, "prompt": "x" * 70_000}, KEY, 413, None, "over this server's limit"),
    ({"model": MODEL, "prompt": "hi", "logprobs": 5}, KEY, 400, "logprobs", "logprobs"),
    ({"model": MODEL, "prompt": "hi"}, "wrong-key", 401, None, "API key"),
    ({"model": MODEL, "prompt": "hi"}, None, 401, None, "API key"),
])
def test_invalid_requests_get_clear_4xx(served, body, key, status, param, words):
    r = _post(served, body, key)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words in err["message"] and err["param"] == param
    assert httpx.get(served.url + "/health").status_code == 200


def test_bad_chat_and_unknown_route(served):
    r = _post(served, {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]},
              path="/v1/chat/completions")
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.get(served.url + "/v1/nothing-here")
    assert r.status_code == 404 and "no such endpoint" in r.json()["error"]["message"]


def test_openai_client_sees_the_errors(served):
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        served.client.completions.create(model=MODEL, prompt="hi", max_tokens=0)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        served.client.completions.create(model="gpt-4", prompt="hi")
    bad = openai.OpenAI(base_url=served.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="API key"):
        bad.completions.create(model=MODEL, prompt="hi")


def test_bad_inputs_fail_alone_while_others_are_served(served):
    # LLM.generate: an error output for the bad prompt, the others as if alone.
    assert served.surrogate.finish_reason == "error"
    assert "cannot be tokenized" in served.surrogate.error
    assert served.none.finish_reason == "error" and "string or a list" in served.none.error
    assert all(o.error is None for o in served.ref + served.chat_ref + [served.long_ref])
    with pytest.raises(ValueError, match="temperature must be a finite number"):
        SamplingParams(temperature=float("inf"))
    # The server: the same inputs are refused while a stream runs beside them.
    with httpx.Client() as client:
        cm, lines = _open_stream(served, client, PROMPTS[1], LONG)
        first = next(lines)
        assert first.startswith("data: ")
        r = _post(served, {"model": MODEL, "prompt": "\udcff"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        assert "cannot be tokenized" in r.json()["error"]["message"]
        r = _post(served, {"model": MODEL, "messages": [{"role": "user", "content": "\udcff"}]},
                  path="/v1/chat/completions")
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        r = _post(served, json.dumps({"model": MODEL, "prompt": "hi", "temperature": math.inf}))
        assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
        r = _post(served, json.dumps({"model": MODEL, "prompt": "hi", "top_p": math.nan}))
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_p"
        text = _stream_text([first, *lines])
        cm.__exit__(None, None, None)
    assert text == served.long_ref.text


# ------------------------------------------------------------------------------ metrics


def test_metrics_count_what_was_served(served):
    _wait_idle(served.engine)
    before = _metrics(served)
    prompts = PROMPTS[10:14]
    r = served.client.completions.create(model=MODEL, prompt=prompts, max_tokens=MAX_TOKENS,
                                         temperature=0)
    s = served.client.chat.completions.create(model=MODEL, messages=CHATS[0], temperature=0,
                                              max_tokens=MAX_TOKENS, stream=True)
    streamed = list(s)
    assert _post(served, {"model": MODEL, "prompt": "hi", "max_tokens": 0}).status_code == 400
    _wait_idle(served.engine)
    after = _metrics(served)

    def delta(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    n_tokens = r.usage.completion_tokens + len(served.chat_ref[0].token_ids)
    finished = sum(delta(f"eejax_requests_total{{finish_reason={f}}}")
                   for f in ("stop", "length", "abort", "error"))
    assert finished == len(prompts) + 1
    assert delta("eejax_generation_tokens_total") == n_tokens
    assert delta("eejax_prompt_tokens_total") == (
        r.usage.prompt_tokens + len(served.chat_ref[0].prompt_token_ids))
    assert delta("eejax_exit_layer_count") == n_tokens
    assert delta("eejax_layers_run_total") == 4 * n_tokens
    assert delta("eejax_time_to_first_token_seconds_count") == len(prompts) + 1
    assert delta("eejax_rejected_requests_total{status=400}") == 1
    assert after["eejax_kv_pages_used"] == 0 and after["eejax_model_layers"] == 4
    assert after["eejax_exit_layer_bucket{le=3.0}"] == before.get("eejax_exit_layer_bucket{le=3.0}")
    # the exit figures are the one summary the CLI prints (`serving.stats.exit_summary`), of
    # the engine's whole life (other tests' early exits included)
    ex = exit_summary(served.engine.stats, served.engine.model_config,
                      served.engine.exit_config)
    assert after["eejax_ideal_speedup"] == pytest.approx(ex["ideal"])
    assert after["eejax_work_fraction"] == pytest.approx(ex["work_fraction"])
    assert 0 < after["eejax_work_fraction"] <= 1.0
    assert streamed[-1].choices[0].finish_reason is not None


# ------------------------------------------------------------------------------- the CLI


@pytest.mark.parametrize("argv, words", [
    (["--num-pages", "64"], "cannot hold one sequence"),
    (["--temperature", "nan"], "temperature must be a finite number"),
    (["--exit-layers", "1,9"], "out of range"),
    (["--max-model-len", "99999"], "context length"),
    (["--model", "/no/such/model.gguf"], "no such registry name or path"),
])
def test_cli_mistakes_end_in_one_line(argv, words, capsys):
    from ee_jax.cli import main

    args = ["generate", "--model", "random", "--prompt", "hi", "--quiet", *argv]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ee-jax: error: ") and words in err[0], err


@pytest.mark.slow
def test_ee_jax_serve_command(tmp_path):
    """`ee-jax serve` in its own process: answers /health at once (starting or ok), serves
    once /ready says so, refuses a wrong key, stops on Ctrl-C."""
    port = free_port()
    cmd = [sys.executable, "-m", "ee_jax.cli", "serve", "--model", "random", "--port",
           str(port), "--api-key", KEY, "--max-model-len", "256", "--num-pages", "64",
           "--quiet", "--no-precompile"]  # (precompiling: test_serve_precompiles_by_default)
    log = open(tmp_path / "serve.log", "w+")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                            cwd=Path(__file__).resolve().parent.parent)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        first_health = None
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            with contextlib.suppress(httpx.HTTPError):
                first_health = first_health or httpx.get(url + "/health", timeout=2)
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        assert first_health.status_code == 200
        assert first_health.json()["status"] in ("starting", "ok")
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        r = client.completions.create(model="random", prompt="hi", max_tokens=3, temperature=0)
        assert r.usage.completion_tokens >= 1 and r.choices[0].finish_reason in ("stop", "length")
        assert httpx.get(url + "/v1/models").status_code == 401
    finally:
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(60)
    assert rc == 0, (tmp_path / "serve.log").read_text()
    assert "Traceback" not in (tmp_path / "serve.log").read_text()


def test_serve_precompiles_by_default():
    """`ee-jax serve` compiles every step shape before it serves (`--no-precompile`: not);
    `generate` only when asked."""
    from ee_jax.cli import build_parser

    parse = build_parser().parse_args
    assert parse(["serve"]).precompile == "all"
    assert parse(["serve", "--no-precompile"]).precompile == "none"
    assert parse(["serve", "--precompile", "decode"]).precompile == "decode"
    assert parse(["generate", "--prompt", "hi"]).precompile == "none"


# ----------------------------------------------------------------- shutdown (runs last)


def test_shutdown_drains_open_streams(served):
    """Stopping the server lets an open stream finish, then stops the engine thread."""
    with httpx.Client() as client:
        cm, lines = _open_stream(served, client, PROMPTS[1], LONG)
        first = next(lines)
        stopper = threading.Thread(target=served.server.stop)
        stopper.start()
        text = _stream_text([first, *lines])
        cm.__exit__(None, None, None)
    stopper.join(60)
    assert text == served.long_ref.text
    # the server's thread ended (a stop that only timed out would leave it running)
    assert not stopper.is_alive() and not served.server.running
    assert served.engine.num_unfinished_requests == 0
    assert served.engine.blocks.num_used_pages == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(served.url + "/health")
