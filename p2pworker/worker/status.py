"""What ``p2pworker inspect`` (the admin socket) shows of a running worker."""

from __future__ import annotations

import os
from p2pworker.session import Session
from p2pworker.worker.core import Core
from p2pworker.worker.lanes import LaneSwitch
from p2pworker.worker.ports import Roster


def status(w: Core, host: Roster, switch: LaneSwitch) -> dict:
    att, data = w.att, w.data
    return {
        "name": w.cfg.name,
        "pid": os.getpid(),
        "node_id": att.ctl.node_id if att else None,
        "address": att.ctl.address if att else None,
        "backend": data.backend if data else None,
        "copy_threads": att.copy_threads if att else 0,  # [data] copy_threads, or what 0 (auto) chose for this host
        "fingerprint": att.fingerprint.digest if att else None,
        "uptime_s": round(w.clock() - w.started, 3),
        "state": state_name(w),
        "region": None if att is None else {"num_blocks": att.region.num_blocks, "block_bytes": att.region.block_bytes},
        "sessions": [session_row(w, switch, link, s) for link, s in host.sessions.items()],
        # what this process's copies run under (p2pworker.copytune: streaming stores for same-host copies)
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
        # listed peers (OpenSession keep): re-opened whenever their session ends
        "kept_peers": sorted(host.peers.kept),
        # outbound links down after they were up, not yet dropped (forget_down_s; a kept peer's never)
        "links_down": len(host.peers.down_since),
        "jobs_in_flight": w.reporter.open_jobs,
        "transfers_in_flight": data.in_flight() if data else 0,
        "bytes_read": data.stats.bytes_done if data else 0,
        "transfers": {"done": data.stats.done, "failed": data.stats.failed} if data else {},
        "parked_requests": len(att.ctx.lot.parcels) if att else 0,
        "leases": att.ctx.lot.leases if att else 0,  # parcels under a consumer's lease
        "leases_offering": att.ctx.lot.offering if att else 0,  # of them, with rows offered (pinned)
        "ring_depth": {"cmd": w.cmd.depth(), "evt": w.evt.depth()},
        "control": dict(att.ctl.counters) if att else {},
        "counters": dict(w.counters),
    }


def state_name(w: Core) -> str:
    if w.stopping:
        return "stopping"
    if not w.phase.takes_work:  # draining, or drained (still refusing)
        return "draining"
    return "running" if w.att is not None else "waiting for region"


def session_row(w: Core, switch: LaneSwitch, link: str, s: Session) -> dict:
    return {"link": link, "peer_id": s.peer_id, "state": s.state.value, "open_loads": s.open_loads,
            "close_reason": s.close_reason, **data_path(w, link), "lane": switch.state_of(link, s),
            **s.counters.as_dict()}


def data_path(w: Core, link: str) -> dict:
    """How a session's reads move (inspect): "same_host" or the backend, and why not same_host."""
    data = w.data
    got = data.path_of(link) if data is not None else None
    path, why = got if got is not None else (None, "")
    prefault = data.prefault_of(link) if data is not None else None
    return {"data_path": path, "data_path_why": why, "peer_region_prefault": prefault}
