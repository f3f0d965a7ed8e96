"""The accelerator path, checked without an accelerator (none is lent): every step program of a
tiny config compiles for a TPU topology (libtpu, ahead of time on this CPU host) and lowers
for CUDA (`jax.export`, the Pallas GPU kernel included); block shapes the kernels' compilers
refuse are refused here too, and the backends' shape rules agree with those compilers.

The truths are the compilers' own: Mosaic (TPU) and the Triton lowering (CUDA). Without
libtpu (the `tpu-aot` extra, `requirements-tpu-aot.txt`) the TPU tests skip, each saying why.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ee_jax.models.exits.config import ExitConfig
from ee_jax.random_model import random_config
from ee_jax.serving import attention_kernels
from ee_jax.serving.aot import compile as aot
from ee_jax.serving.plan import EngineConfig, engine_plan
from ee_jax.serving.scheduler import default_batch_buckets

HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
needs_libtpu = pytest.mark.skipif(
    not HAS_LIBTPU, reason="libtpu is not installed (pip install -r requirements-tpu-aot.txt): "
    "TPU programs cannot be compiled here")

# Tiny, but with a head_dim of 128 so that the Pallas TPU kernel applies (SmolLM2's 64 does
# not: see test_tpu_kernel_rule_agrees_with_mosaic).
CFG = random_config(vocab_size=256, d_model=64, n_heads=4, n_kv_heads=2, head_dim=128,
                    ffn_dim=128, n_layers=3, dtype="bfloat16")
EC = ExitConfig(exit_layers=(1, 2), head="mlp", measure="candidates", adapter_rank=8,
                      vocab_subset=64, threshold=0.9, policy="per_row")
CONFIG = EngineConfig.make(max_num_seqs=2, max_model_len=32, max_num_batched_tokens=64,
                           max_prefill_chunk=32)


def _plan(target: str, attention: str = "auto") -> aot.Plan:
    plan = aot.Plan.make(CFG, aot.parse_target(target),
                         dataclasses.replace(CONFIG, attention=attention), EC, every_policy=True)
    # one decode and one prefill shape: every variant, without every bucket
    decode = next(s for s in plan.shapes if s.kind == "decode" and s.batch == 2)
    prefill = next(s for s in plan.shapes if s.kind == "prefill")
    return dataclasses.replace(plan, shapes=[decode, prefill])


def test_unknown_targets_and_shapes_name_the_known_ones():
    for bad in ("tpu:v9x", "rocm", "tpu:v5e:2by2", "cuda:a100", ""):
        with pytest.raises(aot.TargetError, match=r"known targets are .*tpu:v5e:2x2"):
            aot.parse_target(bad)
    with pytest.raises(aot.TargetError, match=r"random:llama-3\.1-8b"):
        aot.plan_model("random:llama-9")
    assert aot.parse_target("tpu:v5e:2x2").num_devices == 4
    assert aot.parse_target("TPU:V6E").grid == (1, 1)
    assert aot.parse_target("cuda").chip is aot.CHIPS["h100"]


def test_plan_holds_every_variant():
    plan = _plan("cuda")
    names = [name for name, _, _ in plan.items()]
    assert sorted(set(names)) == ["all/deferred", "all/propagate", "full", "per_row/deferred",
                                  "per_row/deferred_learned", "per_row/learned",
                                  "per_row/propagate"]
    # prefill only at full depth: 7 decode programs and 1 prefill program
    assert len(names) == 8


@needs_libtpu
def test_every_step_program_compiles_for_tpu():
    """Prefill, BatchExit under deferred and PerRow under the back-fill that holds the
    others' code (deferred_learned: the projection at the exit, deferred's pending token and
    the maps; "learned" is the same code less the pending token, "propagate" less the maps
    too), bf16, for one TPU v5e chip, with the Pallas kernel (the XLA attention path:
    prefill, and `test_smollm2_shaped_decode_compiles_with_pallas_tpu`'s unpadded call). Left
    out for CI time, ~9-12 s of libtpu each: BatchExit under propagate, PerRow under
    propagate, deferred and learned, and full-depth decode (compiled for v5e by test_traffic's
    hand-count test and the runner-layout tests here); the CUDA lowering test takes every
    program."""
    attention = "pallas_tpu"
    whole = _plan("tpu:v5e", attention)
    kept = ("all/deferred", "per_row/deferred_learned")
    decode = [s for s in whole.shapes if s.kind == "decode"]
    prefill = [s for s in whole.shapes if s.kind == "prefill"]
    plan = dataclasses.replace(whole, programs=[p for p in whole.programs if p[0] in kept],
                               shapes=decode)
    full = dataclasses.replace(whole, programs=[p for p in whole.programs if p[0] == "full"],
                               shapes=prefill)
    rows = list(plan.compile()) + list(full.compile())
    failed = [(r.variant, r.shape, r.error) for r in rows if r.error]
    assert not failed
    assert len(rows) == 3  # two decode programs and the prefill
    for r in rows:  # the compiler's own analyses came back
        assert r.flops > 0 and r.bytes_accessed > 0 and r.temp_bytes is not None
    # the kernel is in the program where it applies (decode), and not with xla
    runner = plan.runner(None)
    text = runner.lower(decode[0]).as_text()  # the runner's StepConfig: platform "tpu"
    assert "tpu_custom_call" in text


@needs_libtpu
def test_step_compiles_for_a_v5e_slice_under_a_mesh():
    plan = aot.Plan.make(CFG, aot.parse_target("tpu:v5e:2x2"),
                         dataclasses.replace(CONFIG, mesh="tp=2,dp=2"), None,
                         kinds=("decode",))
    assert plan.mesh.devices.shape == (2, 2)
    row = aot.build(plan.runner(None), plan.shapes[0], plan.target, "full")
    assert row.error is None, row.error
    assert row.flops > 0


def _tpu_kernel_compiles(head_dim: int, dtype=jnp.bfloat16) -> tuple[bool, str]:
    """Compile JAX's Pallas TPU paged-attention kernel for one v5e chip at SmolLM2's other
    shapes (3 kv heads, 9 query heads, pages of 16, batch 8 of 64 pages)."""
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    dev = aot.target_devices(aot.parse_target("tpu:v5e"))[0]
    s = jax.sharding.SingleDeviceSharding(dev)
    B, H, K, S, W, P = 8, 9, 3, 16, 64, 8 * 64

    def sds(shape, dt):
        return jax.ShapeDtypeStruct(shape, dt, sharding=s)

    fn = jax.jit(functools.partial(paged_attention, pages_per_compute_block=8))
    try:
        fn.lower(sds((B, H, head_dim), dtype), sds((K, P, S, head_dim), dtype),
                 sds((K, P, S, head_dim), dtype), sds((B,), jnp.int32),
                 sds((B, W), jnp.int32)).compile()
    except Exception as e:  # the compiler's refusal is the answer
        return False, str(e)
    return True, ""


@needs_libtpu
def test_tpu_kernel_rule_agrees_with_mosaic():
    """A deliberately bad block shape (head_dim 64) is refused by Mosaic, and the backend's
    rule says so before lowering; head_dim 128 compiles and the rule allows it."""
    ok, err = _tpu_kernel_compiles(64)
    assert not ok and "divisible by 8 and 128" in err
    assert not attention_kernels.tpu_kernel_fits(64)
    ok, err = _tpu_kernel_compiles(128)
    assert ok, err
    assert attention_kernels.tpu_kernel_fits(128)


@needs_libtpu
def test_smollm2_shaped_decode_compiles_with_pallas_tpu():
    """The defect the roofline found: pallas_tpu on SmolLM2's head_dim 64 failed in Mosaic. The
    TPU cache is stored at head_dim 128 (`kv_cache.storage_head_dim`), so the engine's decode
    step runs the kernel there, and it compiles; called on a head_dim-64 cache, the backend
    itself still takes the XLA path (decided from shapes at trace time)."""
    from ee_jax.serving.attention import AttentionMetadata
    from ee_jax.serving.kv_cache import KVCache

    cfg = dataclasses.replace(CFG, n_heads=9, n_kv_heads=3, head_dim=64)
    plan = aot.Plan.make(cfg, aot.parse_target("tpu:v5e"),
                         dataclasses.replace(CONFIG, attention="pallas_tpu"), None,
                         kinds=("decode",))
    runner = plan.runner(None)
    assert runner.cache.k.shape[-1] == 128
    row = aot.build(runner, plan.shapes[0], plan.target, "full")
    assert row.error is None, row.error
    assert "tpu_custom_call" in runner.lower(plan.shapes[0]).as_text()
    sds = jax.ShapeDtypeStruct
    narrow = KVCache(*(sds((1, 9, 16, 3, 64), jnp.bfloat16) for _ in range(2)))
    meta = AttentionMetadata(sds((2, 1), jnp.int32), sds((2, 4), jnp.int32),
                             sds((2,), jnp.int32))
    text = jax.jit(lambda q, c, m: attention_kernels.pallas_tpu(q, c, 0, m)).lower(
        sds((2, 1, 9, 64), jnp.bfloat16), narrow, meta).as_text()
    assert "tpu_custom_call" not in text
    # deferred's decode step carries each row's pending token as a second query: the kernel
    # takes it as a row of its own (no XLA fallback); a prefill block's queries take xla
    wide = KVCache(*(sds((1, 9, 16, 3, 128), jnp.bfloat16) for _ in range(2)))
    for T, kernel in ((2, True), (attention_kernels.KERNEL_MAX_QUERIES + 1, False)):
        m = AttentionMetadata(sds((2, T), jnp.int32), sds((2, 4), jnp.int32),
                              sds((2,), jnp.int32))
        text = jax.jit(lambda q, c, m: attention_kernels.pallas_tpu(q, c, 0, m)).trace(
            sds((2, T, 9, 128), jnp.bfloat16), wide, m).lower(
            lowering_platforms=("tpu",)).as_text()
        assert ("tpu_custom_call" in text) == kernel, T


def test_every_step_program_lowers_for_cuda_with_the_pallas_gpu_kernel():
    plan = _plan("cuda")
    assert plan.engine.attention == "pallas_gpu"
    runners = {}
    for name, ec, shape in plan.items():
        runner = runners.setdefault(name, plan.runner(ec))
        exported = aot.export_cuda(runner, shape)
        assert exported.platforms == ("cuda",)
        if shape.kind == "decode":  # the Triton kernel is in the module
            assert aot.TRITON_CALL in exported.mlir_module()


needs_cuda_aot = pytest.mark.skipif(
    not aot.cuda_compiles(), reason="JAX's CUDA plugin and ptxas are not installed (the "
    "cuda-aot venv: make roofline, requirements-cuda-aot.txt, JAX_PLATFORMS=cpu): CUDA "
    "programs are exported above, not compiled")


@needs_cuda_aot
def test_every_step_program_compiles_for_cuda():
    """With the cuda-aot extra XLA's GPU compiler builds every step program for an H100
    without one (the Pallas GPU kernel's Triton call compiled to PTX and through ptxas), and
    the fused programs have a cost and a memory analysis."""
    plan = _plan("cuda")
    assert plan.target.compiles and plan.engine.attention == "pallas_gpu"
    rows = list(plan.compile(workers=1))
    assert len(rows) == len(plan) and [r.error for r in rows] == [None] * len(rows)
    for r in rows:
        assert r.flops > 0 and r.bytes_accessed > 0 and r.argument_bytes > 0


@needs_cuda_aot
def test_cuda_steps_hold_their_layers_per_layer_and_copy_no_layer_weight():
    """The plan holds a GPU's layers per layer and its exit heads per exit
    (`llama.layout_for`); compiled for an H100, a step of every kind (prefill, full-depth
    decode, each exit policy and back-fill, verified exits) at batch 2 and 8 copies no layer
    weight and no exit head's weight out of a stack (`aot.traffic`'s copies of a weight's
    shape), where the stacked layout copies one a weight (XLA GPU's
    `loop_dynamic_slice_fusion`)."""
    from ee_jax.models.exits.heads import EXIT_PARTS, head_shapes
    from ee_jax.models.exits.heads import per_exit as exit_heads_per_exit
    from ee_jax.serving import hlo
    from ee_jax.serving.aot import traffic

    # rank 32: the stacked heads' [D, r] matrices are copied out at this size (at EC's 8,
    # XLA reads them in place either way), so the count below can see what per exit removes
    exits = dataclasses.replace(EC, adapter_rank=32)
    heads = head_shapes(CFG, exits)
    layer_shapes = {tuple(a.shape[1:]) for a in jax.tree.leaves(
        aot.abstract_params(CFG).layers)}
    head_shapes_ = {tuple(a.shape[1:]) for n in EXIT_PARTS
                    for a in jax.tree.leaves(getattr(heads, n)) if a.ndim > 2}  # GEMM operands

    def squeezed(dims) -> tuple:
        return tuple(d for d in dims if d != 1)

    def copies(text: str) -> tuple[int, int]:
        """(layer weights, exit heads' weights) copied out of a stack in a compiled program."""
        bodies = hlo.computations(text)
        n = [0, 0]
        for lines in bodies.values():
            for i in hlo.instructions(lines):
                callee = traffic._CALLEE.findall(i.rest) if i.op == "fusion" else []
                inner = hlo.instructions(bodies.get(callee[0], ())) if callee else []
                by = {x.name: x for x in inner}
                root = next((x for x in inner if x.root), None)
                if root is None or root.dims is None or not traffic._slice_copy(inner, by, root):
                    continue
                for k, shapes in enumerate((layer_shapes, head_shapes_)):
                    n[k] += squeezed(root.dims) in {squeezed(s) for s in shapes}
        return n[0], n[1]

    target = aot.parse_target("cuda:h100")
    config = dataclasses.replace(CONFIG, scheduler=dataclasses.replace(
        CONFIG.scheduler, max_num_seqs=8))
    seen_stacked_heads = False
    for layout in ("per_layer", "stacked"):
        plan = aot.Plan.make(CFG, target, dataclasses.replace(config, layer_layout=layout),
                             exits, every_policy=layout == "per_layer")
        assert plan.engine.layer_layout == layout
        if layout == "per_layer":
            plan = dataclasses.replace(plan, programs=[*plan.programs,
                                                       ("verified", exits.verified(2))])
        shapes = [s for s in plan.shapes if (s.kind == "decode" and s.batch in (2, 8))
                  or s is next(t for t in plan.shapes if t.kind == "prefill")]
        for name, ec, shape in dataclasses.replace(plan, shapes=shapes).items():
            if layout == "stacked" and not (name == "full" or (
                    name.startswith("per_row") and shape.kind == "decode" and shape.batch == 8)):
                continue
            lowered, _, error = aot._lower(plan.runner(ec), shape, target)
            assert error is None, (name, shape, error)
            layers, head = copies(lowered.compile().as_text())
            if layout == "per_layer":
                assert (layers, head) == (0, 0), (name, shape)
            elif name == "full":
                assert layers > 0, (name, shape)  # why: the stacked layout's copies
            else:  # the count sees a stacked head's copies
                assert not exit_heads_per_exit(plan.runner(ec).exit_heads) and head > 0, name
                seen_stacked_heads = True
    assert seen_stacked_heads


@needs_cuda_aot
def test_cuda_compiled_bytes_are_the_fused_programs():
    """The bytes of a CUDA program compiled here are the optimised module's: a chain of
    elementwise ops fuses into one kernel that reads x and writes y once, where the
    pre-optimisation HLO (what lowering alone can count) charges every op's read and write."""
    dev = aot.target_devices(aot.parse_target("cuda:h100"))[0]
    x = jax.ShapeDtypeStruct((4096, 1024), jnp.bfloat16,
                             sharding=jax.sharding.SingleDeviceSharding(dev))

    def f(x):
        return jnp.tanh(x * 2 + 1) * 3

    _, fused = aot.cost_of(jax.jit(f).lower(x).compile())
    size = 4096 * 1024 * 2
    assert fused == pytest.approx(2 * size, rel=0.01)
    plain = jax.ShapeDtypeStruct(x.shape, x.dtype)
    unfused = jax.jit(f).trace(plain).lower(lowering_platforms=("cuda",)).cost_analysis()
    assert unfused["bytes accessed"] >= 2 * fused


@needs_cuda_aot
def test_gpu_smallest_bucket_reads_each_weight_once():
    """Why the engine's GPU buckets start at two rows (`scheduler.default_batch_buckets`):
    XLA's GPU compiler turns a one-row product into a multiply that writes the [D, F]
    product and a reduction that reads it back, ~3x the weights; at the smallest GPU bucket
    SmolLM2's MLP reads its weights once (the operands' bytes by hand)."""
    dev = aot.target_devices(aot.parse_target("cuda:h100"))[0]
    s = jax.sharding.SingleDeviceSharding(dev)
    D, F = 576, 1536
    w = jax.ShapeDtypeStruct((D, F), jnp.bfloat16, sharding=s)
    wd = jax.ShapeDtypeStruct((F, D), jnp.bfloat16, sharding=s)

    def mlp(x, wg, wu, wd):
        return (jax.nn.silu(x @ wg) * (x @ wu)) @ wd

    def counted(rows):
        x = jax.ShapeDtypeStruct((rows, D), jnp.bfloat16, sharding=s)
        return aot.cost_of(jax.jit(mlp).lower(x, w, w, wd).compile())[1]

    weights = 3 * D * F * 2
    assert counted(1) > 2 * weights
    rows = min(default_batch_buckets("gpu"))
    assert rows == 2 and counted(rows) == pytest.approx(weights, rel=0.1)


def test_gpu_steps_run_one_row_at_two():
    """The engine's rule as every GPU program is built from it: no one-row step on GPU (a
    one-row request pads to two), one-row steps elsewhere."""
    assert 1 not in {s.batch for s in _full_plan("cuda").shapes}
    assert 1 in {s.batch for s in _full_plan("tpu:v5e").shapes}
    for platform, smallest in (("gpu", 2), ("cuda", 2), ("cpu", 1)):
        plan = engine_plan(CFG, EngineConfig(), platform)
        assert plan.scheduler.batch_bucket(1) == smallest
    # buckets given are kept as given, on GPU too
    given = EngineConfig.make(max_num_seqs=4, batch_buckets=(1, 4))
    assert engine_plan(CFG, given, "gpu").scheduler.batch_bucket(1) == 1


def _compile(lowered, target: str):
    """Compiled as the served program is: the suite runs XLA CPU with its older emitter
    (tests/conftest.py, for compile time), which expands a scatter into a while loop whose
    cost analysis counts one trip; ee-jax serves with XLA's default, the fusion emitters."""
    return lowered.compile(compiler_options={"xla_cpu_use_fusion_emitters": True}
                           if target == "cpu" else None)


def _full_plan(target: str) -> aot.Plan:
    return aot.Plan.make(CFG, aot.parse_target(target), CONFIG, EC)


@pytest.mark.parametrize("target", ["cpu", pytest.param("cuda:h100", marks=needs_cuda_aot)])
def test_fused_gathers_are_charged_what_they_read(target):
    """XLA's generic cost analysis charges a fused gather's table whole; `aot.cost_of`
    charges the rows it reads (8 candidates a row of an 8192-row head, as an exit check
    scores them), and a table also read whole stays charged whole."""
    dev = jax.devices("cpu")[0] if target == "cpu" else \
        aot.target_devices(aot.parse_target(target))[0]
    s = jax.sharding.SingleDeviceSharding(dev)
    V, D, B, C = 8192, 576, 2, 8
    table = jax.ShapeDtypeStruct((V, D), jnp.bfloat16, sharding=s)
    ids = jax.ShapeDtypeStruct((B, C), jnp.int32, sharding=s)
    x = jax.ShapeDtypeStruct((B, D), jnp.float32, sharding=s)

    def scores(t, i, x):  # [B, C]
        return (jnp.take(t, i, axis=0).astype(jnp.float32) * x[:, None, :]).sum(-1)

    def scores_and_norm(t, i, x):
        return scores(t, i, x), jnp.sum(t.astype(jnp.float32) ** 2)

    read = B * C * D * 2 + B * C * 4 + B * D * 4 + B * C * 4  # rows, ids, x, out
    _, nbytes = aot.cost_of(_compile(jax.jit(scores).lower(table, ids, x), target))
    assert read <= nbytes < V * D * 2 / 50  # CPU: also its f32 [B, C, D] product
    _, whole = aot.cost_of(_compile(jax.jit(scores_and_norm).lower(table, ids, x), target))
    assert whole >= V * D * 2
    # a conditional is charged as its costlier branch: a gather in one never discounts the
    # other's whole read
    other = jax.ShapeDtypeStruct((V // 2, D), jnp.bfloat16, sharding=s)
    flag = jax.ShapeDtypeStruct((), jnp.bool_, sharding=s)

    def either(t, u, i, x, p):
        return jax.lax.cond(p, lambda: scores(t, i, x),
                            lambda: (u.astype(jnp.float32).sum(-1)[:B * C]).reshape(B, C))

    _, cond = aot.cost_of(_compile(jax.jit(either).lower(table, other, ids, x, flag),
                                       target))
    assert cond >= V // 2 * D * 2


@pytest.mark.parametrize("target", ["cpu", pytest.param("cuda:h100", marks=needs_cuda_aot)])
def test_in_place_scatters_are_charged_their_updates(target):
    """A K/V write of 8 tokens into a donated pool moves the tokens, not the pool (XLA's
    generic cost analysis charges the pool read and written); into a pool not donated, the
    copy the program must make of it stays charged. In the engine's dtype on each (CPU f32:
    a bf16 scatter there converts the whole pool to f32 and back, which is real traffic)."""
    dev = jax.devices("cpu")[0] if target == "cpu" else \
        aot.target_devices(aot.parse_target(target))[0]
    s = jax.sharding.SingleDeviceSharding(dev)
    dt = jnp.dtype(jnp.float32 if target == "cpu" else jnp.bfloat16)
    P, S, K, hd, B = 257, 16, 3, 64, 8
    pool = jax.ShapeDtypeStruct((P, S, K, hd), dt, sharding=s)
    slot = jax.ShapeDtypeStruct((B,), jnp.int32, sharding=s)
    new = jax.ShapeDtypeStruct((B, K, hd), dt, sharding=s)

    def write(c, page, off, kv):
        return c.at[page, off].set(kv)

    pool_bytes = P * S * K * hd * dt.itemsize
    moved = B * K * hd * dt.itemsize + 2 * B * 4
    _, donated = aot.cost_of(_compile(jax.jit(write, donate_argnums=0)
                                      .lower(pool, slot, slot, new), target))
    assert moved <= donated < 4 * moved < pool_bytes / 50
    _, copied = aot.cost_of(_compile(jax.jit(write).lower(pool, slot, slot, new), target))
    assert copied >= 2 * pool_bytes


def test_bad_gpu_block_shape_is_refused_at_export():
    """The Pallas GPU kernel's block_h must be a multiple of 16: export refuses 8."""
    from jax import export
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

    B, H, K, S, W, P, hd = 2, 8, 2, 16, 4, 8, 64
    args = (jax.ShapeDtypeStruct((B, H, hd), jnp.bfloat16),
            jax.ShapeDtypeStruct((K, P, S, hd), jnp.bfloat16),
            jax.ShapeDtypeStruct((K, P, S, hd), jnp.bfloat16),
            jax.ShapeDtypeStruct((B, W), jnp.int32), jax.ShapeDtypeStruct((B,), jnp.int32))

    def exported(block_h):
        fn = jax.jit(functools.partial(paged_attention, block_h=block_h,
                                       pages_per_compute_block=1, k_splits=1))
        return export.export(fn, platforms=("cuda",), disabled_checks=[
            export.DisabledSafetyCheck.custom_call(aot.TRITON_CALL)])(*args)

    assert aot.TRITON_CALL in exported(16).mlir_module()
    with pytest.raises(Exception, match="16"):
        exported(8)


_SUSPECT = ("libtpu", "pallas", "mosaic", "triton", "topologies")
_REPORT = ("import sys\n"
           f"print(sorted(m for m in sys.modules if any(b in m for b in {_SUSPECT!r})))\n")


def _modules_after(code: str) -> tuple[set[str], str]:
    out = subprocess.run([sys.executable, "-c", code + _REPORT], capture_output=True,
                         text=True, timeout=300, check=True)
    return set(eval(out.stdout.strip().splitlines()[-1])), out.stderr


def test_cpu_path_imports_nothing_tpu_or_cuda_specific():
    """A CPU generate (the `make run` path) loads no libtpu, Pallas TPU/GPU or topology
    module beyond what JAX itself loads at start-up, and prints no libtpu warning."""
    jax_own, _ = _modules_after("import jax, jax.numpy as jnp\n"
                                "jax.jit(lambda x: x + 1)(jnp.ones(3))\n")
    ours, stderr = _modules_after(
        "from ee_jax import LLM, SamplingParams\n"
        "from ee_jax.random_model import random_model\n"
        "import ee_jax.cli\n"
        "ee_jax.cli.build_parser()\n"
        "llm = LLM(random_model(), max_num_seqs=1, max_model_len=32)\n"
        "llm.generate(['hi'], SamplingParams(max_tokens=2))\n")
    assert sorted(ours - jax_own) == []
    assert "TPU_WORKER_HOSTNAMES" not in stderr and "host bounds" not in stderr, stderr


# D = 96 is not a multiple of 128: TPU's default layout of the [256, 96] embedding (and of
# the subset's [128, 96] rows) is column-major, as for SmolLM2's [49152, 576]; head_dim 64
# pads, as SmolLM2's does.
NARROW = random_config(vocab_size=256, d_model=96, n_heads=3, n_kv_heads=1, head_dim=64,
                       ffn_dim=256, n_layers=2, tie_embeddings=True, dtype="bfloat16")
NARROW_EC = ExitConfig(exit_layers=(1,), measure="candidates", vocab_subset=128,
                       candidates=4, threshold=0.9, policy="all")


def _narrow_step(B: int, exits: bool):
    """(step fn, abstract args) of NARROW's decode step at batch B: full depth, or with the
    exit checks (BatchExit), the cache donated (argument 2) and returned."""
    from bench.roofline import meta_for, sds
    from ee_jax.models.exits import heads as exit_heads
    from ee_jax.serving.kv_cache import KVCache, cache_shape
    from ee_jax.serving.step import BatchExit, FullDepth, model_step

    cfg, ec = NARROW, NARROW_EC
    params = aot.abstract_params(cfg)
    cache = KVCache(*(sds(cache_shape(cfg, 8 * 4 + 1, 16), cfg.jnp_dtype) for _ in range(2)))
    heads = jax.eval_shape(lambda p, h: exit_heads.with_vocab_rows(p, h, cfg), params,
                           exit_heads.head_shapes(cfg, ec)) if exits else None
    policy = BatchExit(ec) if exits else FullDepth()

    def fn(p, h, c, tokens, meta, thresholds):
        out, c = model_step(p, h, c, tokens, meta, thresholds, cfg, policy, "reference")
        return out.logits.argmax(-1), c

    return fn, (params, heads, cache, sds((B, 1), jnp.int32), meta_for(B, 4),
                sds((B,), jnp.float32))


def _big_copies(compiled) -> list:
    """Copies of a whole weight, table or pool (>= 8,192 elements; NARROW's activations
    are far smaller, its smallest table, the subset's rows, is 12,288)."""
    from ee_jax.serving import layouts

    return [c for c in layouts.copies(compiled.as_text()) if np.prod(c[1]) >= 8192]


@needs_libtpu
def test_tpu_default_layouts_copy_the_embedding_and_checks_do_not():
    """A relayout copy of a whole table is caught: compiled for TPU v5e in XLA's default
    entry layouts, NARROW's batch-8 step copies its column-major embedding whole before
    gathering the tokens' rows (what the runner's picked layouts remove: the next test). The
    exit checks score their candidates from the subset's rows: even in the default layouts,
    no step copies the embedding for them."""
    from bench.roofline import compile_for

    target = aot.parse_target("tpu:v5e")
    V, D = NARROW.vocab_size, NARROW.d_model
    fn, args = _narrow_step(8, exits=False)
    default = _big_copies(compile_for(fn, args, target, donate=(2,)))
    assert ("bf16", (V, D)) in default, default
    fn, args = _narrow_step(1, exits=True)
    assert ("bf16", (V, D)) not in _big_copies(compile_for(fn, args, target, donate=(2,)))


@needs_libtpu
@pytest.mark.parametrize("attention", ["pallas_tpu", "xla"])
def test_engine_runner_places_its_arrays_in_the_layouts_its_tpu_steps_take(attention):
    """The engine's own TPU runner (`aot.Plan.runner`, as `ee-jax compile` builds it; the
    engine passes the same `layout_shape`) holds its weights, heads and pool in the layouts
    its largest decode step picks (`layouts.pick`: Layout.AUTO, then settled; a head-major
    pool, the Pallas kernel's, pinned to the default layout the kernel reads): its decode
    steps at the smallest batch with the checks and the largest without copy no weight,
    table or pool (batch 1 would copy the pool in and out if its one-token K/V write were a
    dynamic-update-slice; a head-major pool would be relaid out around every write if the
    kv head were a window of the scatter: `kv_cache.write_slots`). In XLA's default layouts
    the largest step copies the embedding whole (what the pick removes: the test above)."""
    target = aot.parse_target("tpu:v5e")
    config = EngineConfig.make(max_num_seqs=8, max_model_len=64, max_num_batched_tokens=64,
                               max_prefill_chunk=32, attention=attention)
    # three kv heads, as SmolLM2's: with one, a [K, hd] window is as good as a row
    cfg = NARROW if attention == "xla" else dataclasses.replace(NARROW, n_kv_heads=3)
    plan = aot.Plan.make(cfg, target, config, NARROW_EC, kinds=("decode",))
    runner = plan.runner(NARROW_EC)
    assert runner.program.config.cache_format is not None
    assert runner.cache.head_major == (attention == "pallas_tpu")
    decode = sorted(plan.shapes, key=lambda s: (s.batch, s.pages))

    def big_copies(r, shape, exits):
        return _big_copies(r.lower(dataclasses.replace(shape, exits=exits)).compile())

    # the default on TPU (pallas_tpu): the smallest step with checks, the largest without
    # (the other two corners add ~14 s of libtpu and no layout of their own: the checks
    # read the same weights and pool); xla (a choice) at its largest step
    cases = [(decode[0], True), (decode[-1], False)]
    for shape, exits in cases if attention != "xla" else [(decode[-1], False)]:
        assert big_copies(runner, shape, exits) == [], (shape, exits)


ROOF_CFG = random_config(vocab_size=1024, d_model=256, n_heads=4, n_kv_heads=2, head_dim=64,
                         ffn_dim=512, n_layers=2, tie_embeddings=True, dtype="float32")


def _hand_step_bytes(cfg, B: int, W: int, page: int = 16) -> float:
    """Every weight once (the abstract params' bytes; the embedding is the tied LM head)
    + the K/V of B rows x W pages read and this token's K/V written, in all layers."""
    kv = cfg.n_layers * 2 * B * (W * page + 1) * cfg.n_kv_heads * cfg.head_dim * \
        cfg.jnp_dtype.itemsize
    return aot.tree_bytes(aot.abstract_params(cfg)) + kv


def test_roofline_bytes_match_the_hand_count_on_cpu():
    """bench/roofline.py's composed full-depth step (fixed + L x layer, compiled for this
    CPU) moves the bytes a hand count says, within 10 %: a layer piece that
    gathered pages out of a pool, or counted the K/V write by the pool, would be off by
    several times."""
    from bench import roofline

    m = roofline.pieces(ROOF_CFG, None, 1, 4, aot.parse_target("cpu"), step=False)
    composed = m.pieces.full_depth(ROOF_CFG.n_layers, 1).bytes
    hand = _hand_step_bytes(ROOF_CFG, 1, 4)
    assert abs(composed / hand - 1) <= 0.10, (composed, hand)


@needs_libtpu
def test_roofline_bytes_match_the_hand_count_on_tpu():
    """The same on a TPU v5e compile (bf16), counted with memory-space assignment off: with
    it on, XLA also counts a weight's staging copy into VMEM and the read of it there (a
    batch-8 matmul: several times the weight), which no HBM roofline should add."""
    from bench import roofline

    cfg = dataclasses.replace(ROOF_CFG, dtype="bfloat16")
    target = aot.parse_target("tpu:v5e")
    m = roofline.pieces(cfg, None, 1, 4, target, step=False)
    composed = m.pieces.full_depth(cfg.n_layers, 1).bytes
    assert abs(composed / _hand_step_bytes(cfg, 1, 4) - 1) <= 0.10
    dev = jax.sharding.SingleDeviceSharding(aot.target_devices(target)[0])
    x, w = (jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=dev) for s in ((8, 576), (576, 1536)))
    lowered = jax.jit(jnp.matmul).lower(x, w)
    hand = 2 * (8 * 576 + 576 * 1536 + 8 * 1536)
    off = aot.cost_of(lowered.compile(compiler_options=roofline.TPU_COUNT_OPTIONS))[1]
    on = aot.cost_of(lowered.compile())[1]
    assert abs(off / hand - 1) < 0.02 and on > 2 * hand, (off, on, hand)


@needs_libtpu
def test_a_stacked_packed_weight_is_not_relaid_out_inside_the_layer_loop():
    """Q4 blocks packed two values a byte, stacked by layer and sliced by a loop over the
    layers, compiled for TPU v5e: XLA's Layout.AUTO pick takes the uint8 stack in tiles of
    (32, 128) and the loop body copies the whole stack to (8, 128) every layer (a copy
    inside a fusion, which the entry shows no trace of; SmolLM2's batch-1 step read 1846 MB
    for 99.5 by hand). `layouts.pick` settles it: no copy of the stack anywhere in the
    program, and the step reads about the stack once."""
    from ee_jax.serving import hlo, layouts
    from ee_jax.serving.aot import traffic

    L, O, I = 6, 512, 1024
    dev = jax.sharding.SingleDeviceSharding(aot.target_devices(aot.parse_target("tpu:v5e"))[0])

    def sds(shape, dt):
        return jax.ShapeDtypeStruct(shape, dt, sharding=dev)

    def step(q, scale, x):  # q [L, O, I/2] u8, scale [L, O, I/32] f16, x [1, O]
        def layer(i, x):
            qi = q[i]
            v = jnp.stack([qi & 15, qi >> 4], -1).reshape(O, I).astype(jnp.float32)
            w = (v.reshape(O, I // 32, 32) * scale[i].astype(jnp.float32)[..., None])
            return (x @ w.reshape(O, I).astype(jnp.bfloat16))[:, :O]
        return (jax.lax.fori_loop(0, L, layer, x),)

    args = (sds((L, O, I // 2), jnp.uint8), sds((L, O, I // 32), jnp.float16),
            sds((1, O), jnp.bfloat16))

    def stack_copies(text):
        return [i for lines in hlo.computations(text).values() for i in hlo.instructions(lines)
                if i.op == "copy" and i.dims == (L, O, I // 2)]

    auto = layouts.lower(step, args, (0, 1)).compile()
    assert stack_copies(auto.as_text()), "XLA no longer relays the stack out: drop this test"
    picked = layouts.pick(step, args, (0, 1))
    placed = (layouts.place(args[0], picked[0]), layouts.place(args[1], picked[1]), args[2])
    text = layouts.lower(step, placed).compile().as_text()
    assert stack_copies(text) == []
    weights = L * O * I / 2 + L * O * I / 32 * 2
    assert traffic.count(text).bytes < 1.3 * weights


@needs_libtpu
def test_a_block_tables_one_row_product_runs_as_two_rows_on_tpu():
    """The tied head over a Q8_0 table at batch 1, compiled for TPU v5e: one row is a
    multiply-reduce that the compiler feeds an f32 operand the table's size (its scales
    broadcast; SmolLM2's batch-1 step read 306.8 MB for 99.5 by hand); the table as
    `for_platform` holds it for TPU runs the product as two rows, a dot over the table's own
    bytes: no table-sized f32 array, and about the table read once."""
    from ee_jax.models import quant
    from ee_jax.serving import hlo
    from ee_jax.serving.aot import traffic

    V, D = 8192, 576
    dev = jax.sharding.SingleDeviceSharding(aot.target_devices(aot.parse_target("tpu:v5e"))[0])
    table = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=dev),
                         quant.abstract_blocks((V, D), "Q8_0", table=True))
    x = jax.ShapeDtypeStruct((1, D), jnp.bfloat16, sharding=dev)

    def compiled(t):
        fn = jax.jit(lambda t, x: quant.table_matmul(x, t, preferred_element_type=jnp.float32))
        return fn.lower(t, x).compile().as_text()

    def table_sized_f32(text):
        return [i for lines in hlo.computations(text).values() for i in hlo.instructions(lines)
                if i.dtype == "f32" and i.dims is not None and
                int(np.prod(i.dims)) == V * D]

    one_row = compiled(table)
    assert table.min_rows == 1 and table_sized_f32(one_row), \
        "TPU's compiler fuses the one-row product now: drop TABLE_MIN_ROWS['tpu']"
    held = quant.for_platform(table, "tpu")
    assert held.min_rows == 2
    text = compiled(held)
    assert table_sized_f32(text) == []
    table_bytes = V * D + V * (D // quant.BLOCK) * 2  # int8 values, an f16 scale a block
    assert traffic.count(text).bytes < 1.3 * table_bytes

