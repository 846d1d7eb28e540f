"""The worker's admin endpoint: a ZMQ REP socket on an IPC path, readable by its owner only.

Requests are JSON objects ``{"op": "status"}``; replies are JSON.  The socket
file is created with umask 077, so only the worker's user can connect.
"""

from __future__ import annotations

import json
import os
from typing import Callable

import zmq


class AdminServer:
    def __init__(self, path: str, status: Callable[[], dict]):
        self.path = path
        self.endpoint = f"ipc://{path}"
        self._status = status
        self._ctx = zmq.Context()
        self.socket = self._ctx.socket(zmq.REP)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.MAXMSGSIZE, 64 << 10)
        old = os.umask(0o077)
        try:
            self.socket.bind(self.endpoint)
        finally:
            os.umask(old)
        self._closed = False

    def serve(self) -> None:
        """Answer every waiting request; never blocks."""
        while True:
            try:
                raw = self.socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                req = json.loads(raw)
                op = req.get("op") if isinstance(req, dict) else None
                reply = self._status() if op == "status" else {"error": f"unknown op {op!r}"}
            except (ValueError, UnicodeDecodeError) as e:
                reply = {"error": f"bad request: {e}"}
            self.socket.send(json.dumps(reply, default=str).encode())

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.socket.close(linger=0)
        self._ctx.term()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def query(endpoint: str, op: str = "status", timeout_s: float = 3.0) -> dict:
    """Ask a worker's admin endpoint; raises TimeoutError if it does not answer."""
    if not endpoint.startswith("ipc://"):
        endpoint = f"ipc://{endpoint}"
    ctx = zmq.Context()
    s = ctx.socket(zmq.REQ)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    s.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
    try:
        s.connect(endpoint)
        s.send(json.dumps({"op": op}).encode())
        try:
            return json.loads(s.recv())
        except zmq.Again:
            raise TimeoutError(f"no answer from {endpoint} within {timeout_s} s") from None
    finally:
        s.close(linger=0)
        ctx.term()
