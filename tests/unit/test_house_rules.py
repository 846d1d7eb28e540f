"""The layout rules a newcomer relies on, checked rather than promised (docs/architecture.md): rooms of a few hundred
lines, every "invariant N" in the code defined in docs/invariants.md, history kept in commit messages (no
"session N"/"issue N" in the tree), and nothing pointing outside the repository."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("p2pworker", "vllm_adapter")
MAX_MODULE_LINES = 700
MAX_CLASS_LINES = 300
MAX_WORKER_LINES = 250
TEXT_DIRS = ("p2pworker", "vllm_adapter", "tests", "benchmarks", "docs", "scripts", "configs", "deploy")


def _sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def _texts() -> list[Path]:
    out = [ROOT / "README.md"]
    for d in TEXT_DIRS:
        out += [p for p in (ROOT / d).rglob("*") if p.is_file() and p.suffix in {".py", ".md", ".sh", ".toml",
                                                                                  ".yaml", ".yml", ".json"}
                and "results" not in p.parts]
    return sorted(out)


def _rel(p: Path) -> str:
    return str(p.relative_to(ROOT))


def test_no_module_of_the_packages_is_over_its_limit():
    big = {_rel(p): n for p in _sources() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not big, f"modules over {MAX_MODULE_LINES} lines: {big}"


def test_no_class_is_over_its_limit_and_the_worker_stays_small():
    sizes = {}
    for p in _sources():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ClassDef):
                sizes[f"{_rel(p)}:{node.name}"] = node.end_lineno - node.lineno + 1
    assert sizes["p2pworker/worker/loop.py:Worker"] <= MAX_WORKER_LINES
    big = {k: v for k, v in sizes.items() if v > MAX_CLASS_LINES}
    assert not big, f"classes over {MAX_CLASS_LINES} lines: {big}"


def test_every_invariant_the_code_names_is_defined_in_the_docs():
    defined = {int(n) for n in re.findall(r"^## (\d+)\. ", (ROOT / "docs" / "invariants.md").read_text(), re.M)}
    named = {}
    for p in _sources():
        for n in re.findall(r"[Ii]nvariants? (\d+)", p.read_text()):
            named.setdefault(int(n), _rel(p))
    assert named, "no invariant is named in the code: the pattern is stale"
    assert not {n: f for n, f in named.items() if n not in defined}, f"defined: {sorted(defined)}"


@pytest.mark.parametrize("pattern, why", [
    (r"\b(?:session|issue) \d+\b", "history belongs in commit messages"),
    (r"\.\./shared\b", "the repository carries its own design docs"),
])
def test_the_tree_holds_no_history_and_no_pointer_outside_it(pattern, why):
    rx = re.compile(pattern, re.I)
    hits = [f"{_rel(p)}:{i}" for p in _texts() if p.resolve() != Path(__file__).resolve()
            for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if rx.search(line)]
    assert not hits, f"{why}: {hits[:10]}"


# Private names of other libraries that a harness has no public way to reach, each with why.  Ours never: a test or
# benchmark that needs to see or steer one of our objects gets a named point (a property, a constructor argument, an
# instrument) instead, so renaming a private cannot silently change what it checks.
FOREIGN_PRIVATES = {
    "os._exit": "a crash stand-in: exit with no cleanup",
    "self.tier._primary_kv_view": "vLLM's SecondaryTierManager keeps the CPU tier's view only there",
    "tier._primary_kv_view": "vLLM's SecondaryTierManager keeps the CPU tier's view only there",
    "self.spec._scheduler_mmap": "vLLM's offloading spec: the path of the CPU tier's file",
    "self.mgr._jobs": "vLLM's tiering manager: its open jobs (idle when empty)",
    "cons.mgr._jobs": "vLLM's tiering manager: its open jobs (idle when empty)",
    "prod.mgr._jobs": "vLLM's tiering manager: its open jobs (idle when empty)",
    "mgr._metrics": "vLLM's tiering manager: its metrics object",
}


def _private_reaches(p: Path) -> list[str]:
    """Every ``x._name`` (not on self/cls), ``super()._name``, ``setattr/getattr(x, "_name")`` and ``from ours import
    _name`` in ``p``."""
    out = []
    for n in ast.walk(ast.parse(p.read_text())):
        if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__"):
            if not (isinstance(n.value, ast.Name) and n.value.id in ("self", "cls")):
                out.append(ast.unparse(n))
        elif isinstance(n, ast.Call) and len(n.args) >= 2 and isinstance(n.args[1], ast.Constant):
            name = n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
            arg = n.args[1].value
            if name in ("setattr", "getattr", "delattr", "hasattr") and isinstance(arg, str) and \
                    arg.startswith("_") and not arg.startswith("__"):
                out.append(f"{name}(..., {arg!r})")
        elif isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] in PACKAGES + ("benchmarks", "tests"):
            out += [f"from {n.module} import {a.name}" for a in n.names if a.name.startswith("_")]
    return out


def test_tests_and_benchmarks_reach_our_objects_by_public_names_only():
    reaches = {f"{_rel(p)}: {r}" for d in ("tests", "benchmarks") for p in (ROOT / d).rglob("*.py")
               for r in _private_reaches(p)}
    ours = sorted(r for r in reaches if r.split(": ", 1)[1] not in FOREIGN_PRIVATES)
    assert not ours, f"private names reached from outside their package: {ours}"
    used = {r.split(": ", 1)[1] for r in reaches}
    assert used >= set(FOREIGN_PRIVATES), f"stale allowances: {set(FOREIGN_PRIVATES) - used}"


def _imports_of(path: Path, package: str) -> set[str]:
    """The modules of ``package`` that ``path`` imports, at any depth of its body: a TYPE_CHECKING import counts too
    (an import circle that only the type checker walks is still a circle to a reader), relative imports too, and an
    import of the package itself counts as one of ``__init__`` (which imports the loop)."""
    out = set()
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.ImportFrom):
            module = n.module or ""
            if n.level:  # relative: from . import x / from .x import y, inside the package
                module = f"{package}.{module}" if module else package
            if module == package:
                out.add("__init__")
                out.update(a.name for a in n.names)  # from the package import a module of it
            elif module.startswith(package + "."):
                out.add(module.removeprefix(package + "."))
        elif isinstance(n, ast.Import):
            out.update(a.name.removeprefix(package + ".") for a in n.names if a.name.startswith(package + "."))
            out.update("__init__" for a in n.names if a.name == package)
    return out


def test_the_worker_rooms_import_in_one_direction_and_none_takes_the_whole_worker():
    package = "p2pworker.worker"
    rooms = {p.stem: p for p in (ROOT / "p2pworker" / "worker").glob("*.py")}
    graph = {name: {m for m in _imports_of(p, package) if m in rooms} for name, p in rooms.items()}
    # the loop builds every room and hands each the rooms it calls (ports.py): no room reaches back up to it, nor
    # to the package, whose __init__ imports the loop
    assert [name for name, deps in graph.items() if name != "__init__" and deps & {"loop", "__init__"}] == []
    seen, done, circles = [], set(), []

    def visit(name: str) -> None:
        if name in done:
            return
        if name in seen:
            circles.append(seen[seen.index(name):] + [name])
            return
        seen.append(name)
        for dep in sorted(graph[name]):
            visit(dep)
        seen.pop()
        done.add(name)

    for name in sorted(graph):
        visit(name)
    assert circles == []
