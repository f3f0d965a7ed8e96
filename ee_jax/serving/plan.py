"""The engine plan: everything an engine's configuration decides before any array exists.

`engine_plan(model, config, platform)` works out once, for a model, an engine config and the
platform the steps are built for, what the engine (`LLMEngine`), the ahead-of-time compiler
(`aot.Plan`, `ee-jax compile`) and the roofline benchmark (`bench/roofline.py`) all need:
the mesh and the attention backend it allows, the scheduler's buckets and page ladder, the KV
pool's page count, layout and storage dtype, and what the step programs are built with. The
plan is a pure, hashable value, so an engine and a compile for the same inputs hold equal
plans (tests/test_plan.py), and each rule below is written once.

`EngineConfig` lives here too: the plan is what it means.
"""

from __future__ import annotations

import dataclasses

from ee_jax.models import llama
from ee_jax.models.config import ModelConfig
from ee_jax.serving.attention_kernels import backend_name
from ee_jax.serving.controller import ControllerConfig
from ee_jax.serving.kv_cache import bytes_per_page, cache_shape, head_major_for, storage_dtype
from ee_jax.serving.model_runner import StepShape, layout_shape
from ee_jax.serving.scheduler import GPU_PLATFORMS, SchedulerConfig
from ee_jax.serving.sharding import MeshSpec
from ee_jax.settings import from_flat


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Serving knobs (vLLM's names). The scheduler's (rows, lengths, pages, token budget,
    buckets) are its own config's, `scheduler`; `EngineConfig.make` takes both kinds flat,
    as `LLM(model, **knobs)` and the CLI do. `num_pages` wins over `kv_cache_gib`."""

    # what steps the scheduler forms: max_num_seqs, max_model_len, page_size, buckets, ...
    scheduler: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)
    # pages in the KV pool, the null page included; None: sized from kv_cache_gib
    num_pages: int | None = None
    # with num_pages None: the KV pool's size cap in GiB (2**30 bytes, as stored), short of
    # which it holds max_num_seqs requests of max_model_len
    kv_cache_gib: float = 1.0
    kv_dtype: str | None = None  # K/V dtype name; None: the model's dtype
    # Launch step n+1 before reading step n's tokens (the host never waits for the device).
    async_scheduling: bool = True
    # Attention backend (ee_jax.serving.attention_kernels): "auto" = the Pallas kernels on
    # GPU and TPU, the XLA flash-decoding path on CPU, the reference under a mesh of several
    # devices (`engine_plan`); "reference" = the gather oracle.
    attention: str = "auto"
    # Devices: "tp=4,dp=2" shards heads, MLP width and vocabulary over tp and batch rows over
    # dp (ee_jax.serving.sharding); None: one device.
    mesh: str | None = None
    # How the layers' weights are held (`llama.LAYOUTS`): "stacked" (one array a weight,
    # a leading layer axis), "per_layer" (a buffer a weight a layer), "auto": the target's
    # (`llama.layout_for`: per layer on GPU, whose compiler copies a stacked weight's slice
    # out before its GEMMs; stacked on TPU and CPU, which read the slice in place).
    layer_layout: str = "auto"
    # Exit engines: per batch bucket, whether decode steps run the exit program or the
    # full-depth one (ee_jax.serving.controller; mode "exits": always the exit program).
    exit_control: ControllerConfig = dataclasses.field(default_factory=ControllerConfig)

    @classmethod
    def make(cls, **knobs) -> EngineConfig:
        """An EngineConfig from flat knobs, each a field of EngineConfig or of SchedulerConfig
        (`settings.from_flat`): `EngineConfig.make(max_num_seqs=8, attention="xla")`."""
        return from_flat(cls, "scheduler", knobs)


def device_platform(name: str) -> str:
    """The platform name JAX's devices report for `name`: a GPU's ("cuda", "rocm") is "gpu";
    "cpu" and "tpu" are themselves."""
    name = name.lower()
    return "gpu" if name in GPU_PLATFORMS else name


@dataclasses.dataclass(frozen=True)
class EnginePlan:
    """What an engine of `model` under `config` runs on `platform` (`engine_plan`)."""

    model: ModelConfig
    config: EngineConfig  # as given
    platform: str  # what the steps are built for: "cpu", "gpu" or "tpu" (`device_platform`)
    # the devices config.mesh asks for (checked against the model); None: one, no mesh
    mesh: MeshSpec | None
    attention: str  # the backend every step runs, resolved on `platform` (never "auto")
    # config.scheduler with the platform's batch buckets and the backend's decode page ladder
    # where it left them to the plan (`SchedulerConfig.planned`)
    scheduler: SchedulerConfig
    num_pages: int  # pages in the KV pool, the null page included
    # the pool's layout: [K, L, P, S, hd] where a Pallas kernel reads it, else [L, P, S, K, hd]
    # (`kv_cache.head_major_for`; a sharded pool is layer-major)
    head_major: bool
    kv_dtype: str  # the pool's dtype as stored on `platform` (`kv_cache.storage_dtype`)
    layer_layout: str = "stacked"  # config.layer_layout resolved on `platform`

    @property
    def page_size(self) -> int:
        return self.scheduler.page_size

    @property
    def max_batch(self) -> int:
        """Rows of the largest step (the runner's result buffers hold this many)."""
        return max(self.scheduler.buckets)

    @property
    def kv_shape(self) -> tuple[int, ...]:
        """The shape of each of the pool's K and V arrays, as stored (`kv_cache.cache_shape`)."""
        return cache_shape(self.model, self.num_pages, self.page_size, self.platform,
                           self.head_major)

    def step_shapes(self, kinds: tuple[str, ...] = ("decode", "prefill")) -> list[StepShape]:
        """Every step shape the scheduler can produce, of these kinds."""
        return self.scheduler.step_shapes(kinds)

    def layout_shape(self, exits: bool) -> StepShape | None:
        """The step a TPU runner picks its arrays' layouts from: the largest decode bucket
        (`model_runner.layout_shape`), as an exit program or not."""
        return layout_shape(self.step_shapes(("decode",)), exits)


def engine_plan(model: ModelConfig, config: EngineConfig, platform: str) -> EnginePlan:
    """The plan of an engine of `model` under `config`, its steps built for `platform`
    ("cpu", "gpu"/"cuda", "tpu"). ValueError (a `sharding.MeshError` for the mesh) naming the
    knob to change where the config cannot serve the model."""
    platform = device_platform(platform)
    sched = config.scheduler
    if sched.max_model_len > model.max_position:
        raise ValueError(f"max_model_len ({sched.max_model_len}) exceeds the model's "
                         f"context length ({model.max_position}); lower max_model_len")
    mesh = MeshSpec.parse(config.mesh) if config.mesh else None
    if mesh is not None:
        mesh.validate_for(model)
    attention = config.attention
    if attention == "auto" and mesh is not None and mesh.size > 1:
        # Sharded: the gather reference keeps the Megatron minimum of collectives; the XLA
        # path's row gather over a reshaped cache made XLA gather the whole cache per
        # layer when KV heads are split (`python -m bench.kernels collectives`).
        attention = "reference"
    attention = backend_name(attention, platform)
    sched = sched.planned(platform, attention)
    kv_dtype = storage_dtype(config.kv_dtype or model.dtype, platform)
    num_pages = config.num_pages
    if num_pages is None:  # max_num_seqs requests of max_model_len (and the null page),
        # within kv_cache_gib
        want = sched.max_num_seqs * sched.pages_per_seq + 1
        per_page = bytes_per_page(model, sched.page_size, kv_dtype, platform)
        num_pages = max(2, min(want, int(config.kv_cache_gib * 2**30 // per_page)))
    if num_pages - 1 < sched.pages_per_seq:
        raise ValueError(
            f"the KV cache ({num_pages - 1} usable pages of {sched.page_size} tokens) "
            f"cannot hold one sequence of max_model_len={sched.max_model_len}; raise "
            f"num_pages/kv_cache_gib or lower max_model_len")
    # a pool a Pallas kernel reads is stored in its layout (kv_cache: head-major), unsharded
    head_major = mesh is None and head_major_for(attention)
    layout = config.layer_layout
    if layout == "auto":
        layout = llama.layout_for(platform)
    elif layout not in llama.LAYOUTS:
        raise ValueError(f"unknown layer_layout {layout!r}; choose 'auto' or one of "
                         f"{llama.LAYOUTS}")
    return EnginePlan(model, config, platform, mesh, attention, sched, num_pages, head_major,
                      kv_dtype.name, layout)


__all__ = ["EngineConfig", "EnginePlan", "device_platform", "engine_plan"]
