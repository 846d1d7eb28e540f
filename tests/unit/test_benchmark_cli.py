"""Every kept benchmark answers --help, and --replot prints the figures of its committed results file again (the
tables in benchmarks/README.md come from them); the results format refuses what is not one of its files.  A short
run of each benchmark that needs no `vllm serve` is in tests/vllm/test_benchmark_runs.py; the traffic benchmark's
load generator drives real engines in tests/e2e/test_traffic.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from p2pworker.bench import results

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(120)

SCRIPTS = ("pd_tier", "pull_vs_recompute", "traffic", "scale_keys", "idle_cpu")
# the committed results file each --replot reads, and a line its table prints
REPLOTS = {
    "pd_tier": ("pd_tier.json", "== 16 KiB x 64 chunks"),
    "pull_vs_recompute": ("pull_vs_recompute.json", "recompute"),
    "traffic": ("traffic-long_turns.json", "ours"),
    "scale_keys": ("scale_keys.json", "us/chunk"),
    "idle_cpu": ("idle_cpu.json", "tier - no_tier"),
}


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=100)


@pytest.mark.parametrize("name", SCRIPTS)
def test_each_benchmark_answers_help(name):
    p = _run(f"benchmarks/{name}.py", "--help")
    assert p.returncode == 0, p.stderr
    assert "--json" in p.stdout and "--replot" in p.stdout


@pytest.mark.parametrize("name", SCRIPTS)
def test_replot_prints_the_committed_figures_again(name):
    file, line = REPLOTS[name]
    p = _run(f"benchmarks/{name}.py", "--replot", f"benchmarks/results/{file}",
             *(("--plot", "") if name in ("pull_vs_recompute", "traffic") else ()))
    assert p.returncode == 0, p.stdout + p.stderr
    assert line in p.stdout


def test_a_results_file_carries_what_produced_it_and_is_read_back(tmp_path):
    run = results.Run("pd_tier", "hog")
    path = run.save(str(tmp_path / "x.json"), {"geometries": {}})
    doc = results.load(path, "pd_tier")
    assert doc["schema"] == results.SCHEMA and doc["scenario"] == "hog" and doc["result"] == {"geometries": {}}
    assert doc["command"] and doc["revision"] and doc["date"].endswith("Z")
    assert doc["machine"]["cores"] >= 1 and "loadavg_before" in doc["machine"] and "loadavg_after" in doc["machine"]
    assert Path(results.default_path("pd_tier", "hog")).name == "pd_tier-hog.json"


def test_a_file_of_another_shape_or_benchmark_is_refused_with_the_reason(tmp_path):
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"summary": {}}))
    with pytest.raises(results.NotAResult, match="not a results file"):
        results.load(str(old))
    path = results.Run("traffic").save(str(tmp_path / "t.json"), {})
    with pytest.raises(results.NotAResult, match="not of 'pd_tier'"):
        results.load(path, "pd_tier")
