"""docs/architecture.md describes the code that exists: every path it cites exists, every
dotted name it cites (`module.name`, `Class.attribute`, `ee_jax.x.y`) is defined there, every
CamelCase name is defined somewhere in ee_jax, and a signature it writes out
(`name(a, b, key=...)`) has those keyword parameters. Read statically with `ast` (fast)."""

from __future__ import annotations

import ast
import keyword
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "architecture.md"


def _index():
    """modules: dotted name and file stem -> {top-level name: node}; classes: name -> attrs."""
    modules: dict[str, dict[str, ast.AST | None]] = {}
    classes: dict[str, set[str]] = {}
    functions: dict[str, list[ast.FunctionDef]] = {}
    for path in sorted((REPO / "ee_jax").rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        dotted = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        tree = ast.parse(path.read_text())
        names: dict[str, ast.AST | None] = {}
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.ClassDef):
                names[node.name] = node
            elif isinstance(node, ast.Assign | ast.AnnAssign):
                for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                    if isinstance(t, ast.Name):
                        names[t.id] = None
            elif isinstance(node, ast.ImportFrom | ast.Import):
                for a in node.names:
                    names[(a.asname or a.name).split(".")[0]] = None
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                attrs = classes.setdefault(node.name, set())
                for item in ast.walk(node):
                    if isinstance(item, ast.FunctionDef):
                        attrs.add(item.name)
                    elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        attrs.add(item.target.id)
                    elif isinstance(item, ast.Assign | ast.AnnAssign):
                        for t in (item.targets if isinstance(item, ast.Assign)
                                  else [item.target]):
                            if isinstance(t, ast.Name):
                                attrs.add(t.id)
                            elif isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) \
                                    and t.value.id == "self":
                                attrs.add(t.attr)
            if isinstance(node, ast.FunctionDef):
                functions.setdefault(node.name, []).append(node)
        for key in {dotted, parts[-1] if parts[-1] != "__init__" else parts[-2]}:
            modules.setdefault(key, {}).update(names)
    return modules, classes, functions


MODULES, CLASSES, FUNCTIONS = _index()
TEXT = re.sub(r"```.*?```", "", DOC.read_text(), flags=re.S)  # fenced blocks are pictures
CITED = [" ".join(c.split()) for c in re.findall(r"`([^`]+)`", TEXT)]


def test_cited_paths_exist():
    paths = [c.rstrip("/") for c in CITED if re.fullmatch(r"(ee_jax|tests|bench|docs)/[\w/.]+", c)]
    assert paths, "the check found no paths: the doc's citation style changed?"
    missing = [p for p in paths if not (REPO / p).exists()]
    # a bare file name (`engine.py`) names a file of the package, the tests or bench/
    files = {p.name for d in ("ee_jax", "tests", "bench") for p in (REPO / d).rglob("*.py")}
    missing += [c for c in CITED if re.fullmatch(r"\w+\.py", c) and c not in files]
    assert not missing, f"docs/architecture.md cites paths that do not exist: {missing}"


def _dotted(c: str) -> str | None:
    m = re.match(r"([A-Za-z_][\w.]*)", c)
    return m.group(1).rstrip(".") if m and "." in m.group(1).rstrip(".") else None


def test_cited_dotted_names_exist():
    checked, missing = 0, []
    for c in CITED:
        name = _dotted(c)
        if name is None or re.fullmatch(r"[\w.]+\.(py|md|json|yaml)", name):
            continue
        parts = name.split(".")
        # the longest prefix that is a module, then names inside it
        for i in range(len(parts), 0, -1):
            mod = ".".join(parts[:i])
            if mod in MODULES:
                rest = parts[i:]
                break
        else:
            if parts[0] not in CLASSES:
                continue  # a variable's attribute (meta.blocks_view): not a cited name
            mod, rest = None, parts
        checked += 1
        if mod is not None and rest:
            if rest[0] not in MODULES[mod] and f"{mod}.{rest[0]}" not in MODULES:
                missing.append(name)
                continue
            rest = rest if rest[0] in CLASSES else []
        if len(rest) >= 2 and rest[1] not in CLASSES.get(rest[0], set()):
            missing.append(name)
    assert checked > 20, "the check found few dotted names: the doc's citation style changed?"
    assert not missing, f"docs/architecture.md cites names that do not exist: {missing}"


def test_cited_class_names_exist():
    camel = {c for c in CITED if re.fullmatch(r"[A-Z][a-z0-9]+(?:[A-Z][a-z0-9]*)+", c)}
    defined = set(CLASSES) | {n for names in MODULES.values() for n in names}
    missing = sorted(camel - defined)
    assert not missing, f"docs/architecture.md cites classes that do not exist: {missing}"


def test_written_out_signatures_have_those_keywords():
    checked, wrong = 0, []
    for c in CITED:
        m = re.fullmatch(r"([\w.]+)\((.*)\)(?:\s*->.*)?", c, re.S)
        if not m:
            continue
        fn = m.group(1).split(".")[-1]
        keys = re.findall(r"(\w+)=", m.group(2))
        if fn not in FUNCTIONS or not keys or keyword.iskeyword(fn):
            continue
        checked += 1
        params = {a.arg for f in FUNCTIONS[fn] for a in
                  [*f.args.args, *f.args.kwonlyargs, *f.args.posonlyargs]}
        wrong += [f"{fn}({k}=)" for k in keys if k not in params]
    assert checked >= 2, "no written-out signatures with keywords found"
    assert not wrong, f"docs/architecture.md writes parameters that do not exist: {wrong}"
