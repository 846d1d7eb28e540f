"""One emulated host's engine side: a KV region and a spawned worker, driven by JSON lines on stdin.

Run inside the host's namespaces by tests/hosts/emulate.py (so the region, the rings and the worker all live in
that host's private /dev/shm, and the worker binds that host's veth address).  One request per line, one answer
per line; an answer is {"ok": true, ...} or {"ok": false, "error": "..."}.

    {"op": "start", "name": N, "blocks": B, "block_bytes": S, "host": IP, "port": P, "seed": K, "settings": {...}}
        -> {"ok": true, "address": "IP:PORT", "backend": "nixl"}   region of seeded random bytes, worker attached
    {"op": "store", "job": J, "request": R, "keys": [hex...], "rows": [...]}          park rows for a consumer
    {"op": "load", "job": J, "address": A, "request": R, "keys": [hex...], "rows": [...]}
    {"op": "wait", "jobs": [J...], "timeout_s": T}
        -> {"ok": true, "done": {J: {"success": b, "reason": s, "seconds": f, "nbytes": n}}, "worker_exit": C}
           (reported so far; worker_exit: the worker's exit code if it died while we waited, else null)
    {"op": "digest", "rows": [...]} -> {"ok": true, "sha256": hex}                     of those rows, in order
    {"op": "stop"} -> {"ok": true, "exit_code": C}                                     worker closed, region removed
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

import numpy as np

from p2pworker import api
from p2pworker.client import WorkerClient
from p2pworker.shm import KVRegion


class Agent:
    def __init__(self) -> None:
        self.region: KVRegion | None = None
        self.client: WorkerClient | None = None
        self.done: dict[int, dict] = {}

    def start(self, name: str, blocks: int, block_bytes: int, host: str, port: int, seed: int,
              settings: dict | None) -> dict:
        self.region = KVRegion.create(f"p2pw_host_{name}_{os.getpid()}", blocks, block_bytes)
        rng = np.random.default_rng(seed)
        self.region.array()[:] = rng.integers(0, 256, size=(blocks, block_bytes), dtype=np.uint8)
        args = ["--host", host, "--port", str(port)]
        if settings:
            args += ["--settings-json", json.dumps(settings)]
        self.client = WorkerClient(name, args=args)
        ready = self.client.attach(self.region.handle, {"model": "emulated-hosts"})
        return {"address": ready.address.removeprefix("tcp://"), "backend": ready.backend}

    def _collect(self) -> None:
        for ev in self.client.poll():
            if isinstance(ev, api.JobFinished):
                if ev.job_id in self.done:
                    raise AssertionError(f"job {ev.job_id} reported twice")
                self.done[ev.job_id] = {"success": ev.success, "reason": ev.reason, "seconds": ev.seconds,
                                        "nbytes": ev.nbytes}

    def handle(self, req: dict) -> dict:
        op = req["op"]
        if op == "start":
            return self.start(req["name"], req["blocks"], req["block_bytes"], req["host"], req["port"],
                              req.get("seed", 0), req.get("settings"))
        if op in ("store", "load"):
            keys = [bytes.fromhex(k) for k in req["keys"]]
            cmd = (api.StoreJob(req["job"], req["request"], keys, req["rows"]) if op == "store" else
                   api.LoadJob(req["job"], req["address"], req["request"], keys, req["rows"]))
            if not self.client.send(cmd):
                raise RuntimeError("command ring full")
            return {}
        if op == "wait":
            want, deadline = set(req["jobs"]), time.monotonic() + req["timeout_s"]
            exit_code = None
            while not want <= set(self.done) and time.monotonic() < deadline:
                self._collect()
                if not self.client.alive():  # what the tier does then: its jobs fail once, it restarts the worker
                    self._collect()
                    exit_code = self.client.proc.poll()
                    break
                time.sleep(0.001)
            return {"done": {str(j): self.done[j] for j in want if j in self.done}, "worker_exit": exit_code}
        if op == "digest":
            arr = self.region.array()
            h = hashlib.sha256()
            for r in req["rows"]:
                h.update(arr[r].tobytes())
            return {"sha256": h.hexdigest()}
        if op == "stop":
            return {"exit_code": self.close()}
        raise ValueError(f"unknown op {op!r}")

    def close(self) -> int | None:
        code = self.client.close() if self.client is not None else None
        self.client = None
        if self.region is not None:
            self.region.close()
            self.region = None
        return code


def main() -> None:
    # answers on the original stdout only: everything else that writes to fd 1 (NIXL's logs, the spawned worker,
    # which inherits it) goes to stderr instead
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    agent = Agent()
    try:
        for line in sys.stdin:
            try:
                out = {"ok": True, **agent.handle(json.loads(line))}
            except Exception as e:  # noqa: BLE001 - every failure goes back to the test as an answer
                out = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            answers.write(json.dumps(out) + "\n")
            if json.loads(line).get("op") == "stop":
                return
    finally:
        agent.close()


if __name__ == "__main__":
    main()
