"""End to end: a short multi-turn chat workload (benchmarks/traffic.py's, small N) on the session's pair
(tests/e2e/conftest.py), ours only.

First the llm-d P2P shape: each turn on the other engine than the last, ``remote_kv_source`` naming the last turn's
engine (the prefill engine on 127.0.0.1 and the decode engine on 127.0.0.2 both serve and pull).  Then the PD shape
through `p2pworker router`: 48 requests, 16 conversations at once, each turn after the first naming the decode's
worker as its KV source.  Every request must be answered, every sampled answer must equal a plain engine's (the
same engine with a cache_salt), pulls must have happened, and the engines must log no ERROR or Traceback meanwhile.
The pair's stop after the session (tests/helpers/e2e.py ``running``) must then be clean: within its bound, nothing
left, and no ERROR or Traceback logged while stopping."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest

from benchmarks.traffic_load import Endpoint, Fleet, run_rate
from benchmarks.traffic_plan import Arm, Span, Workload

pytestmark = pytest.mark.timeout(360)

SMALL = Workload(conversations=8, turns=3, system_prompts=2, system_tokens=256, user_tokens=Span(150, 300),
                 answer_tokens=Span(40, 100), output_tokens=12, think_s=0.5, check_every=2, seed=4242)


def _hooked(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return b"P2PWORKER_HOOK=" in f.read()
    except OSError:
        return False


@pytest.fixture(scope="module", autouse=True)
def plain_decode(pd):
    """The decode engine as pd.sh starts it: test_pd.py's negative control leaves its worker scrambling every load
    (tests/hooks/corrupt_loads.py), so it is restarted without the hook first when any of its workers carries one."""
    if any(_hooked(p) for p in pd.worker_pids("decode")):
        p = pd.script("restart-decode")
        assert p.returncode == 0, f"restart-decode failed:\n{p.stdout}\n{p.stderr}"
        pd.report["traffic_restarted_decode_without_hook"] = True


def _pid(pd, role: str) -> int | None:
    try:
        with open(os.path.join(pd.run_dir, f"{role}.pid")) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def endpoints(pd) -> list[Endpoint]:
    return [Endpoint(pd.url("prefill"), "127.0.0.1", pd.prefill_p2p, _pid(pd, "prefill")),
            Endpoint(pd.url("decode"), pd.env["DECODE_HOST"], pd.decode_p2p, _pid(pd, "decode"))]


def _check(res: dict, what: str) -> None:
    c = res["client"]
    assert c["failed"] == 0, f"{what}: {c['failed']} of {c['requests']} requests failed: {res['errors']}"
    assert res["answers_checked"] > 0 and not res["answer_problems"], f"{what}: {res['answer_problems']}"


def test_multi_turn_chat_on_the_p2p_shape_pulls_and_answers_like_a_plain_engine(pd):
    offsets = pd.log_offsets()
    fleet = Fleet(endpoints(pd), Arm.OURS)
    res = run_rate(fleet, SMALL, rate=2.0, salt=1, timeout_s=60, deadline_s=120, tol=1e-4)
    pd.report["traffic_p2p"] = {k: res[k] for k in ("client", "tokens", "tier_counters", "cpu")}
    print("\ntraffic, p2p shape:", pd.report["traffic_p2p"])
    _check(res, "p2p shape")
    assert res["tokens"]["pulled_tokens"] > 0, f"no prompt token was pulled: {res['tokens']}"
    assert not pd.error_lines(offsets), pd.error_lines(offsets)


def test_multi_turn_chat_through_the_pd_router_16_at_a_time(pd):
    """The load of the stop that once logged EngineDeadError: 48 requests, 16 at a time, through the router."""
    offsets = pd.log_offsets()
    w = replace(SMALL, conversations=16, think_s=0.0, check_every=4, seed=4343)
    fleet = Fleet(endpoints(pd), Arm.OURS, router=pd.url("router"),
                  decode_worker=f"{pd.env['DECODE_HOST']}:{pd.decode_p2p}")
    before = pd.p2p_cached()
    res = run_rate(fleet, w, rate=1000.0, salt=2, timeout_s=120, deadline_s=180, tol=1e-4)
    pd.report["traffic_pd"] = {k: res[k] for k in ("client", "tokens", "tier_counters", "cpu")}
    print("\ntraffic, pd shape:", pd.report["traffic_pd"])
    _check(res, "pd shape")
    assert res["client"]["requests"] == 48
    assert pd.p2p_cached() - before > 0, "the decode engine served no prompt token over P2P"
    assert not pd.error_lines(offsets), pd.error_lines(offsets)
