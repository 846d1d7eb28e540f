"""The sessions' side of same-host lanes: what the lane switch (lanes.py) yields, turned into session moves.

A lane carries one session's messages once both ends switched; its frames go to that session exactly as frames
from the control link would.  A lane the peer closed ends the session as a lost link (CloseCause.PEER_LOST keeps an
outbound link to reconnect, see SessionHost.retire); one broken under us is a broken session, closed with a Bye.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from p2pworker.control import Received
from p2pworker.control.lane import Lane, LaneBroken
from p2pworker.errors import P2PError
from p2pworker.data.handover import LANE_TAKEN
from p2pworker.protocol.messages import LaneUp, encode
from p2pworker.session import CloseCause, Session, State
from p2pworker.worker.core import Core
from p2pworker.worker.exits import PeerExits
from p2pworker.worker.lanes import LaneEnded, LaneStage, LaneSwitch
from p2pworker.worker.ports import Roster


log = logging.getLogger("p2pworker.worker")


class LaneHost:
    def __init__(self, core: Core, host: Roster, unready: Callable[[Any], bool]) -> None:
        self.core = core
        self.host = host
        self.unready = unready  # the sleeper's: the last sleep watched this source and found nothing to read
        self.switch = LaneSwitch(core.cfg.control.max_frame_bytes, core.cfg.control.hwm, core.clock)
        # the lanes' peers: a lease of one whose process exited ends then (exits.py)
        self.exits = PeerExits(lambda: core.ctx.lot if core.ctx is not None else None, core.counters)

    def poll(self) -> bool:
        """Dials the acceptor took, then frames (or ends) on the switched lanes; True when anything happened."""
        did = False
        host = self.host
        for taken in self.switch.poll_dials():
            did = True
            s = taken.session
            if host.sessions.get(taken.link) is s and s.state is State.ACTIVE:
                self.lane_up(taken.link, s, self.switch.lane(taken.dial.sock))
            else:
                taken.dial.close()
        for news in self.switch.poll_lanes(self.unready):
            if isinstance(news, LaneEnded):
                self._ended(news)
            else:
                did = self.deliver(news.link, news.session, news.frames) or did
        return did

    def _ended(self, news: LaneEnded) -> None:
        s, e, gone = news.session, news.error, news.peer_gone
        self.drop(s)  # a Bye goes on the control link
        self.host.run(news.link if not gone else None, s,
                        s.close(f"same-host lane: {e}", cause=CloseCause.PEER_LOST if gone else CloseCause.LOCAL,
                                bye=not gone))
        self.host.retire(s)

    def deliver(self, link: str, s: Session, frames) -> bool:
        """Hand ``s`` the frames read from its lane, in order, while it still owns ``link``; True when any came."""
        for frame in frames:
            if self.host.sessions.get(link) is not s:
                break
            self.host.on_control(Received(link, frame), lane=True)
        return bool(frames)

    def lane_up(self, link: str, s: Session, lane: Lane) -> None:
        """Switch ``s``'s messages to ``lane``: LaneUp on the control link first, then only the lane."""
        up = LaneUp()
        self.core.instruments.on_send(link, up, False)
        try:
            self.core.ctl.send(link, encode(up))
        except P2PError as e:
            log.info("no same-host lane to %s: %s", s.peer_id or link, e)
            lane.close()
            return
        self.switch.up(link, s, lane)
        self.exits.know(s, lane.sock)
        self.core.counters["lanes_up"] += 1

    def lane_read(self, link: str, s: Session) -> None:
        """The peer's LaneUp arrived: its later messages are on the lane.  The acceptor switches now too."""
        rec = self.switch.of(link, s)
        if rec is not None and rec.stage is LaneStage.UP:
            self.switch.start_reading(rec)
        elif rec is not None and rec.stage is LaneStage.OFFERED:
            self.lane_up(link, s, self.switch.take_offered(link))
        else:
            # the peer moved its messages to a lane we do not hold (we closed it: taken too late): they would be lost
            self.host.run(link, s, s.close("the peer moved to a same-host lane we do not hold", bye=True))

    def take(self, server) -> None:
        """Lanes dialers proved to our handover thread: tell each dialer we took it; we switch on its LaneUp."""
        for link, key, sock in server.take_lanes():
            s = self.host.sessions.get(link)
            if s is None or s.state is not State.ACTIVE or s.peer_lane_key != key or link in self.switch.links:
                sock.close()  # its session is gone (or has one): the dialer sees the close and keeps to the link
                continue
            try:
                sock.send(LANE_TAKEN)
            except OSError:
                sock.close()
                continue
            self.switch.offer(link, s, sock)

    def drain(self, link: str, s: Session) -> None:
        """Deliver the frames ``s``'s lane holds now (its end, if it ended, is the caller's to handle).  Writes no
        row: the frames go to the session as on any turn (a read an Offer posts is reported only once it settled,
        and the close that follows cancels it: invariant 7); at most 256 frames, as every lane read."""
        lane = self.switch.sending_lane(link, s)
        if lane is None or not lane.reading:
            return
        try:
            frames = lane.recv()
        except LaneBroken:
            return  # nothing was left on it
        self.deliver(link, s, frames)

    def drop(self, s: Session) -> None:
        """Everything lane of ``s`` (closed or superseded), and the handover server's expectation of its dialer."""
        self.switch.drop(s.link, s)
        server = self.core.data.lane_server() if self.core.data is not None else None
        if server is not None and s.peer_lane_key:
            server.forget_lane(s.peer_lane_key)
        if s.state is State.CLOSED:  # retired (a lane's end drops it before the close too): its leases are ownerless
            self.exits.retired(s)
