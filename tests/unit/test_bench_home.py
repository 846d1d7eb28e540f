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


KEPT = {"engines.py", "ideal_tier.py", "idle_cpu.py", "pd_tier.py", "pull_vs_recompute.py", "scale_keys.py",
        "traffic.py", "traffic_load.py", "traffic_plan.py"}


def test_benchmarks_holds_the_few_scripts_users_run_and_their_modules():
    # a new study is a run of a kept benchmark (or a commit message), not another script
    top = {p.name for p in (ROOT / "benchmarks").glob("*.py")}
    assert top == KEPT and len(top) <= 10


def test_every_results_file_is_one_of_a_kept_benchmark_under_its_one_name():
    from p2pworker.bench import results

    files = sorted((ROOT / "benchmarks" / "results").glob("*.json"))
    assert files, "the figures in benchmarks/README.md come from results files"
    for f in files:
        doc = results.load(str(f))
        assert f"{doc['benchmark']}.py" in KEPT or doc["benchmark"] == "bench", f.name  # bench: `p2pworker bench`
        assert Path(results.default_path(doc["benchmark"], doc["scenario"])).name == f.name
        for key in ("command", "revision", "date", "vllm", "nixl", "machine"):
            assert key in doc, (f.name, key)
        assert {"cores", "autogroup", "loadavg_before", "loadavg_after"} <= set(doc["machine"]), f.name


def test_every_figure_file_the_readmes_cite_exists_and_is_a_results_file():
    import re

    cited = set()
    for page in (ROOT / "README.md", ROOT / "benchmarks" / "README.md"):
        cited |= set(re.findall(r"benchmarks/results/[\w.-]+\.json|(?<=\()results/[\w.-]+\.json", page.read_text()))
    assert cited
    for c in cited:
        path = ROOT / (c if c.startswith("benchmarks/") else f"benchmarks/{c}")
        assert path.exists(), c
