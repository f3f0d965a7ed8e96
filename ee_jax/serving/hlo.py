"""Reading XLA's HLO text (`compiled.as_text()`): one parser for every analysis that reads a
compiled module, the cost accounting (`aot.indexed_excess`) and the layout choice
(`layouts.settle`, `layouts.copies`).

An instruction line is `[ROOT ]%name = TYPE op(operands), attributes`, TYPE an array
`f32[8,576]{1,0}` (dtype, dims, then the layout in braces, which may carry tiles `T(8,128)`
and a memory space `S(1)`) or a tuple `(f32[8]{0}, u32[])`; a computation is a header line
`%name (params) -> type {` (`ENTRY %name ...` for the entry) up to a line `}`.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
            "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
_HEADER = re.compile(r"^%?([\w.\-]+) \(.*\{$")
_HEAD = re.compile(r"^\s*(ROOT )?%([\w.\-]+) = ")
_ARRAY = re.compile(r"^(\w+)\[([\d,]*)\](?:\{([^}]*)\})?")
_OP = re.compile(r"^ ([\w\-]+)\((.*)$")
_NAME = re.compile(r"%([\w.\-]+)")
_PART = re.compile(r"(\w+)\[([\d,]*)\](?:\{([^}]*)\})?")  # a tuple element: its array


@dataclasses.dataclass(frozen=True)
class Instr:
    """One instruction: its name, result type (dtype, dims and layout for an array; None for
    a tuple), opcode and the text after the opcode's "(" (operands, then attributes)."""

    name: str
    dtype: str | None
    dims: tuple[int, ...] | None
    layout: str | None
    op: str
    rest: str
    root: bool = False
    elements: tuple[tuple[str, tuple[int, ...]], ...] = ()  # a tuple's arrays (dtype, dims)
    # memory space of each array of the result (its layout's S(n); 0: device memory, TPU's
    # 1: VMEM on chip): the array's, or each tuple element's
    spaces: tuple[int, ...] = (0,)

    @property
    def nbytes(self) -> float:
        return shape_bytes(self.dtype or "f32", self.dims or ())

    @property
    def result_bytes(self) -> float:
        """Bytes of its result: the array, or the sum of a tuple's arrays."""
        if self.dims is None:
            return sum(shape_bytes(d, dims) for d, dims in self.elements)
        return self.nbytes

    @property
    def operands(self) -> list[str]:
        """The names of its operands (up to the operand list's closing parenthesis)."""
        return _NAME.findall(self.rest[:_closing(self.rest, depth=1)])


def _closing(text: str, depth: int = 0) -> int:
    """The index of the parenthesis that brings `depth` (the parentheses open before
    `text`) to 0; len(text) if none does."""
    for i, ch in enumerate(text):
        depth += (ch == "(") - (ch == ")")
        if depth == 0 and ch == ")":
            return i
    return len(text)


def shape_bytes(dtype: str, dims) -> float:
    """Bytes of an HLO array type: dtype (`bf16`) and dims (a tuple, or HLO's "8192,576")."""
    if isinstance(dims, str):
        dims = [int(d) for d in dims.split(",") if d]
    return float(np.prod(dims)) * ITEMSIZE.get(dtype, 4)


def parse(line: str) -> Instr | None:
    """The instruction on `line`, or None (a header, a closing brace, a comment)."""
    head = _HEAD.match(line)
    if head is None:
        return None
    text = line[head.end():]
    elements: tuple = ()
    if text.startswith("("):  # a tuple type: up to its matching parenthesis
        end = _closing(text) + 1
        parts = _PART.findall(text[:end])
        elements = tuple((d, tuple(int(n) for n in dims.split(",") if n))
                         for d, dims, _ in parts)
        spaces = tuple(_space(lay) for _, _, lay in parts)
        text = text[end:]
        dtype = dims = layout = None
    else:
        arr = _ARRAY.match(text)
        if arr is None:
            return None
        text = text[text.find(" "):]
        dtype, layout = arr.group(1), arr.group(3)
        dims = tuple(int(d) for d in arr.group(2).split(",") if d)
        spaces = (_space(layout),)
    op = _OP.match(text)
    if op is None:
        return None
    return Instr(head.group(2), dtype, dims, layout, op.group(1), op.group(2),
                 root=bool(head.group(1)), elements=elements, spaces=spaces)


def _space(layout: str | None) -> int:
    m = re.search(r"S\((\d+)\)", layout or "")
    return int(m.group(1)) if m else 0


def computations(text: str) -> dict[str, list[str]]:
    """Each computation's body lines by name; the entry computation under "ENTRY"."""
    bodies: dict[str, list[str]] = {}
    name = None
    for line in text.splitlines():
        h = _HEADER.match(line) or (line.startswith("ENTRY ") and _HEADER.match(line[6:]))
        if h:
            name = "ENTRY" if line.startswith("ENTRY ") else h.group(1)
            bodies[name] = []
        elif line.startswith("}"):
            name = None
        elif name is not None:
            bodies[name].append(line)
    return bodies


def instructions(lines) -> list[Instr]:
    return [i for i in map(parse, lines) if i is not None]


def entry(text: str) -> list[Instr]:
    """The entry computation's instructions."""
    return instructions(computations(text).get("ENTRY", ()))
