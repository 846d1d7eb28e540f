"""The transfer worker: one event-loop thread that owns every ring, socket, NIXL handle and session.

Rooms (one concern each; the loop calls them; unit-tested without processes in tests/unit/test_worker_rooms.py,
tests/unit/test_worker_loop_rooms.py, tests/unit/test_worker_small_rooms.py and, for the stop's order,
tests/unit/test_worker_shutdown.py):

    loop.py        Worker: builds the rooms, hands each its collaborators; one loop turn (step), sleeping, the hook
    core.py        Core: what every room shares (config, clock, rings, ledger, counters, attachment, phase)
    ports.py       the protocols one room asks of another: no room imports the Worker or another room's class
    phase.py       WorkerPhase and PHASE_MOVES: RUNNING, DRAINING, DRAINED, STOPPING, as a table
    attachment.py  Attachment: region, control, data plane, session context, fingerprint (one record, once)
    commands.py    Commands: the command ring, one handler per command type, failing jobs at once
    sessions.py    SessionHost: which session owns which link, links by address, LinkUp/LinkDown, retiring
    actions.py     ActionRunner: a session's actions performed (sends, data peers, reads), settled reads back
    lanes.py       LaneSwitch: same-host lanes, one record per link with its stage (DIALING, OFFERED, UP)
    lane_host.py   LaneHost: what the lanes yield, turned into session moves
    exits.py       PeerExits: a pidfd of each lane's peer; a closed session's leases end once that process exited
    peers.py       PeerBook: outbound links by address, which came up once, backoff, kept peers (no I/O)
    resolver.py    Resolver: host names resolved off the loop, with the commands that wait for them
    timers.py      Timers: tick, heartbeat, liveness, heap trim; the worker's clock
    outbox.py      EventOutbox: session reports and the worker's own events, in order, into the event ring
    sleeper.py     Sleeper: one poll over every source; poll_timeout_s, how long
    shutdown.py    the orderly stop (drain before deregister)
    status.py      what ``p2pworker inspect`` shows

``from p2pworker.worker import Worker`` is the entry point (``p2pworker launch``).
"""

from p2pworker.worker.lanes import lane_end_reason
from p2pworker.worker.loop import HOOK_ENV, Worker, install_hook
from p2pworker.worker.sleeper import poll_timeout_s
from p2pworker.worker.timers import boottime

__all__ = ["HOOK_ENV", "Worker", "boottime", "install_hook", "lane_end_reason", "poll_timeout_s"]
