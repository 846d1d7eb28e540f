"""One access-log line per request, and the trace the handlers fill in for it."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

from aiohttp import web

from p2pworker.router.config import Lifecycle
from p2pworker.router.metrics import RouterMetrics

access_log = logging.getLogger("p2pworker.router.access")


@dataclass
class Trace:
    """What the access log line says about one request."""

    request_id: str = ""
    prefill: str = "-"
    decode: str = "-"
    note: str = ""
    client_gone: bool = False  # the client went away (its write failed or stalled): logged as 499
    started: float = field(default_factory=time.monotonic)


class AccessLog:
    """The middleware: a Trace per request (``request["trace"]``), its status counted and logged once."""

    def __init__(self, metrics: RouterMetrics, life: Lifecycle, clock: Callable[[], float]):
        self.metrics = metrics
        self.life = life
        self._clock = clock

    @web.middleware
    async def middleware(self, request: web.Request, handler) -> web.StreamResponse:
        trace = request["trace"] = Trace(request_id=request.headers.get("X-Request-Id") or uuid.uuid4().hex,
                                         started=self._clock())
        status = 500
        try:
            resp = await handler(request)
            status = resp.status
            if self.life.draining and not resp.prepared:
                resp.force_close()  # Connection: close: the client's next request goes to another router
            return resp
        except web.HTTPException as e:
            status = e.status
            raise
        except asyncio.CancelledError:
            if self.life.draining:
                trace.note = "cut by the router's shutdown"
            elif not trace.client_gone:
                trace.client_gone, trace.note = True, "client disconnected"
                self.metrics.disconnects.inc()
            raise
        finally:
            if trace.client_gone:
                status = 499  # nginx's code for it; never sent, only logged
            route = request.match_info.route.resource.canonical if request.match_info.route.resource else "other"
            self.metrics.requests.labels(route, str(status)).inc()
            access_log.info("%s %s %s %d %.1f ms id=%s prefill=%s decode=%s%s", request.remote, request.method,
                            request.path, status, (self._clock() - trace.started) * 1e3, trace.request_id,
                            trace.prefill, trace.decode, f" ({trace.note})" if trace.note else "")
