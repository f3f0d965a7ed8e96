"""The FastAPI app: OpenAI's /v1/completions and /v1/chat/completions over one engine loop.

The app answers from the moment it listens, while the engine is still being built and warmed
up (`startup.Startup`): /health says "starting" (with the phase), "ok" or "failed" (liveness:
200 unless failed), /ready answers 200 only once requests are served (readiness). A request
that comes while the server starts waits for the engine (up to `ServerConfig.startup_wait`
seconds), as a client of a server that had not yet opened its port would have waited to
connect; past that it gets 503 with Retry-After (OpenAI's clients retry those).

Each HTTP request becomes one engine request per prompt and choice, submitted to the
`EngineLoop`; its events come back through one asyncio queue. A request is answered only after
the engine accepted it, so every refusal is a 4xx before any byte of a stream is sent. A
streaming client that disconnects cancels its generator, which aborts its engine requests (and
frees their pages); a non-streaming one is polled for disconnects while it waits (every
20 ms at most).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import math
import sys
import time
import traceback
import uuid
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ee_jax.errors import TokenizationError
from ee_jax.models.tokenizer import ChatTemplateError
from ee_jax.serving.engine import LLMEngine
from ee_jax.serving.params import InvalidRequestError, RequestOutput, SamplingParams
from ee_jax.serving.server import protocol
from ee_jax.serving.server.engine_loop import EngineLoop, Event, read_token_ids
from ee_jax.serving.server.metrics import ServerMetrics
from ee_jax.serving.server.protocol import ApiError, ChatBody, CompletionBody, Limits
from ee_jax.serving.server.startup import Startup


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """Safe defaults: localhost only, 1 MiB bodies, prompts that leave room to generate."""

    host: str = "127.0.0.1"  # address to bind; 0.0.0.0 exposes the server
    port: int = 8000  # TCP port to listen on
    model_name: str = "ee-jax"  # the model id /v1/models lists and requests send
    api_key: str | None = None  # required as "Authorization: Bearer KEY" on /v1; None: none
    max_body_bytes: int = 1 << 20  # larger request bodies get 413
    max_prompt_tokens: int | None = None  # default: max_model_len - 1
    max_pending: int = 4096  # engine requests in flight before new ones get 429
    log_level: str = "warning"  # uvicorn's log level
    # How long a request that comes while the server starts waits for the engine (seconds)
    # before it gets 503 with Retry-After; 0: at once.
    startup_wait: float = 120.0
    # Seconds an idle keep-alive connection stays open. Longer than a client pool keeps one
    # (httpx and the openai client: 5 s, uvicorn's own default too): with equal timeouts a
    # client can send a request on a connection the server is closing, and it fails with a
    # connection error before any byte of a response (seen under load in test_server).
    keep_alive: float = 75.0

    def __post_init__(self):
        if not 0 <= self.startup_wait < math.inf:
            raise ValueError(f"startup_wait must be a finite number of seconds >= 0, got "
                             f"{self.startup_wait}")
        if not 0 < self.keep_alive < math.inf:
            raise ValueError(f"keep_alive must be a finite number of seconds > 0, got "
                             f"{self.keep_alive}")
        if self.max_body_bytes <= 0:
            raise ValueError(f"max_body_bytes must be positive, got {self.max_body_bytes}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens <= 0:
            raise ValueError(f"max_prompt_tokens must be positive, got "
                             f"{self.max_prompt_tokens}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")


def create_app(source: LLMEngine | Startup, config: ServerConfig = ServerConfig()) -> FastAPI:
    """An app serving `source`: an engine, or a `Startup` that builds and warms one up while
    the app already answers. The startup (and then the engine thread) begins with the app's
    lifespan and ends with it."""
    startup = source if isinstance(source, Startup) else Startup(source)
    if startup.engine is not None:
        _check_engine(startup.engine)  # an engine given built: its mistakes raise here
    state = _State(startup, config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        aio = asyncio.get_running_loop()
        state.done = asyncio.Event()
        startup.add_done_callback(lambda: aio.call_soon_threadsafe(state.done.set))
        startup.start(state.attach)
        try:
            yield
        finally:
            await asyncio.to_thread(state.shutdown)

    app = FastAPI(title="ee-jax", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.ee = state

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        if exc.status < 500:
            state.count_rejected(exc.status)
        headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        state.count_rejected(exc.status_code)
        message = (f"no such endpoint: {request.method} {request.url.path}"
                   if exc.status_code in (404, 405) else str(exc.detail))
        return JSONResponse(ApiError(exc.status_code, message).body(),
                            status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        traceback.print_exception(exc, file=sys.stderr)
        return JSONResponse(ApiError(500, f"internal error ({type(exc).__name__}); see the "
                                     f"server log").body(), status_code=500)

    @app.get("/health")
    async def health():
        """Liveness: 200 while starting or serving; 503 once failed or stopped."""
        status = state.status()
        return JSONResponse(status, status_code=200 if status["status"] in ("starting", "ok")
                            else 503)

    @app.get("/ready")
    async def ready():
        """Readiness: 200 only while requests are served."""
        status = state.status()
        return JSONResponse(status, status_code=200 if status["status"] == "ok" else 503)

    @app.get("/metrics")
    async def prometheus_metrics():
        body = state.metrics.render() if state.metrics is not None else \
            b"# ee-jax: starting; the metrics begin once the engine serves\n"
        return Response(body, media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request):
        state.authorize(request)
        await state.wait_ready()
        return {"object": "list", "data": [{
            "id": config.model_name, "object": "model", "created": state.created,
            "owned_by": "ee-jax", "max_model_len": state.limits.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await state.handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await state.handle(request, chat=True)

    return app


def _check_engine(engine: LLMEngine) -> None:
    if engine.tokenizer is None:
        raise ValueError("the server needs a model with a tokenizer")


@dataclasses.dataclass
class _Choice:
    index: int
    request_id: str
    prompt_len: int
    params: SamplingParams
    output: RequestOutput | None = None
    sent_text: int = 0
    sent_tokens: int = 0
    started: bool = False

    @property
    def finished(self) -> bool:
        return self.output is not None and self.output.finished


class _State:
    """The app's state: the startup, then (once attached) the engine, its loop and metrics."""

    def __init__(self, startup: Startup, config: ServerConfig):
        self.startup, self.config = startup, config
        self.created = int(time.time())
        self.pending = 0
        self.waiting = 0  # requests waiting for the engine to be ready
        self.done: asyncio.Event | None = None  # set once the startup is over (lifespan)
        self.engine: LLMEngine | None = None
        self.loop: EngineLoop | None = None
        self.metrics: ServerMetrics | None = None
        self.limits: Limits | None = None

    def attach(self, engine: LLMEngine, idle: Callable[[], bool] | None) -> None:
        """Serve `engine` (the startup's thread calls this once it is built and warm)."""
        _check_engine(engine)
        mcfg, ecfg = engine.model_config, engine.config.scheduler
        max_prompt = self.config.max_prompt_tokens or ecfg.max_model_len - 1
        self.limits = Limits(max_model_len=ecfg.max_model_len,
                             max_prompt_tokens=min(max_prompt, ecfg.max_model_len - 1),
                             vocab_size=mcfg.vocab_size, has_exits=engine.exit_config is not None,
                             verifies=engine.verify)
        self.tokenizer = engine.tokenizer
        self.num_layers = mcfg.n_layers
        self.metrics = ServerMetrics(mcfg.n_layers, engine.blocks.num_pages)

        def idle_work() -> bool:
            """The rest of the warm-up, after the requests that waited for the engine: they
            are released as it becomes ready (their handlers submit with no await between),
            and would otherwise wait behind the first programs compiled while idle."""
            if self.waiting:
                time.sleep(0.005)  # a few ms for the asyncio loop to hand them over
                return True
            return idle()

        loop = EngineLoop(engine, self.metrics, idle_work if idle is not None else None)
        loop.start()
        self.engine, self.loop = engine, loop

    def shutdown(self) -> None:
        """Stop starting (if still), then the engine thread (open requests are aborted)."""
        self.startup.cancel()
        if self.loop is not None:
            self.loop.shutdown()

    def status(self) -> dict:
        status = self.startup.status()
        if status["status"] == "ok" and not self.loop.alive:
            status["status"] = "engine stopped"
        if self.waiting:
            status["waiting_requests"] = self.waiting
        return status

    def count_rejected(self, status: int) -> None:
        if self.metrics is not None:  # none before the engine serves
            self.metrics.rejected.labels(str(status)).inc()

    # -- checks ------------------------------------------------------------------------

    async def wait_ready(self) -> None:
        """Return once the engine serves: at once, or after waiting for the startup (up to
        `startup_wait` seconds); else ApiError 503 (with Retry-After while it starts)."""
        if self.startup.state == "starting":
            self.waiting += 1
            try:
                await asyncio.wait_for(self.done.wait(), self.config.startup_wait)
            except TimeoutError:
                pass
            finally:
                self.waiting -= 1
        state = self.startup.state
        if state == "starting":
            phase = self.startup.status()["phase"]
            raise ApiError(503, f"the server is starting ({phase}) and was not ready within "
                           f"{self.config.startup_wait:g}s; retry later (GET /ready answers "
                           f"200 once it serves)", code="starting", retry_after=10)
        if state == "failed":
            raise ApiError(503, f"the server failed to start: {self.startup.status()['error']}"
                           f" (see /health and the server log)", code="startup_failed")
        if not self.loop.alive:
            raise ApiError(503, "the engine has stopped (the server is shutting down)",
                           code="engine_stopped", type="server_error")

    # -- checks ------------------------------------------------------------------------

    def authorize(self, request: Request) -> None:
        key = self.config.api_key
        if key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                                 key.encode()):
            raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>' "
                           "with the key the server was started with", code="invalid_api_key")

    async def read_json(self, request: Request) -> object:
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length", "")
        over = declared.isdigit() and int(declared) > limit
        chunks, size = [], 0
        async for chunk in request.stream():  # read it all: answering early resets clients
            size += len(chunk)
            over = over or size > limit
            if not over:
                chunks.append(chunk)
            elif size > 64 * limit:
                break
        if over:
            raise ApiError(413, f"the request body is over this server's limit of {limit} "
                           f"bytes (--max-body-bytes)", code="request_too_large")
        try:
            return json.loads(b"".join(chunks))
        except ValueError as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}") from None
        except RecursionError:
            raise ApiError(400, "the request body is nested too deeply") from None

    def encode(self, text: str, field: str) -> list[int]:
        try:
            return list(self.tokenizer.encode(text))
        except TokenizationError as e:
            raise ApiError(400, f"the {field} cannot be tokenized: {e}", field) from None

    # -- one HTTP request ----------------------------------------------------------------

    async def handle(self, request: Request, chat: bool):
        arrival = time.perf_counter()
        self.authorize(request)
        # what needs no engine is checked first: a malformed request is refused at once
        body = protocol.parse(ChatBody if chat else CompletionBody,
                              await self.read_json(request))
        if body.model != self.config.model_name:
            raise ApiError(404, f"the model {body.model!r} does not exist; this server serves "
                           f"{self.config.model_name!r} (see /v1/models)", "model",
                           code="model_not_found")
        await self.wait_ready()
        if chat:
            try:
                text = self.tokenizer.apply_chat_template(protocol.chat_messages(body),
                                                          add_generation_prompt=True)
            except ChatTemplateError as e:
                raise ApiError(400, str(e), "messages") from None
            prompts = [self.encode(text, "messages")]
            field = "messages"
        else:
            prompts = [p if isinstance(p, list) else self.encode(p, "prompt")
                       for p in protocol.completion_prompts(body)]
            field = "prompt"
        base = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        choices = []
        for p, ids in enumerate(prompts):
            protocol.check_prompt_ids(ids, self.limits, field)
            for j in range(body.n):
                i = p * body.n + j
                sp = protocol.sampling_params(body, len(ids), i, self.limits, chat)
                choices.append(_Choice(i, f"{base}-{i}", len(ids), sp))
        if self.pending + len(choices) > self.config.max_pending:
            raise ApiError(429, f"the server is busy ({self.pending} requests in flight); "
                           f"retry later", code="server_busy", type="rate_limit_error")
        stream = _Stream(self, request, body, chat, base, choices, [len(x) for x in prompts])
        await stream.submit(prompts, body.n, arrival)
        if body.stream:
            return _SSEResponse(stream)
        try:
            await stream.wait_all()
        finally:
            stream.close()
        return stream.response()


class _Stream:
    """The engine requests of one HTTP request and the events coming back for them."""

    def __init__(self, state: _State, request: Request, body, chat: bool, base: str,
                 choices: list[_Choice], prompt_lens: list[int]):
        self.state, self.request, self.body, self.chat = state, request, body, chat
        self.id, self.choices, self.prompt_lens = base, choices, prompt_lens
        self.by_id = {c.request_id: c for c in choices}
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.created = int(time.time())
        self.held: list[Event] = []
        self.submitted: list[str] = []
        self.closed = False

    async def submit(self, prompts: list[list[int]], n: int, arrival: float) -> None:
        """Submit every choice; returns once the engine accepted all (else ApiError)."""
        aio = asyncio.get_running_loop()
        q = self.queue

        def sink(event: Event) -> None:
            aio.call_soon_threadsafe(q.put_nowait, event)

        self.state.pending += len(self.choices)
        try:
            for c in self.choices:
                self.state.loop.submit(c.request_id, prompts[c.index // n], c.params, sink,
                                       arrival)
                self.submitted.append(c.request_id)
            accepted = 0
            while accepted < len(self.choices):
                event = await self.queue.get()
                if event.kind == "accepted":
                    accepted += 1
                elif event.kind == "error":
                    raise _api_error(event.error)
                else:
                    self.held.append(event)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Abort whatever has not finished (a client gone, an error); idempotent."""
        if self.closed:
            return
        self.closed = True
        self.state.pending -= len(self.choices)
        for rid in self.submitted:
            if not self.by_id[rid].finished:
                self.state.loop.abort(rid)

    async def events(self, poll_disconnect: bool) -> AsyncIterator[Event]:
        """Events until every choice finished; raises ApiError if the engine failed."""
        while self.held:
            yield self.held.pop(0)
        next_check = time.monotonic()
        while not all(c.finished for c in self.choices):
            if poll_disconnect:  # every 20 ms at most, whether or not tokens flow
                try:
                    event = await asyncio.wait_for(self.queue.get(), timeout=0.5)
                except TimeoutError:
                    event = None
                if time.monotonic() >= next_check:
                    next_check = time.monotonic() + 0.02
                    if await self.request.is_disconnected():
                        return
                if event is None:
                    continue
            else:
                event = await self.queue.get()
            if event.kind == "error":
                raise _api_error(event.error)
            yield event

    async def wait_all(self) -> None:
        async for event in self.events(poll_disconnect=True):
            if event.output is not None and event.request_id in self.by_id:
                self.by_id[event.request_id].output = event.output

    # -- responses -----------------------------------------------------------------------

    def usage(self) -> dict:
        layers = [e for c in self.choices if c.output for e in (c.output.exit_layers or [])]
        completion = sum(len(read_token_ids(c.output)) for c in self.choices if c.output)
        prompt = sum(self.prompt_lens)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "early_exit": {"num_layers": self.state.num_layers, "layers_run": sum(layers),
                               "mean_exit_layer": (round(sum(layers) / len(layers), 3)
                                                   if layers else None)}}

    def _logprobs(self, out: RequestOutput, start: int, stop: int) -> dict | None:
        if out.logprobs is None:
            return None
        tok = self.state.tokenizer
        ids, lps = out.token_ids[start:stop], out.logprobs[start:stop]
        texts = [tok.decode([t], skip_special_tokens=False) for t in ids]
        if self.chat:
            return {"content": [{"token": s, "logprob": lp, "bytes": list(s.encode()),
                                 "top_logprobs": []} for s, lp in zip(texts, lps, strict=True)]}
        return {"tokens": texts, "token_logprobs": lps, "top_logprobs": None,
                "text_offset": None}

    def response(self) -> dict:
        choices = []
        for c in self.choices:
            out = c.output
            reason = out.finish_reason
            lp = self._logprobs(out, 0, len(read_token_ids(out)))
            if self.chat:
                choices.append({"index": c.index, "message": {"role": "assistant",
                                                              "content": out.text},
                                "logprobs": lp, "finish_reason": reason})
            else:
                choices.append({"index": c.index, "text": out.text, "logprobs": lp,
                                "finish_reason": reason})
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.body.model, "choices": choices,
                "usage": self.usage()}

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> str:
        obj = {"id": self.id, "object": "chat.completion.chunk" if self.chat
               else "text_completion", "created": self.created, "model": self.body.model,
               "choices": choices}
        if usage is not None:
            obj["usage"] = usage
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    def _delta(self, c: _Choice) -> dict | None:
        """The choice's unsent text and tokens; text that may be the start of a stop string is
        held back until the request finishes (the final text drops a matched stop string)."""
        out = c.output
        hold = 0 if out.finished else max((len(s) for s in c.params.stop), default=1) - 1
        end = max(c.sent_text, len(out.text) - hold)
        text = out.text[c.sent_text:end]
        n_read = len(read_token_ids(out))
        lp = (self._logprobs(out, c.sent_tokens, n_read) if n_read > c.sent_tokens else None)
        if not text and lp is None and not out.finished:
            return None
        c.sent_text, c.sent_tokens = end, max(c.sent_tokens, n_read)
        reason = out.finish_reason if out.finished else None
        if self.chat:
            delta = {"content": text}
            if not c.started:
                delta["role"] = "assistant"
            c.started = True
            return {"index": c.index, "delta": delta, "logprobs": lp, "finish_reason": reason}
        return {"index": c.index, "text": text, "logprobs": lp, "finish_reason": reason}

    async def sse(self) -> AsyncIterator[str]:
        """Server-sent events: chunks as tokens come, [DONE] at the end. Cancelled when the
        client disconnects; `close` then aborts what is still running."""
        try:
            async for event in self.events(poll_disconnect=False):
                c = self.by_id.get(event.request_id)
                if c is None or event.output is None:
                    continue
                c.output = event.output
                part = self._delta(c)
                if part is not None:
                    yield self._chunk([part])
            opts = self.body.stream_options or {}
            if opts.get("include_usage"):
                yield self._chunk([], self.usage())
            yield "data: [DONE]\n\n"
        except ApiError as e:  # the engine failed mid-stream: say so in the stream
            yield f"data: {json.dumps(e.body())}\n\n"
        finally:
            self.close()


class _SSEResponse(StreamingResponse):
    """A stream whose engine requests are aborted however the response ends, even when the
    client leaves before the first chunk (the generator's own `finally` never runs then)."""

    def __init__(self, stream: _Stream):
        super().__init__(stream.sse(), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self._stream = stream

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._stream.close()


def _api_error(error: Exception | None) -> ApiError:
    if isinstance(error, InvalidRequestError):
        return ApiError(400, str(error), error.param or "prompt")
    return ApiError(500, f"the engine failed on this request ({type(error).__name__}: "
                    f"{error}); see the server log")
