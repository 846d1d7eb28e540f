"""What one room of the worker asks of another, as protocols: each room is handed the rooms it calls, typed here,
so no room imports another room's class, nor the Worker (loop.py builds them and hands each its collaborators).
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Union

from p2pworker import api
from p2pworker.control import LinkDown, LinkUp, Received
from p2pworker.session import Action, Session
from p2pworker.worker.lanes import LaneSwitch
from p2pworker.worker.peers import PeerBook
from p2pworker.worker.resolver import Resolver

ControlEvent = Union[LinkUp, LinkDown, Received]
# the commands' handler, handed to the session host for what waited behind a name lookup
Rerun = Callable[[api.Command], None]


class Performs(Protocol):
    """The action runner (actions.py), as the session host uses it."""

    def run(self, link: str | None, s: Session, actions: list[Action]) -> None: ...


class Roster(Protocol):
    """The session host (sessions.py), as the commands, the action runner, the lanes and the stop use it."""

    sessions: dict[str, Session]
    peers: PeerBook
    resolver: Resolver

    def run(self, link: str | None, s: Session, actions: list[Action]) -> None: ...

    def retire(self, s: Session) -> None: ...

    def link_of(self, s: Session) -> str | None: ...

    def on_control(self, ev: ControlEvent, *, lane: bool = False) -> None: ...

    def session_for(self, address: str, cmd: Any = None) -> tuple[Session | None, str]: ...

    def pump(self, p: Any, new_keys: list[bytes] | None = None) -> None: ...


class LaneDuties(Protocol):
    """The lane host (lane_host.py), as the session host and the action runner use it."""

    switch: LaneSwitch

    def drop(self, s: Session) -> None: ...

    def drain(self, link: str, s: Session) -> None: ...

    def lane_read(self, link: str, s: Session) -> None: ...


class Tells(Protocol):
    """The event outbox (outbox.py), as the commands, the action runner and the stop use it."""

    pending: Any

    @property
    def waiting(self) -> bool: ...

    def error(self, message: str, *, fatal: bool = False, attach: bool = False) -> None: ...

    def flush(self) -> None: ...


class FailsQueued(Protocol):
    """The commands (commands.py), as the stop uses them: what was never run is failed once."""

    def fail_queued(self, reason: str) -> None: ...


class Settles(Protocol):
    """The action runner, as the stop uses it: settled reads handed back to their sessions."""

    def poll_data(self) -> bool: ...


class Closes(Protocol):
    def close(self) -> None: ...
