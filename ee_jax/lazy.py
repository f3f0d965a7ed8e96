"""Package namespaces whose public names import on first use (PEP 562 module `__getattr__`).

`ee-jax --help` should answer in a fraction of a second, but importing `ee_jax.cli` imports
its parent packages' `__init__` modules first, and eager re-exports there would load the
engine and JAX (most of a second) before argparse runs. A package built with `lazy_exports`
names its public surface without importing it: `from ee_jax import LLM` imports
`ee_jax.serving.llm` at that moment, and `import ee_jax.cli` imports no JAX at all.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, exports: dict[str, str]
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """(`__getattr__`, `__dir__`) for `package`, whose public names are `exports`' keys, each
    defined in the module its value names. A name is imported when first read, then kept in
    the package's namespace (later reads are plain attribute reads)."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *exports})

    return __getattr__, __dir__
