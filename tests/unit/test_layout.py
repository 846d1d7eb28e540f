"""The test tree's layout rules: helpers live in tests/helpers/, and no test module imports another test module or a
conftest (a renamed test would silently take its neighbours' constants with it)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.append(node.module)
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names]
    return out


def _forbidden(module: str) -> bool:
    last = module.rsplit(".", 1)[-1]
    return module.startswith("tests.") and (last.startswith("test_") or last == "conftest")


def test_no_test_module_imports_another_test_module_or_a_conftest():
    bad = {str(p.relative_to(TESTS)): m for p in TESTS.rglob("*.py") for m in _imports(p) if _forbidden(m)}
    assert not bad, bad


def test_the_rule_catches_both_kinds():
    assert _forbidden("tests.e2e.test_pd") and _forbidden("tests.fault.conftest")
    assert not _forbidden("tests.helpers.e2e") and not _forbidden("tests.helpers.session")
