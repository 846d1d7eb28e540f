"""A fake vLLM OpenAI server for ``p2pworker calibrate``'s logic: /v1/models, /metrics with the cached-by-source
counter, and /v1/completions (streamed or not) whose latency and cache attribution follow a script.

A source (:class:`FakeEngine` with no ``source``) remembers the prompts it computed; a puller (one whose
``source`` is that engine) counts a request carrying ``remote_kv_source`` for a prompt the source computed as
``p2p`` tokens and answers after ``pull_s``; any other request recomputes, after ``recompute_s_per_token`` per
token.  ``contaminate`` makes the puller count every request without transfer params as a host hit; ``pulls_fail``
makes pulls recompute.  Timings are sleeps, far apart, so which leg wins never depends on the machine's load."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tests.helpers.ports import free_port


@dataclass
class Script:
    model: str = "tiny"
    root: str = "/models/tiny"
    max_model_len: int = 2048
    block_size: int = 16
    tier: bool = True
    p2p_address: str | None = None  # published as 0.33's vllm:kv_offload_config_info
    recompute_s_per_token: float = 0.0
    pull_s: float = 0.0
    contaminate: bool = False
    pulls_fail: bool = False


@dataclass
class FakeEngine:
    script: Script = field(default_factory=Script)
    source: "FakeEngine | None" = None
    cached: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0, "p2p": 0})
    computed: set = field(default_factory=set)
    requests: list = field(default_factory=list)

    def __post_init__(self):
        self.lock = threading.Lock()
        self.port = free_port()
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def do_GET(self):
                if self.path == "/v1/models":
                    s = engine.script
                    self.send_body({"object": "list", "data": [{"id": s.model, "root": s.root,
                                                            "max_model_len": s.max_model_len}]})
                elif self.path == "/metrics":
                    self.send_body(engine.metrics().encode(), "text/plain")
                else:
                    self.send_error(404)

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                engine.serve(self, body)

            def send_body(self, obj, ctype="application/json"):
                raw = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)

    def metrics(self) -> str:
        s = self.script
        lines = ["# HELP vllm:prompt_tokens_cached_by_source_total Prompt tokens served from a cache.",
                 "# TYPE vllm:prompt_tokens_cached_by_source_total counter"]
        with self.lock:
            lines += [f'vllm:prompt_tokens_cached_by_source_total{{engine="0",model_name="{s.model}",'
                      f'source="{k}"}} {float(v)}' for k, v in self.cached.items()]
        lines.append(f'vllm:cache_config_info{{block_size="{s.block_size}",cache_dtype="auto",engine="0"}} 1.0')
        if s.tier:
            lines += ["# HELP vllm:kv_offload_p2pworker_loads_total Loads from peers.",
                      "# TYPE vllm:kv_offload_p2pworker_loads_total counter",
                      'vllm:kv_offload_p2pworker_loads_total{engine="0",outcome="ok",worker="w"} 0.0']
        if s.p2p_address:
            lines.append(f'vllm:kv_offload_config_info{{engine="0",p2p_address="{s.p2p_address}",'
                         f'p2p_backend="UCX",tier="0"}} 1.0')
        return "\n".join(lines) + "\n"

    def serve(self, handler, body: dict) -> None:
        import time

        prompt = tuple(body["prompt"]) if isinstance(body["prompt"], list) else body["prompt"]
        n = len(prompt) if isinstance(prompt, tuple) else len(prompt.split())
        s = self.script
        hit = (n - 1) // s.block_size * s.block_size
        pulled = ("remote_kv_source" in (body.get("kv_transfer_params") or {}) and not s.pulls_fail
                  and self.source is not None and prompt in self.source.computed)
        with self.lock:
            self.requests.append(body)
            self.computed.add(prompt)
            if pulled:
                self.cached["p2p"] += hit
            elif s.contaminate and not body.get("kv_transfer_params"):
                self.cached["host"] += hit
        time.sleep(s.pull_s if pulled else s.recompute_s_per_token * n)
        choice = {"index": 0, "text": " x", "finish_reason": "length"}
        if not body.get("stream"):
            handler.send_body({"choices": [choice]})
            return
        handler.send_response(200)
        handler.send_header("Content-Type", "text/event-stream")
        handler.end_headers()
        handler.wfile.write(b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\ndata: [DONE]\n\n")
        handler.wfile.flush()
        handler.close_connection = True
