"""Entry layouts a compiled step wants, so that no step copies a weight or the KV pool whole
on entry (the roofline of the compiled TPU programs found such copies: docs/roofline.md).

XLA gives every parameter of a program a device layout. Left to itself ("default"), the TPU
client picks the one that pads least: SmolLM2's [49152, 576] embedding is held column-major
(576 would pad to 640 in 128-wide tiles, 49152 pads to nothing), the [30, 257, 16, 3, 64] K/V
pool tiled over (page slot, head_dim). A program that wants another layout copies the array
whole, every call: gathering B >= 2 rows of the column-major embedding transposes all 113 MB
first, a batch-8 layer copies its square wq, the full-depth step copies the pool in and out
(SmolLM2, batch 8, TPU v5e: 492 MB of copies in a 1,460 MB step).

Compiled with `Layout.AUTO` for those arguments, XLA picks the entry layouts the program wants
instead (same step, in the layouts `pick` settles on: no copy, 110 MB; the table row-major,
the pool tiled over (kv heads, head_dim), which at head_dim 64 pads more: 252.6 MB on the
device for 94.7 MB of K/V, 141.6 MB in the default layout, whose batch-8 step however needs
443 MB of temporaries for its copies). Arrays allocated in those layouts (`place`) enter every
program with no copy: jit takes a committed array's layout as the program's entry layout, so
the other programs (smaller buckets, exit checks) compile against the same layouts. Pick them
from the program that moves the most (the largest decode bucket); `tests/test_lowering.py`
checks that the others then hold no whole-array copy either.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.experimental.layout import Format, Layout

from ee_jax.serving import hlo


def auto(tree: Any) -> Any:
    """`Layout.AUTO` on every leaf of `tree`, on the leaf's own sharding (abstract leaves:
    `jax.ShapeDtypeStruct` with a sharding; or a sharding for every leaf)."""
    return jax.tree.map(lambda a: Format(Layout.AUTO, _sharding(a)), tree)


def _sharding(a):
    s = a if isinstance(a, jax.sharding.Sharding) else a.sharding
    if s is None:
        raise ValueError("layouts are per device: give every abstract argument a sharding "
                         "(jax.ShapeDtypeStruct(shape, dtype, sharding=...))")
    return s


def _entry(a):
    """What jit's in_shardings takes for an abstract leaf: its format if it has a layout."""
    fmt = getattr(a, "format", None)
    return fmt if fmt is not None and fmt.layout is not None else _sharding(a)


def _bare(a):
    return jax.ShapeDtypeStruct(a.shape, a.dtype)


def lower(fn: Callable, args: Sequence[Any], auto_argnums: Sequence[int] = (), *,
          donate_argnums: Sequence[int] = (), out_shardings: Any = None
          ) -> jax.stages.Lowered:
    """fn(*args) lowered with every argument in its own sharding and layout (abstract leaves
    with shardings, maybe formats: `place`), but args[i], i in `auto_argnums`, whose entry
    layouts XLA picks. Outputs: `out_shardings` (a tree of shardings or formats: give a
    donated argument that comes back its own format, or the step copies it back out of the
    layout it runs in), else XLA's pick where any layout is left to it, else the default."""
    auto_set = set(auto_argnums)
    in_sh = tuple(auto(a) if i in auto_set else jax.tree.map(_entry, a)
                  for i, a in enumerate(args))
    if out_shardings is None and auto_set:
        dev = _sharding(jax.tree.leaves(args)[0])
        out_shardings = jax.tree.map(lambda _: Format(Layout.AUTO, dev),
                                     jax.eval_shape(fn, *args))
    kw = {} if out_shardings is None else {"out_shardings": out_shardings}
    # keep_unused: entry parameter i is leaf i of args (`settle` reads them by number)
    return jax.jit(fn, in_shardings=in_sh, donate_argnums=tuple(donate_argnums),
                   keep_unused=True, **kw).lower(*(jax.tree.map(_bare, a) for a in args))


def chosen(compiled: jax.stages.Compiled, argnums: Sequence[int]) -> tuple[Any, ...]:
    """The formats (layout and sharding) a compiled program takes args[i] in, i in argnums."""
    fmts = compiled.input_formats[0]
    return tuple(fmts[i] for i in argnums)


def _layout(text: str) -> Layout:
    """An HLO layout "1,0:T(32,128)(4,1)" (minor to major, then tiles) as a Layout."""
    order, _, rest = text.partition(":")
    tiles = re.match(r"T((?:\([\d,]*\))+)", rest)
    tiling = None if tiles is None else tuple(
        tuple(int(d) for d in t.split(",") if d) for t in re.findall(r"\(([\d,]*)\)",
                                                                     tiles.group(1)))
    return Layout(tuple(int(d) for d in reversed(order.split(",")) if d), tiling=tiling)


def settle(compile_args: Callable[[tuple], jax.stages.Compiled], args: tuple,
           rounds: int = 3) -> tuple:
    """args (placed in formats: `place`) whose compiled program copies none of them on
    entry: each round compiles `compile_args(args)` (lowered with `lower`: entry parameter
    i is leaf i of args) and moves every argument the program copies on entry into the
    layout it copies it to. Why: XLA's Layout.AUTO pick is not a fixed point: given back as
    the entry layouts, the same program can prefer another for an array (the subset's int8
    rows, [128, 96]: tiled (32, 128) column-major picked, copied to row-major)."""
    for _ in range(rounds):
        text = compile_args(args).as_text()
        entry = hlo.entry(text)
        params = {i.name: (int(i.rest.split(")")[0]), i.dtype, i.layout) for i in entry
                  if i.op == "parameter" and i.layout is not None}
        # memory-space assignment's asynchronous copies (a prefetch) pass an array on
        via = {i.name: i.operands[0] for i in entry  # unchanged
               if i.op in ("copy-start", "copy-done") and i.operands}

        def source(name):
            while name in via:
                name = via[name]
            return params.get(name)

        moved = {}
        for dt, lay, src in ((i.dtype, i.layout, i.operands[0]) for i in entry
                             if i.op == "copy" and i.layout is not None and i.operands):
            p = source(src)  # a relayout of a parameter (TPU's "copy" may also convert it)
            if p is not None and dt == p[1] and lay.split("S(")[0] != p[2].split("S(")[0]:
                moved[p[0]] = _layout(lay)
        moved.update(_inner_relayouts(text, entry))
        if not moved:
            return args
        leaves, tree = jax.tree.flatten(args)
        leaves = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=Format(
            moved[i], _sharding(a))) if i in moved else a for i, a in enumerate(leaves)]
        args = jax.tree.unflatten(tree, leaves)
    return args


INNER_RELAYOUT_MIN_BYTES = 1 << 20  # `_inner_relayouts`: smaller arrays' copies are left


def _inner_relayouts(text: str, entry: list[hlo.Instr]) -> dict[int, Layout]:
    """{entry parameter number: layout} for the parameters a computation other than the
    entry copies whole into another layout (a `copy` of one of its own parameters of exactly
    an entry parameter's dtype, shape and layout: a `copy_fusion` inside a loop body, which
    the entry's copies do not show). Why: TPU's compiler took a stacked packed uint8 weight
    in tiles of (32, 128) and relaid the whole stack out to (8, 128) inside the layer loop,
    every layer, before slicing its layer (SmolLM2's Q4 blocks, batch 1: 1846 MB a step for
    99.5 by hand). Every entry parameter that matches is moved (wq and wo share a shape).
    Arrays under `INNER_RELAYOUT_MIN_BYTES` are left: their copy costs less at run time than
    the compile round that would move them costs at start-up."""
    by_key: dict[tuple, list[int]] = {}
    for i in entry:
        if i.op == "parameter" and i.layout is not None:
            key = (i.dtype, i.dims, i.layout.split("S(")[0])
            by_key.setdefault(key, []).append(int(i.rest.split(")")[0]))
    moved: dict[int, Layout] = {}
    for name, lines in hlo.computations(text).items():
        if name == "ENTRY":
            continue
        instrs = hlo.instructions(lines)
        own = {i.name: i for i in instrs if i.op == "parameter" and i.layout is not None}
        for i in instrs:
            if i.op != "copy" or i.layout is None or not i.operands or i.operands[0] not in own:
                continue
            src = own[i.operands[0]]
            if hlo.shape_bytes(src.dtype, src.dims) < INNER_RELAYOUT_MIN_BYTES:
                continue
            if src.dtype != i.dtype or src.dims != i.dims or \
                    src.layout.split("S(")[0] == i.layout.split("S(")[0]:
                continue
            for n in by_key.get((src.dtype, src.dims, src.layout.split("S(")[0]), ()):
                moved[n] = _layout(i.layout.split("S(")[0])
    return moved


def pick(fn: Callable, args: tuple, auto_argnums: Sequence[int], *,
         donate_argnums: Sequence[int] = (), returned: dict[int, int] | None = None,
         compile: Callable[[jax.stages.Lowered], jax.stages.Compiled] = lambda lo: lo.compile()
         ) -> tuple[Any, ...]:
    """The formats of args[i], i in `auto_argnums`, that fn's compiled program takes with no
    entry copy: XLA's Layout.AUTO pick, then `settle`d. fn returns a tuple; `returned` maps
    an output to the argument it gives back ({0: 2}: output 0 is the donated args[2]),
    which comes back in that argument's format (else the program copies it back out).
    What an engine allocates its weights, heads and pool in: pick from its largest program
    (the largest decode bucket) and give every other program the same arrays."""
    returned = returned or {}
    # The pick's compile donates only arguments whose layout it picks: XLA may give a pinned
    # argument's output (unpinned) another layout, which a donated input cannot alias.
    picked = compile(lower(fn, args, auto_argnums, donate_argnums=tuple(
        i for i in donate_argnums if i in auto_argnums)))
    dev = _sharding(jax.tree.leaves(args)[0])
    n_out = len(jax.eval_shape(fn, *args))
    placed = list(args)
    for i, f in zip(auto_argnums, chosen(picked, auto_argnums), strict=True):
        placed[i] = place(args[i], f)

    def compile_args(a):
        out = tuple(jax.tree.map(_entry, a[returned[o]]) if o in returned
                    else dev for o in range(n_out))
        return compile(lower(fn, a, donate_argnums=donate_argnums, out_shardings=out))

    settled = settle(compile_args, tuple(placed))
    return tuple(jax.tree.map(lambda x: x.format, settled[i]) for i in auto_argnums)


def default_formats(tree: Any) -> Any:
    """The formats of `tree`'s abstract leaves (with shardings) in the device's default
    layouts, made explicit (read back from a compiled identity): an argument pinned there
    enters and leaves a program in that layout, where an unset one may be given another."""
    compiled = jax.jit(lambda t: t, in_shardings=(jax.tree.map(_sharding, tree),)).lower(
        jax.tree.map(_bare, tree)).compile()
    return compiled.input_formats[0][0]


def place(tree: Any, formats: Any) -> Any:
    """`tree` in `formats`: arrays put there (`jax.device_put` relayouts on the device),
    abstract leaves given the format (compiling for a machine this one need not be)."""
    def one(a, f):
        if isinstance(a, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=f)
        return jax.device_put(a, f)

    return jax.tree.map(one, tree, formats)


def unstacked(fmt: Format) -> Format:
    """The format of one slice a[i] of an array stacked on a leading axis (a layer's weight
    from the stacked [L, ...] one), when that axis is the major-most: the same order of the
    other axes, XLA's tiling for them."""
    lay = fmt.layout
    if not isinstance(lay, Layout) or lay.major_to_minor[0] != 0:
        return Format(None, fmt.sharding)
    return Format(Layout(tuple(d - 1 for d in lay.major_to_minor[1:])), fmt.sharding)


def copies(hlo_text: str) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, shape) of every top-level `copy` in a compiled module's entry computation
    (`compiled.as_text()`): the relayouts XLA planned, each a whole-array read and write."""
    return [(i.dtype, i.dims) for i in hlo.entry(hlo_text)
            if i.op == "copy" and i.layout is not None]


def layer_axis_major(fmt: Format) -> Format:
    """`fmt` picked on a one-layer program (its [1, ...] arrays) made fit for the stacked
    [L, ...] ones: the layer axis major-most, the others in their order, and no tiling of
    its own where the layer axis is one of the two tiled (minor) axes (a [1, D] norm weight
    tiled (2, 128): XLA's TPU compiler failed on the [32, 4096] one, "Shape mismatch between
    parameter ... and its operand in dynamic-slice", Llama-3.1-8B)."""
    lay = fmt.layout
    if not isinstance(lay, Layout):
        return fmt
    order = (0, *(d for d in lay.major_to_minor if d != 0))
    tiling = None if 0 in order[-2:] else lay.tiling  # tiles are over the two minor axes
    return Format(Layout(order, tiling=tiling), fmt.sharding)


__all__ = ["auto", "chosen", "copies", "layer_axis_major", "lower", "pick", "place", "settle",
           "unstacked"]
