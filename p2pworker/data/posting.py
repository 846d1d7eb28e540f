"""One piece's life with a backend: posted (or, from a same-host source, copied at once), checked until DONE or
ERR, released, or abandoned when cancelled.  :class:`PiecePosting` declares the hooks each backend implements
(NIXL, the ZMQ fallback) and the calls :class:`~p2pworker.data.pieces.PieceTransport` makes through them.
"""

from __future__ import annotations

import abc
import logging
from typing import Any

import numpy as np

from p2pworker.data import samehost
from p2pworker.data.base import PeerDataInfo, TransferStats, XferState
from p2pworker.data.peer_book import Remote
from p2pworker.data.transfer_book import Transfer

log = logging.getLogger("p2pworker.data.pieces")  # the transport's logger: its records keep their name


class PiecePosting(abc.ABC):
    backend: str
    stats: TransferStats
    _copier: samehost.Copier

    def _post(self, t: Transfer, piece: np.ndarray) -> None:
        handle = None
        source = t.peer.remote.source
        try:
            if source is not None:
                self._copier.copy(source, piece)  # every byte copied, or it raised
                state = XferState.DONE
            else:
                state, handle = self._post_piece(t, piece)
        except Exception as e:
            state = XferState.ERR
            how = "same-host copy" if source is not None else f"{self.backend} post"
            t.error = t.error or f"{how} failed: {type(e).__name__}: {e}"
        self.stats.posts += 1
        self.stats.descriptors += len(piece)
        if state is XferState.PROC:
            t.posted.append(handle)
            return
        if handle is not None:
            self._release_quiet(handle)
        if state is XferState.ERR:
            t.error = t.error or f"{self.backend} transfer state ERR"
            t.pieces.clear()

    def _abandon_quiet(self, handle: Any) -> bool:
        try:
            return self._abandon_handle(handle)
        except Exception as e:  # could not make sure: keep waiting for DONE/ERR
            log.warning("abandoning a %s transfer handle: %s", self.backend, e)
            return False

    def _release_quiet(self, handle: Any) -> None:
        try:
            self._release_handle(handle)
        except Exception as e:
            log.warning("releasing a %s transfer handle: %s", self.backend, e)

    def _check_posted(self, t: Transfer) -> None:
        still = []
        for handle in t.posted:
            try:
                state = self._check_handle(handle)
            except Exception as e:
                state = XferState.ERR
                t.error = t.error or f"{self.backend} transfer failed: {type(e).__name__}: {e}"
            if state is XferState.PROC:
                still.append(handle)
                continue
            self._release_quiet(handle)
            if state is XferState.ERR:
                t.error = t.error or f"{self.backend} transfer state ERR"
                t.pieces.clear()
        t.posted = still

    # ------------------------------------------------------------ backend hooks
    @abc.abstractmethod
    def _remote_add(self, name: str, info: PeerDataInfo) -> Any:
        """Load the remote agent ``name`` (first key naming it); return backend state for
        ``Remote.state``; raise TransferFailed (leaving nothing loaded) when it cannot be used."""

    @abc.abstractmethod
    def _remote_forget(self, remote: Remote) -> None:
        """Unload ``remote``: no key names it and nothing posted through it can still land."""

    @abc.abstractmethod
    def _post_piece(self, t: Transfer, piece: np.ndarray) -> tuple[XferState, Any]:
        """Post a READ of one piece (runs of ``(local_start, remote_start, count)``) from
        ``t.peer``; return (DONE|PROC|ERR, handle or None).  May raise."""

    @abc.abstractmethod
    def _check_handle(self, handle: Any) -> XferState: ...

    @abc.abstractmethod
    def _release_handle(self, handle: Any) -> None: ...

    def _abandon_handle(self, handle: Any) -> bool:
        """Cancel a posted piece so that nothing of it lands from now on; True when that is guaranteed.

        Then the piece counts as settled at once; the backend frees the handle
        itself (no :meth:`_release_handle` follows).  The default is False: with NIXL, releasing a handle does not
        stop the
        bytes already in flight, so a cancelled piece is waited for (DONE/ERR)
        like any other.
        """
        return False

    @abc.abstractmethod
    def _progress(self) -> None:
        """Drive the backend (and the passive side peers read from) once; never blocks."""

    @abc.abstractmethod
    def _deregister(self) -> None: ...
