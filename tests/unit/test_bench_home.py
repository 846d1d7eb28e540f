"""One home for each benchmark's code (benchmarks/README.md, its opening): what the installed command runs is in
p2pworker/bench/, every other benchmark is a script in benchmarks/.  A script may import the package's rig; the
package never imports a script, and no script only forwards to a p2pworker.bench module's ``main``."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names imported from it) of every import in ``path``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
    return out


def test_the_package_never_imports_a_benchmark_script():
    bad = {str(p.relative_to(ROOT)): m for p in (ROOT / "p2pworker").rglob("*.py") for m, _ in _imports(p)
           if m == "benchmarks" or m.startswith("benchmarks.")}
    assert not bad, bad


def test_no_benchmark_script_forwards_to_a_package_module():
    bad = {str(p.relative_to(ROOT)): m for p in (ROOT / "benchmarks").rglob("*.py") for m, names in _imports(p)
           if m.startswith("p2pworker.bench") and "main" in names}
    assert not bad, f"shims: run the p2pworker command, or the module with python -m, instead: {bad}"
