"""Inbound control links (per routing id on our ROUTER): the acceptor's side of the handshake, a bound on the
handshakes in progress, and what each frame from an identity does by the state of its link (ROUTER_MOVES).  A mixin
of :class:`~p2pworker.control.zmq_control.ZmqControl` (its state lives there)."""

from __future__ import annotations

import hmac
import logging
import secrets

import msgspec
import zmq

from p2pworker.control.base import LinkState, Received
from p2pworker.control.zmq_wire import (
    CONTROL_VERSION,
    K_CHALLENGE,
    K_REJECT,
    K_RESET,
    K_WELCOME,
    Act,
    Link,
    _auth_dec,
    HandshakeChallenge,
    _enc,
    _hello_dec,
    router_move,
)

log = logging.getLogger("p2pworker.control.zmq_control")


class InboundLinks:
    def _drain_router(self) -> None:
        for _ in range(self.config.max_batch):
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.counters["frames_in"] += 1
            if len(frames) != 3:
                self.counters["malformed_frames"] += 1
                continue
            ident, kind, body = frames
            link = self._inbound.get(ident)
            state = link.state if link is not None else None
            if state is LinkState.UP:  # any frame from the peer counts as alive, whatever it is
                link.last_recv = self._run.now(self._clock())
            match router_move(state, kind):
                case Act.DELIVER:
                    self._events.append(Received(link.link_id, body))
                case Act.KEEPALIVE:
                    pass
                case Act.BYE:
                    self._down(link, "peer closed the link", retry=False)
                case Act.HELLO:
                    self._on_hello(ident, body, link)
                case Act.AUTH:
                    self._on_auth(link, body)
                case Act.MALFORMED:
                    self.counters["malformed_frames"] += 1
                case _:
                    self.counters["unauthenticated_frames"] += 1
                    self._router_reply(ident, K_RESET, b"")

    def _on_hello(self, ident: bytes, body: bytes, old: Link | None) -> None:
        try:
            hello = _hello_dec.decode(body)
        except (msgspec.MsgspecError, UnicodeDecodeError):
            self.counters["malformed_frames"] += 1
            self._router_reply(ident, K_REJECT, b"malformed hello")
            return
        if hello.version != CONTROL_VERSION:
            self.counters["rejected_handshakes"] += 1
            self._router_reply(
                ident, K_REJECT, f"control protocol version {hello.version}, expected {CONTROL_VERSION}".encode()
            )
            return
        if old is not None:
            self._links.pop(old.link_id, None)
            self._drop(old)
        pending = [lk for lk in self._inbound.values() if lk.state is LinkState.CHALLENGED]
        if len(pending) >= self.config.max_pending_auth:
            oldest = min(pending, key=lambda lk: lk.deadline)
            self._links.pop(oldest.link_id, None)
            self._drop(oldest)
        self._seq += 1
        now = self._run.now(self._clock())
        link = Link(
            f"in-{self._seq}", False, "", LinkState.CHALLENGED, node_id=hello.node_id, ident=ident,
            nonce=secrets.token_bytes(16), peer_nonce=hello.nonce, deadline=now + self.config.deadline_s,
            last_recv=now,
        )
        self._inbound[ident] = link
        self._links[link.link_id] = link
        proof = self._proof(b"server", hello.nonce, link.nonce, hello.node_id, self.node_id)
        self._send_quiet(link, K_CHALLENGE, _enc.encode(HandshakeChallenge(self.node_id, link.nonce, proof)))

    def _on_auth(self, link: Link, body: bytes) -> None:
        try:
            proof = _auth_dec.decode(body).proof
        except (msgspec.MsgspecError, UnicodeDecodeError):
            proof = None
        expect = self._proof(b"client", link.peer_nonce, link.nonce, link.node_id, self.node_id)
        if proof is None or not hmac.compare_digest(expect, proof):
            self.counters["rejected_handshakes"] += 1
            log.warning("rejected control peer %r: it failed to prove the shared secret", link.node_id)
            self._router_reply(link.ident, K_REJECT, b"authentication failed")
            self._links.pop(link.link_id, None)
            self._drop(link)
            return
        self._send_quiet(link, K_WELCOME, b"")
        if link.state is LinkState.CHALLENGED:  # the welcome can find the peer gone: then it never was up
            self._up(link)
