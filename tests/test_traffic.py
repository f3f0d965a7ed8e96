"""`aot.traffic`: what a compiled program moves as it runs, against counts by hand (numpy
shapes, the loop's trips) and, for loop-free programs, against XLA's own cost analysis.

Programs compiled for this CPU; each checks one rule of the module docstring.
"""

from __future__ import annotations

import importlib.util
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ee_jax.cli import main as cli_main
from ee_jax.serving.aot import compile as aot
from ee_jax.serving.aot import traffic

needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason="libtpu is not installed (requirements-tpu-aot.txt)")
L, D, F, B = 7, 256, 512, 4  # layers, width, hidden, rows
W = jax.ShapeDtypeStruct((L, D, F), jnp.float32)
X = jax.ShapeDtypeStruct((B, D), jnp.float32)
SLICE = D * F * 4  # one layer's weight


def _count(fn, *args, donate=(), unknown_trips=1) -> tuple[traffic.Traffic, float]:
    """(the traffic, XLA's raw bytes accessed) of fn compiled for this CPU."""
    compiled = jax.jit(fn, donate_argnums=donate).lower(*args).compile()
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, list) else ca
    return traffic.count(compiled.as_text(), unknown_trips), float(ca["bytes accessed"])


def _layer(w, x):  # [B, D] -> [B, D]: one layer's weight read once
    return jnp.tanh(x @ w)[:, :D]


def test_a_loops_body_counts_once_per_trip():
    """fori_loop over the stacked weight: each trip reads its layer's slice (XLA CPU copies
    it out of the stack first, as XLA GPU does: read, written, read again), so the program
    moves L times a trip's (XLA's raw count: one trip) and computes L layers' flops exactly."""
    def looped(w, x):
        return jax.lax.fori_loop(0, L, lambda i, x: _layer(w[i], x), x)

    t, raw = _count(looped, W, X)
    trip = SLICE * (1 + 2 * t.weight_copies)
    assert t.weight_copies <= 1
    assert L * trip <= t.bytes < L * trip * 1.1
    assert raw < 1.1 * trip  # what the count fixes: XLA's takes one trip
    assert t.flops == L * 2 * B * D * F
    assert t.unknown_loops == 0


def test_a_loop_free_program_agrees_with_xla():
    """Unrolled, the same computation has no loop: the count is XLA's own within 10 %, and
    equal to the loop's."""
    def unrolled(w, x):
        for i in range(L):
            x = _layer(w[i], x)
        return x

    def looped(w, x):
        return jax.lax.fori_loop(0, L, lambda i, x: _layer(w[i], x), x)

    t, raw = _count(unrolled, W, X)
    assert abs(t.bytes - raw) <= 0.1 * raw
    assert abs(t.bytes - _count(looped, W, X)[0].bytes) <= 0.1 * t.bytes


def test_an_in_place_write_moves_its_updates():
    """A donated pool written at 8 rows moves the updates; a pool not donated is copied
    first, and that copy is counted."""
    pool = jax.ShapeDtypeStruct((4096, 256), jnp.float32)
    rows = jax.ShapeDtypeStruct((8,), jnp.int32)
    new = jax.ShapeDtypeStruct((8, 256), jnp.float32)
    t, _ = _count(lambda c, i, v: c.at[i].set(v), pool, rows, new, donate=(0,))
    updates = 8 * 256 * 4
    assert updates <= t.bytes < 4 * updates
    copied, _ = _count(lambda c, i, v: c.at[i].set(v), pool, rows, new)  # not donated
    assert copied.bytes >= 2 * 4096 * 256 * 4


def test_a_conditional_counts_its_cheapest_branch_and_unknown_loops_are_flagged():
    big = jax.ShapeDtypeStruct((1024, 1024), jnp.float32)
    flag = jax.ShapeDtypeStruct((), jnp.bool_)

    def either(p, m, x):
        return jax.lax.cond(p, lambda: jnp.sum(m) + x[0, 0], lambda: x[0, 0])

    t, _ = _count(either, flag, big, X)
    assert t.bytes < 1024 * 1024 * 4 / 100
    n = jax.ShapeDtypeStruct((), jnp.int32)

    def until(n, w, x):  # trips decided by the data
        return jax.lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, _layer(w[c[0]], c[1])),
                                  (0, x))[1]

    once, _ = _count(until, n, W, X)
    thrice, _ = _count(until, n, W, X, unknown_trips=3)
    assert once.unknown_loops == thrice.unknown_loops == 1
    trip = SLICE * (1 + 2 * once.weight_copies)
    assert trip <= once.bytes < 1.2 * trip
    assert thrice.bytes == pytest.approx(3 * once.bytes, rel=0.05)


# A module as XLA's GPU compiler writes one: each trip of the layer loop copies its layer's
# weight out of the stack (`loop_dynamic_slice_fusion`), then the dot reads the copy.
GPU_LIKE = """HloModule m

%copy_slice (p0: f32[30,576,1536], p1: s32[]) -> f32[1,576,1536] {
  %p0 = f32[30,576,1536]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %c = s32[] constant(0)
  ROOT %ds = f32[1,576,1536]{2,1,0} dynamic-slice(%p0, %p1, %c, %c), SIZES
}

%body (t: (s32[], f32[30,576,1536], f32[8,576])) -> (s32[], f32[30,576,1536], f32[8,576]) {
  %t = (s32[], f32[30,576,1536]{2,1,0}, f32[8,576]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %w = f32[30,576,1536]{2,1,0} get-tuple-element(%t), index=1
  %x = f32[8,576]{1,0} get-tuple-element(%t), index=2
  %s = f32[1,576,1536]{2,1,0} fusion(%w, %i), kind=kLoop, calls=%copy_slice
  %b = f32[576,1536]{1,0} bitcast(%s)
  %y = f32[8,1536]{1,0} dot(%x, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %z = f32[8,576]{1,0} slice(%y), slice={[0:8], [0:576]}
  %one = s32[] constant(1)
  %n = s32[] add(%i, %one)
  ROOT %r = (s32[], f32[30,576,1536]{2,1,0}, f32[8,576]{1,0}) tuple(%n, %w, %z)
}

%cond (t: (s32[], f32[30,576,1536], f32[8,576])) -> pred[] {
  %t = (s32[], f32[30,576,1536]{2,1,0}, f32[8,576]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %k = s32[] constant(30)
  ROOT %lt = pred[] compare(%i, %k), direction=LT
}

ENTRY %main (w: f32[30,576,1536], x: f32[8,576]) -> f32[8,576] {
  %w = f32[30,576,1536]{2,1,0} parameter(0)
  %x = f32[8,576]{1,0} parameter(1)
  %zero = s32[] constant(0)
  %t = (s32[], f32[30,576,1536]{2,1,0}, f32[8,576]{1,0}) tuple(%zero, %w, %x)
  %loop = (s32[], f32[30,576,1536]{2,1,0}, f32[8,576]{1,0}) while(%t), LOOP
  ROOT %out = f32[8,576]{1,0} get-tuple-element(%loop), index=2
}
""".replace("SIZES", "dynamic_slice_sizes={1,576,1536}").replace(
    "LOOP", 'condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"30"}}')


def test_weight_copies_are_found_and_their_bytes_counted():
    """The copy fusion is one copy (counted where the program holds it, not per trip); each
    trip moves the slice three times (read, written, read by the dot), x and y twice."""
    t = traffic.count(GPU_LIKE)
    layer = 576 * 1536 * 4
    assert t.weight_copies == 1
    x, y = 8 * 576 * 4, 8 * 1536 * 4  # the dot's input and output, the slice's output
    assert t.bytes == pytest.approx(30 * (3 * layer + 2 * x + 2 * y), rel=0.01)
    assert t.flops == 30 * 2 * 8 * 1536 * 576


def test_a_copy_in_a_branch_not_taken_by_the_bytes_is_still_counted():
    """A conditional's bytes are its cheapest branch's, but a weight copy in any branch is one
    the program holds (an exit program's checks sit in their own branches): the layer loop
    of GPU_LIKE in one branch, x passed through in the other."""
    module = GPU_LIKE.replace("ENTRY %main", "%heavy").replace(
        "%heavy (w: f32[30,576,1536], x: f32[8,576])",
        "%heavy (h: (f32[30,576,1536], f32[8,576]))").replace(
        "  %w = f32[30,576,1536]{2,1,0} parameter(0)\n  %x = f32[8,576]{1,0} parameter(1)\n"
        "  %zero",
        "  %h = (f32[30,576,1536]{2,1,0}, f32[8,576]{1,0}) parameter(0)\n"
        "  %w = f32[30,576,1536]{2,1,0} get-tuple-element(%h), index=0\n"
        "  %x = f32[8,576]{1,0} get-tuple-element(%h), index=1\n  %zero") + """
%cheap (h: (f32[30,576,1536], f32[8,576])) -> f32[8,576] {
  %h = (f32[30,576,1536]{2,1,0}, f32[8,576]{1,0}) parameter(0)
  ROOT %x = f32[8,576]{1,0} get-tuple-element(%h), index=1
}

ENTRY %main (p: pred[], w: f32[30,576,1536], x: f32[8,576]) -> f32[8,576] {
  %p = pred[] parameter(0)
  %w = f32[30,576,1536]{2,1,0} parameter(1)
  %x = f32[8,576]{1,0} parameter(2)
  %h = (f32[30,576,1536]{2,1,0}, f32[8,576]{1,0}) tuple(%w, %x)
  ROOT %out = f32[8,576]{1,0} conditional(%p, %h, %h), BRANCHES
}
""".replace("BRANCHES", "true_computation=%heavy, false_computation=%cheap")
    t = traffic.count(module)
    assert t.weight_copies == 1
    assert t.bytes < 576 * 1536 * 4  # the cheap branch's: no layer read
    assert traffic.count(module.replace("%heavy, false", "%cheap, false")).weight_copies == 0


def test_compile_command_reports_each_programs_traffic(capsys):
    """`ee-jax compile --target cpu`: a line a program with MB read, the hand count, the
    roofline on this CPU's measured peaks and the copies, and a total line summing them; an
    exit program's layer loop is counted once and says so ('>')."""
    assert cli_main(["compile", "--model", "random:smollm2-135m", "--target", "cpu",
                     "--decode-only",
                     "--max-num-seqs", "2", "--max-model-len", "64", "--page-size", "8",
                     "--quiet"]) == 0
    out = capsys.readouterr().out
    head = next(line for line in out.splitlines() if line.startswith("program"))
    assert all(c in head for c in ("MB read", "by hand", "roofline ms", "copies"))
    rows = [line.split() for line in out.splitlines() if line.startswith(("full ", "all/",
                                                                           "per_row/"))]
    total = next(line.split() for line in out.splitlines() if line.startswith("total"))
    assert rows
    reads = [float(r[7].lstrip(">")) for r in rows]
    assert float(total[2]) == pytest.approx(sum(reads), abs=0.1 * len(rows))
    assert float(total[3]) == pytest.approx(sum(float(r[8]) for r in rows), abs=0.1 * len(rows))
    assert sum(int(r[10]) for r in rows) == int(total[5])
    assert all(re.fullmatch(r"\d+\.\d{3}", r[9]) for r in rows)
    full = [r for r in rows if r[0] == "full"]
    assert full and all(float(r[7]) >= float(r[8]) for r in full)  # at least the hand count
    assert all(r[7].startswith(">") for r in rows if r[0] != "full")
    assert "measured here" in out


def test_the_cpu_host_chip_is_measured():
    chip = aot.host_chip()
    assert chip.platform == "cpu" and chip.peak_flops > 1e8 and chip.hbm_bytes_per_s > 1e8
    assert np.isfinite(chip.peak_flops)


@needs_libtpu
def test_tpu_full_depth_decode_moves_the_hand_count():
    """SmolLM2's shape, full-depth decode for TPU v5e at batch 1 and 2: the layer loop (no
    trip count written on TPU) counted 30 times, the kernel's pool reads at the rows' pages,
    VMEM arrays on chip: within 2 % of every weight once plus the rows' K/V, no weight copy
    (XLA's raw count, off by more than 20 %: the loop once, VMEM staging at every level)."""
    from ee_jax.serving.plan import EngineConfig

    target = aot.parse_target("tpu:v5e")
    cfg, _ = aot.plan_model("random:smollm2-135m")
    plan = aot.Plan.make(cfg, target, EngineConfig.make(max_num_seqs=2, max_model_len=64),
                         None, kinds=("decode",))
    shapes = {s.batch: s for _, _, s in plan.items()}
    for batch in (1, 2):
        shape = shapes[batch]
        lowered, _, error = aot._lower(plan.runner(None), shape, target)
        assert error is None, error
        compiled = lowered.compile()
        t = traffic.count(compiled.as_text(), **plan.pool_reads(shape))
        hand = plan.hand_bytes(shape)
        assert t.unknown_loops == 0 and t.weight_copies == 0
        assert abs(t.bytes - hand) <= 0.02 * hand, (batch, t.bytes, hand)
        raw = aot.cost_of(compiled)[1]  # the loop once, VMEM staging counted at each level
        assert abs(raw - hand) > 0.2 * hand


@pytest.mark.real_model
def test_compile_plans_int4_as_load_model_holds_it():
    """`ee-jax compile --quantize int4` plans every layer matmul weight in Q4_1 blocks (a
    random shape), keeps a GGUF's own blocks where the file has them (SmolLM2: its Q8_0
    embedding stays, its Q4_1 layers stay), and names int8 as not planned."""
    from ee_jax.models import quant

    assert aot.plan_blocks("random:smollm2-135m", "int4") == \
        {k: "Q4_1" for k in quant.QUANTIZED_KEYS}
    assert aot.plan_blocks("random:smollm2-135m") == {}
    name = "smollm2-135m-instruct"
    planned, held = aot.plan_blocks(name, "int4"), aot.plan_blocks(name)  # one header parse
    assert planned["embed"] == "Q8_0" and set(quant.QUANTIZED_KEYS) <= set(planned)
    assert {k: planned[k] for k in held} == held
    assert aot.plan_blocks(name, file_blocks=False) == {}
    with pytest.raises(ValueError, match="int8"):
        aot.plan_blocks(name, "int8")


def test_a_ggufs_blocks_are_planned_as_the_loader_holds_them():
    """`ee-jax compile` of a GGUF plans its weights in the file's blocks from the header
    alone: the abstract params are the loader's (shapes, dtypes, block kinds), and the hand
    count's weights are what the loaded model holds on the target (Q4 one value a byte on
    CPU, packed on TPU and GPU)."""
    from ee_jax.models import quant, registry
    from ee_jax.models.gguf_file import open_reader
    from ee_jax.models.loading import load_model
    from ee_jax.serving.plan import EngineConfig

    name = "smollm2-135m-instruct"
    blocks = aot.plan_blocks(name)
    assert blocks["wq"] == "Q4_1" and blocks["embed"] == "Q8_0"
    model = load_model(name, progress=False)
    cfg, _ = aot.plan_model(name, "float32")
    planned = aot.abstract_params(cfg, blocks)

    def sig(tree):
        leaves, treedef = jax.tree.flatten(tree)
        return treedef, [(tuple(a.shape), str(a.dtype)) for a in leaves]

    assert sig(quant.for_platform(planned, "cpu")) == sig(model.params)  # loaded here
    # on TPU at the file's own size: its block tensors' bytes, and the f32 norms
    reader = open_reader(registry.resolve_model(name)[1])  # the loader's, parsed once
    file_blocks = sum(int(t.n_bytes) for t in reader.tensors
                      if t.tensor_type.name in set(blocks.values()))
    norms = (2 * cfg.n_layers + 1) * cfg.d_model * 4
    config = EngineConfig.make(max_num_seqs=2, max_model_len=64)
    for target, weights in (("cpu", quant.param_bytes(model.params)),
                            ("tpu:v5e", file_blocks + norms)):
        plan = aot.Plan.make(cfg, aot.parse_target(target), config, None, kinds=("decode",),
                             blocks=blocks)
        shape = next(s for _, _, s in plan.items())
        assert plan.hand_bytes(shape) - weights == pytest.approx(
            aot.roofline.step_bytes(cfg, shape.batch, shape.pages, plan.engine.page_size,
                                    kv_itemsize=np.dtype(plan.engine.kv_dtype).itemsize,
                                    kv_hd=plan.engine.kv_shape[-1], weight_bytes=0.0),
            rel=1e-6), target
