"""The orderly stop: fail or finish every job once, drain transfers, deregister, unmap, close the rings.

The order is the invariant (drain before deregister): a posted read may still land in our rows until the data
plane says it settled, so nothing is reported, unmapped or deregistered before that.  Reads that do not settle
within shutdown_timeout_s end the process instead (NIXL cannot abort them; the process's death can).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from p2pworker.worker.core import Core
from p2pworker.worker.lanes import LaneSwitch
from p2pworker.worker.ports import Closes, FailsQueued, Roster, Settles, Tells

log = logging.getLogger("p2pworker.worker")

DELIVER_LAST_EVENTS_S = 2.0  # how long the last events may wait for an adapter that is alive but slow to read


@dataclass(frozen=True)
class StopRooms:
    """The rooms the stop goes through, in its order."""

    commands: FailsQueued
    host: Roster
    runner: Settles
    outbox: Tells
    switch: LaneSwitch
    servers: tuple[Closes, ...]  # the admin socket and the metrics endpoint: closed last, whatever happened


def shut_down(w: Core, rooms: StopRooms) -> None:
    reason = f"worker shutting down ({w.stop_reason or 'exit'})"
    try:
        _end_work(w, rooms, reason)
        rooms.switch.close_all()  # sessions were retired with theirs: none expected here
        if w.ctl is not None:
            w.ctl.close()
        _deliver_last_events(w, rooms.outbox)
    finally:
        if w.att is not None:
            w.att.region.close()
        for server in rooms.servers:
            server.close()
        w.evt.close()
        w.cmd.close()
        log.info("worker stopped: %s", w.stop_reason)


def _end_work(w: Core, rooms: StopRooms, reason: str) -> None:
    # Invariant 7: loads are cancelled, then reported only after data.close() says every read settled; rows a peer
    # may still be reading (leased) stay unreported until this process exits.
    host = rooms.host
    rooms.commands.fail_queued(reason)
    for link, sess in list(host.sessions.items()):
        host.run(link, sess, sess.cancel_loads(reason))  # reported once their reads settled
    if w.data is not None:
        if not w.data.close(w.cfg.shutdown_timeout_s):
            # Posted reads may still land in our rows, and NIXL cannot abort them: report nothing, unmap
            # nothing; exit, which ends them (the adapter fails the jobs once this process is reaped).
            w.abort(f"transfers still in flight {w.cfg.shutdown_timeout_s:g} s into the shutdown")
        rooms.runner.poll_data()  # the cancelled reads settled: loads reported, Releases sent
    for link, sess in list(host.sessions.items()):
        host.run(link, sess, sess.close(reason, bye=True))
    if w.ctx is not None:
        held = w.ctx.lot.shutdown(reason)
        if held:
            # A consumer may still be reading those rows (a read goes by pid, not by registration):
            # their store jobs are failed by the adapter once this process is gone, not by us now.
            log.info("%d leased request(s) stay unreported until this process exits", held)


def _deliver_last_events(w: Core, outbox: Tells) -> None:
    deadline = w.clock() + DELIVER_LAST_EVENTS_S
    outbox.flush()
    while outbox.waiting and w.clock() < deadline and w.cmd.peer_alive():
        time.sleep(0.001)
        outbox.flush()
    if outbox.waiting:
        log.warning("%d events could not be delivered: the adapter is gone or not reading", len(outbox.pending))
