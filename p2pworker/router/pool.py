"""Which upstream instance gets the next request (sans-IO: no sockets, no clock of its own).

Each instance (a prefill or decode `vllm serve`) is UP or DOWN.  A failure of the connection itself (refused, not
connected within the connect timeout, reset or closed mid-answer) takes it DOWN at once: the process or its host is
gone.  A slower kind of trouble (HTTP 5xx, a read timeout: one request may be at fault) is an ERROR; only
`ERRORS_TO_DOWN` of them in a row take it down.  A request answered, or a health probe passed (its `/health`
answered 200 and, for a prefill instance, its p2pworker's control port accepted a TCP connection), is OK and
brings a DOWN instance back.  A client's mistake (HTTP 4xx) is OK too: the instance answered.  The moves are the
table `MOVES`; the tests read it.  A DOWN instance is probed again after `Backoff` delays (short at first: a
blip should not cost minutes of recomputed prompts), besides the periodic health round.

Picking: the UP instance with the fewest requests in flight; ties go round-robin, so an idle pool spreads requests
instead of sending every one to the first instance.  With no UP instance left to try, the DOWN instance whose last
failure is oldest is returned: the router's view may be stale, and one real attempt is worth more than an answer
without the instance (decode: no answer at all; prefill: a recomputed prompt).  None only when every instance was
tried.
"""

from __future__ import annotations

import enum
import urllib.parse
from dataclasses import dataclass, field


class Role(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


class InstanceState(enum.Enum):
    UP = "up"
    DOWN = "down"


class Outcome(enum.Enum):
    OK = "ok"  # a request answered (any status below 500) or a health round passed
    ERROR = "error"  # HTTP 5xx or a read timeout: counted; ERRORS_TO_DOWN in a row count as FAILED
    FAILED = "failed"  # the connection failed (refused, connect timeout, reset, closed) or a health round failed


ERRORS_TO_DOWN = 3

MOVES: dict[tuple[InstanceState, Outcome], InstanceState] = {
    (InstanceState.UP, Outcome.OK): InstanceState.UP,
    (InstanceState.UP, Outcome.ERROR): InstanceState.UP,
    (InstanceState.UP, Outcome.FAILED): InstanceState.DOWN,
    (InstanceState.DOWN, Outcome.OK): InstanceState.UP,
    (InstanceState.DOWN, Outcome.ERROR): InstanceState.DOWN,
    (InstanceState.DOWN, Outcome.FAILED): InstanceState.DOWN,
}


class Policy(enum.Enum):
    LEAST_IN_FLIGHT = "least-in-flight"
    ROUND_ROBIN = "round-robin"


@dataclass
class Instance:
    role: Role
    url: str  # http://host:port, no trailing slash
    worker: tuple[str, int] | None = None  # prefill only: where decode's p2pworker fetches this engine's KV
    state: InstanceState = InstanceState.UP  # optimistic until the first health round says otherwise
    in_flight: int = 0
    last_error: str = ""
    failed_at: float = 0.0  # caller's clock; orders DOWN instances for the no-one-is-up fallback
    worker_reachable: bool | None = None  # prefill only: last health round's TCP check of the worker port
    errors_in_row: int = 0  # ERROR outcomes since the last OK
    ad_hoc: bool = False  # prefill named by a request's x-prefiller-host-port, not configured: never health-checked

    @property
    def name(self) -> str:
        """The instance's label in logs and metrics: host:port of its URL."""
        return urllib.parse.urlsplit(self.url).netloc

    def record(self, outcome: Outcome, now: float, error: str = "") -> InstanceState:
        """Apply one outcome; returns the previous state."""
        if outcome is Outcome.ERROR:
            self.errors_in_row += 1
            if self.errors_in_row >= ERRORS_TO_DOWN:
                outcome = Outcome.FAILED
        elif outcome is Outcome.OK:
            self.errors_in_row = 0
        before = self.state
        self.state = MOVES[(before, outcome)]
        if outcome is not Outcome.OK:
            self.last_error = error
        if outcome is Outcome.FAILED:
            self.failed_at = now
        return before


@dataclass
class Backoff:
    """Delays between the re-probes of one DOWN instance: `first_s`, doubling, at most `max_s`."""

    first_s: float
    max_s: float
    _next_s: float = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._next_s = min(self.first_s, self.max_s)

    def next(self) -> float:
        delay, self._next_s = self._next_s, min(self._next_s * 2, self.max_s)
        return delay


@dataclass
class Pool:
    instances: list[Instance]
    policy: Policy = Policy.LEAST_IN_FLIGHT
    _next: int = field(default=0, repr=False)  # round-robin cursor

    def pick(self, exclude: tuple[Instance, ...] = ()) -> Instance | None:
        """The instance for the next request: UP ones first, then DOWN ones (oldest failure first); None when
        every instance is excluded."""
        n = len(self.instances)
        start, self._next = self._next, (self._next + 1) % max(n, 1)
        order = [self.instances[(start + i) % n] for i in range(n)]  # rotated: ties go round-robin
        candidates = [i for i in order if i not in exclude]
        if not candidates:
            return None
        up = [i for i in candidates if i.state is InstanceState.UP]
        if not up:
            return min(candidates, key=lambda i: i.failed_at)
        if self.policy is Policy.ROUND_ROBIN:
            return up[0]
        return min(up, key=lambda i: i.in_flight)  # min keeps the first of equals: the rotation breaks ties

    def up(self) -> list[Instance]:
        return [i for i in self.instances if i.state is InstanceState.UP]


def parse_instance(role: Role, spec: str, default_worker_port: int) -> Instance:
    """`URL` or (prefill) `URL,worker=HOST:PORT`; a prefill instance without `worker=` is served by a p2pworker on
    its URL's host at `default_worker_port`."""
    url, *opts = [p.strip() for p in spec.split(",")]
    u = urllib.parse.urlsplit(url)
    if u.scheme != "http" or not u.hostname or u.path not in ("", "/") or u.query:
        raise ValueError(f"{role.value} instance must be http://host:port, got {url!r}")
    worker = None
    for opt in opts:
        key, _, value = opt.partition("=")
        if key != "worker" or role is not Role.PREFILL:
            allowed = "worker=HOST:PORT" if role is Role.PREFILL else "no options"
            raise ValueError(f"unknown option {opt!r} in {spec!r} ({allowed} allowed)")
        host, _, port = value.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"worker must be HOST:PORT, got {value!r} in {spec!r}")
        worker = (host.strip("[]"), int(port))
    if role is Role.PREFILL and worker is None:
        worker = (u.hostname, default_worker_port)
    return Instance(role=role, url=f"http://{u.netloc}", worker=worker)
