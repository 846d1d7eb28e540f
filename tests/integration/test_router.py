"""The router (`p2pworker router`) as a real process in front of fake engines that are real processes too
(tests/helpers/fakes/engine.py), so a test can kill one mid-request."""

from __future__ import annotations

import asyncio
import errno
import gzip
import http.client
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import types
import urllib.request
from pathlib import Path

import aiohttp
import pytest
from multidict import CIMultiDict

from p2pworker.control.base import DEFAULT_PORT
from p2pworker.router import server
from p2pworker.router.pool import (ERRORS_TO_DOWN, MOVES, Backoff, Instance, InstanceState, Outcome, Policy, Pool,
                                   Role, parse_instance)
from p2pworker.router.routing import HostPort, Routing, routing_of
from p2pworker.router.upstream import Reason, classify
from tests.helpers.fakes.fleet import FakeEngine, FakeWorkerPort, Router
from tests.helpers.ports import free_port

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def fleet(tmp_path):
    """Makes engines, worker ports and routers; stops every one of them at the end (a router must exit 0 on
    SIGTERM)."""
    made: list = []

    class Fleet:
        def engine(self, name: str, **kw) -> FakeEngine:
            made.append(e := FakeEngine(name, tmp_path, **kw))
            return e

        def worker(self) -> FakeWorkerPort:
            made.append(w := FakeWorkerPort())
            return w

        def router(self, prefill: list[str], decode: list[str], *flags: str) -> Router:
            made.append(r := Router(tmp_path, prefill, decode, *flags))
            return r

        def module_router(self, prefill: list[str], decode: list[str], *flags: str) -> Router:
            made.append(r := _ModuleRouter(tmp_path, prefill, decode, *flags))
            return r

    yield Fleet()
    codes = []
    for thing in reversed(made):
        if isinstance(thing, Router):
            codes.append((thing.stop(), thing.log.read_text()[-2000:]))
        elif isinstance(thing, FakeEngine):
            thing.stop()
        else:
            thing.close()
    for code, log in codes:
        assert code == 0, f"router exit {code} on SIGTERM:\n{log}"


class _ModuleRouter(Router):
    """The same router run as `python -m p2pworker.router` (p2pworker/router/__main__.py)."""

    COMMAND = [sys.executable, "-m", "p2pworker.router"]


def _lower(headers: dict) -> dict:
    return {k.lower(): v for k, v in headers.items()}


def _prefill(e: FakeEngine, w: FakeWorkerPort) -> str:
    return f"{e.url},worker=127.0.0.1:{w.port}"


def _wait(cond, timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"{what} not met within {timeout_s} s"
        time.sleep(0.05)


def _read_until(s: socket.socket, marker: bytes, timeout_s: float = 10.0) -> bytes:
    s.settimeout(timeout_s)
    got = b""
    while marker not in got:
        chunk = s.recv(65536)
        assert chunk, f"closed before {marker!r}: {got[-200:]!r}"
        got += chunk
    return got


# ---- the pool (sans-IO) -------------------------------------------------------------------------------------------

def test_moves_table_covers_every_state_and_outcome_and_only_health_or_success_brings_back():
    assert set(MOVES) == {(s, o) for s in InstanceState for o in Outcome}
    assert all(MOVES[(s, Outcome.FAILED)] is InstanceState.DOWN for s in InstanceState)
    assert all(MOVES[(s, Outcome.OK)] is InstanceState.UP for s in InstanceState)
    assert all(MOVES[(s, Outcome.ERROR)] is s for s in InstanceState)  # alone, an error moves nothing


def test_errors_take_an_instance_out_only_several_in_a_row_and_reasons_map_to_outcomes():
    i = Instance(Role.DECODE, "http://h:1")
    for _ in range(ERRORS_TO_DOWN - 1):
        i.record(Outcome.ERROR, now=1.0, error="HTTP 500")
    i.record(Outcome.OK, now=2.0)  # an answer in between starts the count again
    for _ in range(ERRORS_TO_DOWN - 1):
        assert i.record(Outcome.ERROR, now=3.0) is InstanceState.UP and i.state is InstanceState.UP
    i.record(Outcome.ERROR, now=4.0, error="HTTP 503")
    assert i.state is InstanceState.DOWN and (i.last_error, i.failed_at) == ("HTTP 503", 4.0)
    assert {r: r.outcome for r in Reason} == {
        Reason.UNREACHABLE: Outcome.FAILED, Reason.DISCONNECTED: Outcome.FAILED, Reason.TIMEOUT: Outcome.ERROR,
        Reason.HTTP_5XX: Outcome.ERROR, Reason.HTTP_4XX: Outcome.OK, Reason.LOCAL: None}


def test_a_connect_that_fails_for_want_of_local_resources_is_not_the_instance_absence():
    key = types.SimpleNamespace(host="h", port=1, ssl=True, is_ssl=False)
    for code in (errno.EMFILE, errno.ENFILE, errno.EADDRNOTAVAIL, errno.ENOBUFS):
        assert classify(aiohttp.ClientConnectorError(key, OSError(code, os.strerror(code)))).reason is Reason.LOCAL
    refused = aiohttp.ClientConnectorError(key, ConnectionRefusedError(errno.ECONNREFUSED, "refused"))
    assert classify(refused).reason is Reason.UNREACHABLE
    assert classify(aiohttp.ServerDisconnectedError()).reason is Reason.DISCONNECTED


def test_pool_picks_least_in_flight_rotates_ties_and_falls_back_to_the_oldest_failure():
    a, b, c = (Instance(Role.DECODE, f"http://h:{p}") for p in (1, 2, 3))
    pool = Pool([a, b, c])
    assert [pool.pick().url for _ in range(3)] == ["http://h:1", "http://h:2", "http://h:3"]  # ties rotate
    a.in_flight, b.in_flight, c.in_flight = 2, 0, 1
    assert {pool.pick() is b for _ in range(3)} == {True}
    b.record(Outcome.FAILED, now=5.0, error="x")
    assert pool.pick() is c and pool.pick(exclude=(c,)) is a
    a.record(Outcome.FAILED, now=7.0)
    c.record(Outcome.FAILED, now=6.0)
    assert pool.pick() is b  # none up: the one that failed longest ago
    assert pool.pick(exclude=(a, b, c)) is None  # None only once every instance was tried
    # prefill too: a down instance gets a real attempt before decode recomputes
    pre = Pool([Instance(Role.PREFILL, "http://h:4"), Instance(Role.PREFILL, "http://h:5")])
    for i, inst in enumerate(pre.instances):
        inst.record(Outcome.FAILED, now=9.0 - i)
    assert [pre.pick(exclude=()).url, pre.pick(exclude=(pre.instances[1],)).url] == ["http://h:5", "http://h:4"]
    rr = Pool([Instance(Role.DECODE, "http://h:1", in_flight=9), Instance(Role.DECODE, "http://h:2")],
              Policy.ROUND_ROBIN)
    assert [rr.pick().url for _ in range(2)] == ["http://h:1", "http://h:2"]  # in-flight counts ignored


def test_reprobe_backoff_doubles_from_its_first_delay_up_to_the_health_interval():
    b = Backoff(0.2, 5.0)
    assert [b.next() for _ in range(7)] == pytest.approx([0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0])
    assert Backoff(0.2, 0.1).next() == 0.1  # a health interval shorter than the first delay bounds it too


def test_routing_headers_parse_as_llm_d_sends_them_and_malformed_ones_are_refused():
    r = routing_of(CIMultiDict([("X-Prefiller-Host-Port", "10.0.0.5:8100, Pre:8101"),
                                ("x-prefiller-host-port", "[::1]:8102"), ("x-prefiller-host-port", "pre:8101"),
                                ("X-KV-Cache-Source-Host-Port", " peer:5711 ")]))
    assert r.prefillers == (HostPort("10.0.0.5", 8100), HostPort("pre", 8101), HostPort("::1", 8102))  # deduped
    assert str(r.prefillers[2]) == "[::1]:8102" and r.kv_source == HostPort("peer", 5711)
    assert routing_of(CIMultiDict()) == Routing()
    for bad in ("pre", "pre:", "pre:0", "pre:70000", "pre:x", "http://pre:1", "pre:1/v1", "u@pre:1", ":1"):
        with pytest.raises(ValueError, match="x-prefiller-host-port"):
            routing_of(CIMultiDict({"x-prefiller-host-port": bad}))
    with pytest.raises(ValueError, match="one HOST:PORT"):
        routing_of(CIMultiDict({"x-kv-cache-source-host-port": "a:1,b:2"}))


def test_ad_hoc_prefill_instances_are_bounded_and_the_forgotten_ones_leave_metrics():
    app = server.Router(server.RouterConfig(prefill=("http://pre:8100",), decode=("http://dec:8200",)))
    assert app.fleet.named_prefill(HostPort("pre", 8100)) is app.prefill.instances[0]  # configured: matched
    first = app.fleet.named_prefill(HostPort("10.0.0.1", 8100))
    assert first.ad_hoc and first.worker == ("10.0.0.1", DEFAULT_PORT)
    assert app.fleet.named_prefill(HostPort("10.0.0.1", 8100)) is first  # remembered
    for i in range(server.AD_HOC_MAX):
        app.fleet.named_prefill(HostPort("10.0.1.1", 9000 + i))
    assert len(app.ad_hoc) == server.AD_HOC_MAX and "10.0.0.1:8100" not in app.ad_hoc  # the least recent went
    exposed = {s.labels.get("instance") for m in app.metrics.registry.collect() for s in m.samples}
    assert "10.0.0.1:8100" not in exposed and "10.0.1.1:9000" in exposed


def test_instance_specs():
    p = parse_instance(Role.PREFILL, "http://10.0.0.5:8100,worker=10.0.0.5:5711", 5710)
    assert (p.url, p.worker, p.name) == ("http://10.0.0.5:8100", ("10.0.0.5", 5711), "10.0.0.5:8100")
    assert parse_instance(Role.PREFILL, "http://pre:8100/", 5710).worker == ("pre", 5710)
    assert parse_instance(Role.DECODE, "http://dec:8200", 5710).worker is None
    for bad in ("https://x:1", "http://x:1/v1", "x:1", "http://x:1,worker=x", "http://x:1,weight=2"):
        with pytest.raises(ValueError):
            parse_instance(Role.PREFILL, bad, 5710)
    with pytest.raises(ValueError, match="no options"):
        parse_instance(Role.DECODE, "http://x:1,worker=y:2", 5710)


# ---- one of each --------------------------------------------------------------------------------------------------

def test_prefill_then_decode_with_matching_params_and_every_end_to_end_header(fleet):
    pre, dec, w = fleet.engine("p1"), fleet.engine("d1"), fleet.worker()
    r = fleet.router([_prefill(pre, w)], [dec.url])
    status, headers, body = r.request(
        "POST", "/v1/completions",
        {"model": "tiny", "prompt": "hello", "max_tokens": 7, "stream_options": {"include_usage": True},
         "kv_transfer_params": {"remote_prefiller": {"remote_host": "evil"}}},  # the client's own is replaced
        headers={"Authorization": "Bearer sk-1", "X-Request-Id": "req-42", "X-Custom": "kept",
                 "Connection": "keep-alive, X-Hop", "X-Hop": "dropped", "Proxy-Authorization": "dropped",
                 "Keep-Alive": "timeout=5", "Expect": "100-continue"})
    assert status == 200, body
    (p,), (d,) = pre.seen(), dec.seen()
    assert p["body"]["max_tokens"] == 1 and p["body"]["stream"] is False and "stream_options" not in p["body"]
    kv_id = p["body"]["kv_transfer_params"]["remote_decoder"]["kv_request_id"]
    assert d["body"]["max_tokens"] == 7 and d["body"]["prompt"] == "hello"
    assert d["body"]["kv_transfer_params"] == {"remote_prefiller": {
        "kv_request_id": kv_id, "remote_host": "127.0.0.1", "remote_port": w.port}}
    for seen in (p, d):
        h = {k.lower(): v for k, v in seen["headers"].items()}
        assert (h["authorization"], h["x-request-id"], h["x-custom"]) == ("Bearer sk-1", "req-42", "kept")
        assert not {"x-hop", "proxy-authorization", "keep-alive", "expect"} & set(h), h
    assert json.loads(body)["engine"] == "d1"
    assert {k.lower(): v for k, v in headers.items()}["x-request-id"] == "req-42"  # the engine's headers come back
    r.request("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
    p2, d2 = pre.seen()[1], dec.seen()[1]
    assert p2["body"]["kv_transfer_params"]["remote_decoder"]["kv_request_id"] != kv_id  # fresh per request
    rid = {k.lower(): v for k, v in p2["headers"].items()}["x-request-id"]  # none given: one made, both see it
    assert rid and rid == {k.lower(): v for k, v in d2["headers"].items()}["x-request-id"]
    _wait(lambda: f"id={rid}" in r.log.read_text(), what="the access log names it")  # written after the answer


def test_streaming_answer_is_relayed_as_it_comes_and_intact(fleet):
    pre, dec, w = fleet.engine("p1"), fleet.engine("d1", tokens=5, token_delay=0.3), fleet.worker()
    r = fleet.router([_prefill(pre, w)], [dec.url])
    c = r.send({"prompt": "s", "stream": True})
    t0 = time.monotonic()
    resp = c.getresponse()
    first = resp.read1(65536)
    t_first = time.monotonic() - t0
    rest = resp.read()
    t_all = time.monotonic() - t0
    body = first + rest
    assert body == b"".join(b'data: {"engine": "d1", "i": %d}\n\n' % i for i in range(5)) + b"data: [DONE]\n\n"
    assert resp.getheader("Content-Type") == "text/event-stream"
    assert t_first < t_all - 0.8, (t_first, t_all)  # 5 tokens 0.3 s apart: the first came long before the end
    assert pre.seen()[0]["body"]["stream"] is False  # the prefill leg never streams


def test_health_models_metrics_and_bad_input(fleet):
    pre, dec, w = fleet.engine("p1"), fleet.engine("d1"), fleet.worker()
    r = fleet.router([_prefill(pre, w)], [dec.url], "--max-body-mib", "1")
    status, h = r.health()
    assert status == 200 and h["status"] == "ok"
    assert h["prefill"][0]["worker"] == f"127.0.0.1:{w.port}" and h["prefill"][0]["worker_reachable"] is True
    assert [i["state"] for i in h["prefill"] + h["decode"]] == ["up", "up"]
    status, _, body = r.request("GET", "/v1/models")
    assert status == 200 and json.loads(body)["data"][0]["owned_by"] == "d1"
    status, _, body = r.request("POST", "/v1/completions", b"{not json")
    assert status == 400 and b"invalid JSON" in body
    assert r.request("POST", "/v1/completions", b"[1]")[0] == 400
    assert r.request("POST", "/v1/other", {})[0] == 404
    assert r.request("POST", "/v1/completions", b"x" * (2 << 20))[0] == 413
    assert r.metric("p2pworker_router_requests_total", route="/v1/completions", code="400") == 2
    assert r.metric("p2pworker_router_instance_up", role="decode", instance=dec.url[7:]) == 1
    assert r.metric("p2pworker_router_prefill_failures_total", instance=pre.url[7:], reason="http_5xx") == 0


# ---- several instances --------------------------------------------------------------------------------------------

def test_requests_spread_over_instances_and_decode_fetches_from_the_prefill_that_ran(fleet):
    pres = [fleet.engine(f"p{i}") for i in (1, 2)]
    decs = [fleet.engine(f"d{i}") for i in (1, 2)]
    workers = [fleet.worker() for _ in pres]
    r = fleet.router([_prefill(p, w) for p, w in zip(pres, workers)], [d.url for d in decs])
    for i in range(8):
        assert r.request("POST", "/v1/completions", {"prompt": f"q{i}"})[0] == 200
    assert [len(e.seen()) for e in pres + decs] == [4, 4, 4, 4]
    port_of = {}
    for p, w in zip(pres, workers):
        for s in p.seen():
            port_of[s["body"]["kv_transfer_params"]["remote_decoder"]["kv_request_id"]] = w.port
    for d in decs:
        for s in d.seen():
            kv = s["body"]["kv_transfer_params"]["remote_prefiller"]
            assert kv["remote_port"] == port_of[kv["kv_request_id"]]


def test_least_in_flight_steers_around_a_busy_instance(fleet):
    pre, w = fleet.engine("p1"), fleet.worker()
    slow, fast = fleet.engine("d1"), fleet.engine("d2")
    r = fleet.router([_prefill(pre, w)], [slow.url, fast.url])
    slow.mode(delay=3.0)
    c = r.send({"prompt": "held"})  # goes to d1 (first in rotation), held 3 s
    _wait(lambda: len(slow.seen()) == 1, what="d1 got the first request")
    for i in range(4):
        assert r.request("POST", "/v1/completions", {"prompt": f"q{i}"})[0] == 200
    assert (len(slow.seen()), len(fast.seen())) == (1, 4)
    assert c.getresponse().status == 200


# ---- failures -----------------------------------------------------------------------------------------------------

def test_failing_prefill_recomputes_is_taken_out_after_errors_in_a_row_and_a_probe_brings_it_back(fleet):
    pre, dec, w = fleet.engine("p1"), fleet.engine("d1"), fleet.worker()
    r = fleet.router([_prefill(pre, w)], [dec.url], "--health-interval", "0.5")
    pre.mode(status=500, health=503)  # failing requests, and its /health says so: it stays out
    for i in range(ERRORS_TO_DOWN):
        status, _, body = r.request("POST", "/v1/completions", {"prompt": "p"})
        assert status == 200 and "kv_transfer_params" not in dec.seen()[i]["body"]  # decode recomputed
        assert r.health()[1]["prefill"][0]["state"] == ("down" if i == ERRORS_TO_DOWN - 1 else "up")
    status, h = r.health()  # its only prefill is down: not healthy, though it still answers (by recomputing)
    assert status == 503 and h["status"] == "unavailable" and h["no_instance_up"] == ["prefill"], h
    assert "HTTP 50" in h["prefill"][0]["last_error"]  # its 500s, or the 503 of a probe since
    assert r.metric("p2pworker_router_prefill_failures_total", instance=pre.url[7:],
                    reason="http_5xx") == ERRORS_TO_DOWN
    t0 = time.monotonic()  # down: the next request still tries it once (a real attempt), then recomputes
    assert r.request("POST", "/v1/completions", {"prompt": "p"})[0] == 200
    assert len(pre.seen()) == ERRORS_TO_DOWN + 1 and time.monotonic() - t0 < 1.0
    assert r.metric("p2pworker_router_recomputes_total", reason="http_5xx") == ERRORS_TO_DOWN + 1
    pre.mode(status=200, health=200)
    _wait(lambda: r.health()[1]["prefill"][0]["state"] == "up", what="prefill back after a probe")
    r.request("POST", "/v1/completions", {"prompt": "p"})
    assert "remote_prefiller" in dec.seen()[-1]["body"]["kv_transfer_params"]
    assert re.search(r"back: its (health round|re-probe) passed", r.log.read_text())


def test_a_host_that_does_not_accept_is_skipped_after_the_connect_timeout(fleet):
    """An instance that stops completing connections (like a host gone from the network: here a listener whose
    backlog is full) fails the connect timeout, which is 'unreachable': nothing was sent, so the next instance
    takes the request."""
    first, live, pre, w = fleet.engine("d1"), fleet.engine("d2"), fleet.engine("p1"), fleet.worker()
    r = fleet.router([_prefill(pre, w)], [first.url, live.url], "--connect-timeout", "0.5", "--health-interval",
                     "60")  # d1 passed the first health round and stays up in the pool
    first.kill()
    dead = socket.socket()
    dead.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    dead.bind(("127.0.0.1", first.port))
    dead.listen(0)
    filler = socket.create_connection(("127.0.0.1", first.port))  # fills the one-connection backlog
    try:
        t0 = time.monotonic()
        status, _, body = r.request("POST", "/v1/completions", {"prompt": "p"})  # d1 first in rotation
        took = time.monotonic() - t0
        assert status == 200 and json.loads(body)["engine"] == "d2", body
        assert 0.4 < took < 3.0, took  # one connect timeout, then d2
        assert r.metric("p2pworker_router_upstream_errors_total", role="decode", instance=first.url[7:],
                        reason="unreachable") == 1
        assert r.health()[1]["decode"][0]["state"] == "down"
    finally:
        filler.close()
        dead.close()


def test_clients_that_reset_mid_stream_do_not_count_against_the_instance(fleet):
    pre, dec, w = fleet.engine("p1"), fleet.engine("d1", tokens=20000, token_delay=0.0), fleet.worker()
    r = fleet.router([_prefill(pre, w)], [dec.url])
    body = json.dumps({"prompt": "s", "stream": True}).encode()
    for _ in range(3):  # waves of 15 clients that read their first event, then reset together
        socks = []
        for _ in range(15):
            s = socket.create_connection(("127.0.0.1", r.port))
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            socks.append(s)
        for s in socks:
            _read_until(s, b"data:")
        for s in socks:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = RST
            s.close()
    _wait(lambda: r.metric("p2pworker_router_in_flight", role="decode", instance=dec.url[7:]) == 0,
          what="relays ended")
    status, h = r.health()
    assert status == 200 and h["decode"][0]["state"] == "up", h
    assert r.metric("p2pworker_router_client_disconnects_total") == 45
    for reason in Reason:
        assert r.metric("p2pworker_router_upstream_errors_total", role="decode", instance=dec.url[7:],
                        reason=reason.value) == 0
    assert r.request("POST", "/v1/completions", {"prompt": "after"})[0] == 200
    assert "Error handling request" not in r.log.read_text()


def test_a_client_that_stops_reading_is_dropped_after_the_read_timeout(fleet):
    """Invariant 4 on the client's side: a client that takes nothing holds its decode connection only for
    --read-timeout, and that is not the instance's fault."""
    pre, w = fleet.engine("p1"), fleet.worker()
    dec = fleet.engine("d1", tokens=400000, token_delay=0.0)  # ~12 MB of events: more than the sockets buffer
    r = fleet.router([_prefill(pre, w)], [dec.url], "--read-timeout", "1")
    body = json.dumps({"prompt": "s", "stream": True}).encode()
    s = socket.create_connection(("127.0.0.1", r.port))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    try:  # and now read nothing
        _wait(lambda: r.metric("p2pworker_router_client_disconnects_total") == 1, 15.0, "stalled client dropped")
        _wait(lambda: r.metric("p2pworker_router_in_flight", role="decode", instance=dec.url[7:]) == 0,
              what="its decode call ended")
        _wait(lambda: [e["path"] for e in dec.seen("disconnect")] == ["/v1/completions"], 5.0,
              "decode engine saw the router go")
        assert r.health()[1]["decode"][0]["state"] == "up"
        assert r.metric("p2pworker_router_upstream_errors_total", role="decode", instance=dec.url[7:],
                        reason="timeout") == 0
        _wait(lambda: "client stalled" in r.log.read_text(), what="access log says why")
        assert "Error handling request" not in r.log.read_text()
    finally:
        s.close()


def test_prefill_leg_drops_min_tokens_and_query_and_a_compressed_body_reach_the_engines(fleet):
    pre, dec, w = fleet.engine("p1"), fleet.engine("d1"), fleet.worker()
    r = fleet.router([_prefill(pre, w)], [dec.url])
    raw = json.dumps({"prompt": "z", "max_tokens": 9, "min_tokens": 4}).encode()
    status, _, _ = r.request("POST", "/v1/completions?trace=1", gzip.compress(raw),
                             headers={"Content-Encoding": "gzip", "Content-Type": "application/json"})
    assert status == 200
    (p,), (d,) = pre.seen(), dec.seen()
    assert "min_tokens" not in p["body"] and d["body"]["min_tokens"] == 4  # vLLM refuses min_tokens > max_tokens
    assert p["path"] == d["path"] == "/v1/completions" and p["query"] == d["query"] == "trace=1"
    for seen in (p, d):  # the router sends plain JSON: a Content-Encoding would lie about it
        assert "content-encoding" not in {k.lower() for k in seen["headers"]}


def test_sigterm_drains_health_says_503_while_requests_are_still_served_then_cuts_within_the_timeout(fleet):
    pre, w = fleet.engine("p1"), fleet.worker()
    dec = fleet.engine("d1", tokens=300, token_delay=0.1)  # a 30 s stream: still going when the drain ends
    r = fleet.router([_prefill(pre, w)], [dec.url], "--shutdown-delay", "1.5", "--shutdown-timeout", "2")
    long = r.send({"prompt": "long", "stream": True}).getresponse()
    assert long.status == 200 and b"data:" in long.read1(65536)
    t0 = time.monotonic()
    r.proc.send_signal(signal.SIGTERM)
    _wait(lambda: r.health()[0] == 503, 1.0, "health says draining")
    assert r.health()[1]["status"] == "draining"
    status, headers, _ = r.request("POST", "/v1/completions", {"prompt": "p"})  # still served meanwhile
    assert status == 200 and headers.get("Connection") == "close"  # and told to go elsewhere next time
    with pytest.raises(http.client.IncompleteRead):  # cut when the timeout ran out, not hung
        long.read()
    assert r.proc.wait(10) == 0
    took = time.monotonic() - t0
    assert 3.0 < took < 6.0, took  # delay 1.5 + timeout 2 (+ slack), not delay + 2 x timeout
    log = r.log.read_text()
    assert "cut by the router's shutdown" in log and "Error handling request" not in log


def test_one_bad_instance_name_costs_only_that_instance(fleet):
    pre, dec, w = fleet.engine("p1"), fleet.engine("d1"), fleet.worker()
    bad = f"{fleet.engine('p2').url},worker=bad..name:1"  # an empty label: the name cannot even be encoded
    r = fleet.router([_prefill(pre, w), bad], [dec.url])
    status, h = r.health()
    assert status == 200 and [i["state"] for i in h["prefill"]] == ["up", "down"], h
    assert "worker bad..name:1 unreachable" in h["prefill"][1]["last_error"]
    assert r.request("POST", "/v1/completions", {"prompt": "p"})[0] == 200


def test_an_unreachable_instance_is_skipped_without_losing_the_request(fleet):
    pres = [fleet.engine(f"p{i}") for i in (1, 2)]
    decs = [fleet.engine(f"d{i}") for i in (1, 2)]
    workers = [fleet.worker() for _ in pres]
    r = fleet.router([_prefill(p, w) for p, w in zip(pres, workers)], [d.url for d in decs],
                     "--health-interval", "60")  # no health round in between: the requests find them dead
    pres[1].kill()
    decs[1].kill()
    for i in range(4):
        assert r.request("POST", "/v1/completions", {"prompt": f"q{i}"})[0] == 200
    assert len(pres[0].seen()) == 4 and len(decs[0].seen()) == 4
    for s in decs[0].seen():  # none recomputed: the dead prefill's requests went to the live one
        assert s["body"]["kv_transfer_params"]["remote_prefiller"]["remote_port"] == workers[0].port
    _, h = r.health()
    assert [i["state"] for i in h["prefill"]] == ["up", "down"] and "unreachable" in h["prefill"][1]["last_error"]
    assert [i["state"] for i in h["decode"]] == ["up", "down"]
    assert r.metric("p2pworker_router_upstream_errors_total", role="decode", instance=decs[1].url[7:],
                    reason="unreachable") == 1


def test_a_prefill_whose_worker_is_unreachable_is_taken_out(fleet):
    pres = [fleet.engine(f"p{i}") for i in (1, 2)]
    dec, w = fleet.engine("d1"), fleet.worker()
    dead_worker = free_port()  # nothing listens there
    r = fleet.router([_prefill(pres[0], w), f"{pres[1].url},worker=127.0.0.1:{dead_worker}"], [dec.url])
    _, h = r.health()
    assert h["prefill"][1]["state"] == "down" and h["prefill"][1]["worker_reachable"] is False
    assert f"worker 127.0.0.1:{dead_worker} unreachable" in h["prefill"][1]["last_error"]
    for i in range(3):
        assert r.request("POST", "/v1/completions", {"prompt": f"q{i}"})[0] == 200
    assert (len(pres[0].seen()), len(pres[1].seen())) == (3, 0)


def test_no_decode_reachable_is_a_502_and_health_says_unavailable(fleet):
    pre, w = fleet.engine("p1"), fleet.worker()
    r = fleet.router([_prefill(pre, w)], [f"http://127.0.0.1:{free_port()}"])
    status, h = r.health()
    assert status == 503 and h["status"] == "unavailable"
    status, _, body = r.request("POST", "/v1/completions", {"prompt": "p"})
    assert status == 502 and b"no instance reachable" in body and b"unreachable" in body


def test_read_timeout_answers_504_in_time(fleet):
    pre, dec, w = fleet.engine("p1"), fleet.engine("d1"), fleet.worker()
    r = fleet.router([_prefill(pre, w)], [dec.url], "--read-timeout", "0.5")
    dec.mode(delay=5.0)
    t0 = time.monotonic()
    status, _, body = r.request("POST", "/v1/completions", {"prompt": "p"})
    assert status == 504 and b"timeout" in body
    assert time.monotonic() - t0 < 3.0


def test_client_disconnect_cancels_the_upstream_requests(fleet):
    pre, dec, w = fleet.engine("p1"), fleet.engine("d1", tokens=200, token_delay=0.05), fleet.worker()
    r = fleet.router([_prefill(pre, w)], [dec.url])
    # mid-stream: the decode engine sees its client (the router) go away
    s = socket.create_connection(("127.0.0.1", r.port))
    body = json.dumps({"prompt": "s", "stream": True}).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"X-Request-Id: gone-1\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    _read_until(s, b"data:")
    s.close()
    _wait(lambda: [e["request_id"] for e in dec.seen("disconnect")] == ["gone-1"], 3.0,
          "decode engine saw the disconnect")
    # during the prefill leg: the prefill engine sees it, and decode never gets the request
    pre.mode(delay=10.0)
    s = socket.create_connection(("127.0.0.1", r.port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"X-Request-Id: gone-2\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    _wait(lambda: len(pre.seen()) == 2, what="prefill got the second request")
    s.close()
    _wait(lambda: [e["request_id"] for e in pre.seen("disconnect")] == ["gone-2"], 3.0,
          "prefill engine saw the disconnect")
    time.sleep(0.3)
    assert len(dec.seen()) == 1
    assert r.metric("p2pworker_router_client_disconnects_total") == 2
    assert r.metric("p2pworker_router_in_flight", role="prefill", instance=pre.url[7:]) == 0


def test_decode_dying_mid_stream_cuts_the_client_response(fleet):
    pre, dec, w = fleet.engine("p1"), fleet.engine("d1", tokens=200, token_delay=0.05), fleet.worker()
    r = fleet.router([_prefill(pre, w)], [dec.url])
    resp = r.send({"prompt": "s", "stream": True}, timeout=10).getresponse()
    assert resp.status == 200 and b"data:" in resp.read1(65536)
    dec.kill()
    t0 = time.monotonic()
    with pytest.raises(http.client.IncompleteRead):  # a broken response, not one that looks complete
        resp.read()
    assert time.monotonic() - t0 < 3.0
    assert "broke mid-answer" in r.log.read_text() and "Error handling request" not in r.log.read_text()
    labels = {"role": "decode", "instance": dec.url[7:]}
    assert r.metric("p2pworker_router_responses_cut_total", **labels) == 1
    assert r.metric("p2pworker_router_upstream_errors_total", **labels, reason="disconnected") == 1


# ---- llm-d's routing headers -------------------------------------------------------------------------------------

def test_prefiller_header_picks_that_configured_prefill_and_neither_routing_header_reaches_an_engine(fleet):
    pres = [fleet.engine(f"p{i}") for i in (1, 2)]
    workers = [fleet.worker() for _ in pres]
    dec = fleet.engine("d1")
    r = fleet.router([_prefill(p, w) for p, w in zip(pres, workers)], [dec.url])
    for i in range(4):  # without the header these would alternate
        status, _, body = r.request("POST", "/v1/completions", {"prompt": f"q{i}"},
                                    headers={"X-Prefiller-Host-Port": f"127.0.0.1:{pres[1].port}"})
        assert status == 200, body
    assert (len(pres[0].seen()), len(pres[1].seen())) == (0, 4)
    for d in dec.seen():
        assert d["body"]["kv_transfer_params"]["remote_prefiller"]["remote_port"] == workers[1].port
    for seen in pres[1].seen() + dec.seen():
        assert not {"x-prefiller-host-port", "x-kv-cache-source-host-port"} & set(_lower(seen["headers"]))
    status, _, body = r.request("POST", "/v1/completions", {"prompt": "x"},
                                headers={"x-prefiller-host-port": "no-port"})
    assert status == 400 and b"x-prefiller-host-port" in body and len(dec.seen()) == 4  # refused, not ignored


def test_prefiller_header_naming_an_unconfigured_instance_uses_it_ad_hoc_and_an_unreachable_one_is_skipped(fleet):
    configured, w = fleet.engine("p1"), fleet.worker()
    other, dec = fleet.engine("p2"), fleet.engine("d1")
    r = fleet.router([_prefill(configured, w)], [dec.url])
    status, _, body = r.request("POST", "/v1/completions", {"prompt": "q"},
                                headers={"x-prefiller-host-port": f"127.0.0.1:{other.port}"})
    assert status == 200, body
    assert (len(configured.seen()), len(other.seen())) == (0, 1)
    (p,), (d,) = other.seen(), dec.seen()
    kv_id = p["body"]["kv_transfer_params"]["remote_decoder"]["kv_request_id"]
    # its worker where a --prefill without worker= would have it: the default port on its host
    assert d["body"]["kv_transfer_params"] == {"remote_prefiller": {
        "kv_request_id": kv_id, "remote_host": "127.0.0.1", "remote_port": DEFAULT_PORT}}
    assert f"prefill 127.0.0.1:{other.port} (named by a request, not configured) used ad hoc" in r.log.read_text()
    status, h = r.health()
    assert status == 200 and [i["url"] for i in h["prefill"]] == [configured.url]  # not a configured instance
    assert [i["url"] for i in h["ad_hoc_prefill"]] == [other.url]
    # one that cannot be reached: nothing was sent, the configured prefill serves it
    status, _, _ = r.request("POST", "/v1/completions", {"prompt": "q"},
                             headers={"x-prefiller-host-port": f"127.0.0.1:{free_port()}"})
    assert status == 200 and len(configured.seen()) == 1
    assert dec.seen()[-1]["body"]["kv_transfer_params"]["remote_prefiller"]["remote_port"] == w.port


def test_kv_source_header_goes_to_the_leg_that_computes_the_prompt(fleet):
    pre, dec, w = fleet.engine("p1"), fleet.engine("d1"), fleet.worker()
    r = fleet.router([_prefill(pre, w)], [dec.url])
    source = {"x-kv-cache-source-host-port": "10.9.9.9:5999"}
    assert r.request("POST", "/v1/completions", {"prompt": "turn 2"}, headers=source)[0] == 200
    (p,), (d,) = pre.seen(), dec.seen()
    kv_id = p["body"]["kv_transfer_params"]["remote_decoder"]["kv_request_id"]
    # the prefill pulls its prefix from the source, computes the rest and serves the decode: both entries
    assert p["body"]["kv_transfer_params"] == {
        "remote_decoder": {"kv_request_id": kv_id},
        "remote_kv_source": {"kv_request_id": f"{kv_id}-src", "remote_host": "10.9.9.9", "remote_port": 5999}}
    assert d["body"]["kv_transfer_params"] == {"remote_prefiller": {
        "kv_request_id": kv_id, "remote_host": "127.0.0.1", "remote_port": w.port}}
    for seen in (p, d):
        assert "x-kv-cache-source-host-port" not in _lower(seen["headers"])
    pre.mode(status=500)  # no prefill now: decode computes the prompt, so decode pulls from the source
    assert r.request("POST", "/v1/completions", {"prompt": "turn 3"}, headers=source)[0] == 200
    src = dec.seen()[-1]["body"]["kv_transfer_params"]["remote_kv_source"]
    assert (src["remote_host"], src["remote_port"]) == ("10.9.9.9", 5999)
    # not the prefill's pull id: a prefill that failed after it began pulling still owns what the source parked
    assert src["kv_request_id"].endswith("-decodesrc")
    assert dec.seen()[-1]["body"]["kv_transfer_params"].keys() == {"remote_kv_source"}
    assert r.request("POST", "/v1/completions", {"prompt": "x"},
                     headers={"x-kv-cache-source-host-port": "a:1, b:2"})[0] == 400


# ---- aggregated mode ----------------------------------------------------------------------------------------------

def test_aggregated_mode_sends_each_request_to_one_instance_unchanged_but_for_the_kv_source(fleet):
    decs = [fleet.engine(f"d{i}") for i in (1, 2)]
    r = fleet.module_router([], [d.url for d in decs], "--mode", "aggregated")
    status, h = r.health()
    assert (status, h["status"], h["mode"], h["prefill"]) == (200, "ok", "aggregated", [])
    sent = {"model": "tiny", "prompt": "whole", "max_tokens": 7, "kv_transfer_params": {"client": "own"}}
    for _ in range(2):
        status, _, body = r.request("POST", "/v1/completions", sent)
        assert status == 200, body
    assert [len(d.seen()) for d in decs] == [1, 1]  # one instance each, spread
    assert [d.seen()[0]["body"] for d in decs] == [sent, sent]  # exactly as sent
    status, _, _ = r.request("POST", "/v1/completions", sent, headers={"x-kv-cache-source-host-port": "peer:5711"})
    (got,) = [d.seen()[-1] for d in decs if len(d.seen()) == 2]
    src = got["body"].pop("kv_transfer_params")["remote_kv_source"]
    assert got["body"] == {k: v for k, v in sent.items() if k != "kv_transfer_params"}
    assert (src["remote_host"], src["remote_port"]) == ("peer", 5711) and src["kv_request_id"].startswith("p2pw-")
    assert "x-kv-cache-source-host-port" not in _lower(got["headers"])
    # a request that names a prefill instance is prefilled there (PD for that request)
    pre = fleet.engine("p1")
    status, _, _ = r.request("POST", "/v1/completions", sent, headers={"x-prefiller-host-port": pre.url[7:]})
    assert status == 200 and pre.seen()[0]["body"]["max_tokens"] == 1
    assert sum(len(d.seen()) for d in decs) == 4
    assert r.metric("p2pworker_router_recomputes_total", reason="unreachable") == 0


def test_pd_mode_needs_a_prefill_and_aggregated_mode_takes_none():
    dec = f"http://127.0.0.1:{free_port()}"
    for flags, says in ((["--decode", dec], "PD mode needs at least one --prefill"),
                        (["--mode", "aggregated", "--prefill", dec, "--decode", "http://127.0.0.1:1"],
                         "aggregated mode takes no --prefill")):
        out = subprocess.run([sys.executable, "-m", "p2pworker.router", "--port", str(free_port()), *flags],
                             capture_output=True, text=True, timeout=30)
        assert out.returncode != 0 and says in out.stderr, out.stderr


# ---- never recompute silently -------------------------------------------------------------------------------------

def test_a_down_instance_is_reprobed_well_before_the_next_health_round(fleet):
    pre, dec, w = fleet.engine("p1"), fleet.engine("d1"), fleet.worker()
    pre.mode(health=503)  # down from the router's first health round on
    r = fleet.router([_prefill(pre, w)], [dec.url], "--health-interval", "60")
    assert r.health()[1]["prefill"][0]["state"] == "down"
    pre.mode(health=200)
    t0 = time.monotonic()
    _wait(lambda: r.health()[1]["prefill"][0]["state"] == "up", 5.0, "prefill back by a re-probe")
    assert time.monotonic() - t0 < 5.0  # the backoff starts at 0.2 s: the next health round is 60 s away
    assert "prefill 127.0.0.1:%d back: its re-probe passed" % pre.port in r.log.read_text()


def test_with_no_prefill_up_each_configured_prefill_is_tried_once_before_decode_recomputes(fleet):
    pres = [fleet.engine(f"p{i}") for i in (1, 2)]
    workers = [fleet.worker() for _ in pres]
    dec = fleet.engine("d1")
    for p in pres:
        p.mode(status=500, health=503)  # both down from the first health round, and staying down
    r = fleet.router([_prefill(p, w) for p, w in zip(pres, workers)], [dec.url], "--health-interval", "60")
    assert [i["state"] for i in r.health()[1]["prefill"]] == ["down", "down"]
    assert r.request("POST", "/v1/completions", {"prompt": "q"})[0] == 200
    assert [len(p.seen()) for p in pres] == [1, 1]  # a real attempt on each, once
    assert "kv_transfer_params" not in dec.seen()[0]["body"]
    assert r.metric("p2pworker_router_recomputes_total", reason="http_5xx") == 1
    assert re.search(r"WARNING p2pworker\.router: decode recomputes the prompt of \S+, reason http_5xx",
                     r.log.read_text())
    pres[1].mode(status=200)  # answers again, though its /health still keeps it down: the attempt finds it
    assert r.request("POST", "/v1/completions", {"prompt": "q"})[0] == 200
    assert dec.seen()[1]["body"]["kv_transfer_params"]["remote_prefiller"]["remote_port"] == workers[1].port
    assert r.metric("p2pworker_router_recomputes_total", reason="http_5xx") == 1  # not recomputed


def test_health_is_503_naming_the_role_without_an_instance_up_and_a_dead_worker_costs_no_prefill(fleet):
    pre, dec = fleet.engine("p1"), fleet.engine("d1")
    worker_port = free_port()  # nothing listens there yet
    r = fleet.router([f"{pre.url},worker=127.0.0.1:{worker_port}"], [dec.url], "--health-interval", "60")
    status, h = r.health()
    assert (status, h["status"], h["no_instance_up"]) == (503, "unavailable", ["prefill"]), h
    # tried (it is the only one), but its worker is checked first: a KV decode could not fetch is not computed
    assert r.request("POST", "/v1/completions", {"prompt": "q"})[0] == 200
    assert pre.seen() == [] and "kv_transfer_params" not in dec.seen()[0]["body"]
    assert r.metric("p2pworker_router_recomputes_total", reason="unreachable") == 1
    assert re.search(r"WARNING p2pworker\.router: decode recomputes .* reason unreachable: no prefill instance "
                     r"reachable", r.log.read_text())
    worker = socket.create_server(("127.0.0.1", worker_port))
    try:
        _wait(lambda: r.health()[0] == 200, 5.0, "healthy once the worker listens (re-probed)")
        assert (h := r.health()[1])["status"] == "ok" and h["no_instance_up"] == [], h
    finally:
        worker.close()


# ---- scripts/pd.sh ------------------------------------------------------------------------------------------------

def test_pd_sh_start_router_returns_once_the_router_has_every_instance_up_and_says_which_is_not(fleet, tmp_path):
    pre, dec, w = fleet.engine("p1"), fleet.engine("d1"), fleet.worker()
    port = free_port()
    env = {**os.environ, "VENV": str(Path(sys.executable).parents[1]), "RUN_DIR": str(tmp_path / "pd"),
           "P2PWORKER_SECRET": "0" * 64, "PREFILL_HTTP": str(pre.port), "PREFILL_P2P": str(w.port),
           "DECODE_HTTP": str(dec.port), "ROUTER_PORT": str(port), "HEALTH_TIMEOUT_S": "3"}

    def pd(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run([str(ROOT / "scripts" / "pd.sh"), *args], env=env, capture_output=True, text=True,
                              timeout=timeout)

    pre.mode(health=503)
    try:  # never ready: start fails, names what is down and stops the router
        out = pd("start", "router")
        assert out.returncode != 0 and '"no_instance_up": ["prefill"]' in out.stderr, out.stderr
        assert not (tmp_path / "pd" / "router.pid").exists()
        env["HEALTH_TIMEOUT_S"] = "30"
        ready = threading.Timer(2.0, pre.mode, kwargs={"health": 200})  # the prefill comes up while pd.sh waits
        ready.start()
        t0 = time.monotonic()
        out = pd("start", "router")
        took = time.monotonic() - t0
        ready.join()
        assert out.returncode == 0, out.stderr
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as resp:
            h = json.loads(resp.read())
        assert took > 1.5 and [i["state"] for i in h["prefill"] + h["decode"]] == ["up", "up"], (took, h)
    finally:
        assert pd("stop").returncode == 0


# ---- load ---------------------------------------------------------------------------------------------------------

async def _wave(port: int, n: int, tag: str, during=None) -> tuple[int, list[str]]:
    """n concurrent streaming clients; returns (complete streams, errors).  `during`: a coroutine run meanwhile."""
    async def one(session: aiohttp.ClientSession, i: int) -> None:
        async with session.post(f"http://127.0.0.1:{port}/v1/completions",
                                json={"prompt": f"{tag}-{i}", "stream": True}) as resp:
            body = await resp.read()
            if resp.status != 200:
                raise AssertionError(f"HTTP {resp.status}: {body[:300]!r}")
            if not body.endswith(b"data: [DONE]\n\n"):
                raise AssertionError(f"HTTP {resp.status}, ends {body[-40:]!r}")

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=60)) as session:
        jobs = [one(session, i) for i in range(n)] + ([during] if during else [])
        results = await asyncio.gather(*jobs, return_exceptions=True)
    errors = [repr(e) for e in results[:n] if e is not None]
    return n - len(errors), errors


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_200_streaming_clients_an_upstream_killed_mid_wave_bounded_memory(fleet):
    """200 concurrent streaming clients through 2 prefill + 2 decode; a prefill engine killed mid-wave costs no
    request (decode recomputes or the other prefill takes it); the router's memory stays flat over waves; a decode
    engine killed mid-wave fails only the requests it was serving (a stream it had started is cut; one whose headers
    had not come back gets a 502 naming it: the router does not send a decode leg that may have run again), and the
    next wave is whole."""
    pres = [fleet.engine(f"p{i}") for i in (1, 2)]
    decs = [fleet.engine(f"d{i}", tokens=10, token_delay=0.05) for i in (1, 2)]
    workers = [fleet.worker() for _ in pres]
    r = fleet.router([_prefill(p, w) for p, w in zip(pres, workers)], [d.url for d in decs], "--log-level",
                     "WARNING")
    assert asyncio.run(_wave(r.port, 200, "warm")) == (200, [])
    rss = [r.rss_mib()]

    for p in pres:
        p.mode(delay=0.3)  # prefill legs long enough to be in flight when one engine dies

    async def kill_prefill():
        await asyncio.sleep(0.15)
        pres[1].kill()

    ok, errors = asyncio.run(_wave(r.port, 200, "kill-prefill", kill_prefill()))
    assert (ok, errors) == (200, [])
    # prefill legs in flight on it broke before their headers: each went once more, was refused, and the other
    # prefill took it (or, had none been left, decode recomputed)
    cut_prefill = sum(r.metric("p2pworker_router_prefill_failures_total", instance=pres[1].url[7:],
                               reason=reason.value) for reason in Reason)
    assert cut_prefill >= 1
    pres[0].mode(delay=0.0)
    for i in range(4):
        assert asyncio.run(_wave(r.port, 200, f"steady-{i}")) == (200, [])
        rss.append(r.rss_mib())
    assert max(rss) - rss[1] < 25, f"router RSS over waves (MiB): {rss}"

    async def kill_decode():
        # most streams have started by then (10 tokens 50 ms apart: 0.5 s each); on a loaded box some have not
        await asyncio.sleep(0.2)
        decs[1].kill()

    ok, errors = asyncio.run(_wave(r.port, 200, "kill-decode", kill_decode()))
    assert 0 < len(errors) <= 120 and ok >= 80, (ok, errors[:3])  # least-in-flight: about half were on d2
    cut = [e for e in errors if "ClientPayloadError" in e or "TransferEncodingError" in e]
    # before its headers: the router's 502 names the killed instance (what it says of any instance that broke)
    refused = [e for e in errors if "HTTP 502" in e and f"decode instance failed: {decs[1].url[7:]}:" in e]
    other = [e for e in errors if e not in cut and e not in refused]
    assert not other, other[:5]  # the ones that are neither, not the first three of all
    assert asyncio.run(_wave(r.port, 200, "after")) == (200, [])
    print(f"router RSS MiB per wave {[round(x, 1) for x in rss]}; prefill legs cut by the kill {cut_prefill:.0f}; "
          f"requests failed by the decode kill {len(errors)} ({len(cut)} streams cut, {len(refused)} 502 before "
          f"headers)")
