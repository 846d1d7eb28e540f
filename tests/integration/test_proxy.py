"""The PD proxy as a real process, against two real HTTP servers standing in for the engines."""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.ports import free_port

BIN = Path(sys.executable).with_name("p2pworker")


class Engine(ThreadingHTTPServer):
    """A fake OpenAI-compatible engine that records what it was sent."""

    daemon_threads = True

    def __init__(self, name: str, fail: bool = False):
        self.name, self.fail, self.seen = name, fail, []

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_GET(inner):
                body = json.dumps({"object": "list", "data": [{"id": "tiny"}]}).encode()
                inner.send_response(500 if self.fail else 200)
                inner.send_header("Content-Length", str(len(body)))
                inner.end_headers()
                inner.wfile.write(body)

            def do_POST(inner):
                req = json.loads(inner.rfile.read(int(inner.headers["Content-Length"])))
                self.seen.append(req)
                if self.fail:
                    inner.send_response(500)
                    inner.send_header("Content-Length", "0")
                    inner.end_headers()
                    return
                if req.get("stream"):
                    events = [b'data: {"t": %d}\n\n' % i for i in range(3)] + [b"data: [DONE]\n\n"]
                    inner.send_response(200)
                    inner.send_header("Content-Type", "text/event-stream")
                    inner.send_header("Content-Length", str(sum(map(len, events))))
                    inner.end_headers()
                    for ev in events:
                        inner.wfile.write(ev)
                        inner.wfile.flush()
                        time.sleep(0.05)
                    return
                body = json.dumps({"engine": self.name, "echo": req}).encode()
                inner.send_response(200)
                inner.send_header("Content-Type", "application/json")
                inner.send_header("Content-Length", str(len(body)))
                inner.end_headers()
                inner.wfile.write(body)

        super().__init__(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True).start()


@pytest.fixture
def engines():
    pre, dec = Engine("prefill"), Engine("decode")
    yield pre, dec
    for e in (pre, dec):
        e.shutdown()
        e.server_close()


def _start_proxy(pre_url: str, dec_url: str):
    port = free_port()
    proc = subprocess.Popen([str(BIN), "proxy", "--port", str(port), "--prefill", pre_url, "--decode", dec_url,
                             "--prefill-worker", "10.1.2.3:5711"], stderr=subprocess.PIPE)
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, port
        except OSError:
            assert time.monotonic() < deadline and proc.poll() is None, "proxy did not start"
            time.sleep(0.05)


def _post(port: int, path: str, body: dict) -> tuple[int, bytes]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = c.getresponse()
    return r.status, r.read()


@pytest.fixture
def proxy(engines):
    proc, port = _start_proxy(engines[0].url, engines[1].url)
    yield port
    proc.terminate()
    assert proc.wait(10) is not None


def test_prefill_then_decode_with_matching_kv_transfer_params(engines, proxy):
    pre, dec = engines
    status, body = _post(proxy, "/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 7})
    assert status == 200
    (p,), (d,) = pre.seen, dec.seen
    assert p["max_tokens"] == 1 and p["stream"] is False and p["prompt"] == "hello"
    rid = p["kv_transfer_params"]["remote_decoder"]["kv_request_id"]
    assert d["max_tokens"] == 7 and d["prompt"] == "hello"
    assert d["kv_transfer_params"] == {"remote_prefiller": {
        "kv_request_id": rid, "remote_host": "10.1.2.3", "remote_port": 5711}}
    assert json.loads(body)["engine"] == "decode"
    _post(proxy, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}]})
    assert pre.seen[1]["kv_transfer_params"]["remote_decoder"]["kv_request_id"] != rid  # fresh id per request


def test_streaming_body_is_relayed_intact(engines, proxy):
    status, body = _post(proxy, "/v1/completions", {"prompt": "s", "max_tokens": 3, "stream": True})
    assert status == 200
    assert body == b'data: {"t": 0}\n\ndata: {"t": 1}\n\ndata: {"t": 2}\n\ndata: [DONE]\n\n'
    assert engines[0].seen[0]["stream"] is False  # the prefill leg never streams


def test_health_models_and_bad_input(engines, proxy):
    c = http.client.HTTPConnection("127.0.0.1", proxy, timeout=10)
    c.request("GET", "/health")
    r = c.getresponse()
    assert r.status == 200 and json.loads(r.read())["status"] == "ok"
    c.request("GET", "/v1/models")
    r = c.getresponse()
    assert r.status == 200 and json.loads(r.read())["data"][0]["id"] == "tiny"
    c.request("POST", "/v1/completions", body=b"{not json", headers={"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 400 and b"invalid JSON" in r.read()
    assert _post(proxy, "/v1/other", {})[0] == 404


def test_prefill_failure_falls_back_to_decode_without_transfer(engines):
    bad = Engine("prefill", fail=True)
    proc, port = _start_proxy(bad.url, engines[1].url)
    try:
        status, body = _post(port, "/v1/completions", {"prompt": "p", "max_tokens": 2})
        assert status == 200 and "kv_transfer_params" not in engines[1].seen[0]
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        c.request("GET", "/health")
        r = c.getresponse()
        assert r.status == 503 and "prefill: HTTP 500" in r.read().decode()
    finally:
        proc.terminate()
        proc.wait(10)
        bad.shutdown()
        bad.server_close()


def test_decode_unreachable_is_a_502():
    pre = Engine("prefill")
    proc, port = _start_proxy(pre.url, f"http://127.0.0.1:{free_port()}")
    try:
        status, body = _post(port, "/v1/completions", {"prompt": "p"})
        assert status == 502 and b"decode engine unreachable" in body
    finally:
        proc.terminate()
        proc.wait(10)
        pre.shutdown()
        pre.server_close()
