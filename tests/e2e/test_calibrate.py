"""End to end: ``p2pworker calibrate`` against the session's real pair (tests/e2e/conftest.py): the prefill engine
is the source, the decode engine (on 127.0.0.2) the puller, short lengths and one rep.

What is asserted is the attribution and the exit status, never a timing: on the tiny test model recompute is so
cheap that the pull may lose at every length, and then calibrate must say NO CROSSOVER and exit 1 (llm-d's
script does the same) rather than recommend a value.  And its refusals on the same pair: an unreachable puller,
and a source address that is no worker (the engine's HTTP port)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers.ports import free_port

pytestmark = pytest.mark.timeout(300)


def calibrate(pd, *args: str, timeout_s: float = 240.0) -> subprocess.CompletedProcess:
    env = {**os.environ, "P2PWORKER_SECRET": pd.env["P2PWORKER_SECRET"]}
    return subprocess.run([sys.executable, "-m", "p2pworker.cli", "calibrate", "--timeout", "30", *args],
                          env=env, capture_output=True, text=True, timeout=timeout_s)


def test_calibrate_attributes_every_leg_on_a_real_pair(pd, tmp_path):
    out = tmp_path / "calibrate.json"
    p = calibrate(pd, "--source", pd.url("prefill"), "--puller", pd.url("decode"),
                  "--source-p2p", f"127.0.0.1:{pd.prefill_p2p}", "--puller-p2p", f"127.0.0.2:{pd.decode_p2p}",
                  "--lengths", "128,256", "--reps", "1", "--json", str(out))
    no_crossover = p.returncode == 1 and "NO CROSSOVER" in p.stderr
    assert p.returncode == 0 or no_crossover, f"rc {p.returncode}\n{p.stdout}\n{p.stderr}"
    doc = json.loads(out.read_text())
    pd.report["calibrate"] = {pt["length"]: {"recompute_ms": pt["recompute_ms"]["median"],
                                             "pull_ms": pt["pull_ms"]["median"]} for pt in doc["points"]}
    assert [pt["length"] for pt in doc["points"]] == [128, 256]
    assert [pt["pulled_tokens"] for pt in doc["points"]] == [[128], [256]]
    served = [(s["leg"], s["served"], s["cached"]) for s in doc["samples"]]
    for leg, what, cached in served:
        want = "recomputed" if leg == "recompute" else "p2p pull"
        assert what == want, served
        assert cached["host"] == 0 and cached["device"] == 0, served
    assert "tokens" in p.stdout and "recompute ms" in p.stdout  # the table
    if p.returncode == 0:
        assert f"MIN_CACHED_TOKEN_DELTA={doc['min_cached_token_delta']}" in p.stdout
        assert doc["min_cached_token_delta"] in (128, 256)
    else:
        assert doc["min_cached_token_delta"] is None and "MIN_CACHED_TOKEN_DELTA" not in p.stdout


def test_calibrate_refuses_an_unreachable_puller(pd):
    p = calibrate(pd, "--source", pd.url("prefill"), "--puller", f"http://127.0.0.1:{free_port()}",
                  "--source-p2p", f"127.0.0.1:{pd.prefill_p2p}", "--lengths", "128", "--reps", "1")
    assert p.returncode == 1, p.stdout + p.stderr
    assert "refused (unreachable)" in p.stderr and "Connection refused" in p.stderr


def test_calibrate_refuses_a_source_address_that_is_no_worker(pd):
    """The engine's HTTP port given as its worker's: the handshake fails within --timeout, before any request."""
    p = calibrate(pd, "--source", pd.url("prefill"), "--puller", pd.url("decode"),
                  "--source-p2p", f"127.0.0.1:{pd.prefill_http}", "--lengths", "128", "--reps", "1",
                  "--timeout", "5")
    assert p.returncode == 1, p.stdout + p.stderr
    assert "refused (unreachable)" in p.stderr and "did not answer a handshake" in p.stderr
