"""`ee-jax --help` loads no JAX, and the package namespaces still hold their public names.

The packages' `__init__` modules name their public surface lazily (`ee_jax.lazy`); these tests
check both halves of that bargain: nothing heavy is imported to build the CLI's parser, and
`from ee_jax import LLM` (and every other exported name) gives the very object its module
defines.
"""

from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ["ee_jax", "ee_jax.models", "ee_jax.serving"]
HEAVY = ("jax", "jaxlib", "flax", "optax", "orbax", "ml_dtypes", "fastapi", "uvicorn")

_PROBE = """
import contextlib, io, json, sys
import ee_jax.cli
ee_jax.cli.build_parser()
for argv in %r:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
        ee_jax.cli.main(argv)
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in %r)))
"""


def test_help_imports_no_jax():
    """`ee-jax --help` and each subcommand's `--help`, in a fresh interpreter: no JAX (nor
    the server's or training's libraries) in sys.modules afterwards."""
    argvs = [["--help"], *([cmd, "--help"] for cmd in
                           ("generate", "serve", "tune", "calibrate", "eval", "compile"))]
    out = subprocess.run([sys.executable, "-c", _PROBE % (argvs, HEAVY)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def _type_checking_names(package: str) -> set[str]:
    """The names the package's `if TYPE_CHECKING:` block imports (what type checkers see)."""
    path = Path(importlib.import_module(package).__file__)
    tree = ast.parse(path.read_text())
    return {a.asname or a.name for block in tree.body if isinstance(block, ast.If)
            for node in block.body if isinstance(node, ast.ImportFrom) for a in node.names}


@pytest.mark.parametrize("package", PACKAGES)
def test_public_names_resolve_to_their_modules(package):
    pkg = importlib.import_module(package)
    exports = pkg._EXPORTS
    assert set(pkg.__all__) == set(exports) == _type_checking_names(package)
    for name, module in exports.items():
        assert getattr(pkg, name) is getattr(importlib.import_module(module), name), name
    assert set(pkg.__all__) <= set(dir(pkg))
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        pkg.no_such_name  # noqa: B018


def test_from_import_works():
    from ee_jax import LLM, SamplingParams
    from ee_jax.serving.llm import LLM as LLM_
    from ee_jax.serving.params import SamplingParams as SamplingParams_

    assert LLM is LLM_ and SamplingParams is SamplingParams_
    namespace: dict = {}
    exec("from ee_jax import *", namespace)
    assert {"LLM", "load_model", "ExitConfig"} <= set(namespace)
