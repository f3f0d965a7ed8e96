"""Every step program the engine would run on a machine this one need not be: compiled ahead
of time for a TPU topology (libtpu, on any host, as MaxText does) or for a CUDA GPU (XLA's GPU
compiler told the chip, no GPU needed), or lowered for CUDA (`jax.export`) where that compiler
is not installed, from abstract weights (`jax.ShapeDtypeStruct`: an 8B model is never
materialised).

    target = parse_target("tpu:v5e:2x2")                # or "tpu:v6e", "cuda:h100", "cpu"
    plan = Plan.make(cfg, target, EngineConfig(mesh="tp=4"), exit_config)
    for row in plan.compile():                          # one Row per step program
        print(row.variant, row.shape, row.seconds, row.temp_bytes)

The programs are the engine's own: `ModelRunner.lower` on a runner holding abstract params,
heads and cache placed on the target's devices, for every `StepShape` the scheduler can produce
(`SchedulerConfig.step_shapes`, what `LLMEngine.precompile` compiles). Compiling for TPU needs
the `tpu-aot` extra (`requirements-tpu-aot.txt`: libtpu matching the pinned JAX); compiling for
CUDA the `cuda-aot` extra (`requirements-cuda-aot.txt`: JAX's CUDA plugin and ptxas, in a venv
of its own run with JAX_PLATFORMS=cpu, `make roofline`), without which CUDA programs are
lowered only. What a compile here does not check: for CUDA, autotuning (XLA picks default
matmul tiles without a GPU to time them on, so a device's fusions may differ) and anything at
run time; for TPU, run-time behaviour (the compile itself is the device's own compiler).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import time
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from ee_jax.errors import EEJaxError
from ee_jax.models import llama, quant, registry
from ee_jax.models.config import ModelConfig
from ee_jax.models.exits import backfill_maps
from ee_jax.models.exits import checkpoint as exit_checkpoint
from ee_jax.models.exits import heads as exit_heads
from ee_jax.models.exits.config import SERVING_POLICY, ExitConfig, uses_maps
from ee_jax.models.formats import gguf
from ee_jax.serving import compilation, hlo
from ee_jax.serving.aot import roofline
from ee_jax.serving.aot import traffic as traffic_
from ee_jax.serving.kv_cache import KVCache
from ee_jax.serving.model_runner import ModelRunner, StepShape
from ee_jax.serving.plan import EngineConfig, EnginePlan, engine_plan
from ee_jax.serving.sharding import MeshSpec, cache_sharding


class TargetError(EEJaxError, ValueError):
    """A target, topology or model shape this module does not know."""


@dataclasses.dataclass(frozen=True)
class Chip:
    """Published per-chip figures (dense bf16 peak, HBM size and bandwidth) and where from."""

    name: str
    platform: str  # "tpu", "cuda" or "cpu"
    hbm_bytes: int
    peak_flops: float  # dense bf16 FLOP/s
    hbm_bytes_per_s: float
    source: str


GB = 10**9


@functools.cache
def host_chip() -> Chip:
    """This machine's CPU as a target's chip for the roofline (`--target cpu`), its peaks
    measured once a process: a 1024^2 f32 matmul's FLOP/s (best of 3 after a warm call) and
    a 128 MiB copy's bytes/s (read + write). Its memory is not a limit compiles check."""
    n = 1024
    a = jnp.ones((n, n), jnp.float32)
    mm = jax.jit(jnp.matmul)
    mm(a, a).block_until_ready()
    best = min(_timed(lambda: mm(a, a).block_until_ready()) for _ in range(3))
    buf = np.ones(2**27 // 4, np.float32)
    out = np.empty_like(buf)
    np.copyto(out, buf)
    copy = min(_timed(lambda: np.copyto(out, buf)) for _ in range(3))
    return Chip("this CPU", "cpu", 0, 2 * n**3 / best, 2 * buf.nbytes / copy,
                "measured here (f32 matmul, memory copy)")


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0
CHIPS: dict[str, Chip] = {
    "v5e": Chip("TPU v5e", "tpu", 16 * 2**30, 197e12, 819 * GB,
                "cloud.google.com/tpu/docs/v5e (197 TFLOP/s bf16, 16 GiB HBM2, 819 GB/s)"),
    "v6e": Chip("TPU v6e", "tpu", 32 * 2**30, 918e12, 1640 * GB,
                "cloud.google.com/tpu/docs/v6e (918 TFLOP/s bf16, 32 GiB HBM, 1640 GB/s)"),
    "h100": Chip("H100 SXM", "cuda", 80 * GB, 989e12, 3350 * GB,
                 "nvidia.com H100 datasheet (989 TFLOP/s dense bf16, 80 GB HBM3, 3.35 TB/s)"),
    "h200": Chip("H200 SXM", "cuda", 141 * GB, 989e12, 4800 * GB,
                 "nvidia.com H200 datasheet (989 TFLOP/s dense bf16, 141 GB HBM3e, 4.8 TB/s)"),
}
# What XLA's GPU compiler plans fusions, tiles and launch shapes with, per CUDA chip, when it
# compiles without one (NVIDIA's published specifications: SMs, shared memory per SM and per
# block opt-in, L2, boost clock, compute capability). Written as a GpuTargetConfigProto by
# `cuda_target_config`.
_CUDA_FACTS = {
    "h100": {"description": "NVIDIA H100 80GB HBM3", "sms": 132, "l2": 50 * 2**20},
    "h200": {"description": "NVIDIA H200", "sms": 132, "l2": 50 * 2**20},
}
_HOPPER = {"smem_per_sm": 228 * 2**10, "smem_per_block_optin": 227 * 2**10, "clock_ghz": 1.98,
           "capability": (9, 0)}
# The libtpu device kind of each TPU generation (what get_topology_desc's devices report).
_TPU_KINDS = {"v5e": "TPU v5 lite", "v6e": "TPU v6 lite"}
KNOWN_TARGETS = ("tpu:v5e", "tpu:v5e:2x2", "tpu:v6e", "tpu:v6e:2x2", "tpu:<gen>:<X>x<Y>",
                 "cuda", "cuda:h100", "cuda:h200", "cpu")


@dataclasses.dataclass(frozen=True)
class Target:
    """Where the programs are for: `platform` ("tpu", "cuda", "cpu"), the chip (its peaks,
    for the roofline and the memory verdict), and for TPU the slice ("2x2"; "1x1": one chip,
    what Colab gives)."""

    platform: str
    chip: Chip | None
    grid: tuple[int, int] = (1, 1)

    @property
    def name(self) -> str:
        if self.platform == "cpu":
            return "cpu"
        key = next(k for k, c in CHIPS.items() if c == self.chip)
        if self.platform == "cuda":
            return f"cuda:{key}"
        return f"tpu:{key}" + ("" if self.grid == (1, 1) else f":{self.grid[0]}x{self.grid[1]}")

    @property
    def num_devices(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def compiles(self) -> bool:
        """True: programs are compiled (memory and cost analysis); False: lowered only (CUDA
        without the `cuda-aot` extra: `cuda_compiles`)."""
        return self.platform in ("tpu", "cpu") or (self.platform == "cuda" and cuda_compiles())


def parse_target(text: str) -> Target:
    """"tpu:v5e" (one chip), "tpu:v5e:2x2", "tpu:v6e[:XxY]", "cuda[:h100|h200]", "cpu"."""
    parts = str(text).strip().lower().split(":")
    if parts == ["cpu"]:
        return Target("cpu", None)
    if parts[0] == "cuda" and len(parts) <= 2:
        chip = parts[1] if len(parts) == 2 else "h100"
        if CHIPS.get(chip) is not None and CHIPS[chip].platform == "cuda":
            return Target("cuda", CHIPS[chip])
    if parts[0] == "tpu" and len(parts) in (2, 3) and parts[1] in _TPU_KINDS:
        grid = (1, 1)
        if len(parts) == 3:
            m = re.fullmatch(r"(\d+)x(\d+)", parts[2])
            grid = (int(m.group(1)), int(m.group(2))) if m else (0, 0)
        if min(grid) >= 1:
            return Target("tpu", CHIPS[parts[1]], grid)
    raise TargetError(f"unknown target {text!r}: known targets are {', '.join(KNOWN_TARGETS)} "
                      f"(TPU generations: {', '.join(_TPU_KINDS)})")


def cuda_target_config(chip: str) -> str:
    """The GpuTargetConfigProto (text) XLA's GPU compiler compiles for `chip` with, no GPU
    present: the chip's facts (`_CUDA_FACTS`), its HBM size and bandwidth (`CHIPS`)."""
    f, c = {**_HOPPER, **_CUDA_FACTS[chip]}, CHIPS[chip]
    major, minor = f["capability"]
    return (
        "gpu_device_info {\n"
        "  threads_per_block_limit: 1024\n  threads_per_warp: 32\n"
        "  shared_memory_per_block: 49152\n"
        f"  shared_memory_per_core: {f['smem_per_sm']}\n"
        f"  shared_memory_per_block_optin: {f['smem_per_block_optin']}\n"
        "  threads_per_core_limit: 2048\n"
        f"  core_count: {f['sms']}\n  fpus_per_core: 128\n"
        "  block_dim_limit_x: 2147483647\n  block_dim_limit_y: 65535\n"
        "  block_dim_limit_z: 65535\n"
        f"  memory_bandwidth: {int(c.hbm_bytes_per_s)}\n  l2_cache_size: {f['l2']}\n"
        f"  clock_rate_ghz: {f['clock_ghz']}\n  device_memory_size: {c.hbm_bytes}\n"
        "  registers_per_core_limit: 65536\n  registers_per_block_limit: 65536\n"
        f"  cuda_compute_capability {{ major: {major} minor: {minor} }}\n"
        "}\n"
        'platform_name: "CUDA"\n'
        "dnn_version_info { major: 9 minor: 8 }\n"
        f'device_description_str: "{f["description"]}"\n')


@functools.cache
def _cuda_topology(chip: str):
    from jax.experimental import topologies

    return topologies.get_topology_desc(platform="cuda", topology="1x1x1",
                                        target_config=cuda_target_config(chip))


@functools.cache
def cuda_compiles() -> bool:
    """Whether XLA's GPU compiler is here to compile for CUDA without a GPU (the `cuda-aot`
    extra: JAX's CUDA plugin and ptxas, `requirements-cuda-aot.txt`, run with
    JAX_PLATFORMS=cpu); without it CUDA programs are lowered (`jax.export`) only."""
    try:
        _cuda_topology("h100")
    except Exception:  # no CUDA plugin: "topology not implemented for cuda"
        return False
    return True


@functools.cache
def target_devices(target: Target) -> tuple:
    """The devices programs for `target` are compiled against: the TPU topology's (from
    libtpu, no TPU needed), the CUDA chip's (XLA's GPU compiler with the chip's facts, no
    GPU needed; () without the `cuda-aot` extra: exported, not compiled), or this CPU's."""
    if target.platform == "cpu":
        return tuple(jax.devices("cpu"))
    if target.platform == "cuda":
        if not cuda_compiles():
            return ()
        chip = next(k for k, c in CHIPS.items() if c == target.chip)
        return tuple(_cuda_topology(chip).devices)
    compilation.quiet_libtpu()
    from jax.experimental import topologies

    gen = next(k for k, c in CHIPS.items() if c == target.chip)
    x, y = target.grid
    try:
        # One host holds at most 2x2 chips; a smaller slice is one host of that size.
        host = (min(x, 2), min(y, 2), 1)
        topo = topologies.get_topology_desc(platform="tpu", topology_name=f"{gen}:{x}x{y}",
                                            chips_per_host_bounds=host)
    except Exception as e:  # libtpu missing, or the topology refused
        raise TargetError(
            f"cannot describe TPU topology {gen}:{x}x{y} ({' '.join(str(e).split())[:300]}); "
            f"compiling for TPU needs libtpu matching JAX {jax.__version__}: pip install "
            f"-r requirements-tpu-aot.txt") from e
    return tuple(topo.devices)


# --------------------------------------------------------------------------- model shapes

# Llama-shaped models by name, for planning without weights (`random:<name>`). Public
# configs (the models' config.json on the Hugging Face Hub).
MODEL_SHAPES: dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig(vocab_size=49152, d_model=576, n_layers=30, n_heads=9,
                                n_kv_heads=3, head_dim=64, ffn_dim=1536, rope_theta=100000.0,
                                tie_embeddings=True, name="smollm2-135m"),
    "llama-3.2-1b": ModelConfig(vocab_size=128256, d_model=2048, n_layers=16, n_heads=32,
                                n_kv_heads=8, head_dim=64, ffn_dim=8192, rope_theta=500000.0,
                                tie_embeddings=True, max_position=131072,
                                name="llama-3.2-1b"),
    "llama-3.1-8b": ModelConfig(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32,
                                n_kv_heads=8, head_dim=128, ffn_dim=14336,
                                rope_theta=500000.0, max_position=131072, name="llama-3.1-8b"),
}


def shape_config(name: str, dtype: str = "bfloat16") -> ModelConfig:
    """The ModelConfig of a named shape ("llama-3.1-8b", or "random:llama-3.1-8b")."""
    key = name.removeprefix("random:")
    if key not in MODEL_SHAPES:
        raise TargetError(f"unknown model shape {name!r}: known shapes are "
                          f"{', '.join('random:' + k for k in MODEL_SHAPES)}")
    return dataclasses.replace(MODEL_SHAPES[key], dtype=dtype)


def scaled_exit_config(ec: ExitConfig, n_layers: int, from_layers: int
                       ) -> ExitConfig:
    """`ec`'s exits moved to a model of `n_layers` at the same fractions of depth (planning
    a model with no heads of its own the way the shipped ones are laid out)."""
    layers = sorted({max(1, min(n_layers - 1, round(e * n_layers / from_layers)))
                     for e in ec.exit_layers})
    return dataclasses.replace(ec, exit_layers=tuple(layers))


def shipped_exit_config(name: str = "smollm2-135m-instruct") -> ExitConfig | None:
    """The exit config of the heads shipped for registry model `name` (no heads loaded)."""
    path = registry.shipped_exit_heads(name)
    if path is None:
        return None
    d = json.loads((path / exit_checkpoint.CONFIG).read_text())["exit_config"]
    return ExitConfig(**{**d, "exit_layers": tuple(d["exit_layers"])})


def plan_model(name: str, dtype: str = "bfloat16") -> tuple[ModelConfig, ExitConfig | None]:
    """(config, exit config) to plan for, without weights: "random:<shape>" (a named shape,
    with the shipped SmolLM2 heads' exits at the same fractions of depth), a registry name or
    a .gguf file (its header; the registry's shipped exit config where it has one)."""
    if name.startswith("random:") or name in MODEL_SHAPES:
        cfg = shape_config(name, dtype)
        base = MODEL_SHAPES["smollm2-135m"]
        ec = shipped_exit_config()
        return cfg, None if ec is None else scaled_exit_config(ec, cfg.n_layers, base.n_layers)
    try:
        kind, path = registry.resolve_model(name)
    except Exception as e:  # not found: say what would be
        raise TargetError(f"cannot plan for model {name!r} ({e}); use a registry name "
                          f"({', '.join(registry.known_models())}), a .gguf file, or a shape: "
                          f"{', '.join('random:' + k for k in MODEL_SHAPES)}") from e
    if kind != "gguf":
        raise TargetError(f"planning reads a model's shape from a .gguf header; {name!r} is "
                          f"{kind}: use random:<shape> ({', '.join(MODEL_SHAPES)})")
    cfg = gguf.gguf_config(path, dtype)
    return cfg, shipped_exit_config(name)


def abstract_params(cfg: ModelConfig, blocks: dict[str, str] | None = None) -> llama.Params:
    """The model's parameters as shapes and dtypes only; `blocks` (key -> GGUF block kind,
    `gguf.served_blocks`): those weights in their blocks, as an engine serves the file."""
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, cfg.jnp_dtype),
                          llama.param_shapes(cfg))
    for key, kind in (blocks or {}).items():
        if key == "embed":
            params = params.replace(embed=quant.abstract_blocks(params.embed.shape, kind,
                                                                table=True))
        else:
            params = params.replace(layers=params.layers.replace(**{
                key: quant.abstract_blocks(params.weight(key).shape, kind)}))
    return params


def plan_blocks(name: str, quantize: str | None = None, *, file_blocks: bool = True
                ) -> dict[str, str]:
    """The weights a model named as `plan_model` takes is served in GGUF blocks (a .gguf or
    a registry GGUF: `gguf.served_blocks`, unless not `file_blocks`: dense; a random shape:
    none); quantize "int4": also every layer matmul weight the file does not hold in
    blocks, in Q4_1 blocks (what `load_model(quantize="int4")` holds)."""
    if quantize not in (None, "int4"):
        raise ValueError(f"compile plans quantize='int4' (GGUF Q4_1 blocks), not "
                         f"{quantize!r}: int8 weights are not planned ahead of time yet")
    held = {}
    if file_blocks and not (name.startswith("random:") or name in MODEL_SHAPES):
        kind, path = registry.resolve_model(name)
        held = gguf.served_blocks(path) if kind == "gguf" else {}
    if quantize == "int4":
        held = {**{k: "Q4_1" for k in quant.QUANTIZED_KEYS}, **held}
    return held


# --------------------------------------------------------------------------- programs

# The step variants a config can run: prefill and full-depth decode, then the exit policies
# with each back-fill mode ("all" stands for BatchExit, "per_row" for PerRow).
POLICIES = ("all", "per_row")
BACKFILLS = ("deferred", "propagate")
# the back-fills that read fitted maps, under the serving policy only (their step differs
# from the others' in the back-fill after the layers, not in the policy's loop)
MAP_BACKFILLS = ("learned", "deferred_learned")


def variants(ec: ExitConfig | None, every: bool = False
             ) -> list[tuple[str, ExitConfig | None]]:
    """(name, exit config) of the programs to build: full depth, and `ec` as given — or with
    `every`, `ec` under each policy and back-fill mode."""
    out: list[tuple[str, ExitConfig | None]] = [("full", None)]
    if ec is None or not ec.enabled:
        return out
    if not every:
        mode = f"verify{ec.max_draft}" if ec.verify else ec.backfill
        return [*out, (f"{ec.policy}/{mode}", ec)]
    return out + [(f"{p}/{b}", dataclasses.replace(ec, policy=p, backfill=b))
                  for p in POLICIES for b in BACKFILLS] + [
        (f"{SERVING_POLICY}/{b}", dataclasses.replace(ec, policy=SERVING_POLICY, backfill=b))
        for b in MAP_BACKFILLS]


@dataclasses.dataclass
class Row:
    """One compiled (or lowered) program: what it is, how long it took, what it needs."""

    variant: str  # "full", "all/deferred", ...
    shape: StepShape
    seconds: float
    flops: float | None = None
    bytes_accessed: float | None = None
    argument_bytes: int | None = None  # weights, heads, KV pool, inputs
    temp_bytes: int | None = None
    output_bytes: int | None = None
    alias_bytes: int | None = None  # outputs in donated inputs (the KV pool)
    error: str | None = None
    # bytes and flops as the program runs (`traffic.count` of its optimised HLO: a loop's
    # body times its trips), and the weight copies it holds; None where only lowered
    traffic: traffic_.Traffic | None = None

    @property
    def device_bytes(self) -> int | None:
        """Device memory the program needs: arguments + temporaries + outputs not aliased."""
        if self.argument_bytes is None:
            return None
        return self.argument_bytes + self.temp_bytes + self.output_bytes - self.alias_bytes


def indexed_excess(hlo_text: str) -> float:
    """Bytes XLA's generic HLO cost analysis (CPU programs, and CUDA's read through the CPU
    client) charges beyond what gathers and in-place scatters move: inside a fusion, a
    parameter whose only uses are gathers of it is charged whole (its
    `FusionParameterReadBytes` knows slices, not gathers), though each gather reads its
    output's worth (an exit check's gather of 8 candidate rows from the 8192-row head: 9.4 MB
    charged for 9.2 kB a row); a fusion whose root scatters into a parameter (the KV pool, a
    step's K/V write, in place) is charged the whole pool read and written, though it moves
    its updates (8 tokens into SmolLM2's 47 MB pool: 95 MB for 3 kB). Mirrors how the
    analysis walks the module: a while body once, a conditional as its costliest branch
    (which one is not known here, so its least over-charged branch: never too much off)."""
    bodies = hlo.computations(hlo_text)

    @functools.cache
    def fused(comp: str) -> float:  # bytes over-charged per call of a fused computation
        instrs = [i for i in hlo.instructions(bodies.get(comp, ())) if i.dims is not None]
        shapes = {i.name: i.nbytes for i in instrs}
        over = 0.0
        for i in instrs:
            if i.op == "parameter":
                read = _gathered(i.name, instrs)
                if read is not None:
                    over += max(0.0, shapes[i.name] - read * hlo.ITEMSIZE.get(i.dtype, 4))
        root = next((i for i in instrs if i.root), None)
        if root and root.op == "scatter":  # in place: the updates, not the whole pool
            ops = root.operands
            if len(ops) >= 3 and ops[0] in shapes and ops[2] in shapes and any(
                    i.name == ops[0] and i.op == "parameter" for i in instrs):
                updates = shapes[ops[2]]
                over += max(0.0, shapes[ops[0]] - updates) + max(0.0, shapes[root.name]
                                                                 - updates)
        return over

    @functools.cache
    def walk(comp: str) -> float:  # a computation the analysis runs: its fusions' excess
        total = 0.0
        for line in bodies.get(comp, ()):
            callees = re.findall(r"(?:calls|body|true_computation|false_computation)=%([\w.\-]+)"
                                 r"|branch_computations=\{([^}]*)\}", line)
            if " fusion(" in line:
                total += sum(fused(c) for c, _ in callees if c)
            elif " conditional(" in line:
                branches = [c for c, _ in callees if c] + [
                    b.strip().lstrip("%") for _, bs in callees if bs for b in bs.split(",")]
                total += min((walk(b) for b in branches), default=0.0)
            elif " while(" in line:
                total += sum(walk(c) for c, _ in callees if c)
        return total

    return walk("ENTRY")


def _gathered(value: str, instrs: list[hlo.Instr]) -> float | None:
    """Elements of `value` the computation reads if it reaches every use only as a gather's
    operand (through converts and bitcasts, which a fusion computes per element read);
    None if some use reads it otherwise."""
    users = [i for i in instrs if i.name != value and value in i.operands]
    if not users:
        return None
    total = 0.0
    for i in users:
        if i.op == "gather" and i.operands[0] == value:
            total += float(np.prod(i.dims or ()))
        elif i.op in ("convert", "bitcast"):
            inner = _gathered(i.name, instrs)
            if inner is None:
                return None
            total += inner
        else:
            return None
    return total


def cost_of(compiled) -> tuple[float | None, float | None]:
    """(flops, bytes accessed) from a compiled program's cost analysis; on CPU and CUDA
    less what its fused gathers and in-place scatters are over-charged (`indexed_excess`)."""
    ca = compiled.cost_analysis()
    if isinstance(ca, list):  # older JAX: one dict per partition
        ca = ca[0] if ca else None
    if not ca:  # compiled for CUDA without a GPU: the executable has no cost analysis of
        # its own ("not supported"), so XLA's HLO cost analysis runs on its optimised (fused)
        # module through the CPU client
        try:
            from jax._src.lib import _jax

            module = compiled.runtime_executable().hlo_modules()[0]
            ca = _jax.hlo_module_cost_analysis(jax.devices("cpu")[0].client, module)
        except Exception:
            ca = None
    if not ca:
        return None, None
    nbytes = float(ca.get("bytes accessed", 0.0))
    if _platform_of(compiled) in ("cpu", "gpu"):
        nbytes -= indexed_excess(compiled.as_text())
    return float(ca.get("flops", 0.0)), nbytes


def _platform_of(compiled) -> str | None:
    """The platform a compiled program was built for (its first input's devices)."""
    try:
        sharding = jax.tree.leaves(compiled.input_shardings)[0]
        return next(iter(sharding.device_set)).platform
    except Exception:
        return None


@dataclasses.dataclass
class Plan:
    """The engine's step programs for one model, config and target: the engine's own plan
    (`plan.engine_plan` on the target's platform, what an engine there would hold), the
    shapes to build and the exit variants to build them for."""

    engine: EnginePlan
    target: Target
    shapes: list[StepShape]
    programs: list[tuple[str, ExitConfig | None]]
    maps_rank: int = backfill_maps.DEFAULT_RANK  # the fitted maps' rank (back-fills with maps)
    # weights held in GGUF blocks, key -> kind (`plan_blocks`); empty: dense, cfg's dtype
    blocks: dict[str, str] = dataclasses.field(default_factory=dict)

    @classmethod
    def make(cls, cfg: ModelConfig, target: Target, config: EngineConfig,
             exit_config: ExitConfig | None = None, *,
             every_policy: bool = False, kinds: tuple[str, ...] = ("decode", "prefill"),
             blocks: dict[str, str] | None = None) -> Plan:
        """The programs an engine of `config` would run on `target`: its step shapes of
        `kinds`, full depth and `exit_config` (every policy and back-fill: `variants`)."""
        plan = engine_plan(cfg, config, target.platform)
        if target.platform != "cpu" and plan.mesh is not None and \
                plan.mesh.size > target.num_devices:
            raise TargetError(f"mesh {config.mesh} needs {plan.mesh.size} devices but target "
                              f"{target.name} has {target.num_devices}")
        return cls(plan, target, plan.step_shapes(kinds), variants(exit_config, every_policy),
                   blocks=dict(blocks or {}))

    @property
    def mesh(self) -> Mesh | None:
        """The engine's mesh on the target's devices (none for CUDA, compiled for one chip)."""
        if self.engine.mesh is None or self.target.platform == "cuda":
            return None
        return self.engine.mesh.make_mesh(target_devices(self.target))

    def runner(self, ec: ExitConfig | None) -> ModelRunner:
        """The engine's ModelRunner on abstract params, heads and cache, on the target."""
        plan, mesh = self.engine, self.mesh
        cfg = plan.model
        params = abstract_params(cfg, self.blocks)
        heads = None if ec is None else exit_heads.head_shapes(cfg, ec)
        if ec is not None and uses_maps(ec.backfill):
            heads = heads.replace(backfill=backfill_maps.map_shapes(cfg, ec.exit_layers,
                                                                    self.maps_rank))
        kv = jax.ShapeDtypeStruct(plan.kv_shape, jnp.dtype(plan.kv_dtype),
                                  sharding=None if mesh is None else cache_sharding(cfg, mesh))
        cache = KVCache(kv, kv, plan.head_major)
        devices = target_devices(self.target)
        return ModelRunner(cfg, params, cache, ec, heads, attention=plan.attention,
                           max_batch=plan.max_batch, mesh=mesh,
                           device=devices[0] if devices else jax.devices("cpu")[0],
                           platform=plan.platform, layout_shape=plan.layout_shape(ec is not None),
                           layer_layout=plan.layer_layout)

    def hand_bytes(self, shape: StepShape) -> float:
        """What a program of `shape` must move at least, at full depth (`roofline.step_bytes`):
        every weight once as the target holds it (GGUF blocks at their size, `for_platform`),
        its rows' K/V pages read as stored, its tokens' K/V written."""
        plan = self.engine
        held = None
        if self.blocks:  # a GGUF's (tied, SmolLM2's) model, each weight as the target holds it
            held = sum(float(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize
                       for a in jax.tree.leaves(quant.for_platform(
                           abstract_params(plan.model, self.blocks), plan.platform)))
        return roofline.step_bytes(
            plan.model, shape.batch, shape.pages, plan.page_size,
            new_tokens=shape.tokens if shape.kind == "prefill" else shape.batch,
            kv_itemsize=jnp.dtype(plan.kv_dtype).itemsize, kv_hd=plan.kv_shape[-1],
            weight_bytes=held)

    def pool_reads(self, shape: StepShape) -> dict:
        """What a kernel handed the KV pool reads of it a call (`traffic.count`): one of K
        and V, as stored, at the rows' pages (one layer's)."""
        plan = self.engine
        kv = plan.kv_shape
        page = plan.model.n_kv_heads * kv[-1] * jnp.dtype(plan.kv_dtype).itemsize
        return dict(pool_elements=int(np.prod(kv)),
                    pool_read=float(shape.batch * shape.pages * plan.page_size * page))

    def __len__(self) -> int:
        return len(self.items())

    def items(self) -> list[tuple[str, ExitConfig | None, StepShape]]:
        """(variant, exit config, shape) of every program: prefill only at full depth."""
        out = []
        for name, ec in self.programs:
            out += [(name, ec, s) for s in self.shapes
                    if s.kind == "decode" or ec is None]
        return out

    def compile(self, workers: int | None = None) -> Iterator[Row]:
        """Compile (TPU, CPU) or export (CUDA) every program, one Row each, in order; a
        program that fails gives a Row with its error (the rest still run). XLA's compiles
        run on `workers` threads (`compilation.pipelined`)."""
        runners: dict[str, ModelRunner] = {}

        def lower(item):
            name, ec, shape = item
            if name not in runners:
                runners[name] = self.runner(ec)
            return name, shape, _lower(runners[name], shape, self.target)

        def finish(lowered):
            name, shape, (program, seconds, error) = lowered
            return _finish(name, shape, self.target, program, seconds, error,
                           self.pool_reads(shape))

        yield from compilation.pipelined(self.items(), lower, finish, workers)


def _lower(runner: ModelRunner, shape: StepShape, target: Target):
    """(lowered program or None, seconds, error or None): traced and lowered for `target`
    (exported for CUDA, which ends there)."""
    t0 = time.perf_counter()
    try:
        if target.compiles:
            return runner.lower(shape), time.perf_counter() - t0, None
        export_cuda(runner, shape)
        return None, time.perf_counter() - t0, None
    except Exception as e:  # reported per program, with its message
        return None, time.perf_counter() - t0, _message(e)


def _message(e: Exception) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"


def _finish(variant: str, shape: StepShape, target: Target, lowered, seconds: float,
            error: str | None, pool: dict | None = None) -> Row:
    """The Row of a lowered program: compiled, with its cost and memory analyses."""
    if lowered is None or error is not None:
        return Row(variant, shape, seconds, error=error)
    t0 = time.perf_counter()
    try:
        compiled = lowered.compile()
    except Exception as e:
        return Row(variant, shape, seconds + time.perf_counter() - t0, error=_message(e))
    row = Row(variant, shape, seconds + time.perf_counter() - t0)
    row.flops, row.bytes_accessed = cost_of(compiled)
    try:
        row.traffic = traffic_.count(compiled.as_text(), **(pool or {}))
    except Exception:  # a module the reader does not follow: its columns read "-"
        row.traffic = None
    mem = compiled.memory_analysis()
    if mem is not None:
        row.argument_bytes = int(mem.argument_size_in_bytes)
        row.temp_bytes = int(mem.temp_size_in_bytes)
        row.output_bytes = int(mem.output_size_in_bytes)
        row.alias_bytes = int(mem.alias_size_in_bytes)
    return row


def build(runner: ModelRunner, shape: StepShape, target: Target, variant: str = "") -> Row:
    """One step program of `runner` for `target`: compiled, or exported for CUDA."""
    return _finish(variant, shape, target, *_lower(runner, shape, target))


# The Pallas GPU kernels lower to this custom call; jax.export refuses custom calls it does
# not know to be stable unless told (the kernel is compiled from its Triton IR on the GPU).
TRITON_CALL = "__gpu$xla.gpu.triton"


def export_cuda(runner: ModelRunner, shape: StepShape):
    """The step of `shape` exported for CUDA (`jax.export.Exported`): traced and lowered with
    CUDA's lowering rules (the Pallas GPU kernel included), not compiled. `runner` is one
    built for the GPU (`Plan.runner` of a CUDA target): its step's backend and platform are
    its static config's, so this only lowers what it traces."""
    from jax import export

    if runner.program.config.platform not in ("gpu", "cuda"):
        raise ValueError(f"export_cuda needs a runner built for the GPU (platform='gpu'), "
                         f"got one built for {runner.program.config.platform!r}")

    buf = jax.ShapeDtypeStruct((shape.size,), jnp.int32)
    args = [runner.params, runner.exit_heads, runner.cache, buf, runner.last_tokens,
            runner.pending]
    args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)
    return export.export(
        runner._step, platforms=("cuda",),
        disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON_CALL)])(shape, *args)


# --------------------------------------------------------------------------- memory


@dataclasses.dataclass(frozen=True)
class Memory:
    """Device memory per chip of a config: weights, KV pool, the largest program's
    temporaries, against the chip's HBM."""

    weights: int
    kv_pool: int
    temporaries: int
    hbm: int
    devices: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_pool + self.temporaries

    @property
    def fits(self) -> bool:
        return self.total <= self.hbm

    def verdict(self) -> str:
        gib = 2**30
        what = (f"{self.total / gib:.2f} GiB per chip (weights {self.weights / gib:.2f}, KV "
                f"pool {self.kv_pool / gib:.2f}, temporaries {self.temporaries / gib:.2f}) of "
                f"{self.hbm / gib:.0f} GiB HBM")
        if self.fits:
            return f"fits: {what}"
        return (f"DOES NOT FIT: {what}; shard over more chips (--mesh tp=N on a larger slice), "
                f"lower --max-num-seqs / --max-model-len / --num-pages, or quantize")


def tree_bytes(tree) -> int:
    return int(sum(np.prod(a.shape) * jnp.dtype(a.dtype).itemsize
                   for a in jax.tree.leaves(tree)))


def memory(plan: Plan, rows: list[Row]) -> Memory | None:
    """Memory per chip: weights and KV pool split over the mesh's tp (KV heads where tp
    divides them), temporaries from the compiled programs (None when none compiled)."""
    if plan.target.chip is None:
        return None
    engine = plan.engine
    cfg, mesh = engine.model, engine.mesh or MeshSpec()
    weights = tree_bytes(abstract_params(cfg)) // mesh.tp
    kv_tp = mesh.tp if cfg.n_kv_heads % mesh.tp == 0 else 1
    kv = 2 * int(np.prod(engine.kv_shape)) * jnp.dtype(engine.kv_dtype).itemsize // kv_tp
    temps = [r.temp_bytes for r in rows if r.temp_bytes is not None]
    return Memory(weights, kv, max(temps, default=0), plan.target.chip.hbm_bytes, mesh.size)


__all__ = ["CHIPS", "KNOWN_TARGETS", "MODEL_SHAPES", "Chip", "Memory", "Plan", "Row",
           "Target", "TargetError", "abstract_params", "build", "export_cuda", "memory",
           "parse_target", "plan_model", "scaled_exit_config", "shape_config",
           "target_devices", "variants"]
