"""A small prefill/decode proxy with OpenAI-compatible endpoints (stdlib only).

For each completion request: a fresh ``kv_request_id``; the prompt goes to the
prefill engine with ``max_tokens=1`` and ``kv_transfer_params.remote_decoder``
(its KV is parked in the prefill worker); then the original request goes to
the decode engine with ``kv_transfer_params.remote_prefiller`` pointing at the
prefill engine's worker, and the decode engine's answer (streamed or not) is
relayed to the client.  If the prefill call fails, the request still goes to
decode without transfer params (it recomputes), and the failure is logged.
"""

from __future__ import annotations

import http.client
import json
import logging
import threading
import urllib.parse
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

log = logging.getLogger("p2pworker.proxy")

COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")
MAX_BODY_BYTES = 16 << 20
HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}


class Upstream:
    def __init__(self, url: str, timeout_s: float):
        u = urllib.parse.urlsplit(url)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"upstream must be http://host:port, got {url!r}")
        self.host, self.port, self.timeout_s = u.hostname, u.port or 80, timeout_s
        self.url = url

    def request(self, method: str, path: str, body: bytes | None = None) -> http.client.HTTPResponse:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
        conn.request(method, path, body=body, headers={"Content-Type": "application/json"} if body else {})
        return conn.getresponse()


class PDProxy(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, listen: tuple[str, int], prefill: str, decode: str, prefill_worker: str,
                 timeout_s: float = 600.0):
        host, _, port = prefill_worker.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"prefill worker must be host:port, got {prefill_worker!r}")
        self.prefill, self.decode = Upstream(prefill, timeout_s), Upstream(decode, timeout_s)
        self.worker_host, self.worker_port = host, int(port)
        self.counters = {"requests": 0, "prefill_failures": 0, "errors": 0}
        self.lock = threading.Lock()
        super().__init__(listen, _Handler)

    def count(self, key: str) -> None:
        with self.lock:
            self.counters[key] += 1


class _Handler(BaseHTTPRequestHandler):
    server: PDProxy
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt: str, *args) -> None:
        log.debug("%s " + fmt, self.address_string(), *args)

    def _json(self, code: int, obj: dict) -> None:
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/health":
            bad = []
            for name, up in (("prefill", self.server.prefill), ("decode", self.server.decode)):
                try:
                    r = up.request("GET", "/health")
                    r.read()
                    if r.status != 200:
                        bad.append(f"{name}: HTTP {r.status}")
                except OSError as e:
                    bad.append(f"{name}: {e}")
            self._json(503 if bad else 200, {"status": "unhealthy" if bad else "ok", "problems": bad})
        elif self.path == "/v1/models":
            self._relay(self.server.decode, "GET", self.path, None)
        elif self.path == "/stats":
            self._json(200, dict(self.server.counters))
        else:
            self._json(404, {"error": f"no route {self.path}"})

    def do_POST(self) -> None:
        if self.path not in COMPLETION_PATHS:
            self._json(404, {"error": f"no route {self.path}"})
            return
        n = int(self.headers.get("Content-Length") or 0)
        if n <= 0 or n > MAX_BODY_BYTES:
            self._json(400, {"error": f"request body must be 1..{MAX_BODY_BYTES} bytes"})
            return
        try:
            req = json.loads(self.rfile.read(n))
            if not isinstance(req, dict):
                raise ValueError("not a JSON object")
        except ValueError as e:
            self._json(400, {"error": f"invalid JSON body: {e}"})
            return
        srv = self.server
        srv.count("requests")
        kv_id = f"p2pw-{uuid.uuid4().hex}"
        pre = dict(req, max_tokens=1, stream=False, kv_transfer_params={"remote_decoder": {"kv_request_id": kv_id}})
        pre.pop("stream_options", None)
        if "max_completion_tokens" in pre:
            pre["max_completion_tokens"] = 1
        prefilled = False
        try:
            r = srv.prefill.request("POST", self.path, json.dumps(pre).encode())
            r.read()
            prefilled = r.status == 200
            if not prefilled:
                log.warning("prefill answered HTTP %d for %s: decode recomputes", r.status, kv_id)
        except OSError as e:
            log.warning("prefill unreachable (%s) for %s: decode recomputes", e, kv_id)
        if not prefilled:
            srv.count("prefill_failures")
        dec = dict(req)
        if prefilled:
            dec["kv_transfer_params"] = {"remote_prefiller": {
                "kv_request_id": kv_id, "remote_host": srv.worker_host, "remote_port": srv.worker_port}}
        self._relay(srv.decode, "POST", self.path, json.dumps(dec).encode())

    def _relay(self, up: Upstream, method: str, path: str, body: bytes | None) -> None:
        try:
            r = up.request(method, path, body)
        except OSError as e:
            self.server.count("errors")
            self._json(502, {"error": f"decode engine unreachable: {e}"})
            return
        self.send_response(r.status)
        for k, v in r.getheaders():
            if k.lower() not in HOP_HEADERS:
                self.send_header(k, v)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        while True:
            chunk = r.read1(65536) if hasattr(r, "read1") else r.read(65536)
            if not chunk:
                break
            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")


def serve(listen_host: str, listen_port: int, prefill: str, decode: str, prefill_worker: str) -> None:
    proxy = PDProxy((listen_host, listen_port), prefill, decode, prefill_worker)
    log.info("PD proxy on http://%s:%d: prefill %s, decode %s, prefill worker %s",
             listen_host, proxy.server_address[1], prefill, decode, prefill_worker)
    try:
        proxy.serve_forever()
    finally:
        proxy.server_close()
