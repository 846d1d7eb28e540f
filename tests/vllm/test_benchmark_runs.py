"""A short run of each benchmark that needs vLLM's managers but no `vllm serve` (pd_tier, scale_keys), as a user
starts it: it exits 0, writes its results file in the benchmarks' format, with every request checked, and leaves no
process or /dev/shm file of its own behind.  Speeds are the benchmarks' business, not this test's."""

from __future__ import annotations

import glob
import subprocess
import sys
from pathlib import Path

import pytest

from p2pworker.bench import results

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)


def _ours_in_shm() -> set[str]:
    return set(glob.glob("/dev/shm/*"))  # the suite runs one test at a time: anything new is the run's


def _run(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=280)


def test_pd_tier_short_run_writes_its_results_file(tmp_path):
    before = _ours_in_shm()
    out = tmp_path / "pd_tier.json"
    p = _run(["benchmarks/pd_tier.py", "--blocks", "1", "--reps", "2", "--geometries", "16384x8", "--tiers", "ours",
              "--json", str(out)])
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    doc = results.load(str(out), "pd_tier")
    g = doc["result"]["geometries"]["16 KiB x 8"]["ours"]
    assert g["all_ok"] and g["warm_ms"] > 0
    assert doc["vllm"] and doc["revision"]
    assert _ours_in_shm() <= before


def test_scale_keys_short_run_writes_its_results_file(tmp_path):
    before = _ours_in_shm()
    out = tmp_path / "scale_keys.json"
    p = _run(["benchmarks/scale_keys.py", "--sizes", "64", "--reps", "1", "--json", str(out)])
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    doc = results.load(str(out), "scale_keys")
    assert [r["chunks"] for r in doc["result"]["results"]] == [64] and doc["result"]["results"][0]["all_ok"]
    assert _ours_in_shm() <= before
