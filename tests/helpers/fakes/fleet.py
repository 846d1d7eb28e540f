"""Processes for router tests: fake engines (tests/helpers/fakes/engine.py), a fake p2pworker port, and the real
router."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.ports import free_port

ENGINE = Path(__file__).with_name("engine.py")
BIN = Path(sys.executable).with_name("p2pworker")


def _wait_port(port: int, proc: subprocess.Popen, what: str, log: Path, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"{what} did not start (exit {proc.poll()}):\n{log.read_text()[-3000:]}")
            time.sleep(0.05)


class FakeEngine:
    def __init__(self, name: str, tmp: Path, tokens: int = 5, token_delay: float = 0.02):
        self.name, self.port = name, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.record, self.log = tmp / f"{name}.jsonl", tmp / f"{name}.log"
        self.proc = subprocess.Popen(
            [sys.executable, str(ENGINE), "--port", str(self.port), "--name", name, "--record", str(self.record),
             "--tokens", str(tokens), "--token-delay", str(token_delay)],
            stdout=subprocess.DEVNULL, stderr=self.log.open("w"))
        _wait_port(self.port, self.proc, f"fake engine {name}", self.log)

    def seen(self, event: str = "request") -> list[dict]:
        if not self.record.exists():
            return []
        rows = [json.loads(line) for line in self.record.read_text().splitlines() if line.strip()]
        return [r for r in rows if r["event"] == event]

    def mode(self, **kw) -> None:
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        c.request("POST", "/_fake/mode", body=json.dumps(kw), headers={"Content-Type": "application/json"})
        assert c.getresponse().status == 200

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


class FakeWorkerPort:
    """A listening TCP port standing in for a prefill engine's p2pworker control port (the router only checks that
    it accepts a connection)."""

    def __init__(self):
        self.port = free_port()
        self.sock = socket.create_server(("127.0.0.1", self.port))

    def close(self) -> None:
        self.sock.close()


class Router:
    COMMAND = [str(BIN), "router"]  # the console script

    def __init__(self, tmp: Path, prefill: list[str], decode: list[str], *flags: str):
        self.port = free_port()
        self.log = tmp / f"router-{self.port}.log"
        args = [*self.COMMAND, "--port", str(self.port)]
        for p in prefill:
            args += ["--prefill", p]
        for d in decode:
            args += ["--decode", d]
        self.proc = subprocess.Popen(args + list(flags), stdout=subprocess.DEVNULL, stderr=self.log.open("w"))
        _wait_port(self.port, self.proc, "router", self.log)

    def request(self, method: str, path: str, body: dict | bytes | None = None, headers: dict | None = None,
                timeout: float = 30) -> tuple[int, dict, bytes]:
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
        h = {"Content-Type": "application/json"} if data is not None else {}
        c.request(method, path, body=data, headers={**h, **(headers or {})})
        r = c.getresponse()
        out = r.status, dict(r.getheaders()), r.read()
        c.close()
        return out

    def send(self, body: dict, timeout: float = 30) -> http.client.HTTPConnection:
        """POST a completion and return the connection: the caller takes the response when it wants it (streams,
        requests held open)."""
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        c.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        return c

    def health(self) -> tuple[int, dict]:
        status, _, body = self.request("GET", "/health")
        return status, json.loads(body)

    def metric(self, name: str, **labels: str) -> float:
        """The value of one series of /metrics (0.0 when absent)."""
        _, _, body = self.request("GET", "/metrics")
        for family in text_string_to_metric_families(body.decode()):
            for s in family.samples:
                if s.name == name and s.labels == labels:
                    return s.value
        return 0.0

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
                return None
        return self.proc.returncode
