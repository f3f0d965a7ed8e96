"""The package's import graph: no cycles, and layers import downward only.

Layers, lowest first: `ee_jax.errors` (with `ee_jax.files`, atomic writes, `ee_jax.lazy`,
package namespaces that import on first use, and `ee_jax.settings`, configs built from flat
settings); `ee_jax.models` (with `ee_jax.testing`, tiny configs for tests and examples);
`ee_jax.serving` (with `ee_jax.random_model`, which builds a `LoadedModel` the server can
serve); `ee_jax.training`; `ee_jax.evaluation`; `ee_jax.cli`.
`ee_jax/__init__.py` re-exports the public surface (on first use) and sits on top. A module may
import its own layer or any lower one. Every import counts, function-level ones included (a
cycle hidden in a function is still a cycle); imports of ee_jax modules belong at module top,
except in the CLI, which imports each subcommand's layer when that command runs (a fast
`--help`).

Read statically with `ast` (no module is executed), so the check costs well under a second.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "ee_jax"
LAYERS = {"errors": 0, "files": 0, "lazy": 0, "settings": 0, "models": 1, "testing": 1,
          "serving": 2, "random_model": 2, "training": 3, "evaluation": 4, "cli": 5, "": 6}
LAZY_IMPORTS_ALLOWED = {"ee_jax.cli"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def layer(module: str) -> int:
    top = module.split(".")[1] if "." in module else ""
    assert top in LAYERS, f"{module}: no layer assigned; add {top!r} to LAYERS"
    return LAYERS[top]


def resolve(name: str) -> str:
    """The ee_jax module an import of `name` loads (a name imported from a module: that one)."""
    while name not in MODULES:
        name = name.rsplit(".", 1)[0]
    return name


def _type_checking(node: ast.stmt) -> bool:
    return isinstance(node, ast.If) and isinstance(node.test, ast.Name) and \
        node.test.id == "TYPE_CHECKING"


def imports(module: str) -> list[tuple[str, int, bool]]:
    """(imported ee_jax module, line, at module top?) for every import in `module`."""
    tree = ast.parse(MODULES[module].read_text(), str(MODULES[module]))
    # an `if TYPE_CHECKING:` block at the top is top level: declarations, run by no one
    # (the lazy package namespaces, `ee_jax.lazy`, name their modules there)
    top_level = {id(n) for n in tree.body}
    top_level |= {id(n) for block in tree.body if _type_checking(block) for n in block.body}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] == "ee_jax":
                out.append((resolve(name), node.lineno, id(node) in top_level))
    return out


GRAPH = {m: imports(m) for m in MODULES}


def test_layers_import_downward_only():
    upward = [f"{m}:{line} imports {dep}" for m, deps in GRAPH.items()
              for dep, line, _ in deps if layer(dep) > layer(m)]
    assert not upward, ("a lower layer imports a higher one (pass the value in as an "
                        "argument, or move the code down):\n" + "\n".join(upward))


# Inside a package, its subpackages are layers too, lowest first: the base model (config,
# layers, quantized storage, tokenizer) <- the exit machinery <- the checkpoint formats (a
# Megatron checkpoint carries exits) <- the entry points (loading, the registry, convert);
# the engine <- ahead-of-time compilation and the roofline, which build engines' programs.
SUBLAYERS = {"ee_jax.models": {"": 0, "exits": 1, "formats": 2, "loading": 3, "registry": 3,
                               "convert": 4},
             "ee_jax.serving": {"": 0, "server": 1, "aot": 1}}


def sublayer(module: str) -> tuple[str, int] | None:
    """(package, layer) of a module inside a package with SUBLAYERS; None elsewhere."""
    for pkg, table in SUBLAYERS.items():
        if module.startswith(pkg + "."):
            part = module[len(pkg) + 1:].split(".")[0]
            return pkg, table.get(part, 0)
    return None


def test_subpackages_import_downward_only():
    upward = []
    for m, deps in GRAPH.items():
        here = sublayer(m)
        for dep, line, _ in deps:
            there = sublayer(dep)
            if here and there and here[0] == there[0] and there[1] > here[1]:
                upward.append(f"{m}:{line} imports {dep}")
    assert not upward, ("a module imports from a higher part of its package (move the code "
                        "down or pass the value in):\n" + "\n".join(upward))


def test_no_import_cycles():
    edges = {m: sorted({d for d, _, _ in deps if d != m}) for m, deps in GRAPH.items()}
    # the package's __init__ modules import their children; a child importing a sibling
    # goes through the parent package only when it names it, which `resolve` already maps
    state: dict[str, int] = {}
    cycles = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in edges[m]:
            if state.get(d) == 1:
                cycles.append(" -> ".join([*path[path.index(d):], d]))
            elif d not in state:
                visit(d, [*path, d])
        state[m] = 2

    for m in edges:
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_ee_jax_imports_at_module_top():
    lazy = [f"{m}:{line} imports {dep}" for m, deps in GRAPH.items()
            if m not in LAZY_IMPORTS_ALLOWED for dep, line, top in deps if not top]
    assert not lazy, ("imports of ee_jax modules inside functions (move them to the top; "
                      "if a cycle forces it, the cycle is the problem):\n" + "\n".join(lazy))


@pytest.mark.parametrize("source,layer_name", [
    ("from ee_jax.training.tune_config import TuneConfig", "training"),
    ("import ee_jax.cli", "cli"),
])
def test_the_check_sees_an_upward_import(tmp_path, source, layer_name):
    """The walk itself: an upward import placed in a models module is found."""
    tree = ast.parse(f"def f():\n    {source}\n")
    node = tree.body[0].body[0]
    name = (node.names[0].name if isinstance(node, ast.Import)
            else f"{node.module}.{node.names[0].name}")
    dep = resolve(name)
    assert dep.split(".")[1] == layer_name and layer(dep) > layer("ee_jax.models.llama")
