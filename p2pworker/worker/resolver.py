"""Host-name resolution off the worker's loop: a slow resolver must not stall heartbeats or other peers.

    resolve(key, cmd) --IP literal, or resolved within ttl_s--> key (dial now)
                      --otherwise--> None: ``cmd`` waits; one lookup thread per name, however many commands wait
    settle()          --> the names whose lookup ended (or ran past timeout_s), each with its error and its commands

The link is then opened with the NAME: libzmq resolves it on its own thread on every reconnect, so a peer that
comes back at a new address is found.  The worker runs the settled commands again (they dial, or fail with the
backoff the error started).
"""

from __future__ import annotations

import ipaddress
import socket
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

RESOLVE_TTL_S = 30.0  # how long a host name that resolved is trusted to resolve again (libzmq does the real lookup)
RESOLVE_TIMEOUT_S = 5.0  # commands parked behind a slower lookup fail (bounded wait, invariant 4)


class Lookup:
    """One getaddrinfo on its own daemon thread (lookups do not queue behind each other, and a lookup that
    hangs does not keep the process alive at exit)."""

    def __init__(self, host: str, port: str, started: float):
        self.started = started
        self.error: str | None = None
        self.done = threading.Event()
        threading.Thread(target=self._run, args=(host, port), daemon=True, name="p2pworker-resolve").start()

    def _run(self, host: str, port: str) -> None:
        try:
            socket.getaddrinfo(host, int(port) if port.isdigit() else 0, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as e:
            self.error = str(e)
        finally:
            self.done.set()


@dataclass
class Pending:
    lookup: Any  # a Lookup (or what start_lookup made): .started, .done (an Event), .error
    cmds: list = field(default_factory=list)


@dataclass
class Settled:
    key: str
    error: str | None  # None: it resolved
    cmds: list


class Resolver:
    def __init__(self, clock: Callable[[], float], start_lookup: Callable[[str, str, float], Any] = Lookup,
                 ttl_s: float = RESOLVE_TTL_S, timeout_s: float = RESOLVE_TIMEOUT_S):
        self.clock, self.start_lookup = clock, start_lookup
        self.ttl_s, self.timeout_s = ttl_s, timeout_s
        self.pending: dict[str, Pending] = {}  # address key -> its lookup and the commands waiting for it
        self.resolved_at: dict[str, float] = {}  # address key -> when its host name last resolved

    def __contains__(self, key: str) -> bool:
        return key in self.pending

    def __bool__(self) -> bool:
        return bool(self.pending)

    def resolve(self, key: str, cmd: Any) -> str | None:
        """``key`` once its host is known to resolve, else None (``cmd`` waits for the lookup)."""
        host, _, port = key.rpartition(":")
        bare = host.strip("[]")
        try:
            ipaddress.ip_address(bare)
            return key  # a literal: nothing to look up
        except ValueError:
            pass
        cached = self.resolved_at.get(key)
        if cached is not None and self.clock() - cached < self.ttl_s:
            return key
        waiting = self.pending.get(key)
        if waiting is None:
            waiting = self.pending[key] = Pending(self.start_lookup(bare, port, self.clock()))
        waiting.cmds.append(cmd)
        return None

    def settle(self) -> list[Settled]:
        """The lookups that ended (resolved or failed) or ran past timeout_s, with the commands that waited."""
        out = []
        now = self.clock()
        for key, p in list(self.pending.items()):
            if p.lookup.done.is_set():
                error = None if p.lookup.error is None else f"cannot resolve it: {p.lookup.error}"
                if error is None:
                    self.resolved_at[key] = now
            elif now - p.lookup.started >= self.timeout_s:
                error = f"resolving its host name took more than {self.timeout_s:g} s"
            else:
                continue
            del self.pending[key]
            out.append(Settled(key, error, p.cmds))
        return out

    def take_waiting(self) -> list:
        """Every command still waiting (at shutdown: each fails once); the lookups are forgotten."""
        cmds = [c for p in self.pending.values() for c in p.cmds if c is not None]
        self.pending.clear()
        return cmds
