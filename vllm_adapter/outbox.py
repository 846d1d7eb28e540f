"""Outbox: the commands for the worker that are not on its command ring yet.

Every tier call queues its commands here (``send``, never blocking); whichever comes first hands them to the ring
(``flush``): vLLM 0.33's tier-poll thread (get_finished_jobs, off the scheduler thread) or, when no poll thread runs
(0.32), the step's on_schedule_end, once per step."""

from __future__ import annotations

import logging
import time
from typing import Callable

from p2pworker import api
from p2pworker.errors import MessageTooLarge, P2PError
from vllm_adapter.supervisor import WorkerSupervisor

log = logging.getLogger("vllm_adapter.tier")

# A request that will load from a peer asks the worker to open the session at once (OpenSession keep=False), at most
# once per peer per this many seconds: for an open session it is a dict lookup in the worker, but not one per request.
OPEN_AHEAD_S, OPEN_AHEAD_MAX = 5.0, 4096


class Outbox:
    def __init__(self, supervisor: WorkerSupervisor, refuse: Callable[[api.Command, str], None]):
        self.commands: list[api.Command] = []
        self._supervisor = supervisor
        self._refuse = refuse  # a command the ring cannot carry: its job or lookup ends through the failure path

    @property
    def pending(self) -> bool:
        return bool(self.commands)

    def send(self, cmd: api.Command) -> bool:
        """Queue a command for the worker (False: no serving worker)."""
        if not self._supervisor.serving:
            return False
        self.commands.append(cmd)
        return True

    def flush(self) -> None:
        client, box = self._supervisor.client, self.commands
        if client is None or client.ready is None:
            return
        try:
            client.flush()  # the tail of a command that spans slots goes first (never blocks)
        except P2PError as e:
            log.error("command ring: %s", e)
            return
        sent = 0
        for cmd in box:
            try:
                taken = client.send(cmd)  # a command larger than a slot: taken once its first slot is out
            except MessageTooLarge as e:  # past limits.RING_MAX_MESSAGE_BYTES: fail it, never raise into vLLM
                self._refuse(cmd, str(e))
                taken = True
            if not taken:  # ring full (or a long command still going out): the rest waits, in order
                break
            sent += 1
        del box[:sent]

    def clear(self) -> None:
        """The worker is gone: its queued commands with it (their jobs and lookups were ended)."""
        self.commands.clear()


class OpenAhead:
    """A request that will look up and load from a peer arrived: the worker opens that session now, so the handshake
    (and on one host the handover and lane) runs while vLLM schedules the request instead of after its first load is
    submitted (first contact).  Not a listed peer: opened once, not kept.  At most once per peer per OPEN_AHEAD_S."""

    def __init__(self, outbox: Outbox, clock: Callable[[], float] = time.monotonic):
        self._outbox, self._clock = outbox, clock
        self._at: dict[str, float] = {}  # peer address -> when a request last asked to open its session

    def open(self, address: str) -> None:
        now = self._clock()
        if now - self._at.get(address, -OPEN_AHEAD_S) < OPEN_AHEAD_S:
            return
        if len(self._at) >= OPEN_AHEAD_MAX:
            self._at.clear()  # bounded: at worst a peer is asked once more
        self._at[address] = now
        if self._outbox.send(api.OpenSession(address, keep=False)):
            # Now, not at the step's end: the point is to start before the lookups.  A non-blocking ring put; vLLM
            # calls on_new_request under the manager lock (0.33+), which the poll thread's flush holds too.
            self._outbox.flush()

    def clear(self) -> None:
        """A new worker has no session yet."""
        self._at.clear()
