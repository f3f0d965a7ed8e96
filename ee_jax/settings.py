"""Configs that hold configs, built from one flat set of keyword settings.

A frozen config that nests another (`EngineConfig.scheduler`, a `SchedulerConfig`;
`TuneConfig.exit_config`, an `ExitConfig`) defines each field once, in the class it belongs
to, and still lets a caller write the knobs side by side (`LLM(model, max_num_seqs=8,
attention="xla")`, a flat YAML preset): `from_flat` sends each setting to the class that has
it. No JAX here: the CLI's parser may read it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any


def field_names(cls) -> tuple[str, ...]:
    """The dataclass `cls`'s field names, in order."""
    return tuple(f.name for f in dataclasses.fields(cls))


def nested_default(cls, inner: str) -> Any:
    """The default of `cls`'s field `inner` (a `default` or a `default_factory`'s value)."""
    f = next(f for f in dataclasses.fields(cls) if f.name == inner)
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def from_flat(cls, inner: str, settings: Mapping[str, Any]):
    """`cls(**settings)`, where `cls`'s field `inner` holds a frozen config of its own:
    settings that name a field of that config replace it there, in `settings[inner]` when
    given (that config, or a mapping of its fields, over `cls`'s default for it) and else in
    that default. A name the classes do not have is refused (TypeError, as a dataclass
    refuses one), with the names they do have."""
    given = settings.get(inner, nested_default(cls, inner))
    base = nested_default(cls, inner) if isinstance(given, Mapping) else given
    own, theirs = set(field_names(cls)) - {inner}, set(field_names(type(base)))
    mapped = dict(given) if isinstance(given, Mapping) else {}
    flat = {k: v for k, v in settings.items() if k != inner}
    unknown = sorted((set(flat) - own - theirs) | (set(mapped) - theirs))
    if unknown:
        raise TypeError(f"{cls.__name__}: unknown settings {unknown}; known: {sorted(own)} "
                        f"and, of {type(base).__name__} ({inner}), {sorted(theirs)}")
    changes = {**mapped, **{k: v for k, v in flat.items() if k in theirs}}
    outer = {k: v for k, v in flat.items() if k in own}
    return cls(**outer, **{inner: dataclasses.replace(base, **changes) if changes else base})

__all__ = ["field_names", "from_flat", "nested_default"]
