"""The adapter's side of a worker: creates the rings, spawns (or attaches to) the worker, speaks through the rings.

Never blocks on the worker in :meth:`send`/:meth:`poll` (what vLLM's scheduler
thread calls); the ``wait_*`` helpers are for tools, tests and start-up.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from typing import Callable

import msgspec

from p2pworker import api, copytune
from p2pworker.errors import MessageTooLarge, P2PError, PeerDead, RingApiMismatch
from p2pworker.shm import RegionHandle, Ring, Role

log = logging.getLogger(__name__)
# close(): how long a worker that did not shut down is waited for after its SIGKILL.  One stuck in the kernel (an
# I/O or a driver call that does not return) does not die of it, and vLLM's shutdown must not hang on that.
KILL_WAIT_S = 5.0


class WorkerClient:
    def __init__(
        self,
        name: str,
        *,
        config_path: str | None = None,
        args: list[str] | None = None,
        env: dict[str, str] | None = None,
        spawn: bool = True,
        stderr=None,
        prefix: str | None = None,
    ):
        """``spawn=False`` with a fixed ``prefix``: an operator runs ``p2pworker launch --rings PREFIX``."""
        self.name = name
        self.prefix = prefix or f"p2pw_{name}_{os.getpid()}_{secrets.token_hex(3)}"
        cmd_name, evt_name = api.ring_names(self.prefix)
        self.cmd = Ring.create(cmd_name, Role.PRODUCER, nslots=api.RING_NSLOTS, slot_bytes=api.RING_SLOT_BYTES,
                               msg_type=api.Command)
        try:
            self.evt = Ring.create(evt_name, Role.CONSUMER, nslots=api.RING_NSLOTS, slot_bytes=api.RING_SLOT_BYTES,
                                   msg_type=api.Event)
        except BaseException:
            self.cmd.close()
            raise
        self.proc: subprocess.Popen | None = None
        self.ready: api.Ready | None = None
        self.backlog: list[api.Event] = []
        self.admin_path: str | None = None
        if spawn:
            argv = [sys.executable, "-m", "p2pworker.cli", "launch", "--name", name, "--rings", self.prefix]
            if "--admin" not in (args or []):  # ours to remove if the worker is killed
                self.admin_path = f"/tmp/p2pworker-{name}-{self.prefix.rsplit('_', 1)[-1]}.admin"
                argv += ["--admin", self.admin_path]
            if config_path:
                argv += ["--config", config_path]
            argv += args or []
            child_env = {**os.environ, **(env or {})}
            child_env = copytune.worker_env(child_env) or child_env  # set here, so that launch need not exec again
            self.proc = subprocess.Popen(argv, env=child_env, stdin=subprocess.DEVNULL,
                                         stdout=stderr, stderr=stderr)  # NIXL logs to stdout

    # ------------------------------------------------------------ never blocking
    def send(self, cmd: api.Command) -> bool:
        """Queue a command; False when the command ring is full (the caller retries or fails the job).

        A command larger than one slot is taken once its first slot is out; :meth:`flush` (also run by every
        ``send``) publishes the rest.  Raises ``MessageTooLarge`` past ``limits.RING_MAX_MESSAGE_BYTES``."""
        return self.cmd.try_put(cmd)

    def flush(self) -> bool:
        """Publish what fits of a command that spans slots; True when nothing is left.  Never blocks."""
        return self.cmd.flush()

    def poll(self) -> list[api.Event]:
        """Events so far (never blocks); also publishes what fits of a command that spans slots."""
        self.cmd.flush()  # returns at once when nothing is pending
        out, self.backlog = self.backlog, []
        while True:
            try:
                ev = self.evt.try_get()
            except (msgspec.MsgspecError, UnicodeDecodeError, MessageTooLarge) as e:
                log.error("worker %s: event dropped: %s", self.name, e)  # consumed: the next one is intact
                continue
            except P2PError:
                self.backlog = out  # what was read is delivered by the next poll, not lost with this error
                raise
            if ev is None:
                return out
            out.append(ev)

    def wait(self, timeout_s: float) -> list[api.Event]:
        """Tools only (never vLLM's scheduler): sleep on the event ring's bell until events arrive."""
        events = self.poll()
        if events:
            return events
        try:
            return [self.evt.get(timeout_s=timeout_s)] + self.poll()
        except TimeoutError:
            return []

    def kill(self) -> None:
        """SIGKILL the worker (a wedged one: its pid lives, its loop does not).  Whether it is gone yet is
        :meth:`alive`'s answer: a stopped process dies only when the kernel gets to it."""
        pid = self.proc.pid if self.proc is not None else self.evt.peer_pid
        if pid > 0:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError as e:  # gone already, or not ours to kill (an operator's worker run as another user)
                if not isinstance(e, ProcessLookupError):
                    log.error("cannot kill wedged worker pid %d: %s", pid, e)

    def alive(self) -> bool:
        """False only once the worker is really gone.  A spawned worker: reaped (waitpid), so no thread of it
        can still copy into our rows; a worker that closed its rings but still runs is alive.  An operator's
        worker (no child of ours): the event ring's producer pid and start time."""
        if self.proc is not None:
            return self.proc.poll() is None
        return self.evt.peer_alive()

    # ------------------------------------------------------------ tools
    def wait_for(self, pred: Callable[[api.Event], bool], timeout_s: float = 30.0) -> api.Event:
        """The first event matching ``pred`` (others stay in the backlog for poll())."""
        deadline = time.monotonic() + timeout_s
        seen: list[api.Event] = []
        try:
            while True:
                for ev in self.poll():
                    if pred(ev):
                        return ev
                    seen.append(ev)
                if not self.alive():
                    code = None if self.proc is None else self.proc.poll()
                    raise PeerDead(self.evt.name, "worker", self.evt.peer_pid, f"worker exited ({code})")
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"worker {self.name}: no matching event within {timeout_s} s; got {seen[-5:]}")
                time.sleep(0.0005)
        finally:
            self.backlog = seen + self.backlog

    def attach(self, handle: RegionHandle, identity: dict | None = None, timeout_s: float = 60.0) -> api.Ready:
        """Hand the worker the region; returns its Ready (address, backend, fingerprint)."""
        if not self.send(api.AttachRegion(handle, identity or {}, api.RING_API)):
            raise P2PError("command ring full")
        ev = self.wait_for(lambda e: isinstance(e, (api.Ready, api.WorkerError)), timeout_s)
        if isinstance(ev, api.WorkerError):
            raise P2PError(f"worker {self.name} could not attach the region: {ev.message}")
        why = api.ring_api_mismatch(ev.api, f"worker {self.name}")
        if why is not None:
            raise RingApiMismatch(why, ev.api, api.RING_API)
        self.ready = ev
        self.cmd.unlink()  # both sides attached: a crash now leaves nothing in /dev/shm
        self.evt.unlink()
        return ev

    def close(self, timeout_s: float = 15.0) -> int | None:
        """Ask the worker to shut down, wait for it (``timeout_s``, then SIGKILL and KILL_WAIT_S more), close the
        rings.  Returns its exit code: None for an operator's worker, or one that outlived the SIGKILL."""
        code = None
        if self.proc is not None:
            if self.proc.poll() is None:
                self._send_within(api.Shutdown("client closing"), min(timeout_s, 5.0))
                try:
                    code = self.proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    try:
                        code = self.proc.wait(KILL_WAIT_S)
                    except subprocess.TimeoutExpired:  # its rings are closed below: if it ever runs on, it stops
                        log.error("worker %s (pid %d) still alive %g s after SIGKILL (stuck in the kernel?): left "
                                  "behind, stop it by hand", self.name, self.proc.pid, KILL_WAIT_S)
            else:
                code = self.proc.returncode
        try:
            self.backlog += self.poll()
        except P2PError:
            pass
        self.cmd.close()
        self.evt.close()
        self._remove_admin()
        return code

    def _remove_admin(self) -> None:
        if self.admin_path and os.path.exists(self.admin_path):  # a killed worker could not remove it
            os.unlink(self.admin_path)

    def abandon(self) -> None:
        """Close our rings without waiting for the worker: one that outlived SIGKILL and holds no job.  If it ever
        runs on, it sees its command ring closed and stops.  Its admin socket (ours: a worker killed by SIGKILL
        cannot remove it) goes now, not once it dies: we may be gone by then.  :meth:`reap` tells when it is gone."""
        self.cmd.close()
        self.evt.close()
        self._remove_admin()

    def reap(self) -> bool:
        """After :meth:`abandon`: True once the worker is gone.  A child of ours is reaped (no zombie); an
        operator's worker is the operator's (its rings are closed: nothing of it is ours to watch)."""
        return self.proc is None or self.proc.poll() is not None

    def _send_within(self, cmd: api.Command, timeout_s: float) -> bool:
        """Tools and shutdown only: send, finishing a command that spans slots first, for up to ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if self.cmd.flush() and self.send(cmd):
                    return True
            except P2PError:
                return False
            if time.monotonic() >= deadline or not self.alive():
                return False
            time.sleep(0.001)

    def __enter__(self) -> "WorkerClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
