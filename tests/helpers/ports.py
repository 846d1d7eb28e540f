"""Loopback ports for tests that must name a port before the process that binds it starts.

Why not ``bind(("127.0.0.1", 0))`` then close: the kernel hands out exactly that range (ip_local_port_range) to
every other ``bind(0)`` and outgoing ``connect`` on the machine, so between our close and the worker's bind a vLLM
engine starting beside it (torch.distributed's store, gloo, ZMQ, HTTP clients) can take the same port, and the
worker then fails to bind and the engine fails its start.  Ports below the ephemeral range are never handed out
by the kernel, so only an explicit bind to that very number can collide, and this module never returns a port
twice in one process.
"""

from __future__ import annotations

import random
import socket

_handed_out: set[int] = set()
_FLOOR = 10_000  # below: well-known and registered services a CI image may run


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default


def free_ports(n: int) -> list[int]:
    """``n`` distinct loopback TCP ports outside the kernel's ephemeral range that were free a moment ago."""
    high = _ephemeral_low()
    if high - _FLOOR < 1_000:
        raise RuntimeError(f"ip_local_port_range starts at {high}: no room below it for test ports")
    rng = random.SystemRandom()
    out: list[int] = []
    for _ in range(200 * n):
        if len(out) == n:
            return out
        port = rng.randrange(_FLOOR, high)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        out.append(port)
    raise RuntimeError(f"no {n} free loopback ports in [{_FLOOR}, {high})")


def free_port() -> int:
    return free_ports(1)[0]


def free_port_run(n: int) -> int:
    """The first of ``n`` consecutive free ports (the control ports of an engine's DP ranks: base + rank)."""
    high = _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(200):
        base = rng.randrange(_FLOOR, high - n)
        run = range(base, base + n)
        if any(p in _handed_out for p in run):
            continue
        socks = []
        try:
            for p in run:
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
        _handed_out.update(run)
        return base
    raise RuntimeError(f"no {n} consecutive free loopback ports in [{_FLOOR}, {high})")
