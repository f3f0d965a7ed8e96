"""What a compiled step program moves and computes, counted from its optimised HLO as it runs.

XLA's cost analysis (`compiled.cost_analysis()`) walks a module once: a `while` body counts
once whatever its trips (SmolLM2's full-depth decode on TPU v5e: 1/30 of the layers it runs),
an in-place write into the KV pool counts the whole pool, and a fused gather of a few rows
counts the whole table. `count` walks the same module the way the program runs:

- a `while` with a known trip count (XLA's `known_trip_count`, or on TPU, which writes none,
  a counter compared with a constant from a constant start: every `fori_loop`) counts its
  body and condition that many times; one without (an exit program's layer loop, whose trips
  the rows' confidence decides; the XLA attention's loop over page blocks, as many as the
  rows' lengths need) `unknown_trips` times (default once) and is counted in
  `unknown_loops`: the program's count is then a lower bound;
- a `conditional` counts its cheapest branch: what the step moves at least whichever way it
  branches (a greedy batch skips the sampler's filters; an exit step the head it does not
  need), and the weight copies of every branch (a copy the program holds is one, whether a
  given step takes its branch or not);
- a fusion reads each parameter whole, except one it only slices or gathers (a layer's slice
  of the stacked weights, a few rows of the head: those elements) and the buffer it updates in
  place (the KV pool written by a dynamic-update-slice or scatter: nothing read, the updates
  written); it writes its result;
- a kernel (custom call) reads its operands, but of the KV pool only the pages the caller
  says its page table names (`pool_read`);
- any other instruction reads its operands and writes its result (a `copy` both); the
  plumbing (parameters, tuples, bitcasts, constants) moves nothing; on TPU an array in VMEM
  (memory space 1) is on chip: only device-memory bytes count, a prefetch's read included.

Flops are the dots' and convolutions' (2 x output elements x contracted size), wherever they
sit; elementwise arithmetic is left out (a decode step's is under 1 % of its dots').
`weight_copies` counts the fusions and instructions that copy a dynamic slice out of a
larger buffer before it is used (XLA GPU's `loop_dynamic_slice_fusion` of a stacked layer
weight, docs/roofline.md "CUDA"), once each where the program holds it: a layer loop's copies
are counted once, not per trip.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re

import numpy as np

from ee_jax.serving import hlo

# Instructions that move no data of their own.
_PLUMBING = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all",
             "partition-id", "replica-id", "opt-barrier", "add-dependency", "domain",
             "copy-done"}
_SLICES = {"dynamic-slice", "slice", "gather"}
_IN_PLACE = {"dynamic-update-slice": 1, "scatter": 2}  # op -> the operand that is written
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CALLEE = re.compile(r"(?:calls|to_apply|body|condition|true_computation|false_computation)"
                     r"=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_DIMS = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
# a copy of a slice worth counting: at least this many bytes (a weight, not an index)
COPY_MIN_BYTES = 4096


@dataclasses.dataclass(frozen=True)
class Traffic:
    """A program's bytes moved and flops, as it runs (module docstring)."""

    bytes: float
    flops: float
    unknown_loops: int = 0  # while loops of unknown trips, counted `unknown_trips` times
    weight_copies: int = 0  # slices copied out of a larger buffer before use

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(self.bytes + other.bytes, self.flops + other.flops,
                       self.unknown_loops + other.unknown_loops,
                       self.weight_copies + other.weight_copies)

    def __mul__(self, k: float) -> Traffic:  # trips: bytes and flops, not what the HLO holds
        return Traffic(self.bytes * k, self.flops * k, self.unknown_loops, self.weight_copies)


ZERO = Traffic(0.0, 0.0)


def count(hlo_text: str, unknown_trips: int = 1, pool_elements: int | None = None,
          pool_read: float = 0.0) -> Traffic:
    """The bytes and flops of a compiled module's entry computation as it runs (module
    docstring); `unknown_trips`: how many times a loop of unknown trip count runs. A kernel
    (custom call) given the whole KV pool reads only the pages its page table names, which
    the module does not say: an operand of `pool_elements` elements (one of K and V, as
    stored) is charged `pool_read` bytes a call, the caller's count of those pages."""
    bodies = hlo.computations(hlo_text)
    parsed = {name: hlo.instructions(lines) for name, lines in bodies.items()}

    @functools.cache
    def fused(comp: str) -> tuple[dict[int, float], float, float, int]:
        """A fused computation: (parameter index -> bytes read where not read whole, bytes
        written, flops, whether its root is a slice copy)."""
        instrs = parsed.get(comp, [])
        by_name = {i.name: i for i in instrs}
        reads: dict[int, float] = {}
        for i in instrs:
            if i.op != "parameter":
                continue
            index = int(re.match(r"(\d+)", i.rest).group(1))
            sliced = _sliced_bytes(i, instrs, lambda c: fused(c)[0])
            if sliced is not None:
                reads[index] = sliced
        root = next((i for i in instrs if i.root), None)
        written = 0.0
        for out in _root_outputs(root, by_name):
            at = _IN_PLACE.get(out.op)
            ops = out.operands
            if at is not None and len(ops) > at and _is_param(ops[0], by_name):
                index = int(re.match(r"(\d+)", by_name[ops[0]].rest).group(1))
                reads[index] = 0.0  # updated in place: not read
                written += _bytes(ops[at], by_name)
            else:
                written += _hbm(out)
        flops = sum(_dot_flops(i, by_name) for i in instrs)
        flops += sum(fused(c)[2] for i in instrs if i.op == "fusion"
                     for c in _CALLEE.findall(i.rest))
        return reads, written, flops, int(_slice_copy(instrs, by_name, root))

    @functools.cache
    def walk(comp: str) -> Traffic:
        instrs = parsed.get(comp, [])
        by_name = {i.name: i for i in instrs}
        total = ZERO
        for i in instrs:
            if i.op in _PLUMBING:
                continue
            callees = _CALLEE.findall(i.rest)
            if i.op == "while":
                known = _trips(i, by_name, parsed)
                loop = sum((walk(c) for c in callees), ZERO) * (known or unknown_trips)
                total += dataclasses.replace(loop,
                                             unknown_loops=loop.unknown_loops + (known is None))
            elif i.op == "conditional":
                branches = callees + [b.strip().lstrip("%") for bs in _BRANCHES.findall(i.rest)
                                      for b in bs.split(",") if b.strip()]
                walked = [walk(b) for b in branches]
                cheapest = min(walked, key=lambda t: t.bytes, default=ZERO)
                # bytes: the cheapest branch (a lower bound); copies: every branch's, as the
                # program holds them (an exit program's checks sit in branches of their own)
                total += dataclasses.replace(cheapest, weight_copies=sum(
                    t.weight_copies for t in walked))
            elif i.op in ("call", "async-start") and callees:
                total += sum((walk(c) for c in callees), ZERO)
            elif i.op == "fusion" and callees:
                reads, written, flops, copy = fused(callees[0])
                read = sum(reads.get(k, _bytes(name, by_name))
                           for k, name in enumerate(i.operands))
                # a slice copied into VMEM (TPU) is a prefetch, not a copy in device memory
                total += Traffic(read + written, flops, 0, copy * (i.spaces[0] == 0))
            elif i.op in _IN_PLACE and len(i.operands) > _IN_PLACE[i.op]:
                update = _bytes(i.operands[_IN_PLACE[i.op]], by_name)
                total += Traffic(2 * update, 0.0)
            elif i.op == "copy-start":  # device memory: read it, write its copy (TPU's
                # prefetches into VMEM, memory space 1, write nothing there)
                dst = i.elements[0] if i.elements else (i.dtype or "f32", i.dims or ())
                total += Traffic(sum(_bytes(n, by_name) for n in i.operands[:1])
                                 + (hlo.shape_bytes(*dst) if i.spaces[0] == 0 else 0.0), 0.0)
            elif i.op == "custom-call" and pool_elements:
                moved = _hbm(i) + sum(
                    pool_read if _elements(name, by_name) == pool_elements
                    else _bytes(name, by_name) for name in i.operands)
                total += Traffic(moved, _dot_flops(i, by_name))
            else:
                moved = sum(_bytes(name, by_name) for name in i.operands) + _hbm(i)
                copy = int(i.op == "dynamic-slice" and i.result_bytes >= COPY_MIN_BYTES)
                total += Traffic(moved, _dot_flops(i, by_name), 0, copy)
        return total

    return walk("ENTRY")


def _slice_copy(instrs: list[hlo.Instr], by_name: dict[str, hlo.Instr],
                root: hlo.Instr | None) -> bool:
    """Whether a fused computation only copies a dynamic slice of one of its parameters
    (maybe converted): no dot, reduction or scatter, a result of at least COPY_MIN_BYTES."""
    if root is None or root.result_bytes < COPY_MIN_BYTES:
        return False
    if any(i.op in ("dot", "convolution", "reduce", "scatter", "custom-call") for i in instrs):
        return False

    def from_param(name: str) -> bool:
        i = by_name.get(name)
        while i is not None and i.op in ("bitcast", "convert", "reshape", "copy"):
            i = by_name.get(i.operands[0]) if i.operands else None
        return i is not None and i.op == "parameter"

    return any(i.op == "dynamic-slice" and i.operands and from_param(i.operands[0])
               for i in instrs)


def _trips(loop: hlo.Instr, by_name: dict[str, hlo.Instr],
           parsed: dict[str, list[hlo.Instr]]) -> int | None:
    """A while loop's trip count: XLA's `known_trip_count` where it wrote one (CPU, GPU),
    else read off a counted loop (TPU writes none): a condition `counter < constant` on a
    tuple element the loop starts at a constant (a `fori_loop`); None if neither."""
    m = _TRIPS.search(loop.rest)
    if m:
        return int(m.group(1))
    cond = re.search(r"condition=%([\w.\-]+)", loop.rest)
    instrs = parsed.get(cond.group(1), []) if cond else []
    local = {i.name: i for i in instrs}
    root = next((i for i in instrs if i.root), None)
    if root is None or root.op != "compare" or "direction=LT" not in root.rest:
        return None
    ops = [local.get(n) for n in root.operands]
    if len(ops) != 2 or None in ops or ops[0].op != "get-tuple-element" \
            or ops[1].op != "constant":
        return None
    index = re.search(r"index=(\d+)", ops[0].rest)
    start = by_name.get(loop.operands[0]) if loop.operands else None
    if index is None or start is None or start.op != "tuple":
        return None
    first = by_name.get(start.operands[int(index.group(1))])
    while first is not None and first.op in ("copy", "bitcast") and first.operands:
        first = by_name.get(first.operands[0])
    if first is None or first.op != "constant":
        return None
    return max(0, _constant(ops[1]) - _constant(first))


def _constant(i: hlo.Instr) -> int:
    return int(re.match(r"\s*(-?\d+)", i.rest).group(1))


def _elements(name: str, by_name: dict[str, hlo.Instr]) -> int | None:
    i = by_name.get(name)
    return None if i is None or i.dims is None else int(np.prod(i.dims))


def _hbm(i: hlo.Instr) -> float:
    """Bytes of a result in device memory (on TPU, arrays in VMEM, memory space 1, are on
    chip: reading or writing them moves nothing over the memory bus)."""
    if i.dims is not None:
        return i.nbytes if i.spaces[0] == 0 else 0.0
    return sum(hlo.shape_bytes(d, dims) for (d, dims), space
               in zip(i.elements, i.spaces, strict=False) if space == 0)


def _bytes(name: str, by_name: dict[str, hlo.Instr]) -> float:
    i = by_name.get(name)
    return 0.0 if i is None else _hbm(i)


def _is_param(name: str, by_name: dict[str, hlo.Instr]) -> bool:
    i = by_name.get(name)
    return i is not None and i.op == "parameter"


def _root_outputs(root: hlo.Instr | None, by_name: dict[str, hlo.Instr]) -> list[hlo.Instr]:
    """The arrays a fusion returns: its root, or a tuple root's elements."""
    if root is None:
        return []
    if root.op == "tuple":
        return [by_name[n] for n in root.operands if n in by_name]
    return [root]


def _sliced_bytes(param: hlo.Instr, instrs: list[hlo.Instr], inner_reads) -> float | None:
    """Bytes a fusion reads of `param` if every use of it (through bitcasts, converts and
    reshapes, which a fusion computes per element read) is the data operand of a slice,
    dynamic slice or gather (their results' elements at its itemsize), or an operand of a
    nested fusion that reads it so (`inner_reads(callee)`: parameter index -> bytes); None
    otherwise (read whole)."""
    itemsize = hlo.ITEMSIZE.get(param.dtype or "f32", 4)

    def read(name: str) -> float | None:
        users = [i for i in instrs if i.name != name and name in i.operands]
        if not users:
            return None
        total = 0.0
        for i in users:
            if i.op in _SLICES and i.operands[0] == name:
                total += float(np.prod(i.dims or ())) * itemsize
            elif i.op in ("bitcast", "convert", "reshape", "copy"):
                inner = read(i.name)
                if inner is None:
                    return None
                total += inner
            elif i.op == "fusion" and _CALLEE.findall(i.rest):
                reads = inner_reads(_CALLEE.findall(i.rest)[0])
                at = [k for k, n in enumerate(i.operands) if n == name]
                if not all(k in reads for k in at):
                    return None
                total += sum(reads[k] for k in at)
            else:
                return None
        return total

    return read(param.name)


def _dot_flops(i: hlo.Instr, by_name: dict[str, hlo.Instr]) -> float:
    """2 x output elements x contracted size of a dot (or a GEMM custom call: its
    `lhs_contracting_dimensions`); 0 for anything else."""
    if i.op == "convolution":  # XLA TPU's matmuls: rhs dims labelled "i" are contracted
        m = re.search(r"dim_labels=\w+_(\w+)->", i.rest)
        rhs = by_name.get(i.operands[1]) if len(i.operands) > 1 else None
        if m is None or rhs is None or rhs.dims is None:
            return 0.0
        k = float(np.prod([d for d, lab in zip(rhs.dims, m.group(1), strict=False)
                           if lab == "i"]))
        return 2.0 * float(np.prod(i.dims or ())) * k
    if i.op == "dot":
        m = _DIMS.search(i.rest)
        contracting = [int(d) for d in m.group(1).split(",") if d] if m else []
    elif i.op == "custom-call" and "gemm" in i.rest:
        m = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', i.rest)
        contracting = json.loads(f"[{m.group(1)}]") if m else []
        contracting = [int(d) for d in contracting]
    else:
        return 0.0
    lhs = by_name.get(i.operands[0]) if i.operands else None
    if lhs is None or lhs.dims is None:
        return 0.0
    k = float(np.prod([lhs.dims[d] for d in contracting])) if contracting else 1.0
    dims = i.dims if i.dims is not None else (i.elements[0][1] if i.elements else ())
    return 2.0 * float(np.prod(dims)) * k
