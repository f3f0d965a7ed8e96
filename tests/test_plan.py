"""One engine plan (`plan.engine_plan`): an engine and `ee-jax compile` given the same model,
config and platform hold the same plan value, and so run the same rules (mesh and backend, KV
layout, dtype and page count, buckets, page ladder); the plan's rules are checked here once."""

from __future__ import annotations

import dataclasses

import jax
import pytest

from ee_jax.cli import _engine_kwargs, build_parser
from ee_jax.models.exits.config import ExitConfig
from ee_jax.serving.aot import compile as aot
from ee_jax.serving.engine import LLMEngine
from ee_jax.serving.kv_cache import cache_shape
from ee_jax.serving.plan import EngineConfig, EnginePlan, device_platform, engine_plan
from ee_jax.serving.scheduler import SchedulerConfig
from ee_jax.serving.sharding import MeshError, MeshSpec
from ee_jax.testing import tiny_model

CFG, PARAMS = tiny_model(seed=3)
EC = ExitConfig(exit_layers=(1, 2), threshold=0.5, policy="per_row")


@pytest.mark.parametrize("knobs", [
    dict(max_num_seqs=4, max_model_len=64, page_size=8),
    dict(max_num_seqs=2, max_model_len=32, page_size=4, kv_cache_gib=1e-4, attention="reference",
         batch_buckets=(2,), kv_dtype="bfloat16"),
])
def test_engine_and_compile_build_one_plan(knobs):
    """The engine on this CPU and `ee-jax compile --target cpu` (`aot.Plan.make`): equal
    plans, and the compile's runner holds the pool the engine allocates."""
    config = EngineConfig.make(**knobs)
    engine = LLMEngine(CFG, PARAMS, None, config, EC)
    compiled = aot.Plan.make(CFG, aot.parse_target("cpu"), config, EC)
    assert isinstance(engine.plan, EnginePlan)
    assert compiled.engine == engine.plan
    assert hash(compiled.engine) == hash(engine.plan)  # a value: static, hashable
    runner = compiled.runner(EC)
    assert runner.cache.k.shape == engine.runner.cache.k.shape == engine.plan.kv_shape
    assert runner.cache.k.dtype == engine.runner.cache.k.dtype
    assert runner.program.config.attention == engine.runner.program.config.attention
    assert compiled.shapes == engine.scheduler.config.step_shapes()


def test_compile_command_plans_what_the_engine_serves():
    """`ee-jax compile` and `ee-jax generate` given the same flags (or none) plan one engine:
    the flags' defaults agree, and the knobs compile has not are the config's defaults."""
    parser = build_parser()
    smollm2 = aot.shape_config("random:smollm2-135m")  # a context for the default 2048 tokens
    for flags in ([], ["--max-num-seqs", "4", "--max-model-len", "64", "--page-size", "8",
                       "--attention", "xla"]):
        compiled = EngineConfig.make(**_engine_kwargs(parser.parse_args(
            ["compile", "--target", "cpu", *flags])))
        served = EngineConfig.make(**_engine_kwargs(parser.parse_args(["generate", *flags])))
        assert engine_plan(smollm2, compiled, "cpu") == engine_plan(smollm2, served, "cpu")


def test_the_plans_rules():
    """auto picks by platform, the reference under a mesh of several devices; the pool is
    head-major where a Pallas kernel reads it, stored f32 on CPU; GPU batches start at two
    rows; a decode page table of one width where attention follows the rows' lengths."""
    config = EngineConfig.make(max_num_seqs=4, max_model_len=64, page_size=8)
    cpu, gpu, tpu = (engine_plan(CFG, config, p) for p in ("cpu", "cuda", "tpu"))
    assert (cpu.attention, gpu.attention, tpu.attention) == ("xla", "pallas_gpu", "pallas_tpu")
    assert gpu.platform == "gpu" == device_platform("CUDA")
    assert (cpu.head_major, gpu.head_major, tpu.head_major) == (False, True, True)
    assert min(gpu.scheduler.buckets) == 2 and min(cpu.scheduler.buckets) == 1
    assert cpu.scheduler.decode_page_ladder is False  # xla's cost follows the lengths
    assert gpu.scheduler.decode_page_ladder is True
    assert tpu.kv_shape == cache_shape(CFG, tpu.num_pages, 8, "tpu", head_major=True)
    bf16 = dataclasses.replace(config, kv_dtype="bfloat16")
    assert engine_plan(CFG, bf16, "cpu").kv_dtype == "float32"  # kv_cache.storage_dtype
    assert engine_plan(CFG, bf16, "tpu").kv_dtype == "bfloat16"
    # what the config says stays said
    given = EngineConfig.make(max_num_seqs=4, max_model_len=64, page_size=8,
                              batch_buckets=(1, 4), decode_page_ladder=True)
    assert engine_plan(CFG, given, "gpu").scheduler.buckets == (1, 4)
    assert engine_plan(CFG, given, "cpu").scheduler.decode_page_ladder is True
    # under a mesh of several devices: the reference, layer-major
    sharded = engine_plan(CFG, dataclasses.replace(config, mesh="tp=2"), "tpu")
    assert sharded.mesh == MeshSpec(tp=2)
    assert (sharded.attention, sharded.head_major) == ("reference", False)
    with pytest.raises(MeshError, match="does not divide"):
        engine_plan(CFG, dataclasses.replace(config, mesh="tp=3"), "cpu")


def test_the_plan_refuses_what_cannot_serve():
    with pytest.raises(ValueError, match="exceeds the model's context length"):
        engine_plan(CFG, EngineConfig.make(max_model_len=CFG.max_position + 1), "cpu")
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        engine_plan(CFG, EngineConfig.make(max_model_len=64, page_size=8, num_pages=8), "cpu")
    # the page count: max_num_seqs requests of max_model_len and the null page, within
    # kv_cache_gib
    plan = engine_plan(CFG, EngineConfig.make(max_num_seqs=4, max_model_len=64, page_size=8),
                       "cpu")
    assert plan.num_pages == 4 * 8 + 1


def test_engine_config_takes_the_scheduler_knobs_flat():
    config = EngineConfig.make(max_num_seqs=8, attention="xla", mixed_steps=False)
    assert config.scheduler == SchedulerConfig(max_num_seqs=8, mixed_steps=False)
    assert config.attention == "xla"
    # over a scheduler config given, and as a mapping of its fields
    base = SchedulerConfig(page_size=8)
    assert EngineConfig.make(scheduler=base, max_num_seqs=4).scheduler == \
        SchedulerConfig(page_size=8, max_num_seqs=4)
    assert EngineConfig.make(scheduler={"page_size": 8}).scheduler == base
    with pytest.raises(TypeError, match=r"unknown settings \['max_num_seq'\]"):
        EngineConfig.make(max_num_seq=8)


def test_a_mesh_needs_its_spec_and_devices():
    mesh = MeshSpec(tp=1).make_mesh(jax.devices()[:1])
    with pytest.raises(MeshError, match=r"EngineConfig\.mesh is None"):
        LLMEngine(CFG, PARAMS, None, EngineConfig.make(max_model_len=64), mesh=mesh)
