"""Compilation, process-wide: JAX's persistent compilation cache and counting compiles.

Both touch process-wide JAX state, so the library never does the first on its own: the entry
points (`ee-jax generate` / `serve`, the benchmarks) turn the cache on before building an
engine (`enable_compilation_cache`, with `compilation_cache_from_env` for the default).
Counting compiles listens to JAX's own compile events (`jax.monitoring`), the one signal that
also sees a known shape compiled again (jit compiles anew, without tracing, when its
arguments' placement changes).
"""

from __future__ import annotations

import collections
import concurrent.futures
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import jax

COMPILATION_CACHE_ENV = "EE_JAX_COMPILATION_CACHE"  # relocates the default cache ("": off)
DEFAULT_COMPILATION_CACHE = "~/.cache/ee-jax/xla"
# JAX reports every backend compile under this event (a persistent-cache hit included: the
# program is then loaded, not compiled, which also stalls the step that needs it).
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def pipelined(items: Iterable[Any], lower: Callable[[Any], Any], finish: Callable[[Any], Any],
              workers: int | None = None) -> Iterator[Any]:
    """finish(lower(item)) for every item, yielded in order: `lower` (tracing and lowering,
    which hold Python's lock) runs here, one item after another; `finish` (XLA's compile, or
    a persistent-cache load) runs on `workers` threads (default: the host's cores), beside
    the next items' lowering, so several programs compile at once (XLA's compile of one
    program uses about one core)."""
    workers = max(1, workers or os.cpu_count() or 1)
    with concurrent.futures.ThreadPoolExecutor(workers, "ee-jax-compile") as pool:
        pending: collections.deque = collections.deque()
        for item in items:
            pending.append(pool.submit(finish, lower(item)))
            while len(pending) > workers or (pending and pending[0].done()):
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def quiet_libtpu() -> None:
    """On a host with no TPU chip, tell libtpu it is one host with no workers to find:
    otherwise its start-up prints warnings that it could not determine the accelerator type,
    host bounds and worker hostnames (harmless: there is no TPU to run on, only to compile
    for), and it would hold /tmp/libtpu_lockfile so that a second process (another test run,
    a compile beside a server) failed to load it: with no chip there is nothing to guard. A
    TPU VM's own settings are left alone."""
    from jax._src import hardware_utils

    if hardware_utils.num_available_tpu_chips_and_device_id()[0] == 0:
        os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
        os.environ.setdefault("TPU_HOST_BOUNDS", "1,1,1")
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def compilation_cache_from_env() -> str | None:
    """The cache folder an entry point should use: $EE_JAX_COMPILATION_CACHE when set (empty:
    None, off), else ~/.cache/ee-jax/xla."""
    return os.environ.get(COMPILATION_CACHE_ENV, DEFAULT_COMPILATION_CACHE) or None


def enable_compilation_cache(path: str | None) -> None:
    """Turn on JAX's persistent compilation cache at `path` (None: leave it as it is), for
    every program however quick to compile: a step of a small model compiles in seconds and
    still stalls a request; a restarted server loads its programs instead."""
    if not path:
        return
    path = str(Path(path).expanduser())
    if jax.config.jax_compilation_cache_dir != path:
        Path(path).mkdir(parents=True, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


class _CompileCounter(threading.local):
    count = 0


_counter = _CompileCounter()
_listening = threading.Lock()
_listener_installed = False


def _on_event(event: str, duration: float, **_kw) -> None:
    if event == _COMPILE_EVENT:
        _counter.count += 1


def compiles_on_this_thread() -> int:
    """How many programs JAX has compiled (or loaded from the persistent cache) on the calling
    thread so far; compare two readings around a call to see whether it compiled. Compiles
    run on the thread that calls the jitted function, so an engine in a server's thread
    counts its own."""
    global _listener_installed
    if not _listener_installed:
        with _listening:
            if not _listener_installed:
                jax.monitoring.register_event_duration_secs_listener(_on_event)
                _listener_installed = True
    return _counter.count
