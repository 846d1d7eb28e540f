"""End to end: the request shapes llm-d (routing sidecar + EPP) and vLLM's own p2p proxy send, on the main pair.

Both orchestrators were written for vLLM's in-tree p2p tier; each test sends one of their shapes straight to the
engines (as the sidecar or the proxy would) and compares the answer token for token with one engine answering
alone.  The pair is the session's (tests/e2e/conftest.py): prefill on 127.0.0.1, decode on 127.0.0.2, one worker
each; the decode engine runs with ``offload_prompt_only: false`` (llm-d's multi-turn P/D), so its generated KV sits
in its CPU tier for the next turn.  Every prompt has its own seed (no engine's prefix cache answers for another
test's prompt).  The stop at the end of the session (``running``) must be clean after all of this traffic: no
force-kill, nothing left in /dev/shm or /tmp.
"""

from __future__ import annotations

import os
import signal
import statistics
import threading
import time
import uuid

import pytest

from tests.helpers.e2e import BLOCK, assert_same, baseline, expected_p2p_tokens, http_json
from tests.helpers.tiny_model import prompt

pytestmark = pytest.mark.timeout(600)

IDLE_S = 2.0  # an engine with no request for this long has stopped stepping (vLLM 0.32 calls no tier then)
P2P = "vllm:prompt_tokens_cached_by_source_total"
PULL_KEYS = "vllm:kv_offload_p2pworker_pull_keys_total"
PULLS = "vllm:kv_offload_p2pworker_pulls_total"


@pytest.fixture(scope="module", autouse=True)
def warm(pd):
    """One plain request on each engine first: a fresh vLLM CPU engine's first request pays one-time costs (~3 s
    here) that would be counted against the first pull."""
    for which in ("prefill", "decode"):
        pd.complete(which, prompt(300, seed=5900 + (which == "decode")))


def p2p_tokens(pd, which: str) -> float:
    return pd.metric(which, P2P, source="p2p")


def source(pd, which: str, rid: str | None = None) -> dict:
    """A ``remote_kv_source`` entry naming that engine's worker (what llm-d's sidecar injects)."""
    host = "127.0.0.2" if which == "decode" else "127.0.0.1"
    port = pd.decode_p2p if which == "decode" else pd.prefill_p2p
    return {"kv_request_id": rid or f"pull-{uuid.uuid4().hex}", "remote_host": host, "remote_port": port}


def timed(fn, *args, **kw):
    t0 = time.monotonic()
    out = fn(*args, **kw)
    return out, time.monotonic() - t0


def pull(pd, text: str, src: dict, which: str = "decode"):
    """One request on ``which`` pulling its prefix from ``src``: (answer, seconds, P2P tokens it counted)."""
    before = p2p_tokens(pd, which)
    got, took = timed(pd.complete, which, text, kv_transfer_params={"remote_kv_source": src})
    return got, took, p2p_tokens(pd, which) - before


def released_after(pd, ended: float, what: str) -> float:
    """Seconds from ``ended`` (the decode's answer) until the prefill engine's worker holds no open job; fails past
    10 s.  The worker's own count: vLLM's gauge of it is refreshed only by engine steps, which an idle 0.34 engine
    does not take."""
    while pd.worker_status("prefill")["jobs_in_flight"] > 0:
        assert time.monotonic() - ended < 10, f"the prefill engine still holds {what}"
        time.sleep(0.05)
    return time.monotonic() - ended


def missed_keys(pd, which: str = "decode") -> float:
    """Keys one-trip loads of ``which`` promised that their source did not bring (vLLM recomputed them)."""
    return pd.metric(which, PULL_KEYS, outcome="missed")


def test_pull_from_an_idle_source_is_served_not_waited_out(pd):
    """vLLM's proxy in ``--p2p`` mode and llm-d's aggregated sharing: the prefill engine computes a prompt with no
    transfer params, sits idle (vLLM 0.32 stops calling its tiers), and the decode engine pulls that prefix with
    ``remote_kv_source``, in one round trip (its lookups answer at once, the load asks the source).  The idle source
    serves (its engine is woken for the load's ask): every full block is pulled, the answer equals one engine's, and
    the pull costs at most 1 s more than recomputing the same length (before the waker, the source's lookup sat
    unread until the puller's lookup_timeout_s, 5 s, and it recomputed)."""
    n = 520
    text = prompt(n, seed=6000)
    want = baseline(pd, text)
    pd.complete("prefill", text, max_tokens=1)  # the source holds the prompt in its CPU tier
    time.sleep(IDLE_S)
    one_trip = pd.metric("decode", PULLS, path="one_trip")
    got, took, pulled = pull(pd, text, source(pd, "prefill"))
    assert_same(got, want, "pulled from an idle source")
    assert pulled == expected_p2p_tokens(n), f"decode pulled {pulled} tokens, want {expected_p2p_tokens(n)}"
    assert pd.metric("decode", PULLS, path="one_trip") == one_trip + 1
    _, recompute_s = timed(pd.complete, "decode", prompt(n, seed=6001))
    pd.report["idle_source_pull_s"] = {"pull": round(took, 3), "recompute_same_length": round(recompute_s, 3)}
    assert took <= recompute_s + 1.0, f"pull from an idle source took {took:.2f} s, recompute {recompute_s:.2f} s"


def test_pull_from_a_busy_source_is_served(pd):
    """The same pull while the source engine generates for another request: served within its steps."""
    n = 640
    text = prompt(n, seed=6100)
    want = baseline(pd, text)
    pd.complete("prefill", text, max_tokens=1)
    busy = threading.Thread(target=pd.complete, args=("prefill", prompt(200, seed=6101)),
                            kwargs={"max_tokens": 300, "ignore_eos": True})
    busy.start()
    try:
        time.sleep(0.5)
        got, took, pulled = pull(pd, text, source(pd, "prefill"))
    finally:
        busy.join(120)
    assert not busy.is_alive()
    assert_same(got, want, "pulled from a busy source")
    assert pulled == expected_p2p_tokens(n)
    pd.report["busy_source_pull_s"] = round(took, 3)


LOOKUP_TIMEOUT_S = 5.0  # the engines' lookup_timeout_s (configs/vllm-cpu-*.json): a source's engine is waited this long


def test_an_unresponsive_source_makes_the_pull_recompute_within_its_lookup_timeout(pd):
    """The source's worker is up but its engine never answers (its EngineCore SIGSTOPped: the worker takes the
    link and the load's ask, nothing pins): the pull recomputes with the single-engine answer within
    lookup_timeout_s + one recompute + 1 s, instead of waiting on the source for ever (vLLM's in-tree tier: RETRY for
    ever, vllm-project/vllm#56823).  Resumed, the source serves the next pull."""
    n = 520
    text = prompt(n, seed=6180)
    want = baseline(pd, text)
    _, recompute_s = timed(pd.complete, "decode", prompt(n, seed=6181))
    pd.complete("prefill", text, max_tokens=1)  # the source holds the prompt
    (worker,) = pd.worker_pids("prefill")
    with open(f"/proc/{worker}/stat") as f:
        core = int(f.read().rsplit(")", 1)[1].split()[1])  # the worker's parent: the engine core its tier runs in
    os.kill(core, signal.SIGSTOP)
    try:
        got, took, pulled = pull(pd, text, source(pd, "prefill"))
    finally:
        os.kill(core, signal.SIGCONT)
    assert_same(got, want, "pulled from an unresponsive source")
    assert pulled == 0
    pd.report["unresponsive_source_pull_s"] = {"pull": round(took, 3), "recompute_same_length": round(recompute_s, 3)}
    # it waited on the source (not a stale hint's MISS), and not past the source's own bound
    assert 0.8 * LOOKUP_TIMEOUT_S <= took <= LOOKUP_TIMEOUT_S + recompute_s + 1.0, \
        f"a pull from an unresponsive source took {took:.2f} s (recompute {recompute_s:.2f} s)"
    text = prompt(n, seed=6182)
    want = baseline(pd, text)
    pd.complete("prefill", text, max_tokens=1)
    got, _, pulled = pull(pd, text, source(pd, "prefill"))
    assert_same(got, want, "pulled from the resumed source")
    assert pulled == expected_p2p_tokens(n), f"the resumed source served {pulled} tokens"


def test_prefill_leg_pulls_its_prefix_and_serves_the_decode(pd):
    """llm-d's P/D + P2P: the prefill leg carries ``remote_decoder`` AND ``remote_kv_source``.  Here the source is
    the decode engine, which holds a shared prefix: the prefill engine pulls it (p2p tokens on prefill), computes
    the rest, and parks every block for the decode; the decode already holds the shared prefix, loads the rest, and
    answers as one engine would.  The prefix blocks it never fetches are released when its request ends (Done):
    the prefill engine's open jobs are back to 0 within 1 s of the decode's answer, not after park_timeout_s."""
    shared = prompt(400, seed=6200)
    pd.complete("decode", shared, max_tokens=1)  # the decode engine (the source) holds the shared prefix
    text = shared + " " + prompt(300, seed=6201)
    n = len(text.split())
    want = baseline(pd, text)
    rid = f"pdp2p-{uuid.uuid4().hex}"
    before_prefill, before_decode = p2p_tokens(pd, "prefill"), p2p_tokens(pd, "decode")
    pd.complete("prefill", text, max_tokens=1, kv_transfer_params={
        "remote_decoder": {"kv_request_id": rid}, "remote_kv_source": source(pd, "decode")})
    pulled = p2p_tokens(pd, "prefill") - before_prefill
    assert pulled == 400 // BLOCK * BLOCK, f"the prefill leg pulled {pulled} tokens of the shared prefix"
    got = pd.complete("decode", text, kv_transfer_params={"remote_prefiller": {
        "kv_request_id": rid, "remote_host": "127.0.0.1", "remote_port": pd.prefill_p2p}})
    ended = time.monotonic()
    assert_same(got, want, "P/D + P2P request")
    loaded = p2p_tokens(pd, "decode") - before_decode
    assert 0 < loaded <= expected_p2p_tokens(n) - 400 // BLOCK * BLOCK, loaded  # the rest, not the shared prefix
    released_s = released_after(pd, ended, "parked stores nobody will fetch")
    pd.report["unfetched_released_s"] = round(released_s, 3)
    assert released_s <= 1.0, f"unfetched parked stores released {released_s:.2f} s after the decode's answer"


def test_a_decode_that_fetches_nothing_releases_the_producers_stores_at_once(pd):
    """The same prompt through PD twice (a retried request, a shared system prompt): the second time the decode
    engine holds every full block itself and fetches nothing.  The prefill engine's parked copies end when the
    decode's request ends (Done), within 1 s, not park_timeout_s (60 s) later; both answers equal one engine's."""
    text = prompt(520, seed=6250)
    want = baseline(pd, text)
    ended = None
    for i in range(2):
        rid = f"twice-{i}-{uuid.uuid4().hex}"
        before = p2p_tokens(pd, "decode")
        pd.complete("prefill", text, max_tokens=1, kv_transfer_params={"remote_decoder": {"kv_request_id": rid}})
        got = pd.complete("decode", text, kv_transfer_params={"remote_prefiller": {
            "kv_request_id": rid, "remote_host": "127.0.0.1", "remote_port": pd.prefill_p2p}})
        ended = time.monotonic()
        assert_same(got, want, f"PD request {i + 1} of the same prompt")
        loaded = p2p_tokens(pd, "decode") - before
        assert loaded == (expected_p2p_tokens(520) if i == 0 else 0), (i, loaded)
    released_s = released_after(pd, ended, "stores the decode never fetched")
    pd.report["nothing_fetched_released_s"] = round(released_s, 3)
    assert released_s <= 1.0, f"stores nobody fetched released {released_s:.2f} s after the decode's answer"


def test_multi_turn_pd_pulls_the_decodes_generated_kv(pd):
    """llm-d's multi-turn P/D: turn 1 through PD; the decode engine (offload_prompt_only: false) keeps the KV it
    generated in its CPU tier; turn 2's prefill leg (``remote_decoder`` + ``remote_kv_source`` naming the decode)
    pulls that history instead of recomputing it: p2p tokens on the prefill engine beyond what it computed in turn
    1, and both turns answer as one engine would."""
    turn1 = prompt(300, seed=6300)
    rid1 = f"turn1-{uuid.uuid4().hex}"
    pd.complete("prefill", turn1, max_tokens=1, kv_transfer_params={"remote_decoder": {"kv_request_id": rid1}})
    body = {"model": "tiny", "prompt": turn1, "max_tokens": 200, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "kv_transfer_params": {"remote_prefiller": {
                "kv_request_id": rid1, "remote_host": "127.0.0.1", "remote_port": pd.prefill_p2p}}}
    c = http_json(pd.url("decode") + "/v1/completions", body)["choices"][0]
    history = list(c["prompt_token_ids"]) + list(c["token_ids"])
    turn2 = history + [int(t) for t in c["prompt_token_ids"][1:41]]  # the next user message: 40 more tokens
    want = baseline(pd, turn2)
    rid2 = f"turn2-{uuid.uuid4().hex}"
    before = p2p_tokens(pd, "prefill")
    pd.complete("prefill", turn2, max_tokens=1, kv_transfer_params={
        "remote_decoder": {"kv_request_id": rid2}, "remote_kv_source": source(pd, "decode")})
    pulled = p2p_tokens(pd, "prefill") - before
    computed_in_turn1 = len(c["prompt_token_ids"]) // BLOCK * BLOCK
    assert pulled >= BLOCK, f"turn 2's prefill pulled {pulled} tokens of the decode's history"
    assert computed_in_turn1 + pulled >= (len(history) - 1) // BLOCK * BLOCK, (computed_in_turn1, pulled)
    got = pd.complete("decode", turn2, kv_transfer_params={"remote_prefiller": {
        "kv_request_id": rid2, "remote_host": "127.0.0.1", "remote_port": pd.prefill_p2p}})
    assert_same(got, want, "turn 2")


def test_concurrent_legs(pd):
    """llm-d's sidecar in ``offloading`` mode dispatches both legs at once (and vLLM's proxy with
    ``--decoder-first`` sends the decode leg first): the decode's request reaches its engine before the prefill
    engine stored anything; it waits for the stores and loads every full block."""
    n = 900
    text = prompt(n, seed=6400)
    want = baseline(pd, text)
    rid = f"both-{uuid.uuid4().hex}"
    before = p2p_tokens(pd, "decode")
    out: dict = {}

    def decode_leg():
        out["got"] = pd.complete("decode", text, kv_transfer_params={"remote_prefiller": {
            "kv_request_id": rid, "remote_host": "127.0.0.1", "remote_port": pd.prefill_p2p}})

    t = threading.Thread(target=decode_leg)
    t.start()
    time.sleep(0.2)  # the decode first
    pd.complete("prefill", text, max_tokens=1, kv_transfer_params={"remote_decoder": {"kv_request_id": rid}})
    t.join(120)
    assert not t.is_alive() and "got" in out
    assert_same(out["got"], want, "concurrent legs")
    assert p2p_tokens(pd, "decode") - before == expected_p2p_tokens(n)


@pytest.mark.parametrize("where", ["refused", "http"])
def test_a_mis_addressed_pull_recomputes_fast(pd, where):
    """A ``remote_kv_source`` naming a port nobody listens on (refused) or an engine's HTTP port (not a worker):
    the request recomputes with the single-engine answer.  Refused: at most 0.5 s more than recomputing (a refused
    connection is known at once); HTTP: bounded by the handshake timeout (3 s) plus slack.  The in-tree tier
    stalls here until the client gives up."""
    from tests.helpers.ports import free_ports

    port = free_ports(1)[0] if where == "refused" else pd.prefill_http
    src = {"kv_request_id": f"bad-{uuid.uuid4().hex}", "remote_host": "127.0.0.1", "remote_port": port}
    runs, plain = [], []
    for i in range(2):  # the second finds the address already known bad (backoff): as fast
        text = prompt(520, seed=6500 + 10 * i + (where == "http"))
        want = baseline(pd, text)
        got, took, pulled = pull(pd, text, src)
        assert_same(got, want, f"pull from a {where} address")
        assert pulled == 0
        runs.append(took)
        plain.append(timed(pd.complete, "decode", prompt(520, seed=6600 + 10 * i + (where == "http")))[1])
    pd.report[f"misaddressed_{where}_s"] = {"pull": [round(x, 3) for x in runs],
                                            "recompute": [round(x, 3) for x in plain]}
    extra = max(r - p for r, p in zip(runs, plain))
    assert extra <= (0.5 if where == "refused" else 3.0 + 1.0), f"{where}: {runs} s vs recompute {plain} s"
    assert statistics.median(runs) < 5.0


def test_a_source_that_evicted_its_copy_makes_the_pull_recompute(pd):
    """The source computed the prompt, then dropped its CPU tier (``/reset_prefix_cache?reset_external=true``, as a
    full tier's evictions would): the one-trip load's ask finds nothing, the load fails, the request recomputes with
    the single-engine answer, and the tier counts every promised key as missed, at most 1 s slower than recomputing.
    (A later request from that source whose first key it lacked asks first: tests/vllm/test_tier.py; here the
    puller's own CPU tier holds the recomputed prompt by then.)"""
    n = 520
    text = prompt(n, seed=6700)
    want = baseline(pd, text)
    pd.complete("prefill", text, max_tokens=1)
    assert http_json(pd.url("prefill") + "/reset_prefix_cache?reset_external=true", {}) is not None
    missed = missed_keys(pd)
    got, took, pulled = pull(pd, text, source(pd, "prefill"))
    assert_same(got, want, "pulled from a source that evicted its copy")
    assert pulled == 0
    assert missed_keys(pd) - missed == n // BLOCK, "every promised key counted as recomputed"
    _, recompute_s = timed(pd.complete, "decode", prompt(n, seed=6701))
    pd.report["evicted_source_pull_s"] = {"pull": round(took, 3), "recompute_same_length": round(recompute_s, 3)}
    assert took <= recompute_s + 1.0, f"a pull of nothing took {took:.2f} s, recompute {recompute_s:.2f} s"


def test_a_source_of_another_model_is_refused_and_the_pull_recomputes(pd, tmp_path):
    """A source whose worker serves another model (its KV fingerprint differs): the handshake refuses it, the
    one-trip load fails at once, and the request recomputes with the single-engine answer."""
    from p2pworker.client import WorkerClient
    from p2pworker.shm import KVRegion

    secret = pd.env.get("P2PWORKER_SECRET")  # the session's pair is given one; pd.sh generates one otherwise
    if not secret:
        with open(os.path.join(pd.run_dir, "secret")) as f:
            secret = f.read().strip()
    region = KVRegion.create(f"p2pw_e2e_other_{os.getpid()}", 16, 4096)
    other = WorkerClient("e2e-other-model", args=["--port", "0", "--admin", str(tmp_path / "other.admin")],
                         env={"P2PWORKER_SECRET": secret})
    try:
        other.attach(region.handle, {"model": "another-model"})
        host, port = other.ready.address.removeprefix("tcp://").rsplit(":", 1)
        n = 520
        text = prompt(n, seed=6800)
        want = baseline(pd, text)
        src = {"kv_request_id": f"other-{uuid.uuid4().hex}", "remote_host": host, "remote_port": int(port)}
        got, took, pulled = pull(pd, text, src)
        assert_same(got, want, "pulled from a source of another model")
        assert pulled == 0
        _, recompute_s = timed(pd.complete, "decode", prompt(n, seed=6801))
        pd.report["other_model_pull_s"] = {"pull": round(took, 3), "recompute_same_length": round(recompute_s, 3)}
        assert took <= recompute_s + 1.0, f"a refused pull took {took:.2f} s, recompute {recompute_s:.2f} s"
    finally:
        assert other.close() == 0
        region.close()


def test_a_dead_source_makes_the_pull_recompute_and_a_restarted_one_serves_again(pd):
    """The source engine's worker is SIGKILLed right after it held a prefix: the pull from it recomputes with the
    single-engine answer (its link is gone; nothing hangs); the engine's tier restarts the worker, and a later pull
    from it is served."""
    n = 520
    text = prompt(n, seed=6900)
    want = baseline(pd, text)
    pd.complete("prefill", text, max_tokens=1)
    (old,) = pd.worker_pids("prefill")
    os.kill(old, signal.SIGKILL)
    got, took, pulled = pull(pd, text, source(pd, "prefill"))
    assert_same(got, want, "pulled from a dead source")
    assert pulled == 0
    pd.report["dead_source_pull_s"] = round(took, 3)
    assert took < 10, f"a pull from a dead source took {took:.2f} s"
    deadline = time.monotonic() + 60
    for i in range(200):  # requests step the source engine: its tier notices the death and restarts the worker
        text = prompt(n, seed=6910 + i)
        pd.complete("prefill", text, max_tokens=1)
        if [p for p in pd.worker_pids("prefill") if p != old]:
            _, _, pulled = pull(pd, text, source(pd, "prefill"))
            if pulled == expected_p2p_tokens(n):
                break
        assert time.monotonic() < deadline, "no pull was served after the source's worker was restarted"
        time.sleep(0.5)
