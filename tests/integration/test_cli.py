"""The console script, run as a user would run it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BIN = Path(sys.executable).with_name("p2pworker")


def _run(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN), *args], capture_output=True, text=True, timeout=timeout_s, check=False)


def test_bench_ring_prints_one_json_line_per_contender():
    res = _run("bench-ring", "-n", "2000", "--warmup", "200", "--wake-n", "20")
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    assert [r["contender"] for r in rows] == ["p2pworker_ring", "p2pworker_ring_wake", "mp_queue", "zmq_ipc_pair"]
    for r in rows:
        assert 0 < r["p50_us"] <= r["p99_us"], r
    by = {r["contender"]: r for r in rows}
    assert by["p2pworker_ring"]["p50_us"] < by["zmq_ipc_pair"]["p50_us"]


def test_sweep_removes_only_its_prefix(shm_prefix):
    mine = f"/dev/shm/{shm_prefix}a"
    Path(mine).write_bytes(b"x")
    res = _run("sweep", "--dry-run", shm_prefix)
    assert res.returncode == 0 and res.stdout.split() == [mine]
    assert os.path.exists(mine)
    res = _run("sweep", shm_prefix)
    assert res.returncode == 0 and res.stdout.split() == [mine]
    assert not os.path.exists(mine)
    res = _run("sweep", "")  # an empty prefix would match everything: a usage error, not a traceback
    assert res.returncode == 2 and "empty prefix" in res.stderr and "Traceback" not in res.stderr


def test_demo_moves_and_verifies_and_cleans_up():
    res = _run("demo", "--requests", "6", "--blocks", "16", "--block-kib", "64", "--inflight", "2", timeout_s=180)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "verified byte-exact: 6/6 requests; mismatches 0; failures 0; worker exit codes [0, 0]" in res.stdout
    assert "demo OK" in res.stdout
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(("p2pw_pd_", "p2pw_prefill_", "p2pw_decode_"))]


def test_inspect_exit_status_says_whether_the_worker_answered(tmp_path):
    missing = str(tmp_path / "nobody.admin")
    for args in (("inspect", "--admin", missing), ("inspect", "--json", "--admin", missing)):
        res = _run(*args, "--timeout", "1")
        assert res.returncode == 1, (args, res.stdout, res.stderr)
        assert "Traceback" not in res.stderr
    assert "did not answer" in _run("inspect", "--admin", missing, "--timeout", "1").stderr
    assert json.loads(_run("inspect", "--json", "--admin", missing, "--timeout", "1").stdout)[0]["error"]


def test_verbosity_and_the_inherited_log_level():
    import logging

    from p2pworker.cli import log_levels

    assert log_levels(0, {}) == (logging.INFO, logging.INFO)
    assert log_levels(0, {"VLLM_LOGGING_LEVEL": "WARNING"}) == (logging.WARNING, logging.WARNING)
    assert log_levels(0, {"VLLM_LOGGING_LEVEL": "WARNING", "P2PWORKER_LOG_LEVEL": "debug"}) == (
        logging.DEBUG, logging.DEBUG)
    assert log_levels(1, {"VLLM_LOGGING_LEVEL": "WARNING"}) == (logging.WARNING, logging.DEBUG)  # ours only
    assert log_levels(2, {}) == (logging.DEBUG, logging.DEBUG)
    assert log_levels(0, {"VLLM_LOGGING_LEVEL": "nonsense"}) == (logging.INFO, logging.INFO)


def test_config_check_prints_effective_settings_or_the_error(tmp_path):
    res = _run("config", "check", str(Path(__file__).resolve().parents[2] / "configs" / "prefill.toml"))
    assert res.returncode == 0, res.stderr
    cfg = json.loads(res.stdout)
    assert cfg["name"] == "prefill" and cfg["control"]["port"] == 5710 and cfg["session"]["load_timeout_s"] == 30.0
    bad = tmp_path / "bad.toml"
    bad.write_text("[control]\nport = '5710'\nsecret = 'hunter2'\n")
    res = _run("config", "check", str(bad))
    assert res.returncode == 1 and f"{bad}: $.control.port: Expected `int | null`, got `str`" in res.stderr
    assert "Traceback" not in res.stderr
    ok = tmp_path / "ok.toml"
    ok.write_text("[control]\nsecret = 'hunter2'\n")
    res = _run("config", "check", str(ok))
    assert res.returncode == 0 and "hunter2" not in res.stdout and json.loads(res.stdout)["control"]["secret"] == "***"


def test_bench_reports_workers_vs_raw_nixl(tmp_path):
    from p2pworker.bench import results

    saved = tmp_path / "bench.json"
    res = _run("bench", "--json", "--block-kib", "64", "--blocks", "16", "--requests", "4", "--inflight", "2",
               "--save", str(saved), timeout_s=240)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    doc = results.load(str(saved), "bench")  # the same rows, in the benchmarks' results format
    assert doc["result"]["rows"] == rows and doc["command"].split()[1:3] == ["bench", "--json"]
    assert [r["data_path"] for r in rows] == ["nixl", "same_host"]  # each path checked against inspect by bench
    assert "bench [" in res.stderr and "64 KiB x 16" in res.stderr  # progress while it runs, on stderr
    for row in rows:
        assert row["block_bytes"] == 65536 and row["blocks"] == 16
        assert row["workers_gbps"] > 0 and row["raw_nixl_gbps"] > 0 and row["memcpy_gbps"] > 0
        # the printed figures are rounded independently: compare with a tolerance, never rounded to rounded
        assert abs(row["ratio"] - row["workers_gbps"] / row["raw_nixl_gbps"]) <= 0.002 + 0.01 * row["ratio"]
        assert abs(row["vs_memcpy"] - row["workers_gbps"] / row["memcpy_gbps"]) <= 0.002 + 0.01 * row["vs_memcpy"]
