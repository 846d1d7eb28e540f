"""What the adapter's AttachRegion gives the worker: one record, present once attached, never half-built.

``attach`` maps the region, builds the fingerprint, opens the control transport and the data plane (NIXL
registration), and the session context every session shares.  Any step failing undoes the ones before it and
raises: the worker stays unattached and reports the cause (the loop turns it into a WorkerError).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

from p2pworker import api
from p2pworker.config import WorkerConfig
from p2pworker.control import ControlTransport, ZmqControl
from p2pworker.data import DataTransport, make_data_transport
from p2pworker.data.samehost import auto_copy_threads, available_cpus
from p2pworker.errors import RingApiMismatch
from p2pworker.fingerprint import Fingerprint
from p2pworker.protocol.messages import PROTOCOL_VERSION
from p2pworker.session import ParkingLot, Reporter, SessionContext
from p2pworker.shm import KVRegion

log = logging.getLogger("p2pworker.worker")


@dataclass
class Attachment:
    region: KVRegion
    ctl: ControlTransport
    data: DataTransport
    ctx: SessionContext
    fingerprint: Fingerprint
    copy_threads: int  # [data] copy_threads, or what 0 (auto) chose for this host
    identity: dict = field(default_factory=dict)  # the adapter's KV identity (model, dtype, ...): metric labels


def attach(cfg: WorkerConfig, cmd: api.AttachRegion, reporter: Reporter, clock: Callable[[], float]) -> Attachment:
    why = api.ring_api_mismatch(cmd.api, "the adapter that created our rings")
    if why is not None:
        raise RingApiMismatch(why, cmd.api, api.RING_API)
    copy_threads = cfg.data.copy_threads or auto_copy_threads(available_cpus())
    region = KVRegion.attach(cmd.handle, populate=cfg.prefault)
    ctl = data = None
    try:  # every step after the mapping: whichever fails, what the ones before it opened is closed again
        fingerprint = Fingerprint.build(
            block_bytes=region.block_bytes, protocol_version=PROTOCOL_VERSION, identity=cmd.identity
        )
        ctl = ZmqControl(cfg.control)
        data = make_data_transport(
            region, backend=cfg.data.backend, agent_name=f"{cfg.name}-{ctl.node_id}", host=cfg.control.host,
            max_piece_bytes=cfg.data.max_piece_bytes, post_budget_bytes=cfg.data.post_budget_bytes,
            same_host=cfg.data.same_host,
            copy_threads=copy_threads,
            prefault_peers=cfg.data.prefault_peers,
        )
        lot = ParkingLot(reporter, clock, block_bytes=region.block_bytes,
                         park_timeout_s=cfg.session.park_timeout_s,
                         park_unfinished_s=cfg.session.park_unfinished_s)
        ctx = SessionContext(
            node_id=ctl.node_id, data_info=data.local_info(), fingerprint=fingerprint,
            reporter=reporter, lot=lot, clock=clock, config=cfg.session,
            lanes=cfg.data.same_host and cfg.data.lane and data.lane_server() is not None,
            deferred_release=cmd.deferred_release,
        )
    except BaseException:
        _undo(region, ctl, data)
        raise
    log.info("region attached (%d x %d B), control %s, data backend %s, fingerprint %s, same-host copies on %d "
             "thread(s)", region.num_blocks, region.block_bytes, ctl.address, data.backend,
             fingerprint.digest, copy_threads)
    return Attachment(region, ctl, data, ctx, fingerprint, copy_threads, dict(cmd.identity))


def _undo(region: KVRegion, ctl: ControlTransport | None, data: DataTransport | None) -> None:
    """Close what a failed attach opened, newest first; the caller re-raises the attach's own error (an error
    closing one part is logged, not raised in its place).  The region is unmapped only after the data plane said
    nothing can land in it any more (invariant 2): nothing is posted before attach returns, but a data plane that
    cannot say so keeps the mapping (leaked) rather than unmap under a transfer."""
    drained = True
    if data is not None:
        try:
            drained = data.close()
        except Exception:  # noqa: BLE001
            drained = False
            log.exception("undoing a failed attach: closing the data plane failed")
    if ctl is not None:
        try:
            ctl.close()
        except Exception:  # noqa: BLE001
            log.exception("undoing a failed attach: closing the control transport failed")
    if drained:
        region.close()
    else:
        log.error("undoing a failed attach: the data plane did not drain; the region stays mapped")

