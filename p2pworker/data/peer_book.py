"""Peer keys and the remote agents they share, as drawn in :mod:`p2pworker.data.pieces`'s docstring (sans-IO:
the transport loads and forgets remotes through its backend; this book says which key holds which remote, and
when a remote's last reference goes).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Callable

from p2pworker.data import samehost
from p2pworker.data.base import PeerDataInfo
from p2pworker.errors import TransferFailed


class RemotePath(enum.Enum):
    """How reads from a remote move (inspect shows the value)."""

    UNDECIDED = "undecided"  # a same-host candidate on a link it dialed: chosen at our first read, nothing loaded
    SAME_HOST = "same_host"  # copied out of its region file (``source``); the backend never saw it
    BACKEND = "backend"  # loaded into the backend (``state``)
    UNUSABLE = "unusable"  # the backend refused it at our first read: reads fail (the worker closes the session)


@dataclass(eq=False)
class Remote:
    """One remote agent, loaded once, shared by every peer record that names it."""

    name: str
    info: PeerDataInfo  # as first loaded: a later key must describe the same incarnation
    refs: set = field(default_factory=set)  # Peer records (live or retiring) that use it
    state: Any = None  # backend state (e.g. a socket)
    source: samehost.SameHostSource | None = None  # set: the same-host path (the backend never saw this remote)
    refusal: str = ""  # why not the same-host path (inspect)
    path: RemotePath = RemotePath.BACKEND

    def path_view(self, backend: str) -> tuple[str, str]:
        """(the path reads from it take: "same_host", "undecided", "unusable" or ``backend``, why not same_host)."""
        match self.path:
            case RemotePath.SAME_HOST:
                return "same_host", ""
            case RemotePath.UNDECIDED:
                return "undecided", "chosen at the first read from this peer (it dialed us)"
            case RemotePath.UNUSABLE:
                return "unusable", self.refusal
        return backend, self.refusal


@dataclass(eq=False)
class Peer:
    """One registration under a peer key; several may share a :class:`Remote`."""

    key: str
    remote: Remote
    base_address: int
    num_blocks: int
    transfers: set[int] = field(default_factory=set)


def same_incarnation(a: PeerDataInfo, b: PeerDataInfo) -> bool:
    """Two infos naming one agent describe the same process start (and so one loaded remote)."""
    # same_host too: a peer naming another's agent with its own files must not have them used for the other
    return (a.metadata, a.endpoint, a.token, a.base_address, a.num_blocks, a.same_host) == (
        b.metadata, b.endpoint, b.token, b.base_address, b.num_blocks, b.same_host
    )


class PeerBook:
    """The live peer records by key, the retiring ones, and the remote agents they reference by name."""

    def __init__(self) -> None:
        self.live: dict[str, Peer] = {}
        self.retiring: list[Peer] = []
        self.remotes: dict[str, Remote] = {}

    def get(self, peer_key: str) -> Peer | None:
        return self.live.get(peer_key)

    def known(self, peer_key: str, info: PeerDataInfo) -> Remote | None:
        """The remote a new key for ``info`` shares, None when a new one must be made.  A remote that turned out
        UNUSABLE is not shared: nothing was loaded or posted through it, so a new link starts afresh (the old keys
        keep it).  TransferFailed when the agent name is loaded with another incarnation."""
        remote = self.remotes.get(info.agent_name)
        if remote is None or remote.path is RemotePath.UNUSABLE:
            return None
        if not same_incarnation(remote.info, info):
            # A restarted peer reusing its agent name while reads through the old incarnation can
            # still land: NIXL holds one agent per name, and unloading the old one now would leave
            # those reads' outcome unknowable (a transfer is reported only once nothing can land).
            raise TransferFailed(
                f"peer {peer_key}: agent {info.agent_name!r} is already loaded with other metadata "
                f"(used by {sorted(p.key for p in remote.refs)}); remove those links and let their reads "
                f"settle first, or give each process start a unique agent name"
            )
        return remote

    def loaded(self, remote: Remote) -> None:
        """``remote`` is usable now (its path chosen): later keys naming its agent share it."""
        self.remotes[remote.name] = remote

    def register(self, peer_key: str, remote: Remote, info: PeerDataInfo) -> Peer:
        peer = Peer(peer_key, remote, info.base_address, info.num_blocks)
        remote.refs.add(peer)
        self.live[peer_key] = peer
        return peer

    def retire(self, peer_key: str) -> Peer | None:
        """Take ``peer_key`` out of the live keys; its record retires until nothing posted through it can land."""
        peer = self.live.pop(peer_key, None)
        if peer is not None:
            self.retiring.append(peer)
        return peer

    def reap(self, still_posted: Callable[[Peer], bool]) -> list[Peer]:
        """The retiring records nothing posted through can still land from, taken out of the book."""
        done = [p for p in self.retiring if not still_posted(p)]
        for peer in done:
            self.retiring.remove(peer)
        return done

    def drop(self, peer: Peer) -> Remote | None:
        """Drop ``peer``'s reference; its remote when that was the last one (then out of the book: forget it)."""
        remote = peer.remote
        remote.refs.discard(peer)
        if remote.refs or self.remotes.get(remote.name) is not remote:
            return None
        del self.remotes[remote.name]
        return remote

    def ref_counts(self) -> dict[str, int]:
        return {name: len(r.refs) for name, r in self.remotes.items()}

    def records(self) -> list[Peer]:
        """Every record, live then retiring."""
        return list(self.live.values()) + list(self.retiring)

    def clear(self) -> None:
        self.live.clear()
        self.retiring.clear()
