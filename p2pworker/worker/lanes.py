"""Same-host lanes (p2pworker.control.lane): one record per control link, with the stage its lane is in.

    DIALING   we dialed (DialLane); the acceptor has not taken it yet            given up at handover.TIMEOUT_S
    OFFERED   we accepted and took it ("K" sent); the dialer has not said LaneUp  given up at 2 x TIMEOUT_S
    UP        switched: LaneUp went out on the link, every message of the session goes on the lane

A session either dials (it sent Hello) or accepts (it answered one), so a link holds one record at most.  The
acceptor switches only after the dialer said LaneUp, so a dialer that gave up never leaves us sending into a lane.
The switch does the lanes' I/O; what to do with what they yield (deliver frames, close a session) is the
session host's.  ``epoch`` moves whenever the set of lane sockets the loop sleeps on changes.
"""

from __future__ import annotations

import enum
import logging
import math
from dataclasses import dataclass
from typing import Callable, Iterator

from p2pworker.control.lane import Lane, LaneBroken, LaneClosed
from p2pworker.data.handover import TIMEOUT_S as LANE_TIMEOUT_S
from p2pworker.data.handover import LaneDial, LaneRefused
from p2pworker.protocol.messages import Bye, decode
from p2pworker.errors import RemoteProtocolError
from p2pworker.session import CloseCause, Session

log = logging.getLogger("p2pworker.worker")


class LaneStage(enum.Enum):
    DIALING = "dialing"
    OFFERED = "offered"
    UP = "up"


@dataclass
class LaneLink:
    session: Session
    stage: LaneStage
    dial: LaneDial | None = None  # DIALING
    lane: Lane | None = None  # OFFERED, UP
    deadline: float = math.inf  # DIALING, OFFERED


@dataclass(frozen=True)
class DialTaken:
    """The acceptor took our dial: the host switches the session to it if it still owns the link, else closes it."""
    link: str
    session: Session
    dial: LaneDial


@dataclass(frozen=True)
class LaneFrames:
    link: str
    session: Session
    frames: list


@dataclass(frozen=True)
class LaneEnded:
    link: str
    session: Session
    error: LaneBroken

    @property
    def peer_gone(self) -> bool:
        """Closed by the peer (it closed the session, or died), rather than broken under us."""
        return isinstance(self.error, LaneClosed)


class LaneSwitch:
    def __init__(self, max_frame_bytes: int, hwm: int, clock: Callable[[], float]) -> None:
        self.max_frame_bytes = max_frame_bytes
        self.hwm = hwm
        self.clock = clock
        self.links: dict[str, LaneLink] = {}
        self.epoch = 0

    # ------------------------------------------------------------ looking
    def of(self, link: str, s: Session) -> LaneLink | None:
        rec = self.links.get(link)
        return rec if rec is not None and rec.session is s else None

    def sending_lane(self, link: str, s: Session) -> Lane | None:
        """The lane ``s``'s messages go on (LaneUp went out on the link: from then on, only the lane), or None."""
        rec = self.of(link, s)
        return rec.lane if rec is not None and rec.stage is LaneStage.UP else None

    def polled(self) -> bool:
        """Anything for the loop's lane pass (O(1) on every turn; an offered lane alone makes it a pass that skips
        it: it waits silent for the dialer's LaneUp)."""
        return bool(self.links)

    def backlog(self) -> bool:
        return any(rec.lane.backlog for rec in self.links.values() if rec.stage is LaneStage.UP)

    def fds(self) -> list[int]:
        """What the loop sleeps on: the lanes it reads, the dials it waits to see taken."""
        out = []
        for rec in self.links.values():
            if rec.stage is LaneStage.UP and rec.lane.reading:
                out.append(rec.lane.fileno())
            elif rec.stage is LaneStage.DIALING:
                out.append(rec.dial.fileno())
        return out

    def state_of(self, link: str, s: Session) -> str:
        """Where the session's messages go (inspect): "up" (a same-host lane), "dialing", or "control link"."""
        if self.sending_lane(link, s) is not None:
            return "up"
        rec = self.links.get(link)
        return "dialing" if rec is not None and rec.stage is LaneStage.DIALING else "control link"

    # ------------------------------------------------------------ moves
    def dial(self, link: str, s: Session, target: tuple, key: bytes, ids: bytes) -> None:
        """DialLane: dial the acceptor's handover server (nothing if this link has a lane in any stage)."""
        if link in self.links:
            return
        try:
            dial = LaneDial(*target, key, ids, self.clock() + LANE_TIMEOUT_S)
        except LaneRefused as e:
            log.info("no same-host lane to %s: %s", s.peer_id or link, e)
            return
        self.links[link] = LaneLink(s, LaneStage.DIALING, dial=dial, deadline=dial.deadline)
        self.epoch += 1

    def offer(self, link: str, s: Session, sock) -> None:
        """The dialer proved this lane to our handover thread and we told it so: switch on its LaneUp."""
        self.links[link] = LaneLink(s, LaneStage.OFFERED, lane=self.lane(sock),
                                    deadline=self.clock() + 2 * LANE_TIMEOUT_S)

    def lane(self, sock) -> Lane:
        return Lane(sock, self.max_frame_bytes, self.hwm)

    def up(self, link: str, s: Session, lane: Lane) -> None:
        self.links[link] = LaneLink(s, LaneStage.UP, lane=lane)
        self.epoch += 1
        if s.lane_in:
            lane.reading = True

    def start_reading(self, rec: LaneLink) -> None:
        if not rec.lane.reading:
            rec.lane.reading = True
            self.epoch += 1

    def take_offered(self, link: str) -> Lane:
        rec = self.links.pop(link)
        rec.lane.reading = True
        return rec.lane

    # ------------------------------------------------------------ polling
    def poll_dials(self) -> Iterator[DialTaken]:
        for link, rec in list(self.links.items()):
            if rec.stage is not LaneStage.DIALING:
                continue
            dial = rec.dial
            try:
                if not dial.step():
                    continue
                if self.clock() >= dial.deadline:  # taken too late: the acceptor may have given up on it already
                    raise LaneRefused(f"{dial.name} took the lane after {LANE_TIMEOUT_S:g} s")
            except LaneRefused as e:
                log.info("no same-host lane to %s: %s", rec.session.peer_id or link, e)
                self._drop_dial(link)
                continue
            del self.links[link]
            self.epoch += 1
            yield DialTaken(link, rec.session, dial)

    def poll_lanes(self, unready: Callable[[int], bool]) -> Iterator[LaneFrames | LaneEnded]:
        """Read each switched lane (first: what the peer sent before a close, its Bye) and flush what it holds."""
        for link, rec in list(self.links.items()):
            if rec.stage is not LaneStage.UP:
                continue
            lane = rec.lane
            try:
                frames = lane.recv() if lane.reading and not unready(lane.fileno()) else ()
                if lane.backlog:
                    lane.flush()
            except LaneBroken as e:
                yield LaneEnded(link, rec.session, e)
                continue
            yield LaneFrames(link, rec.session, frames)

    def deadlines(self, now: float) -> None:
        for link, rec in list(self.links.items()):
            if now < rec.deadline:
                continue
            if rec.stage is LaneStage.DIALING:
                log.info("no same-host lane to %s: not taken within %g s", rec.session.peer_id or link,
                         LANE_TIMEOUT_S)
                self._drop_dial(link)
            elif rec.stage is LaneStage.OFFERED:  # the dialer gave up before it switched (it logged why)
                del self.links[link]
                rec.lane.close()

    # ------------------------------------------------------------ ending
    def drop(self, link: str, s: Session) -> None:
        """Everything lane of ``s`` (closed or superseded).  What its lane holds still goes out first (a Bye just
        sent, a last Release), as far as the socket takes it now."""
        rec = self.of(link, s)
        if rec is None:
            return
        if rec.stage is LaneStage.UP:
            del self.links[link]
            try:
                rec.lane.flush()
            except LaneBroken:
                pass
            rec.lane.close()
            self.epoch += 1
        elif rec.stage is LaneStage.DIALING:
            self._drop_dial(link)
        else:
            del self.links[link]
            rec.lane.close()

    def _drop_dial(self, link: str) -> None:
        self.links.pop(link).dial.close()
        self.epoch += 1

    def close_all(self) -> None:
        for rec in self.links.values():
            (rec.dial if rec.stage is LaneStage.DIALING else rec.lane).close()
        self.links.clear()


def lane_end_reason(lane: Lane, e: LaneClosed) -> tuple[CloseCause, str]:
    """Why a session ends whose send found its lane closed by the peer.  A peer that closed the session said why
    in a Bye before closing its end, and that Bye may still wait, unread, in our end (our send came first this loop
    turn; Linux reports EPIPE before what is queued): its reason, as if it had been read first.  Otherwise the peer
    is lost.  What is read here is not delivered: the session is closing, and its loads fail either way.  Returns
    the cause and detail Session.close takes."""
    if lane.reading:  # the peer's frames come on the lane (its LaneUp arrived)
        try:
            frames = lane.recv()
        except LaneBroken:
            frames = []
        for frame in frames:
            try:
                msg = decode(frame)
            except RemoteProtocolError:
                break
            if isinstance(msg, Bye):
                return CloseCause.PEER_BYE, msg.reason
    return CloseCause.PEER_LOST, f"same-host lane: {e}"
