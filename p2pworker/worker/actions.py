"""Performing what a session asks for (its outbox of actions), and handing settled reads back to it.

The session decides (sans-IO); this room does the I/O: sends on the control link or the session's lane, registers
and removes data peers, dials and expects lanes, posts and cancels reads.  Failures feed back into the session
iteratively, never re-entrantly: a send that fails closes it; a refused data peer closes it before anything else
goes out; a read that cannot be posted is reported failed to it.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass

from p2pworker.control.lane import LaneClosed
from p2pworker.data.handover import lane_ids
from p2pworker.errors import P2PError, PeerUnusable, TransferFailed
from p2pworker.protocol.messages import encode
from p2pworker.session import (
    Abort,
    Action,
    AddDataPeer,
    CancelReads,
    DialLane,
    ExpectLane,
    PostRead,
    RemoveDataPeer,
    Send,
    Session,
    State,
)
from p2pworker.worker.core import Core
from p2pworker.worker.lanes import lane_end_reason
from p2pworker.worker.ports import LaneDuties, Roster, Tells

log = logging.getLogger("p2pworker.worker")


@dataclass(frozen=True)
class PostedRead:
    session: Session
    read_id: int


class ReadBook:
    """Our posted reads, both ways: data transfer id -> (session, its read id), and back (to cancel them)."""

    def __init__(self) -> None:
        self._by_tid: dict[int, PostedRead] = {}
        self._by_read: dict[PostedRead, int] = {}

    def add(self, tid: int, s: Session, read_id: int) -> None:
        read = PostedRead(s, read_id)
        self._by_tid[tid] = read
        self._by_read[read] = tid

    def pop(self, tid: int) -> PostedRead | None:
        read = self._by_tid.pop(tid, None)
        if read is not None:
            del self._by_read[read]
        return read

    def tids(self, s: Session, read_ids) -> list[int]:
        return [self._by_read[r] for r in (PostedRead(s, rid) for rid in read_ids) if r in self._by_read]

    def __len__(self) -> int:
        return len(self._by_tid)


@dataclass
class _Run:
    """One session's actions being performed: ``link`` becomes None once nothing more may go out on it."""
    link: str | None
    s: Session
    todo: collections.deque


class ActionRunner:
    def __init__(self, core: Core, host: Roster, lanes: LaneDuties, outbox: Tells) -> None:
        self.core = core
        self.host = host
        self.lanes = lanes
        self.outbox = outbox
        self.reads = ReadBook()
        self._held_sends: list | None = None  # see poll_data
        self._perform = {Send: self._send, AddDataPeer: self._add_data_peer, RemoveDataPeer: self._remove_data_peer,
                         DialLane: self._dial_lane, ExpectLane: self._expect_lane, PostRead: self._post_read,
                         CancelReads: self._cancel_reads, Abort: self._abort}

    def run(self, link: str | None, s: Session, actions: list[Action]) -> None:
        """Perform what ``s`` asked for, in order (``link`` None: a retired session, whose link is gone)."""
        run = _Run(link, s, collections.deque(actions))
        while run.todo:
            a = run.todo.popleft()
            self._perform[type(a)](run, a)
        if s.state is State.CLOSED:
            self.host.retire(s)
        elif s.lane_in and run.link is not None:
            self.lanes.lane_read(run.link, s)

    # ------------------------------------------------------------ one action each
    def _send(self, run: _Run, a: Send) -> None:
        if run.link is None:
            return  # a retired session: its link is gone
        if self._held_sends is not None:  # inside poll_data: after the events (in order)
            self._held_sends.append((run.link, run.s, a))
            return
        s = run.s
        lane = self.lanes.switch.sending_lane(run.link, s)
        self.core.instruments.on_send(run.link, a.msg, lane is not None)
        try:
            if lane is not None:
                lane.send(encode(a.msg))  # LaneUp went out on the link: from then on, only the lane
            else:
                self.core.ctl.send(run.link, encode(a.msg))
        except LaneClosed as e:  # the peer's end is gone: as a lost link (see LaneHost.poll)
            run.link = None
            cause, detail = lane_end_reason(lane, e)
            run.todo.extend(s.close(detail, cause=cause))
        except P2PError as e:  # LaneBroken too
            log.warning("control link %s: %s; closing its session", run.link, e)
            link_was, run.link = run.link, None  # nothing more goes out on it
            run.todo.extend(s.close(f"control link {link_was} unusable: {e}"))

    def _add_data_peer(self, run: _Run, a: AddDataPeer) -> None:
        try:
            # a link a peer dialed (a PD producer's 64 consumers) proves its same-host path only when first read
            # from (never, for a producer): no handover per accepted link
            self.core.data.add_peer(run.link, a.info, now=a.dialed)
        except TransferFailed as e:
            run.todo.clear()  # not the HelloAck, not the queued messages
            run.todo.extend(run.s.close(f"data plane refused the peer: {e}", bye=True))

    def _remove_data_peer(self, run: _Run, a: RemoveDataPeer) -> None:
        self.core.data.remove_peer(run.s.link)

    def _dial_lane(self, run: _Run, a: DialLane) -> None:
        target = self.core.data.lane_target(a.info) if run.link is not None else None
        if target is not None:
            self.lanes.switch.dial(run.link, run.s, target, a.key, lane_ids(self.core.ctx.node_id, run.s.peer_id))

    def _expect_lane(self, run: _Run, a: ExpectLane) -> None:
        s, data = run.s, self.core.data
        server = data.lane_server()
        # only a dialer on our host (same boot, our network namespace): nobody else can dial it here
        if server is not None and run.link is not None and s.peer_info is not None and \
                data.lane_target(s.peer_info) is not None:
            server.expect_lane(a.key, lane_ids(s.peer_id, self.core.ctx.node_id), run.link)

    def _post_read(self, run: _Run, a: PostRead) -> None:
        # The one path here that writes rows: this worker's own read (NIXL or the same-host copy) into our region,
        # by this process.  Invariant 7: the session reports the load only from on_read_result, which poll_data
        # calls once the data plane says the read settled (landed, failed or cancelled: nothing of it can land
        # later); a read that never settles ends the process (Abort) before any report.  Where vLLM defers releases
        # (0.34), a load may be reported failed while cancelled reads are posted, but unsettled: vLLM keeps those
        # rows out of its free pool until the JobSettled that the same settling sends.  Invariant 8: a job's rows
        # go as many pieces as they need (the data plane splits by max_piece_bytes); no size here caps a job.
        s = run.s
        try:
            tid = self.core.data.read_blocks(s.link, a.local_rows, a.remote_rows)
        except PeerUnusable as e:  # as a refusal at AddDataPeer: this session cannot move data
            run.todo.extend(s.on_read_result(a.read_id, False, f"read refused: {e}"))
            run.todo.extend(s.close(f"data plane refused the peer: {e}", bye=True))
        except TransferFailed as e:
            run.todo.extend(s.on_read_result(a.read_id, False, f"read refused: {e}"))
        else:
            self.reads.add(tid, s, a.read_id)

    def _cancel_reads(self, run: _Run, a: CancelReads) -> None:
        # asks only: a cancelled read is still reported through poll_data once it settled, never before
        tids = self.reads.tids(run.s, a.read_ids)
        if tids:
            self.core.data.cancel(tids)

    def _abort(self, run: _Run, a: Abort) -> None:
        self.core.abort(a.why)  # reads that will not settle: only this process's death ends them

    # ------------------------------------------------------------ settled reads
    def poll_data(self) -> bool:
        """Hand settled reads back to the sessions that posted them."""
        if not self.core.instruments.on_poll_data():
            return False
        done, failed = self.core.data.poll()
        if not done and not failed:
            return False
        # What the sessions send about settled reads (Release to the producer) goes out after the events they
        # reported (the load's JobFinished): vLLM waits on the event, the producer only frees rows on the Release
        # (~60 us sooner to vLLM in benchmarks/hops' profile).  The order is safe: the reads settled before either.
        self._held_sends = []
        try:
            for tid in done:
                self.read_result(tid, True, "")
            for tid, reason in failed:
                self.read_result(tid, False, reason)
        finally:
            held, self._held_sends = self._held_sends, None
            self.outbox.flush()
            for link, s, send in held:  # even if a result raised: a Release withheld would pin the producer's rows
                self.run(link, s, [send])
        return True

    def read_result(self, tid: int, ok: bool, reason: str) -> None:
        # watch only: the data plane says this read settled (no byte of it can land any more); its session has not
        # reported the load yet, and only on_read_result below may (invariant 7)
        self.core.instruments.on_read_settled(tid, ok)
        read = self.reads.pop(tid)
        if read is None:
            self.core.counters["unowned_transfers"] += 1
            return
        s = read.session
        self.run(self.host.link_of(s), s, s.on_read_result(read.read_id, ok, reason))
