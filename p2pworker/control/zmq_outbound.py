"""Outbound control links (our DEALER per peer): dialing, the socket monitor that follows the TCP connection under a
link (its dial, and its end once UP), the initiator's side of the handshake, and the deadline of a handshake that
does not end.  A mixin of :class:`~p2pworker.control.zmq_control.ZmqControl` (its state lives there)."""

from __future__ import annotations

import hmac
import logging
import os
import secrets

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from p2pworker.control.base import DownCause, LinkState, Received
from p2pworker.control.zmq_wire import (
    _CAUSE_DETAIL,
    _WARNED_MAX,
    CAUSE_COUNTERS,
    CONTROL_VERSION,
    K_AUTH,
    K_HELLO,
    MONITOR_EVENTS,
    Act,
    Link,
    Wire,
    HandshakeAuth,
    _challenge_dec,
    _enc,
    HandshakeHello,
    dealer_move,
    monitor_move,
)

log = logging.getLogger("p2pworker.control.zmq_control")


class OutboundLinks:
    def _open(self, link: Link) -> None:
        link.incarnation += 1
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, self.config.hwm)
        sock.setsockopt(zmq.RCVHWM, self.config.hwm)
        sock.setsockopt(zmq.MAXMSGSIZE, self.config.max_frame_bytes)
        sock.setsockopt(zmq.ROUTING_ID, f"{self.node_id}#{link.link_id}#{link.incarnation}".encode())
        monitor = None
        try:
            # before connect(): the monitor sees the dial from its first event on
            monitor = sock.get_monitor_socket(MONITOR_EVENTS)
            sock.connect(link.address)
        except zmq.ZMQError:
            # not yet ours to track (no link holds them): close both here or they leak, one pair per failed dial
            if monitor is not None:
                sock.disable_monitor()
                monitor.close(linger=0)
            sock.close(linger=0)
            raise
        link.sock, link.monitor, link.wire = sock, monitor, Wire.DIALING
        for s in (sock, monitor):  # the DEALER first: poll() drains it before its monitor
            self._poller.register(s, zmq.POLLIN)
            self._by_sock[s] = link
        self.sockets_epoch += 1
        link.nonce = secrets.token_bytes(16)
        link.state = LinkState.CONNECTING
        # on the run clock (liveness.py): a stall of ours is not the peer's silence
        link.deadline = self._run.now(self._clock()) + self.config.deadline_s
        self._send_quiet(link, K_HELLO, _enc.encode(HandshakeHello(CONTROL_VERSION, self.node_id, link.nonce)))

    def _unwatch(self, link: Link) -> None:
        """Close ``link``'s socket monitor (with its DEALER)."""
        monitor = link.monitor
        if monitor is None:
            return
        link.monitor = None
        # libzmq's side first: it sends events with a blocking send from its I/O thread, and a PAIR whose peer is
        # closed never takes one; stopping also unbinds the inproc address
        link.sock.disable_monitor()
        self._poller.unregister(monitor)
        self._by_sock.pop(monitor, None)
        self.sockets_epoch += 1
        monitor.close(linger=0)

    def _close_sock(self, link: Link) -> None:
        self._unwatch(link)
        if link.sock is not None:
            self._poller.unregister(link.sock)
            self._by_sock.pop(link.sock, None)
            self.sockets_epoch += 1
            link.sock.close(linger=0)
            link.sock = None

    def _retry_later(self, link: Link, was_up: bool = False) -> None:
        """The next dial of a DOWN outbound link after its backoff, which doubles up to reconnect_max_s.  A link that
        went down after it stayed UP for a deadline starts again from reconnect_min_s (its drop is news); one that
        links and drops at once (a crash-looping peer) keeps doubling, never redialled every 0.1 s."""
        if was_up and self._clock() - link.up_at >= self.config.deadline_s:
            link.backoff_s = self.config.reconnect_min_s
        link.next_attempt = self._clock() + link.backoff_s
        link.backoff_s = min(link.backoff_s * 2, self.config.reconnect_max_s)

    def _dial_failed(self, link: Link, cause: DownCause, detail: str = "") -> None:
        """The monitor (or the deadline, for a silent TCP peer) says this dial cannot work: DOWN now, retried
        after the link's backoff like any other DOWN; counted each time, logged once per address and cause."""
        self.counters[CAUSE_COUNTERS[cause]] += 1
        reason = f"{cause.value}: {link.address}: {detail or _CAUSE_DETAIL[cause]}"
        key = (link.address, cause)
        if key not in self._warned:
            self._warned[key] = None
            if len(self._warned) > _WARNED_MAX:
                self._warned.popitem(last=False)
            log.warning("control link %s: %s (retrying with backoff up to %.1f s; logged once per address)",
                        link.link_id, reason, self.config.reconnect_max_s)
        self._down(link, reason, retry=True, cause=cause)

    def _drain_monitor(self, link: Link) -> None:
        monitor = link.monitor
        if monitor is None:
            return
        for _ in range(self.config.max_batch):
            if link.monitor is not monitor:  # the link came up or went down meanwhile: its monitor is closed
                return
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            move = monitor_move(link.wire, event["event"])
            if isinstance(move, Wire):
                link.wire = move
            elif isinstance(move, DownCause):
                # what the DEALER already holds first: a REJECT before the hang-up is the truer reason
                self._drain_dealer(link)
                if link.monitor is not monitor:
                    return
                if link.state in (LinkState.CONNECTING, LinkState.AUTHING):
                    err = int(event["value"])
                    detail = _CAUSE_DETAIL[move]
                    if move is DownCause.HANDSHAKE_FAILED and err:  # NO_DETAIL / PROTOCOL carry an errno
                        detail += f" ({os.strerror(err)})"
                    self._dial_failed(link, move, detail)
                elif link.state is LinkState.UP and move is DownCause.CLOSED:
                    # Not a failed dial: counted, logged at INFO with the other downs, redialled after the link's
                    # backoff (reconnect_min_s once it stayed up: _retry_later), so a restarted peer is found soon.
                    self.counters[CAUSE_COUNTERS[move]] += 1
                    self._down(link, f"{move.value}: {link.address}: {_CAUSE_DETAIL[move]}", retry=True, cause=move)

    def _drain_dealer(self, link: Link) -> None:
        for _ in range(self.config.max_batch):
            if link.sock is None:
                return
            try:
                frames = link.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.counters["frames_in"] += 1
            if len(frames) != 2:
                self.counters["malformed_frames"] += 1
                continue
            kind, body = frames
            if link.state is LinkState.UP:  # any frame from the peer counts as alive, whatever it is
                link.last_recv = self._run.now(self._clock())
            self._on_dealer_frame(link, dealer_move(link.state, kind), body)

    def _on_dealer_frame(self, link: Link, act: Act, body: bytes) -> None:
        """One well-formed frame on an outbound link, as :func:`dealer_move` classed it."""
        match act:
            case Act.DELIVER:
                self._events.append(Received(link.link_id, body))
            case Act.KEEPALIVE:
                pass
            case Act.CHALLENGE:
                self._on_challenge(link, body)
            case Act.WELCOME:
                self._up(link)
            case Act.REJECTED:
                self.counters["rejected_handshakes"] += 1
                self._down(link, f"rejected by {link.address}: {body.decode(errors='replace')}", retry=False)
            case Act.RESET:
                # a peer that declared us lost while this process did not run has forgotten the link too: say so
                hint = self._run.hint(self._clock(), self.config.deadline_s)
                why = f", or {hint}" if hint else "?"
                self._down(link, f"{link.address} no longer knows this link (it restarted{why})", retry=True)
            case Act.BYE:
                self._down(link, "peer closed the link", retry=True)
            case _:
                self.counters["malformed_frames"] += 1

    def _on_challenge(self, link: Link, body: bytes) -> None:
        try:
            ch = _challenge_dec.decode(body)
        except (msgspec.MsgspecError, UnicodeDecodeError):
            self.counters["malformed_frames"] += 1
            return
        expect = self._proof(b"server", link.nonce, ch.nonce, self.node_id, ch.node_id)
        if not hmac.compare_digest(expect, ch.proof):
            self.counters["rejected_handshakes"] += 1
            self._down(link, f"{link.address} failed to prove the shared secret", retry=False)
            return
        link.node_id = ch.node_id
        link.peer_nonce = ch.nonce
        link.state = LinkState.AUTHING
        proof = self._proof(b"client", link.nonce, ch.nonce, self.node_id, ch.node_id)
        self._send_quiet(link, K_AUTH, _enc.encode(HandshakeAuth(proof)))

    def _on_deadline(self, link: Link) -> None:
        """An outbound handshake ran past its deadline: say how far it got."""
        st, d = link.state, self.config.deadline_s
        self._drain_monitor(link)  # how far the wire got, up to now (a failure event takes the link down here)
        if link.state is not st:
            return
        if link.wire is Wire.TCP:  # a peer's libzmq answers the greeting on its own I/O thread: not our kind there
            self._dial_failed(link, DownCause.HANDSHAKE_FAILED,
                              f"it accepted TCP but sent no ZMTP greeting within {d:.1f} s "
                              f"(not a p2pworker control port, or a stopped process)")
        else:
            self._down(link, f"no answer from {link.address} within {d:.1f} s", retry=True)
