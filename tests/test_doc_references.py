"""Every file, module and doc section the code and the docs name exists, and the benchmarks
page stays a page of the present (at most 400 lines; its history is in git).

Read statically (regexes over the text, no imports): repository paths (`bench/...`,
`docs/...`, `ee_jax/...`, `tests/...`, `configs/...`, a pytest node id's test included),
dotted module paths (`python -m bench.step`, `ee_jax.serving.stats`), bare file names
(`step.py`, `tuning.md`), relative Markdown links in the docs, and a doc's section named in
quotes after it (`docs/benchmarks.md, "Verified exits"`: a heading or a bold lead of that
doc starts with it), and a benchmark command's mode (`python -m bench.roofline dots`: a key of
that module's `MODES`). Paths under runs/ or /tmp, and names built in f-strings, are not
claims about this tree and are not matched."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS_MAX_LINES = 400


def _sources() -> list[Path]:
    files = [REPO / "README.md", REPO / "Makefile", REPO / "pyproject.toml"]
    files += sorted((REPO / "docs").rglob("*.md"))
    files += sorted((REPO / "configs").glob("*.yaml"))
    for top in ("ee_jax", "bench", "tests"):
        files += sorted((REPO / top).rglob("*.py"))
    files += sorted((REPO / "bench").glob("*.sh"))
    this = Path(__file__).resolve()
    return [f for f in files if f.exists() and f.resolve() != this]


SOURCES = _sources()


@cache
def _text(path: Path) -> str:
    return path.read_text()


@cache
def _file_names() -> frozenset[str]:
    skip = {".git", ".venv", "node_modules", "runs", "__pycache__"}
    names = set()
    for p in REPO.rglob("*"):
        if p.is_file() and not skip & set(p.relative_to(REPO).parts):
            names.add(p.name)
    return frozenset(names)


def _where(path: Path, text: str, index: int) -> str:
    return f"{path.relative_to(REPO)}:{text.count(chr(10), 0, index) + 1}"


def _found(pattern: re.Pattern):
    """(file:line, match) of every match of `pattern` in the sources."""
    for src in SOURCES:
        text = _text(src)
        for m in pattern.finditer(text):
            yield _where(src, text, m.start()), m


# --------------------------------------------------------------------------- repository paths

# The whole token, so that a pattern (`configs/tune-<model>.yaml`, `tune-*.yaml`) is seen whole.
PATH = re.compile(r"(?<![\w/.{<*-])((?:bench|docs|ee_jax|tests|configs)/[\w./<>*{}-]*)(::\w+)?")
# Placeholders in examples: `tests/test_x.py`, `bench.NAME`, `ee_jax.x.y`.
PLACEHOLDER = re.compile(r"(?:^|[/_.])(?:x|y|X|NAME)(?:$|[/_.])")


def _claim(token: str) -> str | None:
    """The path or module a token names, or None for a pattern or a placeholder."""
    token = token.rstrip(".-/")
    if re.search(r"[<>*{}]", token) or PLACEHOLDER.search(token):
        return None
    return token


def test_named_paths_exist():
    missing = []
    for where, m in _found(PATH):
        rel, node = _claim(m.group(1)), m.group(2)
        if rel is None:
            continue
        target = REPO / rel
        if not target.exists():
            missing.append(f"{where}: {rel}")
        elif node and target.is_file() and f"def {node[2:]}(" not in _text(target):
            missing.append(f"{where}: {rel}{node}")
    assert not missing, "paths named that do not exist:\n" + "\n".join(missing)


# --------------------------------------------------------------------------- dotted modules

MODULE = re.compile(r"(?<![\w./-])((?:bench|ee_jax)(?:\.[A-Za-z_]\w*)+)")


def _resolves(dotted: str) -> bool:
    """`bench.step`, `ee_jax.serving.stats.exit_summary`: the longest prefix that is a module
    or package exists, and what follows is an attribute of it (or of a package's __init__)."""
    parts = dotted.split(".")
    here = REPO / parts[0]
    for name in parts[1:]:
        if (here / name).is_dir():
            here = here / name
            continue
        if (here / f"{name}.py").is_file():
            return True  # the rest, if any, are attributes of that module
        if here.is_dir():  # an attribute of the package: defined or imported in its __init__
            init = here / "__init__.py"
            return init.is_file() and re.search(rf"\b{name}\b", _text(init)) is not None
    return True


def test_named_modules_exist():
    missing = []
    for where, m in _found(MODULE):
        dotted = _claim(m.group(1))
        if dotted is None or dotted.endswith((".py", ".md", ".sh")):
            continue
        if not _resolves(dotted):
            missing.append(f"{where}: {dotted}")
    assert not missing, "modules named that do not exist:\n" + "\n".join(missing)


# --------------------------------------------------------------------------- bench commands

# `python -m bench.X` and the word after it, when that is a word (a mode), not an option.
COMMAND = re.compile(r"python3? -m (bench\.\w+)(?:[ \t]+([a-z][\w-]*)(?=[\s`\"'),.;:]|$))?")


@cache
def _modes(module: Path) -> frozenset[str]:
    """The keys of a benchmark's top-level `MODES` dict (its modes; none: no modes), read
    with ast, nothing imported."""
    for node in ast.parse(_text(module)).body:
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
                and any(isinstance(t, ast.Name) and t.id == "MODES" for t in node.targets)):
            return frozenset(k.value for k in node.value.keys if isinstance(k, ast.Constant))
    return frozenset()


def test_bench_commands_name_a_benchmark_and_its_mode():
    bad = []
    for where, m in _found(COMMAND):
        module, mode = _claim(m.group(1)), m.group(2)
        if module is None:
            continue
        path = REPO / (module.replace(".", "/") + ".py")
        if not path.is_file():
            bad.append(f"{where}: {module}: no such benchmark")
        elif mode is not None and mode not in _modes(path):
            bad.append(f"{where}: {module} {mode}: not one of its modes {sorted(_modes(path))}")
    assert not bad, "benchmark commands that do not run:\n" + "\n".join(bad)


def test_bench_modes_are_read():
    """The reader above sees the modes a benchmark dispatches on (so the check is not empty)."""
    assert {"dots", "weight-slices", "compile-time"} <= _modes(REPO / "bench" / "roofline.py")
    assert {"engine", "checkpoint"} <= _modes(REPO / "bench" / "load.py")


# --------------------------------------------------------------------------- bare file names

BARE = re.compile(r"(?<![\w/.{-])(\w+\.(?:py|md|sh))\b")
# Names of other projects' files: llama.cpp's converter, a tokenizer test's sample text.
ELSEWHERE = frozenset({"convert_hf_to_gguf.py", "setup.py"})


def test_named_files_exist():
    names = _file_names()
    missing = []
    for where, m in _found(BARE):
        name = m.group(1)
        if name not in names and name not in ELSEWHERE:
            missing.append(f"{where}: {name}")
    assert not missing, "files named that do not exist:\n" + "\n".join(missing)


# --------------------------------------------------------------------------- Markdown links

LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")


def test_doc_links_resolve():
    missing = []
    for src in SOURCES:
        if src.suffix != ".md":
            continue
        text = _text(src)
        for m in LINK.finditer(text):
            target = m.group(1)
            if re.match(r"[a-z]+:", target):
                continue  # a URL
            if not (src.parent / target).exists():
                missing.append(f"{_where(src, text, m.start())}: {target}")
    assert not missing, "links that do not resolve:\n" + "\n".join(missing)


# --------------------------------------------------------------------------- doc sections

SECTION = re.compile(r"\b((?:docs/)?\w+\.md)\)?(?:,\s*|\s+)\(?\"([^\"\n]{3,80}?)[\"?]")
SECTION_AFTER = re.compile(r"\"([^\"\n]{3,80})\"\s+in\s+\[?((?:docs/)?\w+\.md)")


@cache
def _anchors(doc: Path) -> tuple[str, ...]:
    text = _text(doc)
    heads = re.findall(r"^#+\s+(.*)$", text, flags=re.M)
    bold = re.findall(r"\*\*([^*]+)\*\*", text)
    return tuple(" ".join(a.split()).lower() for a in heads + bold)


def _doc(name: str) -> Path | None:
    for p in (REPO / name, REPO / "docs" / Path(name).name, REPO / Path(name).name):
        if p.is_file():
            return p
    return None


def test_named_sections_exist():
    missing = []
    for src in SOURCES:
        text = " ".join(_text(src).split())  # a reference may wrap over lines and comments
        text = re.sub(r"\s#\s", " ", text)
        found = [(m.group(1), m.group(2)) for m in SECTION.finditer(text)]
        found += [(m.group(2), m.group(1)) for m in SECTION_AFTER.finditer(text)]
        for name, section in found:
            doc = _doc(name)
            if doc is None:
                continue  # a missing doc is test_named_files_exist's to report
            want = " ".join(section.split()).lower()
            if not any(a.startswith(want) for a in _anchors(doc)):
                missing.append(f"{src.relative_to(REPO)}: {name}, \"{section}\"")
    assert not missing, "doc sections named that do not exist:\n" + "\n".join(missing)


# --------------------------------------------------------------------------- the present

def test_benchmarks_page_is_short():
    lines = (REPO / "docs" / "benchmarks.md").read_text().count("\n")
    assert lines <= BENCHMARKS_MAX_LINES, (
        f"docs/benchmarks.md has {lines} lines (at most {BENCHMARKS_MAX_LINES}): keep the latest "
        "table of each benchmark, leave the superseded ones to git")
