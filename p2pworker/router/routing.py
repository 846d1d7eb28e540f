"""What a client request asks of the router beyond its body: the mode the router runs in, and the routing headers
llm-d's routing sidecar sends (sans-IO: parsing only)."""

from __future__ import annotations

import enum
import urllib.parse
from dataclasses import dataclass

from multidict import CIMultiDict, CIMultiDictProxy

# the prefill instance to use for this request: HTTP host:port of a `vllm serve` (llm-d's routing sidecar)
PREFILLER_HEADER = "x-prefiller-host-port"
# a peer whose p2pworker holds (part of) this prompt's KV: host:port of that worker's control socket
KV_SOURCE_HEADER = "x-kv-cache-source-host-port"
# asked of the router, not of an engine: never forwarded upstream
ROUTING_HEADERS = frozenset({PREFILLER_HEADER, KV_SOURCE_HEADER})


class Mode(enum.Enum):
    PD = "pd"  # prefill on a prefill instance, then decode on a decode instance
    AGGREGATED = "aggregated"  # one instance computes the prompt and decodes


@dataclass(frozen=True)
class HostPort:
    host: str  # without IPv6 brackets
    port: int

    @classmethod
    def parse(cls, value: str) -> HostPort:
        """`HOST:PORT` (an IPv6 host in brackets); ValueError on anything else (a path, user info, no port)."""
        value = value.strip()
        u = urllib.parse.urlsplit(f"http://{value}")
        try:
            port = u.port
        except ValueError:  # out of range or not a number
            port = None
        if not u.hostname or port is None or port == 0 or u.username or u.password or u.path or u.query \
                or u.fragment:
            raise ValueError(f"need HOST:PORT, got {value!r}")
        return cls(u.hostname, port)

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True)
class Routing:
    """What the routing headers of one request ask for."""

    prefillers: tuple[HostPort, ...] = ()  # tried in this order, before the configured prefill instances
    kv_source: HostPort | None = None  # the leg that computes the prompt pulls its prefix from this worker


def routing_of(headers: CIMultiDictProxy[str] | CIMultiDict[str]) -> Routing:
    """The routing headers of a request; ValueError (naming the header) when one is malformed.

    The prefiller header may list several instances, comma-separated or repeated (the sidecar's forms); the source
    is one worker."""
    prefillers = [_parse(PREFILLER_HEADER, p) for p in _values(headers, PREFILLER_HEADER)]
    sources = _values(headers, KV_SOURCE_HEADER)
    if len(sources) > 1:
        raise ValueError(f"{KV_SOURCE_HEADER}: one HOST:PORT, got {', '.join(sources)}")
    return Routing(tuple(dict.fromkeys(prefillers)), _parse(KV_SOURCE_HEADER, sources[0]) if sources else None)


def _values(headers: CIMultiDictProxy[str] | CIMultiDict[str], name: str) -> list[str]:
    """Every comma-separated item of every occurrence of one header."""
    return [p.strip() for raw in headers.getall(name, []) for p in raw.split(",") if p.strip()]


def _parse(header: str, value: str) -> HostPort:
    try:
        return HostPort.parse(value)
    except ValueError as e:
        raise ValueError(f"{header}: {e}") from None


def peer_params(kv_request_id: str, peer: HostPort) -> dict:
    """The `{kv_request_id, remote_host, remote_port}` entry of kv_transfer_params naming a peer's worker."""
    return {"kv_request_id": kv_request_id, "remote_host": peer.host, "remote_port": peer.port}
