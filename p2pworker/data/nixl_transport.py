"""NIXL data transport: UCX backend, DRAM to DRAM, WRITE only.

What shapes it (../shared/NIXL_NOTES.md, re-measured here):

- The region is registered ONCE; every piece builds descriptor lists of
  *runs* (rows contiguous on both sides), so a transfer of k runs posts k
  descriptors, not one per row (vLLM's in-tree tier posts one per row).
- With UCX on one host (cma) ``transfer()`` copies synchronously: pieces of at
  most ``max_piece_bytes`` bound how long one post stalls the event loop.
- NIXL's progress thread spins a core when idle (the Python wrapper hard-codes
  its delay to 0), so it is disabled and :meth:`poll` drives progress,
  including for the passive target side (``get_new_notifs``).
- Errors arrive as exceptions and as the ``ERR`` state; both fail the piece's
  transfer, which is reported only once none of its pieces can still land.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from p2pworker.data.base import PeerDataInfo, XferState
from p2pworker.data.pieces import Peer, PieceTransport, Transfer
from p2pworker.errors import DataPlaneUnavailable, TransferFailed
from p2pworker.shm.region import KVRegion

log = logging.getLogger(__name__)


def import_nixl() -> tuple[Any, Any]:
    """(nixl_agent, nixl_agent_config), or DataPlaneUnavailable naming what is missing."""
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except Exception as e:  # ImportError, or a wheel whose shared library fails to load
        raise DataPlaneUnavailable(
            f"NIXL cannot be imported ({type(e).__name__}: {e}); install it with "
            f"`pip install 'nixl>=1.5,<2'`, or set the data backend to 'auto' to fall back to ZMQ"
        ) from e
    return nixl_agent, nixl_agent_config


class NixlTransport(PieceTransport):
    backend = "nixl"

    def __init__(self, region: KVRegion, *, agent_name: str, backends: tuple[str, ...] = ("UCX",), **kw: Any):
        super().__init__(region, **kw)
        nixl_agent, nixl_agent_config = import_nixl()
        try:
            agent = nixl_agent(agent_name, nixl_agent_config(enable_prog_thread=False, backends=list(backends)))
        except Exception as e:
            raise DataPlaneUnavailable(f"NIXL agent {agent_name!r} could not start: {e}") from e
        missing = [b for b in backends if b not in agent.backends]
        if missing:
            raise DataPlaneUnavailable(
                f"NIXL backend(s) {missing} could not be created (plugins found: {agent.get_plugin_list()}); "
                f"check the UCX install, or set the data backend to 'auto' to fall back to ZMQ"
            )
        self._agent = agent
        self.agent_name = agent_name
        self._reg = agent.register_memory([(region.address, region.nbytes, 0, "")], "DRAM")

    def local_info(self) -> PeerDataInfo:
        return self._info(metadata=self._agent.get_agent_metadata())

    def _remote_add(self, peer: Peer, info: PeerDataInfo) -> None:
        try:
            name = self._agent.add_remote_agent(info.metadata)
        except Exception as e:
            raise TransferFailed(f"NIXL refused peer {peer.peer_id}'s metadata: {type(e).__name__}: {e}") from e
        name = name.decode() if isinstance(name, bytes) else name
        if name != info.agent_name:
            log.warning("peer %s advertised agent %r but its metadata names %r", peer.peer_id, info.agent_name, name)
        peer.remote_name = name

    def _remote_forget(self, peer: Peer) -> None:
        self._agent.remove_remote_agent(peer.remote_name)

    def _post_piece(self, t: Transfer, piece: np.ndarray) -> tuple[XferState, Any]:
        bb = self._bb
        local = np.empty((len(piece), 3), dtype=np.uint64)
        local[:, 0] = self._region.address + piece[:, 0] * bb
        local[:, 1] = piece[:, 2] * bb
        local[:, 2] = 0
        remote = local.copy()
        remote[:, 0] = t.peer.base_address + piece[:, 1] * bb
        agent = self._agent
        handle = agent.initialize_xfer(
            "WRITE", agent.get_xfer_descs(local, "DRAM"), agent.get_xfer_descs(remote, "DRAM"), t.peer.remote_name
        )
        try:
            return XferState.from_nixl(agent.transfer(handle)), handle
        except Exception:
            self._release_quiet(handle)
            raise

    def _check_handle(self, handle: Any) -> XferState:
        return XferState.from_nixl(self._agent.check_xfer_state(handle))

    def _release_handle(self, handle: Any) -> None:
        self._agent.release_xfer_handle(handle)

    def _progress(self) -> None:
        # Also the passive target's progress: a peer writing into us needs it.
        try:
            self._agent.get_new_notifs()
        except Exception as e:
            log.debug("get_new_notifs: %s", e)

    def _deregister(self) -> None:
        if self._reg is not None:
            self._agent.deregister_memory(self._reg)
            self._reg = None
