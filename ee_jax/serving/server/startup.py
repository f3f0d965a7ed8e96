"""A server that says it is starting: the port opens at once, and the engine is built and warmed
up behind it.

Loading a model and compiling its step programs takes from seconds (a restart: programs come
from the program cache) to minutes (a fresh machine). A server silent all that time looks
dead to a readiness probe and to a user, so `ee-jax serve` listens first and builds the engine
in a background thread; /health says "starting" (with the phase: "loading", "compiling 3/4"),
"ok" or "failed" (with the error), and /ready answers 200 only once requests are served.

Warm-up comes in two parts. Before serving: the step programs of the smallest batch bucket
(`LLMEngine.step_shapes` puts them first), which are what one short request meets, its
prefill steps and its decode steps. After: every other shape, a few programs at a time while
the engine has nothing to step (`EngineLoop`'s idle work). A request therefore waits for at
most the few programs being compiled when it came, then its own shape if that is not ready
yet (compiled as it is met, as with `--no-precompile`), never for the whole warm-up.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Literal

from ee_jax.errors import EEJaxError
from ee_jax.serving.engine import LLMEngine
from ee_jax.serving.model_runner import StepShape

State = Literal["starting", "ok", "failed"]
KINDS = ("decode", "prefill")

# The app's side of becoming ready: start serving `engine`, whose loop calls the idle work
# (None: there is none) between steps while no request is in flight.
Attach = Callable[[LLMEngine, Callable[[], bool] | None], None]


class StartupCancelled(Exception):
    """The server stopped while it was starting (not a failure: nothing is reported)."""


class Startup:
    """An engine on its way to serving: built by `build` in a background thread (or given
    built), its first step programs compiled, then handed to the server (`start`'s attach).

    precompile: the kinds of step shapes to compile ahead ("decode", "prefill"; () for none:
    every shape compiles when first met). program_cache: the folder of compiled programs
    (`compilation.program_cache_dir()`). log: progress lines on stderr (a failure is always
    logged). on_ready: called with the engine once it serves (the CLI's "serving" line).
    Every method may be called from any thread; `compile_more` only from the engine's.
    """

    def __init__(self, build: Callable[[], LLMEngine] | LLMEngine, *,
                 precompile: tuple[str, ...] = (), program_cache: str | None = None,
                 log: bool = False, on_ready: Callable[[LLMEngine], None] | None = None):
        unknown = set(precompile) - set(KINDS)
        if unknown:
            raise ValueError(f"precompile kinds must be among {KINDS}, got {sorted(unknown)}")
        self._build = build if not isinstance(build, LLMEngine) else None
        self.engine: LLMEngine | None = build if isinstance(build, LLMEngine) else None
        self.precompile = tuple(k for k in KINDS if k in precompile)
        self.program_cache, self.log, self.on_ready = program_cache, log, on_ready
        self._lock = threading.Lock()
        self._state: State = "starting"
        self._phase = "loading" if self.engine is None else "compiling"
        self.error: BaseException | None = None
        self._shapes: list[StepShape] = []  # every shape to warm up, in order
        self._first = 0  # how many of them come before serving
        self._later: list[StepShape] = []  # what the idle work has still to compile
        self._background_error: str | None = None
        self._done = threading.Event()
        self._callbacks: list[Callable[[], None]] = []
        self._cancelled = False
        self._started = False
        # the thread building the engine; None where `start` ran it inline (nothing to wait for)
        self._thread: threading.Thread | None = None
        self._t0 = time.monotonic()
        self._ready_at: float | None = None
        self._programs = 0  # warm-up programs compiled or loaded
        # warm-up shapes ready: those of the finished parts, and of the part under way
        self._ready = self._in_flight = 0
        self._loaded0 = 0  # the engine's count of loaded programs before the warm-up

    # -- any thread --------------------------------------------------------------------

    @property
    def state(self) -> State:
        return self._state

    def status(self) -> dict:
        """What /health reports: status, phase, the step programs ready and the error."""
        with self._lock:
            out: dict = {"status": self._state, "phase": self._phase}
            if self._shapes:
                ready = self._ready + self._in_flight
                out["programs"] = {"ready": ready, "total": len(self._shapes)}
                if self._state == "starting" and self._phase == "compiling":
                    out["programs"]["before_serving"] = self._first
                    out["phase"] = f"compiling {min(ready, self._first)}/{self._first}"
            if self.error is not None:
                out["error"] = _describe(self.error)
            if self._background_error is not None:
                out["background_error"] = self._background_error
            out["elapsed_s"] = round(time.monotonic() - self._t0, 1)
            if self._ready_at is not None:
                out["ready_after_s"] = round(self._ready_at - self._t0, 1)
            return out

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        """Call `fn` (from the starting thread) once the state leaves "starting"; at once if
        it has."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        fn()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the state leaves "starting" (or `timeout` seconds); True if serving."""
        self._done.wait(timeout)
        return self._state == "ok"

    def start(self, attach: Attach) -> None:
        """Build and warm up the engine, then `attach` it: in a background thread, or here
        when there is nothing slow to do (an engine given built, with no warm-up: ready when
        this returns)."""
        if self._started:
            raise RuntimeError("this Startup was started already (one per server)")
        self._started = True
        self._t0 = time.monotonic()
        if self.engine is not None and not self.precompile:
            # inline: the caller's thread (the server's) is not ours to wait for at shutdown
            self._run(attach)
            return
        self._thread = threading.Thread(target=self._run, args=(attach,),
                                        name="ee-jax-startup", daemon=True)
        self._thread.start()

    def cancel(self, timeout: float = 30.0) -> None:
        """Stop starting (the server is shutting down): the warm-up stops at its next
        program; a model being loaded finishes loading first (up to `timeout` seconds are
        waited for)."""
        with self._lock:
            self._cancelled = True
        thread = self._thread
        if thread is not None and thread is not threading.current_thread() and \
                thread.is_alive():
            thread.join(timeout)

    # -- the starting thread -----------------------------------------------------------

    def _run(self, attach: Attach) -> None:
        try:
            if self.engine is None:
                engine = self._build()
                if not isinstance(engine, LLMEngine):
                    raise TypeError(f"the server's build function returned "
                                    f"{type(engine).__name__}, not an LLMEngine")
                with self._lock:
                    self.engine = engine
            self._check_cancelled()
            self._warm_up()
            with self._lock:
                self._check_cancelled()
                self._phase = "starting the engine loop"
            attach(self.engine, self.compile_more if self._later else None)
            with self._lock:
                self._state, self._phase = "ok", "serving"
                self._ready_at = time.monotonic()
        except StartupCancelled:
            return
        except BaseException as e:  # reported on /health and here, never lost
            with self._lock:
                self._state, self.error = "failed", e
            if not isinstance(e, (EEJaxError, ValueError, OSError)):  # a bug: its traceback
                traceback.print_exception(e, file=sys.stderr)
            print(f"ee-jax: error: the server failed to start ({self._phase}): "
                  f"{_describe(e)}; /health reports it until the server is stopped (Ctrl-C)",
                  file=sys.stderr)
        finally:
            self._finish()
        if self._state == "ok":
            self._log_ready()
            if self.on_ready is not None:
                self.on_ready(self.engine)

    def _finish(self) -> None:
        with self._lock:
            callbacks, self._callbacks = self._callbacks, []
            self._done.set()
        for fn in callbacks:
            fn()

    def _check_cancelled(self) -> None:
        if self._cancelled:
            raise StartupCancelled

    def _warm_up(self) -> None:
        """Compile the programs one short request meets (the smallest batch bucket's), and
        queue the rest for the idle work."""
        if not self.precompile:
            return
        engine = self.engine
        shapes = engine.step_shapes(self.precompile)
        smallest = min((s.batch for s in shapes), default=0)
        first = [s for s in shapes if s.batch == smallest]
        with self._lock:
            self._shapes, self._first = shapes, len(first)
            self._later = [s for s in shapes if s.batch != smallest]
            self._phase = "compiling"
        self._loaded0 = engine.stats.num_programs_loaded
        self._compile(first, progress=self.log)

    def _compile(self, shapes: list[StepShape], progress: bool) -> None:
        """Compile (or load) `shapes`, counting each as it is ready (/health's progress);
        stops at the next program once cancelled (StartupCancelled)."""
        already = sum(self.engine.is_compiled(s) for s in shapes)  # met by requests
        with self._lock:
            self._in_flight = already

        def ready(done: int, total: int) -> None:
            with self._lock:
                self._in_flight = already + done
            self._check_cancelled()

        finished = False
        try:
            self._programs += self.engine.precompile(
                shapes=shapes, progress=progress, program_cache=self.program_cache,
                on_program=ready)
            finished = True
        finally:
            with self._lock:
                self._ready += len(shapes) if finished else self._in_flight
                self._in_flight = 0

    def _counts(self) -> str:
        loaded = self.engine.stats.num_programs_loaded - self._loaded0
        return f"{self._programs - loaded} compiled, {loaded} loaded from the program cache"

    def _log_ready(self) -> None:
        if not self.log:
            return
        took = self._ready_at - self._t0
        if not self._shapes:
            print(f"ee-jax: ready in {took:.1f}s", file=sys.stderr)
            return
        rest = len(self._shapes) - self._first  # (the idle work may have begun on them)
        later = f"; the other {rest} compile while the engine is idle" if rest else ""
        print(f"ee-jax: ready in {took:.1f}s: the smallest batch bucket's {self._first} step "
              f"programs ({self._counts()}){later}", file=sys.stderr)

    # -- the engine thread -------------------------------------------------------------

    def compile_more(self) -> bool:
        """The idle work: compile the next few programs of the warm-up (as many as the host
        has cores: XLA compiles them side by side), so a request that comes meanwhile waits
        for about one program's compile. True while more remain."""
        with self._lock:
            chunk = self._later[:max(1, os.cpu_count() or 1)]
        if not chunk or self._cancelled:
            return False
        try:
            self._compile(chunk, progress=False)
        except StartupCancelled:  # the server is stopping
            return False
        except Exception as e:  # serving goes on: each shape compiles when first met
            traceback.print_exc(file=sys.stderr)
            with self._lock:
                self._background_error, self._later = _describe(e), []
            print("ee-jax: warning: compiling step programs while idle failed (above); the "
                  "server goes on, each step shape compiles when first met", file=sys.stderr)
            return False
        with self._lock:
            del self._later[:len(chunk)]
            more = bool(self._later)
        if not more and self.log:
            print(f"ee-jax: all {len(self._shapes)} step programs ready, "
                  f"{time.monotonic() - self._t0:.1f}s after start ({self._counts()}; any "
                  f"others compiled as requests met them)", file=sys.stderr)
        return more


def _describe(e: BaseException) -> str:
    message = " ".join(str(e).split())
    return f"{type(e).__name__}: {message}" if message else type(e).__name__
