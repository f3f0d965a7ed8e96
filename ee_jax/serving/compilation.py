"""Compilation, process-wide: JAX's persistent compilation cache, the step-program cache
beside it, and counting compiles.

The persistent cache touches process-wide JAX state, so the library never turns it on by
itself: the entry points (`ee-jax generate` / `serve`, the benchmarks) do, before building an
engine (`enable_compilation_cache`, with `compilation_cache_from_env` for the default).
It saves XLA's compile, not JAX's tracing and lowering, which hold Python's lock and cost
~0.3 s a step program on this project's 2-core CPU (a server's ~110-180 programs: 20-50 s
on every start). `ProgramCache` keeps whole compiled executables instead, keyed on
everything that decides them, so a restart loads each program without tracing it.
Counting compiles listens to JAX's own compile events (`jax.monitoring`), the one signal that
also sees a known shape compiled again (jit compiles anew, without tracing, when its
arguments' placement changes).
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import hashlib
import os
import pickle
import threading
import warnings
import zlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import jax
import jaxlib
from jax.experimental import serialize_executable

from ee_jax.errors import MemoryMapsExhausted
from ee_jax.files import write_atomic

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


def memory_maps() -> tuple[int, int] | None:
    """(memory regions this process maps, the most Linux lets it map), or None off Linux."""
    try:
        limit = int(Path("/proc/sys/vm/max_map_count").read_text())
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f), limit
    except (OSError, ValueError):
        return None


def check_memory_maps(programs: int, share: float = 0.9) -> None:
    """Raise MemoryMapsExhausted, with what to do, once this process holds more than
    `share` of the memory maps Linux allows it (`programs`: how many it has compiled or
    loaded, for the message): XLA's CPU backend would otherwise crash at the limit."""
    maps = memory_maps()
    if maps is not None and maps[0] > share * maps[1]:
        raise MemoryMapsExhausted(
            f"this process maps {maps[0]} memory regions of the {maps[1]} Linux allows "
            f"(vm.max_map_count), after {programs} step programs: XLA's CPU backend keeps "
            f"each program's code in its own regions and crashes at the limit. Raise it "
            f"(`sudo sysctl -w vm.max_map_count=262144`) or serve fewer step shapes (fewer "
            f"batch buckets, a smaller max_num_seqs or max_model_len)")


PROGRAM_CACHE_SUBDIR = "ee-jax-programs"


def program_cache_dir() -> str | None:
    """Where the step-program cache lives: beside JAX's persistent compilation cache, and on
    exactly when that is (None: off)."""
    path = jax.config.jax_compilation_cache_dir
    return str(Path(path) / PROGRAM_CACHE_SUBDIR) if path else None


@functools.cache
def source_digest() -> str:
    """A digest of ee_jax's own source: a program compiled by other code is never loaded."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        h.update(str(f.relative_to(root)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def abstract_signature(tree: Any) -> str:
    """What a compiled program assumes of its arguments: their tree, and each leaf's shape,
    dtype and placement (its format where it has one: sharding and device layout, which a TPU
    engine picks: `ee_jax.serving.layouts`)."""
    def leaf(x):
        aval = getattr(x, "aval", None) or jax.ShapeDtypeStruct(x.shape, x.dtype)
        where = getattr(x, "format", None) or getattr(x, "sharding", None)
        return f"{aval!r}@{where!r}"
    return f"{jax.tree.structure(tree)}|{[leaf(x) for x in jax.tree.leaves(tree)]}"


class ProgramCache:
    """Compiled step programs on disk (`jax.experimental.serialize_executable`), one file per
    program, keyed on what decides it: ee_jax's source, JAX and jaxlib's versions, the
    compiler flags, the devices, and what the caller names (the step's static configuration,
    its shape, its arguments' `abstract_signature`). A miss, a file another build wrote or a
    damaged one cost a compile, never a wrong program: a file that fails to load is removed
    and warned about. Like JAX's own cache it trusts its folder: loading runs what it reads,
    so it must be the user's own."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path).expanduser()

    def key(self, *parts: Any) -> str:
        """The file name for a program decided by `parts` (their reprs) in this process."""
        env = (jax.__version__, jaxlib.__version__, source_digest(),
               os.environ.get("XLA_FLAGS", ""), os.environ.get("LIBTPU_INIT_ARGS", ""),
               jax.config.jax_enable_x64, jax.config.jax_default_matmul_precision)
        return hashlib.sha256(repr((env, parts)).encode()).hexdigest()

    def load(self, key: str, devices: list[jax.Device]) -> jax.stages.Compiled | None:
        """The program saved under `key`, loaded onto `devices` (in the order it was compiled
        for), or None."""
        f = self.path / f"{key}.bin"
        try:
            blob = f.read_bytes()
        except FileNotFoundError:
            return None
        try:
            executable, in_tree, out_tree = pickle.loads(zlib.decompress(blob))
            return serialize_executable.deserialize_and_load(
                executable, in_tree, out_tree, backend=devices[0].client,
                execution_devices=devices)
        except Exception as e:
            warnings.warn(f"ee-jax: removed an unreadable compiled program {f} ({e!r}); it "
                          f"compiles again", stacklevel=2)
            f.unlink(missing_ok=True)
            return None

    def save(self, key: str, compiled: jax.stages.Compiled) -> None:
        """Keep `compiled` under `key` (written whole or not at all). A program that cannot
        be saved (a backend without serialization, a full disk) is warned about and skipped:
        the cache only ever saves time."""
        try:
            blob = zlib.compress(pickle.dumps(serialize_executable.serialize(compiled)), 1)
            self.path.mkdir(parents=True, exist_ok=True)
            write_atomic(self.path / f"{key}.bin", blob)
        except Exception as e:
            warnings.warn(f"ee-jax: could not keep a compiled program in {self.path} "
                          f"({e!r})", stacklevel=2)


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
