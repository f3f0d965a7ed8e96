"""One thread owns the engine; requests come in through a queue, tokens go out as made.

`LLMEngine` is not thread-safe, so only this thread touches it. Callers `submit` and `abort`
(thread-safe: they only enqueue) and receive `Event`s through the sink they gave, called from
the engine thread (an asyncio handler's sink hops onto its event loop). Between steps the
thread drains the inbox; while nothing is in flight it does its idle work (the rest of a
server's warm-up, `startup.Startup.compile_more`) a piece at a time, then sleeps on the inbox.
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Literal

from ee_jax.serving.engine import LLMEngine
from ee_jax.serving.params import InvalidRequestError, RequestOutput, SamplingParams
from ee_jax.serving.server.metrics import ServerMetrics
from ee_jax.serving.stats import exit_summary


@dataclasses.dataclass
class Event:
    """accepted: the engine took the request; output: it progressed (or finished);
    error: it was refused (InvalidRequestError) or the engine failed."""

    kind: Literal["accepted", "output", "error"]
    request_id: str
    output: RequestOutput | None = None
    error: Exception | None = None


Sink = Callable[[Event], None]


def read_token_ids(out: RequestOutput) -> list[int]:
    """The output's tokens the host has read: with overlapped steps an output can end in
    placeholders (negative ids) for tokens still on the device."""
    ids = out.token_ids
    n = len(ids)
    while n and ids[n - 1] < 0:
        n -= 1
    return ids[:n]


@dataclasses.dataclass
class _Live:
    sink: Sink
    arrival: float
    num_tokens: int = 0
    last_token_time: float | None = None


class EngineLoop:
    """Steps `engine` in a daemon thread until `shutdown`. idle: work for the engine thread
    while no request is in flight, in short pieces (a request that comes waits for one):
    called again while it returns True."""

    def __init__(self, engine: LLMEngine, metrics: ServerMetrics | None = None,
                 idle: Callable[[], bool] | None = None):
        self.engine = engine
        self.metrics = metrics
        self._idle = idle
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}  # engine thread only
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ee-jax-engine", daemon=True)
        # Engine stats already counted (or from before this server): counters take deltas.
        s = engine.stats
        self._preemptions, self._compiles = s.num_preemptions, s.num_compiles
        self._drafted, self._accepted = s.num_drafted, s.num_accepted
        self._compile_time = s.compile_time
        self._decode_steps = -1

    # -- any thread --------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    def submit(self, request_id: str, prompt: list[int], params: SamplingParams, sink: Sink,
               arrival: float | None = None) -> None:
        """Queue a request; `sink` gets "accepted" or "error", then its outputs."""
        self._inbox.put(("add", request_id, prompt, params, sink,
                         time.perf_counter() if arrival is None else arrival))

    def abort(self, request_id: str) -> None:
        """Abort a request (a client went away): its pages are freed at the next drain."""
        self._inbox.put(("abort", request_id))

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop stepping; requests still in flight are aborted (their sinks told so)."""
        self._stop.set()
        self._inbox.put(("wake",))
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- the engine thread -------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain(block=self._idle is None and not self.engine.has_unfinished_requests())
            if self._stop.is_set():
                break
            if self.engine.has_unfinished_requests():
                self._step()
            elif self._idle is not None:
                self._idle_work()
        self._drain(block=False)
        for rid in list(self._live):
            self._abort(rid)

    def _idle_work(self) -> None:
        try:
            more = self._idle()
        except Exception:  # the idle work's own failure: no more of it, serving goes on
            traceback.print_exc(file=sys.stderr)
            more = False
        if not more:
            self._idle = None
        # Programs compiled ahead are no step's compile: the compile counters skip them.
        s = self.engine.stats
        self._compiles, self._compile_time = s.num_compiles, s.compile_time

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if item[0] == "add":
                self._add(*item[1:])
            elif item[0] == "abort":
                self._abort(item[1])
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _add(self, rid: str, prompt: list[int], params: SamplingParams, sink: Sink,
             arrival: float) -> None:
        try:
            self.engine.add_request(rid, prompt, params)
        except InvalidRequestError as e:
            _send(sink, Event("error", rid, error=e))
            return
        except Exception as e:  # a bug: this request fails, the server carries on
            traceback.print_exc(file=sys.stderr)
            _send(sink, Event("error", rid, error=e))
            return
        self._live[rid] = _Live(sink, arrival)
        _send(sink, Event("accepted", rid))

    def _abort(self, rid: str) -> None:
        live = self._live.pop(rid, None)
        try:
            out = self.engine.abort_request(rid)
        except Exception:
            traceback.print_exc(file=sys.stderr)
            out = None
        if out is not None:
            self._finished(out, live)
            if live is not None:
                _send(live.sink, Event("output", rid, output=out))

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # fail what is in flight, keep serving new requests
            traceback.print_exc(file=sys.stderr)
            for rid in list(self._live):
                live = self._live.pop(rid)
                with contextlib.suppress(Exception):
                    self.engine.abort_request(rid)
                if self.metrics:
                    self.metrics.requests.labels("error").inc()
                _send(live.sink, Event("error", rid, error=e))
            return
        now = time.perf_counter()
        for out in outputs:
            live = self._live.get(out.request_id)
            if live is None:
                continue
            n_read = len(read_token_ids(out))
            new = n_read - live.num_tokens
            if self.metrics and new > 0:
                if live.last_token_time is None:
                    self.metrics.ttft.observe(now - live.arrival)
                else:
                    self.metrics.itl.observe((now - live.last_token_time) / new)
                for layer in (out.exit_layers or [])[live.num_tokens:n_read]:
                    self.metrics.token(layer)
            if new > 0:
                live.num_tokens, live.last_token_time = n_read, now
            if out.finished:
                self._live.pop(out.request_id, None)
                self._finished(out, live)
            _send(live.sink, Event("output", out.request_id, output=out))
        self._update_gauges()

    def _finished(self, out: RequestOutput, live: _Live | None) -> None:
        if not self.metrics:
            return
        self.metrics.requests.labels(out.finish_reason or "stop").inc()
        self.metrics.prompt_tokens.inc(len(out.prompt_token_ids))
        if live is not None:
            self.metrics.latency.observe(time.perf_counter() - live.arrival)
        self._update_gauges()

    def _update_gauges(self) -> None:
        if not self.metrics:
            return
        stats = self.engine.stats
        self.metrics.preemptions.inc(stats.num_preemptions - self._preemptions)
        self.metrics.compiles.inc(stats.num_compiles - self._compiles)
        self.metrics.compile_seconds.inc(stats.compile_time - self._compile_time)
        self.metrics.drafted.inc(stats.num_drafted - self._drafted)
        self.metrics.accepted.inc(stats.num_accepted - self._accepted)
        self._drafted, self._accepted = stats.num_drafted, stats.num_accepted
        if stats.acceptance_rate is not None:
            self.metrics.acceptance.set(stats.acceptance_rate)
        self._preemptions, self._compiles = stats.num_preemptions, stats.num_compiles
        self._compile_time = stats.compile_time
        self.metrics.pages_used.set(self.engine.blocks.num_used_pages)
        self.metrics.running.set(self.engine.num_unfinished_requests)
        if stats.num_decode_steps != self._decode_steps:  # the exit figures moved
            self._decode_steps = stats.num_decode_steps
            ex = exit_summary(stats, self.engine.model_config, self.engine.exit_config)
            self.metrics.ideal_speedup.set(ex["ideal"])
            self.metrics.work_fraction.set(ex["work_fraction"])


def _send(sink: Sink, event: Event) -> None:
    with contextlib.suppress(Exception):  # a sink whose event loop is gone: nobody listens
        sink(event)
