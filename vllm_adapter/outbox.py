"""Outbox: the commands for the worker that are not on its command ring yet.

Every tier call queues its commands here (``send``, never blocking); whichever comes first hands them to the ring
(``flush``): vLLM 0.33's tier-poll thread (get_finished_jobs, off the scheduler thread) or, when no poll thread runs
(0.32), the step's on_schedule_end, once per step."""

from __future__ import annotations

import logging
from typing import Callable

from p2pworker import api
from p2pworker.errors import MessageTooLarge, P2PError
from vllm_adapter.supervisor import WorkerSupervisor

log = logging.getLogger("vllm_adapter.tier")


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
