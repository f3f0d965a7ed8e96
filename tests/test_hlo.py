"""The one HLO reader (`ee_jax.serving.hlo`) on a hand-written module, and the cost and layout
analyses through it on hand-counted cases."""

from __future__ import annotations

from ee_jax.serving import hlo, layouts
from ee_jax.serving.aot import compile as aot

MODULE = """HloModule m

%fused_gather (p0: f32[8192,4], p1: s32[2,1]) -> f32[2,4] {
  %p0 = f32[8192,4]{1,0} parameter(0)
  %p1 = s32[2,1]{1,0} parameter(1)
  %c = f32[8192,4]{1,0} convert(%p0)
  ROOT %g = f32[2,4]{1,0} gather(%c, %p1), offset_dims={1}, slice_sizes={1,4}
}

%fused_write (q0: f32[64,8], q1: s32[3,1], q2: f32[3,8]) -> f32[64,8] {
  %q0 = f32[64,8]{1,0} parameter(0)
  %q1 = s32[3,1]{1,0} parameter(1)
  %q2 = f32[3,8]{1,0} parameter(2)
  ROOT %s = f32[64,8]{1,0} scatter(%q0, %q1, %q2), update_window_dims={1}, to_apply=%add
}

ENTRY %main (a: f32[8192,4], i: s32[2,1], pool: f32[64,8], j: s32[3,1], u: f32[3,8]) -> f32[64,8] {
  %a = f32[8192,4]{1,0:T(8,128)S(1)} parameter(0)
  %i = s32[2,1]{1,0} parameter(1)
  %pool = f32[64,8]{1,0} parameter(2)
  %j = s32[3,1]{1,0} parameter(3)
  %u = f32[3,8]{1,0} parameter(4)
  %cs = (f32[8192,4]{1,0}, f32[8192,4]{0,1}, u32[]) copy-start(%a)
  %cd = f32[8192,4]{0,1} copy-done(%cs)
  %t = f32[8192,4]{0,1} copy(%cd)
  %f = f32[2,4]{1,0} fusion(%t, %i), kind=kLoop, calls=%fused_gather
  ROOT %w = f32[64,8]{1,0} fusion(%pool, %j, %u), kind=kLoop, calls=%fused_write
}
"""


def test_instructions_read_as_written():
    bodies = hlo.computations(MODULE)
    assert list(bodies) == ["fused_gather", "fused_write", "ENTRY"]
    entry = {i.name: i for i in hlo.entry(MODULE)}
    a = entry["a"]
    assert (a.dtype, a.dims, a.layout, a.op, a.rest) == ("f32", (8192, 4), "1,0:T(8,128)S(1)",
                                                         "parameter", "0)")
    assert entry["cs"].dtype is None and entry["cs"].op == "copy-start"  # a tuple type
    assert entry["cs"].operands == ["a"] and entry["cd"].operands == ["cs"]
    assert entry["w"].root and entry["w"].operands == ["pool", "j", "u"]
    assert entry["f"].nbytes == 2 * 4 * 4
    assert hlo.shape_bytes("bf16", "8192,576") == hlo.shape_bytes("bf16", (8192, 576)) == \
        8192 * 576 * 2


def test_indexed_excess_counts_gathers_and_in_place_scatters_by_hand():
    # the gathered parameter is charged whole (8192 x 4 f32) but 2 rows of 4 are read; the
    # scatter's pool is charged read and written whole (64 x 8 f32 each) for 3 x 8 updates
    gather = 8192 * 4 * 4 - 2 * 4 * 4
    scatter = 2 * (64 * 8 * 4 - 3 * 8 * 4)
    assert aot.indexed_excess(MODULE) == gather + scatter


def test_copies_are_the_entry_relayouts():
    assert layouts.copies(MODULE) == [("f32", (8192, 4))]
