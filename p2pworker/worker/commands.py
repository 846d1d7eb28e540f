"""The adapter's commands, taken from the command ring and dispatched by type, one handler each.

A command that cannot run fails its job at once, with the reason (no region yet, draining, the peer unreachable
or in its backoff): the adapter reports every job exactly once, and vLLM recomputes what a load could not bring.
"""

from __future__ import annotations

import logging
from typing import Callable, ClassVar

import msgspec

from p2pworker import api
from p2pworker.errors import AuthError, DataPlaneUnavailable, MessageTooLarge, P2PError, RingApiMismatch
from p2pworker.session import JobKind
from p2pworker.worker.core import Core
from p2pworker.worker.peers import addr_key
from p2pworker.worker.ports import Roster, Tells
from p2pworker.worker.sessions import PARKED

log = logging.getLogger("p2pworker.worker")

TAKE_PER_TURN = 256  # commands taken per loop turn: the loop's other duties run at least this often
# Configuration errors at attach (the data plane cannot run here, no secret) do not heal by restarting; a port in
# use or a full /dev/shm may.
FATAL_AT_ATTACH = (DataPlaneUnavailable, AuthError, RingApiMismatch)


class Commands:
    # The method that runs each command of the ring API (a test checks every command has exactly one)
    HANDLERS: ClassVar[dict[type, str]] = {
        api.StoreJob: "_store", api.LoadJob: "_load", api.LookupKeys: "_lookup",
        api.AnswerLookup: "_answer_lookup", api.RequestFinished: "_request_finished",
        api.ConsumerDone: "_consumer_done", api.ResetCache: "_reset_cache",
        api.OpenSession: "_open_session", api.CloseSession: "_close_session",
        api.AttachRegion: "_attach", api.Drain: "_drain", api.Shutdown: "_shutdown",
    }

    def __init__(self, core: Core, host: Roster, outbox: Tells, attach: Callable[[api.AttachRegion], None]) -> None:
        self.core = core
        self.host = host
        self.outbox = outbox
        self._attach_region = attach  # the worker's: it builds the attachment and says Ready
        self._handlers = {kind: getattr(self, name) for kind, name in self.HANDLERS.items()}

    def _attach(self, cmd: api.AttachRegion) -> None:
        self._attach_region(cmd)

    def take(self) -> bool:
        did = False
        for _ in range(TAKE_PER_TURN):
            try:
                cmd = self.core.cmd.try_get()
            except (msgspec.MsgspecError, UnicodeDecodeError) as e:
                self._undecodable(e)
                continue
            except MessageTooLarge as e:
                # The adapter refuses such a command before sending it (same limit): a job id we could not read would
                # stay open in the adapter forever.  Stop instead; the adapter fails every open job once we are gone.
                self.outbox.error(f"command over the ring's limit: {e}")
                self.core.stop(f"a command exceeded the ring's limit ({e})")
                return True
            if cmd is None:
                break
            did = True
            self.core.counters["commands"] += 1
            self._run(cmd)
        return did

    def _undecodable(self, e: Exception) -> None:
        if self.core.att is None:  # the first command is the adapter's AttachRegion: another release's
            self.outbox.error(f"undecodable command before any region was attached ({e}): the adapter is likely "
                                f"another p2pworker release (this worker speaks ring API {api.RING_API}): install "
                                f"the same release in vLLM's environment and the worker's", fatal=True, attach=True)
        else:
            self.outbox.error(f"undecodable command dropped: {e}")

    def _run(self, cmd: api.Command) -> None:
        attach = isinstance(cmd, api.AttachRegion)
        try:
            self.core.instruments.on_command(cmd)
            self.handle(cmd)
        except P2PError as e:
            self.outbox.error(f"{type(cmd).__name__}: {e}", attach=attach,
                                fatal=attach and isinstance(e, FATAL_AT_ATTACH))
        except Exception as e:
            if not attach:
                raise
            # A library that fails in its own way at start (NIXL, ZMQ): the cause, not a crash.
            self.outbox.error(f"AttachRegion: {type(e).__name__}: {e}", attach=True)

    def handle(self, cmd: api.Command) -> None:
        self._handlers[type(cmd)](cmd)

    # ------------------------------------------------------------ jobs and lookups
    def _store(self, cmd: api.StoreJob) -> None:
        if self._refuse(cmd.job_id, JobKind.STORE):
            return
        news = self.core.ctx.lot.store(cmd.job_id, cmd.request_id, cmd.keys, cmd.rows)
        if news is not None:
            self.host.pump(*news)

    def _load(self, cmd: api.LoadJob) -> None:
        counters = self.core.counters
        # inspect shows it (tests/e2e/test_long_prompt.py reads it)
        if len(cmd.keys) > counters["largest_load_keys"]:
            counters["largest_load_keys"] = len(cmd.keys)
        if self._refuse(cmd.job_id, JobKind.LOAD):
            return
        s, why = self.host.session_for(cmd.address, cmd)
        if s is None:
            if why is not PARKED:
                self.fail_now(cmd.job_id, JobKind.LOAD, why)
            return
        self.host.run(s.link, s, s.load(cmd.job_id, cmd.request_id, cmd.keys, cmd.rows, ask=cmd.ask))

    def _lookup(self, cmd: api.LookupKeys) -> None:
        s, why = (None, "worker not ready") if self.core.ctx is None or self.core.stopping else \
            self.host.session_for(cmd.address, cmd)
        if s is None:
            if why is not PARKED:
                self.miss_now(cmd.lookup_id, why)
            return
        self.host.run(s.link, s, s.lookup(cmd.lookup_id, cmd.keys, cmd.request_id))

    def _answer_lookup(self, cmd: api.AnswerLookup) -> None:
        for link, s in list(self.host.sessions.items()):
            if s.peer_id == cmd.peer_id:
                answer = s.answer_lookup(cmd.lookup_id, cmd.present)
                if answer.served:
                    self.host.run(link, s, answer.actions)
                    break

    def _request_finished(self, cmd: api.RequestFinished) -> None:
        if self.core.ctx is not None:
            self.host.pump(self.core.ctx.lot.request_finished(cmd.request_id))

    def _consumer_done(self, cmd: api.ConsumerDone) -> None:
        if self.core.ctx is not None and not self.core.stopping:
            s, _ = self.host.session_for(cmd.address, cmd)  # none (unreachable, resolving): its reaper ends them
            if s is not None:
                self.host.run(s.link, s, s.done(cmd.request_id))

    def _reset_cache(self, cmd: api.ResetCache) -> None:
        if self.core.ctx is None:
            return
        for p in self.core.ctx.lot.reset(cmd.reason):
            self.host.pump(p)
        if cmd.loads:  # reported once their reads settled (none aborted)
            for link, s in list(self.host.sessions.items()):
                self.host.run(link, s, s.cancel_loads(cmd.reason))

    # ------------------------------------------------------------ peers
    def _open_session(self, cmd: api.OpenSession) -> None:
        if cmd.keep:
            self.host.peers.kept.add(addr_key(cmd.address))
        if not self.core.stopping:  # a no-op when the session exists, or the address is in its backoff
            self.host.session_for(cmd.address, cmd)

    def _close_session(self, cmd: api.CloseSession) -> None:
        host = self.host
        key = addr_key(cmd.address)
        host.peers.kept.discard(key)
        link = host.peers.links.get(key)
        s = host.sessions.get(link) if link is not None else None
        if s is not None:
            host.run(link, s, s.close("closed by the adapter", bye=True))
            host.peers.retry.pop(key, None)  # asked for, not a failure: no backoff
        elif link is not None:
            host.peers.forget(link)
            self.core.ctl.disconnect(link)

    # ------------------------------------------------------------ lifecycle
    def _drain(self, cmd: api.Drain) -> None:
        self.core.drain()

    def _shutdown(self, cmd: api.Shutdown) -> None:
        self.core.stop(f"shutdown command{': ' + cmd.reason if cmd.reason else ''}")

    # ------------------------------------------------------------ failing at once
    def _refuse(self, job_id: int, kind: JobKind) -> bool:
        if self.core.ctx is None:
            self.fail_now(job_id, kind, "worker has no region attached yet")
            return True
        if not self.core.phase.takes_work:
            self.fail_now(job_id, kind, "worker is draining or shutting down")
            return True
        return False

    def fail_now(self, job_id: int, kind: JobKind, reason: str) -> None:
        now = self.core.clock()
        self.core.reporter.open(job_id, kind, now)
        self.core.reporter.done(job_id, False, (), 0, now, reason)

    def miss_now(self, lookup_id: int, reason: str) -> None:
        self.core.reporter.open_lookup(lookup_id)
        self.core.reporter.lookup_done(lookup_id, None, reason)

    def fail_queued(self, reason: str) -> None:
        """At shutdown: fail what waits behind a name lookup and what is still in the command ring, once each."""
        for cmd in self.host.resolver.take_waiting():
            self._fail_unrun(cmd, reason)
        while True:
            try:
                cmd = self.core.cmd.try_get()
            except (msgspec.MsgspecError, UnicodeDecodeError):
                continue
            except P2PError:
                return
            if cmd is None:
                return
            self._fail_unrun(cmd, reason)

    def _fail_unrun(self, cmd: api.Command, reason: str) -> None:
        if isinstance(cmd, (api.StoreJob, api.LoadJob)):
            self.fail_now(cmd.job_id, JobKind.STORE if isinstance(cmd, api.StoreJob) else JobKind.LOAD, reason)
        elif isinstance(cmd, api.LookupKeys):
            self.miss_now(cmd.lookup_id, reason)
