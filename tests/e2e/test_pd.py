"""End to end: two real `vllm serve` engines (vLLM's CPU backend), the PD router, two p2pworkers, real NIXL.

Every prompt uses its own seed: prompts from one seed share a prefix, and an engine's own prefix
cache would otherwise answer instead of the P2P tier.  The baseline is the prefill engine answering
the whole prompt itself (a cache salt keeps it off any cached blocks): one non-disaggregated engine.
The tests run in file order on one pair of engines (scripts/pd.sh start ... stop).
"""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import stat
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import uuid
from pathlib import Path

import pytest

from tests.helpers.e2e import MAX_MODEL_LEN, ROOT, assert_same, baseline, expected_p2p_tokens, http_json
from tests.helpers.tiny_model import prompt

pytestmark = pytest.mark.timeout(600)



def pd_request(pd, n: int, seed: int):
    """One request through the router; returns (output, baseline, P2P-cached tokens on decode)."""
    text = prompt(n, seed)
    want = baseline(pd, text)
    before = pd.p2p_cached()
    # salted: a test run again in one session (a repeat of a flaky one) must not find its prompt in the decode
    # engine's own prefix cache from the run before, which would answer instead of the P2P tier
    got = pd.complete("router", text, cache_salt=f"pd-{uuid.uuid4().hex}")
    return got, want, pd.p2p_cached() - before


@pytest.mark.parametrize("n", [300, 520, 900, 1500])
def test_pd_output_equals_single_engine_and_comes_from_p2p(pd, n):
    """Through the router, decode's greedy tokens and logprobs equal one engine answering alone, and the
    decode engine's own metrics count every full prompt block as served by the P2P tier."""
    got, want, cached = pd_request(pd, n, seed=1000 + n)
    assert_same(got, want, f"{n}-token prompt")
    assert cached == expected_p2p_tokens(n), \
        f"decode served {cached} prompt tokens from P2P, want {expected_p2p_tokens(n)}"


def test_ttft_transfer_vs_recompute(pd):
    """For a long prompt the decode engine's time to first token, with the KV fetched from the prefill
    engine's worker vs recomputing it, measured side by side (medians of 3); also the whole router path."""
    n = MAX_MODEL_LEN - 64
    with_transfer, recompute, router = [], [], []
    for i in range(3):
        text = prompt(n, seed=2000 + i)
        rid = f"ttft-{uuid.uuid4().hex}"
        pd.complete("prefill", text, max_tokens=1, kv_transfer_params={"remote_decoder": {"kv_request_id": rid}})
        before = pd.p2p_cached()
        with_transfer.append(pd.ttft("decode", text, kv_transfer_params={"remote_prefiller": {
            "kv_request_id": rid, "remote_host": "127.0.0.1", "remote_port": pd.prefill_p2p}}))
        assert pd.p2p_cached() - before == expected_p2p_tokens(n)
        recompute.append(pd.ttft("decode", prompt(n, seed=2100 + i)))
        router.append(pd.ttft("router", prompt(n, seed=2200 + i)))
    pd.report["ttft_s"] = {"prompt_tokens": n, "decode_with_transfer": with_transfer, "decode_recompute": recompute,
                           "router_prefill_transfer_decode": router,
                           "median_ratio_transfer_over_recompute": round(
                               statistics.median(with_transfer) / statistics.median(recompute), 3)}
    print("\nTTFT", pd.report["ttft_s"])


def test_prefill_worker_killed_mid_transfer(pd):
    """The prefill engine's worker is hung (SIGSTOP) while a request's KV is parked in it and the decode
    worker is fetching, then SIGKILLed: the request still completes (decode recomputes) with the
    single-engine answer, in bounded time; the prefill tier restarts its worker and the next request
    is served over P2P again."""
    (old,) = pd.worker_pids("prefill")
    os.kill(old, signal.SIGSTOP)
    result: dict = {}

    def run():
        t0 = time.monotonic()
        try:
            result["out"] = pd_request(pd, 700, seed=3000)
        except Exception as e:  # noqa: BLE001 - reported below
            result["err"] = e
        result["s"] = time.monotonic() - t0

    t = threading.Thread(target=run)
    t.start()
    time.sleep(1.5)  # the prefill engine has answered its part; decode is waiting on the hung worker
    os.kill(old, signal.SIGKILL)
    t.join(60)
    assert not t.is_alive(), "request hung after the prefill worker was killed"
    assert "err" not in result, result.get("err")
    got, want, cached = result["out"]
    assert_same(got, want, "request whose transfer died")
    assert cached == 0
    pd.report["prefill_worker_killed_request_s"] = round(result["s"], 2)

    deadline = time.monotonic() + 30
    while not [p for p in pd.worker_pids("prefill") if p != old]:
        assert time.monotonic() < deadline, "the prefill tier did not restart its worker"
        time.sleep(0.2)
    # The restarted worker serves, and the decode worker's link to it is back on its own: the killed worker's
    # closed connection took that link down at once, and it is redialled at most [control] reconnect_max_s (1 s)
    # apart.  Then the very next request is served over P2P.
    t0 = time.monotonic()
    while not _linked(pd):
        assert time.monotonic() - t0 < 30, "the restarted prefill worker never served, or decode never linked to it"
        time.sleep(0.1)
    relinked = time.monotonic() - t0
    t0 = time.monotonic()
    got, want, cached = pd_request(pd, 640, seed=3100)
    took = round(time.monotonic() - t0, 2)
    assert_same(got, want, "request after the prefill worker restart")
    assert cached == expected_p2p_tokens(640), \
        f"the first request after the prefill worker restarted was not served over P2P ({cached} tokens)"
    pd.report.setdefault("after_prefill_worker_restart_request_s", []).append(took)
    pd.report.setdefault("prefill_worker_restart_relinked_s", []).append(round(relinked, 2))
    assert took < 10, f"the request waited {took} s after the worker restart (fetch for a lost parcel?)"


def _linked(pd) -> bool:
    """The prefill engine's (restarted) worker runs, and the decode worker holds an active session with it."""
    try:
        pre = pd.worker_status("prefill")
        dec = pd.worker_status("decode")
    except (OSError, ValueError):  # its admin socket is not there yet (the new worker is starting)
        return False
    return pre.get("state") == "running" and any(
        row["peer_id"] == pre["node_id"] and row["state"] == "active" for row in dec["sessions"])


def test_decode_restart_mid_run(pd):
    """The decode engine is stopped and started again while a request is in flight: that request ends
    (answered or a clean HTTP error, never a hang), and requests after the restart are served over
    P2P by the new decode engine with the single-engine answer."""
    result: dict = {}

    def inflight():
        try:
            result["out"] = pd.complete("router", prompt(1800, seed=4000), max_tokens=200)
        except (urllib.error.HTTPError, urllib.error.URLError, ConnectionError) as e:
            result["err"] = e

    t = threading.Thread(target=inflight)
    t.start()
    time.sleep(0.5)
    p = pd.script("restart-decode")
    assert p.returncode == 0, f"restart-decode failed:\n{p.stdout}\n{p.stderr}"
    t.join(60)
    assert not t.is_alive(), "the in-flight request hung across the decode restart"
    assert "out" in result or "err" in result
    got, want, cached = pd_request(pd, 777, seed=4100)
    assert_same(got, want, "request after the decode restart")
    assert cached == expected_p2p_tokens(777)


def test_negative_control_corrupted_transfer_changes_output(pd):
    """The test can fail: with the decode worker scrambling every block it loads (tests/hooks/corrupt_loads.py,
    loaded through the worker's one hook, $P2PWORKER_HOOK), the KV still comes from P2P but the output differs
    from the single-engine answer."""
    hook = f" P2PWORKER_HOOK=tests.hooks.corrupt_loads:install PYTHONPATH={ROOT}"
    p = pd.script("restart-decode", DECODE_ENV=pd.env["DECODE_ENV"] + hook)
    assert p.returncode == 0, f"restart-decode failed:\n{p.stdout}\n{p.stderr}"
    differ = 0
    for n, seed in ((520, 5000), (900, 5001)):
        got, want, cached = pd_request(pd, n, seed)
        assert cached == expected_p2p_tokens(n)
        differ += got[0] != want[0]
    assert differ == 2, "corrupted KV did not change the output: the equality tests would prove nothing"


def test_every_metric_the_dashboard_queries_is_exported(pd):
    """dashboards/p2pworker.json: each metric a panel queries, with its literal label matchers (source="p2p",
    outcome="failed", ...), has a series on this running pair's endpoints: vLLM's /metrics (its own series and the
    tier's, through vLLM's metric hook) or a worker's (worker_settings inline in the kv-transfer-config turned them
    on).  Runs after the requests above, so every series has had its chance to appear."""
    with open(os.path.join(ROOT, "dashboards", "p2pworker.json")) as f:
        dash = json.load(f)
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(dash["panels"]) >= 6 and all(exprs)
    # (metric, {label: value}) for every metric a query names, with its `label="value"` matchers
    queried = []
    for e in exprs:
        for name, selector in re.findall(r"\b((?:vllm:|p2pworker_)[A-Za-z0-9_:]*)(\{[^}]*\})?", e):
            literal = {k: v for k, op, v in re.findall(r'(\w+)\s*(=~|!=|=)\s*"([^"]*)"', selector)
                       if op == "=" and "$" not in v}
            queried.append((name, literal))
    series: dict[str, list[dict]] = {}
    for which in ("prefill", "decode", "prefill-worker", "decode-worker"):
        text = http_json(pd.url(which) + "/metrics")
        for name, labels in re.findall(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{([^}]*)\})? ", text, re.M):
            series.setdefault(name, []).append(dict(re.findall(r'(\w+)="([^"]*)"', labels)))
    missing = [(name, want) for name, want in queried
               if not any(want.items() <= have.items() for have in series.get(name, []))]
    assert not missing, f"the dashboard queries series nobody exports: {missing}"
    # the tier's own counters reached vLLM's /metrics with real counts (not only declared)
    assert pd.metric("decode", "vllm:kv_offload_p2pworker_loads_total", outcome="ok") >= 1
    # and join the workers' series: the tier's `worker` label is the worker's `engine` label, for both engines
    tier_workers = {lab["worker"] for lab in series["vllm:kv_offload_p2pworker_loads_total"]}
    worker_engines = {lab["engine"] for lab in series["p2pworker_sessions"]}
    assert len(worker_engines) == 2 and worker_engines <= tier_workers, (worker_engines, tier_workers)
    names = sorted({n for n, _ in queried})
    print(f"dashboard: {len(dash['panels'])} panels, {len(queried)} queried series of {len(names)} metrics, all "
          f"exported: {names}")


def test_vllms_ipc_sockets_live_in_the_engines_own_directory(pd):
    """A SIGTERMed `vllm serve` leaves its ZMQ ipc sockets behind (an e2e run left 56 in /tmp): pd.sh gives each
    engine its own VLLM_RPC_BASE_PATH and removes it at stop (checked gone by `running` after the stop)."""
    for role in ("prefill", "decode"):
        d = pd.rpc_dir(role)
        assert d and d.startswith(f"/tmp/p2pw-pd-{role}."), d
        socks = [n for n in os.listdir(d) if stat.S_ISSOCK(os.stat(os.path.join(d, n)).st_mode)]
        assert socks, f"{role}: vLLM made no ipc socket in {d}: is VLLM_RPC_BASE_PATH still what it reads?"


def test_each_role_listens_where_pd_sh_was_told(pd):
    """The pair was started one role at a time with DECODE_HOST=127.0.0.2: the decode engine answers there (every
    decode request of this module went there) and its worker's control port is bound and advertised there."""
    (admin,) = glob.glob(f"/tmp/p2pworker-vllm-{pd.engine_id('decode')}*.admin")
    res = subprocess.run([str(Path(sys.executable).with_name("p2pworker")), "inspect", "--json", "--admin", admin],
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    (st,) = json.loads(res.stdout)
    assert st["address"].startswith("tcp://127.0.0.2:"), st["address"]
    # both engines on this host, sharing /dev/shm and the PID namespace: the decode worker copies the prefill
    # engine's rows out of its region file (the same-host path), the session made by this module's requests
    up = [(s["data_path"], s["data_path_why"]) for s in st["sessions"] if s["state"] == "active"]
    assert up and set(up) == {("same_host", "")}, st["sessions"]
    assert pd.env["DECODE_HOST"] == "127.0.0.2" and pd.url("decode").startswith("http://127.0.0.2:")
