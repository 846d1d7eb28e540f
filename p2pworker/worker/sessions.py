"""The session host: which session owns which control link, how links come and go, and when a session retires.

One session per control link.  Outbound links are found by address through the peer book (connecting one if
needed, after its backoff); inbound ones appear with LinkUp.  A closed session leaves its link at once but is
kept (``settling``) until the reads it posted have settled: nothing may land in rows after its jobs are reported.
"""

from __future__ import annotations

import logging
from typing import Any

from p2pworker import api
from p2pworker.control import LinkDown, LinkState, LinkUp, Received
from p2pworker.errors import P2PError
from p2pworker.session import CloseCause, Session, State
from p2pworker.session.client import UNREACHABLE
from p2pworker.worker.core import Core
from p2pworker.worker.peers import PeerBook, addr_key
from p2pworker.worker.ports import LaneDuties, Performs, Rerun
from p2pworker.worker.resolver import Resolver

log = logging.getLogger("p2pworker.worker")

PARKED = "parked until the peer's host name is resolved"
# a closed session's counters that live on in the worker's (status, metrics) once it is forgotten
FOLDED_COUNTERS = ("late_reads", "late_offers", "stale_releases", "unsettled_reads", "protocol_errors")


class SessionHost:
    def __init__(self, core: Core) -> None:
        self.core = core
        # the rooms this one calls, handed over by wire() (they are built with this one: each calls the other)
        self._runner: Performs | None = None
        self._lanes: LaneDuties | None = None
        self._rerun: Rerun | None = None
        self.sessions: dict[str, Session] = {}  # control link id -> session
        self.settling: list[Session] = []  # closed sessions whose cancelled reads have not settled yet
        # outbound links by address, which came up once, the backoff of failed addresses, the kept peers (the tier's
        # `peers`: a PD decode lists its prefill workers, so the first request finds the session and the data path
        # set up; re-opened on the tick, with backoff)
        self.peers = PeerBook()
        self.resolver = Resolver(core.clock)  # host names resolved off the loop (a slow resolver stalls nothing)

    def wire(self, runner: Performs, lanes: LaneDuties, rerun: Rerun) -> None:
        self._runner, self._lanes, self._rerun = runner, lanes, rerun

    def run(self, link: str | None, s: Session, actions: list) -> None:
        self._runner.run(link, s, actions)

    def link_of(self, s: Session) -> str | None:
        """The link ``s`` may still send on: None once a newer session (or none) owns it."""
        return s.link if self.sessions.get(s.link) is s else None

    def in_flight(self) -> bool:
        """Work a drain waits for: commands parked behind a name lookup (not reported yet), sessions settling
        their reads, loads open, leases held."""
        if self.resolver:
            return True
        return bool(self.settling) or any(s.open_loads or s.leases for s in self.sessions.values())

    # ------------------------------------------------------------ links by address
    def session_for(self, address: str, cmd: Any = None) -> tuple[Session | None, str]:
        """The session of the outbound link to ``address`` (connecting one if needed), or (None, why not).

        (None, PARKED): the host name is being resolved off the loop; ``cmd`` is run again once it is."""
        ctl = self.core.ctl
        if ctl is None:
            return None, "worker has no region attached yet"
        key = addr_key(address)
        link = self.peers.links.get(key)
        if key in self.peers.gone:
            return None, self._redial_gone(address, key, link)
        if link is not None:
            why = self._unusable(address, key, link)
            if why:
                return None, why
        else:
            link, why = self._connect(address, key, cmd)
            if link is None:
                return None, why
        s = self.sessions.get(link)
        if s is None:
            s = self.sessions[link] = self.new_session(link, None)
        return s, ""

    def _unusable(self, address: str, key: str, link: str) -> str:
        """Why the outbound link we hold to ``key`` must not take a command now ("" if it may)."""
        lk = self.core.ctl.link(link)
        if lk is None or lk.state is LinkState.FAILED:
            # The control transport gave up on it (the peer rejected us): drop it; after a backoff the next
            # command opens a fresh link (the peer may have been fixed and restarted meanwhile).
            why = lk.reason if lk is not None else "link gone"
            self.forget_link(link, key, f"control link failed: {why}", f"control link failed: {why}")
            return f"{UNREACHABLE}{address}: control link failed ({why})"
        if lk.state is not LinkState.UP and link in self.peers.was_up:
            # Fail fast: a Fetch queued now would reach whatever process answers next on that address (a
            # restarted producer that never heard of the request) and wait out its fetch_timeout_s.
            return f"{UNREACHABLE}{address}: control link {lk.state.value} ({lk.reason or 'reconnecting'})"
        return ""

    def _redial_gone(self, address: str, key: str, link: str | None) -> str:
        """Why a command for an address whose link was dropped (down for forget_down_s) fails at once, as it did
        while that link was redialled: a fresh dial would make it wait out a handshake deadline on a silent host, or
        a name lookup.  The address is dialled again (unless a dial is in flight or in its backoff); once that link
        is up (its PeerUp tells the adapter) the next command goes through."""
        lk = self.core.ctl.link(link) if link is not None else None
        if link is not None and (lk is None or lk.state is LinkState.FAILED):
            self._drop_link(link, "control link failed")  # a dial the transport gave up on: not one in flight
            link = None
        if link is None:
            # the dial's own command, not the caller's: a host name parks it for the lookup, the caller fails now
            link, why = self._connect(address, key, api.OpenSession(address, keep=False))
            if link is None and why != PARKED:
                return why  # in its backoff: "...; retrying in N s"
        return (f"{UNREACHABLE}{address}: its control link was down for over {self.core.cfg.control.forget_down_s:g}"
                f" s; dialling it again")

    def _connect(self, address: str, key: str, cmd: Any) -> tuple[str | None, str]:
        now = self.core.clock()
        b = self.peers.blocked(key, now)
        if b is not None:
            return None, f"{UNREACHABLE}{address}: {b.why}; retrying in {b.not_before - now:.1f} s"
        target = self.resolver.resolve(key, cmd)
        if target is None:
            return None, PARKED
        try:
            link = self.core.ctl.connect(target, resolve=False)
        except P2PError as e:
            log.warning("cannot connect to %s: %s", address, e)
            self.peers.backoff(key, f"unreachable: {e}", self.core.clock())
            return None, f"{UNREACHABLE}{address}: {e}"
        self.peers.add(key, link)
        return link, ""

    def forget_link(self, link: str, key: str, close_reason: str, backoff_reason: str) -> None:
        """Drop an outbound link the transport gave up on (or that never came up): its session closes (what waits on
        it fails), and the next command for ``key`` opens a fresh link only after the backoff."""
        self._drop_link(link, close_reason)
        self.peers.backoff(key, backoff_reason, self.core.clock())

    def _drop_link(self, link: str, close_reason: str) -> None:
        """Forget outbound ``link`` and hang it up; a session still on it closes (what waits on it fails)."""
        self.peers.forget(link)
        self.core.ctl.disconnect(link)
        s = self.sessions.get(link)
        if s is not None:
            self.run(None, s, s.close(close_reason))
            self.retire(s)

    def resolved(self) -> bool:
        """Run the commands whose peer's name resolved (or fail them with the resolver's error or its time-out)."""
        settled = self.resolver.settle()
        for done in settled:
            if done.error is not None:
                self.peers.backoff(done.key, done.error, self.core.clock())
            for cmd in done.cmds:
                if cmd is not None:
                    self._rerun(cmd)  # resolved: proceeds; failed: the backoff entry fails it
        return bool(settled)

    def reopen_kept(self) -> None:
        """A kept peer whose session closed: open a new one (session_for backs off)."""
        ctl = self.core.ctl
        for key in self.peers.kept:
            link = self.peers.links.get(key)
            lk = ctl.link(link) if link is not None else None
            # no link, or one the control transport gave up on (session_for drops it, then backs off)
            if (lk is None or lk.state is LinkState.FAILED) and key not in self.resolver and not self.core.stopping:
                self.session_for(key, api.OpenSession(key))

    def new_session(self, link: str, peer: str | None) -> Session:
        s = Session(self.core.ctx, expected_peer_id=peer, link=link)
        s.address = self.peers.addr_of.get(link, "")  # ours to dial: the adapter learns it is reachable (PeerUp)
        return s

    def pump(self, p, new_keys: list[bytes] | None = None) -> None:
        """The parking lot has news for the session serving ``p``'s lease (new stores, request finished)."""
        if p is not None and p.lease is not None and p.lease.owner is not None:
            s = p.lease.owner
            self.run(self.link_of(s), s, s.pump(p, new_keys))

    def tick(self) -> None:
        for link, s in list(self.sessions.items()):
            self.run(link, s, s.tick())
        for s in list(self.settling):
            self.run(None, s, s.tick())  # a session whose reads will not settle returns an Abort (actions.py)
        self._drop_long_down()

    def _drop_long_down(self) -> None:
        """Stop redialling outbound links down for [control] forget_down_s to addresses the adapter did not ask to
        keep: a source gone for good (a scaled-down pod, a new address after a restart) would otherwise cost a dial
        a second for as long as this worker runs.  A later command naming the address fails at once and dials it
        again (_redial_gone)."""
        after_s = self.core.cfg.control.forget_down_s
        # none of these is UP: a LinkUp takes its link out of down_since in the turn that polled it, before this tick
        for link, key in self.peers.long_down(self.core.clock(), after_s):
            self.core.counters["links_dropped_down"] += 1
            log.info("control link to %s down for over %g s: no longer redialled (a later pull naming it fails at "
                     "once and dials it again)", key, after_s)
            self._drop_link(link, f"control link down for over {after_s:g} s")  # its session closed when it went down
            self.peers.dropped(key)

    # ------------------------------------------------------------ retiring
    def retire(self, s: Session) -> None:
        """Forget a closed session's link; keep the session until its cancelled reads settled."""
        self._lanes.drop(s)
        forgotten = False  # removed from one of our collections by this call (counters are folded once)
        if self.sessions.get(s.link) is s:
            del self.sessions[s.link]
            forgotten = True
            self._hang_up(s)
        if s.settled:
            if s in self.settling:
                self.settling.remove(s)
                forgotten = True
            if forgotten:  # its counters live on in the worker's (status, metrics)
                for name in FOLDED_COUNTERS:
                    self.core.counters[f"sessions_{name}"] += getattr(s.counters, name)
        elif s not in self.settling:
            self.settling.append(s)

    def _hang_up(self, s: Session) -> None:
        """What the link of a session that just left it needs."""
        link, ctl = s.link, self.core.ctl
        # the transport's record says who dialled (an outbound link keeps its id across reconnects); a link it forgot
        # already is nobody's to keep (disconnecting it again below is a no-op)
        lk = ctl.link(link) if ctl is not None else None
        out = lk is not None and lk.outbound
        key = self.peers.addr_of.get(link)  # the address as the adapter gave it (a name stays a name)
        if out and key is not None:
            if self.peers.links.get(key) == link and s.close_reason and s.close_cause is not CloseCause.PEER_LOST:
                # Closed on a live link (protocol error, refused handshake, data plane, send failure): drop the
                # link and let the next load open a fresh one, after a backoff that doubles while it keeps failing.
                self.peers.forget(link)
                ctl.disconnect(link)
                self.peers.backoff(key, s.close_reason, self.core.clock())
        elif not out and ctl is not None and not s.quiet_close:
            # Hang up: the peer's session may still think it is ACTIVE (we may not have been able to send
            # Bye); without the link it notices now instead of sending into a session that ignores it.
            ctl.disconnect(link)

    # ------------------------------------------------------------ control events
    def on_control(self, ev, *, lane: bool = False) -> None:
        if isinstance(ev, Received):
            self._received(ev, lane)
        elif isinstance(ev, LinkUp):
            self._link_up(ev)
        elif isinstance(ev, LinkDown):
            self._link_down(ev)

    def _received(self, ev: Received, lane: bool) -> None:
        self.core.instruments.on_received(ev.link, ev.payload, lane)
        s = self.sessions.get(ev.link)
        if s is None:
            return
        actions = s.receive(ev.payload, lane=lane)
        if s.state is State.CLOSED and s.counters.protocol_errors:
            self.core.counters["protocol_errors"] += 1
            log.warning("peer %s: %s; session closed", s.peer_id or ev.link, s.close_reason)
        self.run(ev.link, s, actions)

    def _link_up(self, ev: LinkUp) -> None:
        old = self.sessions.get(ev.link)
        if old is not None and old.state is not State.IDLE:
            self.run(None, old, old.close("superseded by a new incarnation of the link"))
            self.retire(old)
        s = self.sessions.get(ev.link)
        if s is None:
            s = self.sessions[ev.link] = self.new_session(ev.link, ev.node_id)
        s.expected_peer_id = ev.node_id
        if ev.outbound:
            self.peers.came_up(ev.link)
            self.run(ev.link, s, s.start())
        # An inbound reconnect replaces its old link inside the control transport without a LinkDown:
        # retire sessions whose link is gone.
        for link, other in list(self.sessions.items()):
            if self.core.ctl.link(link) is None:
                self.run(None, other, other.close("control link replaced"))
                self.retire(other)

    def _link_down(self, ev: LinkDown) -> None:
        self.core.counters["peer_deaths"] += 1
        key = self.peers.addr_of.get(ev.link)
        if key is not None and ev.link not in self.peers.was_up:
            self.unreachable(ev.link, key, ev.reason)
            return
        if key is not None:  # ours, once up: the transport redials it (until _drop_long_down gives up on it)
            self.peers.went_down(ev.link, self.core.clock())
        s = self.sessions.get(ev.link)
        if s is not None:
            # A peer that shuts down sends its Bye on the session's lane, then closes both; this turn may see the
            # control link go first (the loop reads it before the lanes): read what the lane holds first, so
            # the session ends with the peer's own reason, not "peer lost".
            self._lanes.drain(ev.link, s)
        if s is not None and self.sessions.get(ev.link) is s and s.state is not State.CLOSED:
            self.run(None, s, s.close(ev.reason, cause=CloseCause.PEER_LOST))
            self.retire(s)

    def unreachable(self, link: str, key: str, reason: str) -> None:
        """An outbound link that never came up went down: the address is wrong (refused; not a p2pworker) or silent.
        What waits on it fails now (lookups MISS, loads fail: vLLM recomputes), and so does what comes for it until
        the backoff ends (session_for), instead of queueing for a handshake that will not come.  Logged once per
        address (bounded) and counted (p2pworker_peers_unreachable)."""
        self.core.counters["peers_unreachable"] += 1
        if self.peers.first_failure(key):
            # INFO: the control transport already warned, once per address and cause
            log.info("peer %s unreachable: %s; pulls from it recompute (retried after a backoff)", key, reason)
        self.forget_link(link, key, f"peer {key} unreachable: {reason}", f"unreachable: {reason}")
