"""What a request is to the tier, from its ``kv_transfer_params`` (vLLM's keys):

- ``remote_decoder: {kv_request_id}``: producer (prefill).  Stores are parked in
  the worker under ``kv_request_id`` until the consumer's fetch binds them;
  ``on_new_request`` asks for REQUEST_LEVEL offloading so prefix hits cascade too.
- ``remote_prefiller: {kv_request_id, remote_host, remote_port}``: PD consumer
  (decode).  Lookups answer HIT (the producer has or will have the blocks);
  ``submit_load`` asks the producer's worker to write them into our rows.  After
  a failed load the request's lookups answer MISS, so vLLM recomputes.
- ``remote_kv_source: {kv_request_id, remote_host, remote_port}``: symmetric
  consumer.  In one round trip (hints.py, lookups.py): lookups answer HIT at
  once and ``submit_load`` asks the peer, whose tier pins its hits through
  vLLM's parent API in ``serve_external_requests`` and parks them under our
  ``kv_request_id`` for that load; what it lacks is recomputed.  Or in two
  steps, when the peer lately lacked the request's first key: lookups are
  batched to the peer (RETRY until its answer, then HIT or MISS), then the
  load fetches what it parked.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("vllm_adapter.tier")


class RoleKind(enum.Enum):
    PRODUCER = "producer"  # remote_decoder: our blocks are offered to the decode engine's worker
    CONSUMER = "consumer"  # remote_prefiller: a PD decode; every lookup is answered by that producer
    SYMMETRIC = "symmetric"  # remote_kv_source: look up what a peer engine holds, load the hits
    # remote_decoder + remote_kv_source (llm-d's P/D + P2P prefill leg, multi-turn P/D): the prefix is pulled from
    # the source as SYMMETRIC does, the rest computed, and every block (pulled and computed) parked for the decode
    PRODUCER_PULLING = "producer+pull"
    NONE = "none"  # no (usable) P2P params: MISS, recompute

    @property
    def loads(self) -> bool:
        """Its lookups go to a peer and its hits are loaded from there."""
        return self in (RoleKind.CONSUMER, RoleKind.SYMMETRIC, RoleKind.PRODUCER_PULLING)

    @property
    def produces(self) -> bool:
        """Its stores are parked for a decode engine's fetch."""
        return self in (RoleKind.PRODUCER, RoleKind.PRODUCER_PULLING)

    @property
    def asks(self) -> bool:
        """Its lookups are asked of the peer key by key (a PD consumer's are HIT: the producer will have them)."""
        return self in (RoleKind.SYMMETRIC, RoleKind.PRODUCER_PULLING)


@dataclass(frozen=True)
class PDRole:
    """What a request is to this tier, parsed once from kv_transfer_params."""

    kind: RoleKind
    kv_request_id: str = ""  # a loading role's id at its peer (what it fetches and looks up under)
    address: str = ""  # a loading role: the peer's worker, host:port
    park_id: str = ""  # a producing role: the decode's kv_request_id, which our stores are parked under


def _peer(field_name: str, pre: Any) -> tuple[str, str] | None:
    """(kv_request_id, host:port) of a remote_prefiller / remote_kv_source entry, or None (logged) if unusable."""
    if isinstance(pre, dict):
        rid, host, port = pre.get("kv_request_id"), pre.get("remote_host"), pre.get("remote_port")
        try:
            port = int(port)
        except (TypeError, ValueError):
            port = -1
        if isinstance(rid, str) and rid and isinstance(host, str) and host and 0 < port < 65536:
            return rid, f"{host}:{port}"
    log.error("invalid %s %r (need kv_request_id, remote_host, remote_port); recomputing", field_name, pre)
    return None


def parse_role(params: Any) -> PDRole:
    """vLLM's kv_transfer_params -> PDRole; invalid params are logged and give role none (MISS).

    ``remote_decoder`` with ``remote_kv_source`` is the one legal pair (vLLM's p2p protocol): a prefill engine that
    pulls its prefix from the source and serves the decode.  An unusable source there leaves a plain producer."""
    if not isinstance(params, dict):
        return PDRole(RoleKind.NONE)
    dec = params.get("remote_decoder")
    if dec is not None:
        rid = dec.get("kv_request_id") if isinstance(dec, dict) else None
        if not (isinstance(rid, str) and rid):
            log.error("remote_decoder without a usable kv_request_id: %r; not offloading to peers", dec)
            return PDRole(RoleKind.NONE)
        src = params.get("remote_kv_source")
        pull = _peer("remote_kv_source", src) if src is not None else None
        if pull is None:
            return PDRole(RoleKind.PRODUCER, park_id=rid)
        return PDRole(RoleKind.PRODUCER_PULLING, pull[0], pull[1], park_id=rid)
    for field_name, kind in (("remote_prefiller", RoleKind.CONSUMER), ("remote_kv_source", RoleKind.SYMMETRIC)):
        pre = params.get(field_name)
        if pre is None:
            continue
        peer = _peer(field_name, pre)
        return PDRole(kind, peer[0], peer[1]) if peer is not None else PDRole(RoleKind.NONE)
    return PDRole(RoleKind.NONE)


def role_of(req_context) -> PDRole:
    """The request's role, parsed once and kept in its context."""
    role = req_context.get_state(PDRole)
    if role is None:
        role = parse_role(req_context.kv_transfer_params)
        req_context.set_state(role)
    return role
