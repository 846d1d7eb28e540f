"""A completion's legs: the prefill leg (tried on one instance after another, or given up: decode then
recomputes, counted and logged) and the bodies each leg sends (docs/router.md)."""

from __future__ import annotations

import asyncio
import logging
from typing import Iterator

import aiohttp
import msgspec
from multidict import CIMultiDict

from p2pworker.router.access import Trace
from p2pworker.router.fleet import Fleet
from p2pworker.router.health import Health
from p2pworker.router.metrics import RouterMetrics
from p2pworker.router.pool import Instance, InstanceState
from p2pworker.router.relay import Upstream
from p2pworker.router.routing import HostPort, Routing, peer_params
from p2pworker.router.upstream import Reason, UpstreamError, classify

log = logging.getLogger("p2pworker.router")
# bodies: msgspec, several times faster than json on a 7 MiB prompt of token ids
_encode = msgspec.json.Encoder().encode


def tries_next(err: UpstreamError, was_up: bool) -> bool:
    """After a failed prefill try, whether the next prefill instance is tried: when nothing was sent (unreachable),
    or when the instance was already down (little was expected of it) and the request is not at fault (a 4xx would
    be the same everywhere).  An up instance that failed after the request went out may have half done it, and
    the request itself may be at fault: once is enough, decode recomputes."""
    if err.reason is Reason.UNREACHABLE:
        return True
    return not was_up and err.reason is not Reason.HTTP_4XX


def source_id(kv_id: str, leg: str = "") -> str:
    """The kv_request_id of a request's pull from its KV source: its own, so that the source's parked rows and the
    prefill's (under kv_id) can never be taken for each other, even were the source the prefill's own worker; a
    decode leg that pulls because no prefill served the request gets another one (``leg``)."""
    return f"{kv_id}-{leg}src" if leg else f"{kv_id}-src"


def aggregated_body(body: bytes, req: dict, routing: Routing, kv_id: str) -> bytes:
    """Aggregated mode: the request as it came, or with the router's remote_kv_source (the only params then)."""
    if routing.kv_source is None:
        return body  # not re-encoded: the engine gets the client's bytes
    src = peer_params(source_id(kv_id), routing.kv_source)
    return _encode(dict(req, kv_transfer_params={"remote_kv_source": src}))


def prefill_body(req: dict, kv_id: str, routing: Routing) -> bytes:
    """The prefill leg's request: one token, parked for a remote decoder (and its prefix pulled from the source)."""
    kv: dict = {"remote_decoder": {"kv_request_id": kv_id}}
    if routing.kv_source is not None:  # the legal pair: pull the prefix from the source, compute the rest
        kv["remote_kv_source"] = peer_params(source_id(kv_id), routing.kv_source)
    pre = dict(req, max_tokens=1, stream=False, kv_transfer_params=kv)
    pre.pop("stream_options", None)  # only valid with stream=true
    pre.pop("min_tokens", None)  # vLLM refuses min_tokens > max_tokens (1 here)
    if "max_completion_tokens" in pre:
        pre["max_completion_tokens"] = 1
    return _encode(pre)


def decode_body(req: dict, kv_id: str, routing: Routing, by: Instance | None) -> bytes:
    """The decode leg's request: the client's, with the router's transfer params (never the client's)."""
    dec = dict(req)
    dec.pop("kv_transfer_params", None)  # the router's transfer params, never the client's
    if by is not None:
        host, port = by.worker
        dec["kv_transfer_params"] = {"remote_prefiller": peer_params(kv_id, HostPort(host, port))}
    elif routing.kv_source is not None:  # decode computes the prompt now: it may still pull the prefix
        # its own id at the source: a prefill that failed after it began pulling under source_id may still
        # hold (or later release, Done) what the source parked for it
        dec["kv_transfer_params"] = {"remote_kv_source": peer_params(source_id(kv_id, "decode"),
                                                                     routing.kv_source)}
    return _encode(dec)


class PrefillLeg:
    def __init__(self, fleet: Fleet, upstream: Upstream, health: Health, metrics: RouterMetrics):
        self.fleet = fleet
        self.upstream = upstream
        self.health = health
        self.metrics = metrics

    async def run(self, path: str, req: dict, headers: CIMultiDict[str], kv_id: str, routing: Routing,
                  named: list[Instance], trace: Trace) -> Instance | None:
        """Prefill on one instance; that instance, or None (counted, logged) when none served it: decode
        recomputes.  Tried in turn, each once: the instances the request named, then the configured ones, up ones
        first, then down ones (a real attempt: the router's view may be stale); see tries_next."""
        data = prefill_body(req, kv_id, routing)
        errors: list[UpstreamError] = []
        for inst in self.order(named):
            was_up = inst.state is InstanceState.UP
            trace.prefill = inst.name
            err = await self._try(inst, path, data, headers, check_worker=not was_up)
            if err is None:
                return inst
            errors.append(err)
            self.metrics.prefill_failures.labels(inst.name, err.reason.value).inc()
            self.health.failed(inst, err)
            log.info("prefill on %s (%s) failed for %s: %s", inst.name, "up" if was_up else "down",
                     trace.request_id, err)
            if not tries_next(err, was_up):
                break
        self._recompute(errors, trace)
        return None

    def order(self, named: list[Instance]) -> Iterator[Instance]:
        """The prefill instances one request tries, each once (see run)."""
        tried: list[Instance] = []
        for inst in named:
            if not any(inst is t for t in tried):
                tried.append(inst)
                yield inst
        while (inst := self.fleet.prefill.pick(exclude=tuple(tried))) is not None:
            tried.append(inst)
            yield inst

    async def _try(self, inst: Instance, path: str, data: bytes, headers: CIMultiDict[str],
                   check_worker: bool) -> UpstreamError | None:
        """One prefill call; None when it succeeded (the KV is parked in that engine's worker).  `check_worker`
        (a down instance): its worker must accept a connection first, else the engine would compute a KV that
        decode cannot fetch (decode would recompute all the same, uncounted here, and the engine's answer would
        bring the instance back for the requests after it)."""
        if check_worker and (why := await self.health.worker_error(inst)):
            return UpstreamError(Reason.UNREACHABLE, why)
        try:
            async with self.upstream.call(inst, "POST", path, data, headers) as r:
                detail = (await r.read())[:300].decode(errors="replace")
                if r.status == 200:
                    self.health.ok(inst)
                    return None
                return UpstreamError(Reason.HTTP_5XX if r.status >= 500 else Reason.HTTP_4XX,
                                     f"HTTP {r.status}: {detail}")
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return classify(e)

    def _recompute(self, errors: list[UpstreamError], trace: Trace) -> None:
        """Count and log a request that goes to decode without a prefill's KV.  The reason is the last failure
        that reached an instance; "unreachable" when none could be reached (or there was none to try)."""
        reached = [e for e in errors if e.reason is not Reason.UNREACHABLE]
        reason = reached[-1].reason if reached else Reason.UNREACHABLE
        self.metrics.recomputes.labels(reason.value).inc()
        why = (f"prefill failed ({reached[-1]})" if reached else
               f"no prefill instance reachable ({len(errors)} tried)")
        trace.note = f"recomputed: {why}"
        log.warning("decode recomputes the prompt of %s, reason %s: %s", trace.request_id, reason.value, why)
