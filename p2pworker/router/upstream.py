"""The router's view of an upstream call: which headers cross, and what a failure says about the instance."""

from __future__ import annotations

import asyncio
import enum
import errno

import aiohttp
from multidict import CIMultiDict, CIMultiDictProxy

from p2pworker.router.pool import Outcome
from p2pworker.router.routing import ROUTING_HEADERS

HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                        "trailers", "transfer-encoding", "upgrade", "proxy-connection"})
# the body is re-encoded as plain JSON (its length changes; aiohttp already undid any Content-Encoding), the
# upstream is another host, the router itself answered any Expect: 100-continue, and the routing headers were
# asked of the router (an engine would only see where else it could have gone)
NOT_FORWARDED_UP = HOP_BY_HOP | {"host", "content-length", "content-encoding", "expect"} | ROUTING_HEADERS
# aiohttp frames the relayed body itself (chunked) and writes its own Date and Server
NOT_FORWARDED_DOWN = HOP_BY_HOP | {"content-length", "date", "server"}


class Reason(enum.Enum):
    """Why an upstream call failed; the label of the failure counters."""

    UNREACHABLE = "unreachable"  # refused or not connected in time: nothing was sent, another instance may take it
    TIMEOUT = "timeout"  # no bytes for read_timeout_s
    DISCONNECTED = "disconnected"  # the connection broke after the request was sent
    HTTP_5XX = "http_5xx"
    HTTP_4XX = "http_4xx"  # the request's fault, not the instance's (prefill leg only: decode's 4xx is relayed)
    LOCAL = "local"  # this router ran out of file descriptors, ports or buffers: nothing about the instance

    @property
    def outcome(self) -> Outcome | None:
        """What it says about the instance (pool.MOVES); None: nothing."""
        if self is Reason.LOCAL:
            return None
        if self in (Reason.UNREACHABLE, Reason.DISCONNECTED):
            return Outcome.FAILED  # the process or its host is gone
        if self is Reason.HTTP_4XX:
            return Outcome.OK  # it answered; the request is what it refused
        return Outcome.ERROR  # one request may be at fault: only several in a row take it out


class UpstreamError(Exception):
    def __init__(self, reason: Reason, detail: str):
        super().__init__(f"{reason.value}: {detail}")
        self.reason, self.detail = reason, detail


# errno of a failed connect that is this process's or this host's shortage, not the instance's absence
LOCAL_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.EADDRNOTAVAIL, errno.ENOBUFS, errno.ENOMEM})


def classify(e: BaseException) -> UpstreamError:
    if isinstance(e, aiohttp.ClientConnectorError) and e.os_error.errno in LOCAL_ERRNOS:
        return UpstreamError(Reason.LOCAL, str(e))
    # ConnectionTimeoutError: no connection within the connect timeout (it is a TimeoutError too: test it first)
    if isinstance(e, (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)):
        return UpstreamError(Reason.UNREACHABLE, str(e) or type(e).__name__)
    if isinstance(e, asyncio.TimeoutError):  # aiohttp's ServerTimeoutError is one too
        return UpstreamError(Reason.TIMEOUT, str(e) or type(e).__name__)
    return UpstreamError(Reason.DISCONNECTED, str(e) or type(e).__name__)


def forwarded(headers: CIMultiDictProxy[str] | CIMultiDict[str], drop: frozenset[str]) -> CIMultiDict[str]:
    """Headers to pass on: all but `drop` and the ones the `Connection` header lists (hop-by-hop by declaration)."""
    listed = {t.strip().lower() for t in headers.get("Connection", "").split(",") if t.strip()}
    out: CIMultiDict[str] = CIMultiDict()
    for k, v in headers.items():
        if k.lower() not in drop and k.lower() not in listed:
            out.add(k, v)
    return out
