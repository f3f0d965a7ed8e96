"""Several hosts: one engine per process over one global mesh, driven by process 0.

    process 0 (leader)                          processes 1..N-1 (followers)
    scheduler, block manager, requests          the same model, cache and compiled steps
    builds each step's packed input  ──broadcast (shape + buffer)──>  receive it
    runs the global jitted step                 run the same global jitted step
    reads the results (its local copy)          (results unused)

JAX's runtime is the distributed engine: `jax.distributed.initialize` connects the
processes, the mesh spans every process's devices (`jax.devices()`), and the step's
collectives cross hosts inside XLA. Only the step's decision (its `StepShape` and packed
int32 buffer) crosses from the leader's host, with `multihost_utils.broadcast_one_to_all`.
A process that dies stops sending heartbeats; JAX's coordination service then ends the
others with an error naming the dead task within `heartbeat_timeout_s` (plus a poll), so a
lost host never leaves the rest hanging.

TPU pod slices: run the same command on every host; `jax.distributed.initialize()` with no
arguments detects the slice. Multi-node GPU (e.g. SLURM): the same, or give the coordinator
address, process count and id (`--coordinator 10.0.0.1:1234 --num-processes 2
--process-id 0`, or EE_JAX_COORDINATOR / EE_JAX_NUM_PROCESSES / EE_JAX_PROCESS_ID).
"""

from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np

from ee_jax.errors import EEJaxError

STOP = 0  # header[0] of a broadcast: the leader is shutting down
GO = 1


class DistributedError(EEJaxError, RuntimeError):
    """Processes that cannot form (or keep) one job."""


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """Where the coordinator is and who this process is (None: let JAX detect it, as on TPU
    pods and SLURM). `local_cpu_devices` simulates devices on a CPU host (tests)."""

    coordinator_address: str | None = None  # "host:port" of process 0's coordinator
    num_processes: int | None = None  # processes in the job
    process_id: int | None = None  # this process's rank; 0 is the leader
    local_cpu_devices: int | None = None  # CPU devices this process simulates (tests)
    heartbeat_timeout_s: int = 30  # seconds without a heartbeat before a peer counts as lost
    initialization_timeout_s: int = 120  # seconds to wait for every process to join

    @classmethod
    def from_env(cls, **overrides) -> DistributedConfig:
        """EE_JAX_COORDINATOR, EE_JAX_NUM_PROCESSES, EE_JAX_PROCESS_ID (flags override)."""
        env = os.environ

        def num(name):
            v = env.get(name)
            if v is None:
                return None
            if not v.isdigit():
                raise DistributedError(f"{name} must be a non-negative integer, got {v!r}")
            return int(v)

        base = dict(coordinator_address=env.get("EE_JAX_COORDINATOR"),
                    num_processes=num("EE_JAX_NUM_PROCESSES"),
                    process_id=num("EE_JAX_PROCESS_ID"))
        base.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**base)

    def validate(self) -> None:
        if (self.num_processes is not None and self.process_id is not None
                and not 0 <= self.process_id < self.num_processes):
            raise DistributedError(f"process_id {self.process_id} is outside [0, "
                                   f"{self.num_processes}) (num_processes)")
        if self.coordinator_address is not None and ":" not in self.coordinator_address:
            raise DistributedError(f"coordinator address {self.coordinator_address!r} needs a "
                                   f"port: write it as host:port")


def initialize(config: DistributedConfig) -> None:
    """Join the job (before anything else touches JAX's devices)."""
    config.validate()
    if config.local_cpu_devices is not None:
        jax.config.update("jax_num_cpu_devices", config.local_cpu_devices)
    if jax.config.jax_platforms in (None, "", "cpu"):
        # Cross-process collectives on CPU hosts (no-op for GPU/TPU backends).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(
            config.coordinator_address, config.num_processes, config.process_id,
            initialization_timeout=config.initialization_timeout_s,
            heartbeat_timeout_seconds=config.heartbeat_timeout_s)
    except Exception as e:
        raise DistributedError(
            f"could not join the distributed job (coordinator "
            f"{config.coordinator_address or 'auto-detected'}, {config.num_processes} "
            f"processes, this is process {config.process_id}): {e}. Check that every process "
            f"got the same coordinator address and process count and that it is reachable"
        ) from e


def is_multiprocess() -> bool:
    return jax.process_count() > 1


def is_leader() -> bool:
    return jax.process_index() == 0


def broadcast_header(header: np.ndarray | None) -> np.ndarray:
    """The leader's int32 header [5] to every process (followers pass None)."""
    from jax.experimental import multihost_utils

    x = header if header is not None else np.zeros(5, np.int32)
    return np.asarray(multihost_utils.broadcast_one_to_all(x.astype(np.int32)))


def broadcast_buffer(buf: np.ndarray | None, size: int) -> np.ndarray:
    from jax.experimental import multihost_utils

    x = buf if buf is not None else np.zeros(size, np.int32)
    return np.asarray(multihost_utils.broadcast_one_to_all(x.astype(np.int32)))


def global_array(x: np.ndarray, sharding) -> jax.Array:
    """A global array with `sharding` from a host value every process holds in full."""
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])
