"""NIXL data transport: UCX backend, DRAM to DRAM; the consumer READs the producer's rows.

What shapes it (measured here):

- Pull: ``initialize_xfer("READ", local, remote, name)`` copies the peer's
  rows into ours, so only this process ever writes our region (invariant 7).
  On one host (cma) READ costs what WRITE costs; over TCP the passive side
  must drive UCX's emulation of the one-sided READ, which is why
  :meth:`_progress` polls ``get_new_notifs`` even when we post nothing.
- The region is registered ONCE (and the agent metadata fetched once) at
  construction, so a registration failure (e.g. RLIMIT_MEMLOCK too low) shows
  there as ``DataPlaneUnavailable``, never later inside a transfer.  Every
  piece builds descriptor lists of *runs* (rows contiguous on both sides), so
  a transfer of k runs posts k descriptors, not one per row (vLLM's in-tree
  tier posts one per row).
- A remote agent is loaded once per agent name, however many peer keys name
  it: NIXL refuses ``add_remote_agent`` for a name it already holds
  (``nixlNotAllowedError``).  :class:`~p2pworker.data.pieces.PieceTransport`
  keeps the reference count.
- With UCX on one host (cma) ``transfer()`` copies synchronously: pieces of at
  most ``max_piece_bytes`` bound how long one post stalls the event loop.
- NIXL's progress thread spins a core when idle (the Python wrapper hard-codes
  its delay to 0), so it is disabled and :meth:`poll` drives progress.
- Errors arrive as exceptions and as the ``ERR`` state; both fail the piece's
  transfer, which is reported only once none of its pieces can still land.
  Releasing a handle does not stop bytes already in flight, so a cancelled
  piece is still waited for (no ``_abandon_handle``).
"""

from __future__ import annotations

import importlib
import logging
import resource
from typing import Any

import numpy as np

from p2pworker.data.base import PeerDataInfo, XferState
from p2pworker.data.pieces import PieceTransport, Remote, Transfer
from p2pworker.errors import DataPlaneUnavailable, TransferFailed
from p2pworker.shm.region import KVRegion

log = logging.getLogger(__name__)

_FALLBACK = "or set the data backend to 'auto' to fall back to ZMQ"


# Where NIXL's Python API may live: the `nixl` meta package (pulls both CUDA builds and picks one by the CUDA
# major it detects), or one CUDA build alone (`pip install 'p2pworker[cu12]'` / `[cu13]`), whose module is
# nixl_cu12 / nixl_cu13.  We register DRAM only (the CPU tier's region), which either build serves.
NIXL_MODULES = ("nixl._api", "nixl_cu13._api", "nixl_cu12._api")


def import_nixl() -> tuple[Any, Any]:
    """(nixl_agent, nixl_agent_config) from the first of NIXL_MODULES that imports, or DataPlaneUnavailable
    naming what each attempt said."""
    tried = []
    for name in NIXL_MODULES:
        try:
            mod = importlib.import_module(name)
        except Exception as e:  # ImportError, or a wheel whose shared library fails to load
            tried.append(f"{name}: {type(e).__name__}: {e}")
            continue
        log.debug("NIXL from %s", name)
        return mod.nixl_agent, mod.nixl_agent_config
    raise DataPlaneUnavailable(
        f"NIXL cannot be imported ({'; '.join(tried)}); install the build for your CUDA major with "
        f"`pip install 'p2pworker[cu12]'` or `pip install 'p2pworker[cu13]'` (either works without a GPU), "
        f"{_FALLBACK}")


def _memlock_limit() -> str:
    """RLIMIT_MEMLOCK in words: the usual reason a DRAM registration fails."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    except (ValueError, OSError):
        return "unknown"
    words = lambda v: "unlimited" if v == resource.RLIM_INFINITY else f"{v} bytes"  # noqa: E731
    return f"soft {words(soft)}, hard {words(hard)}"


class NixlTransport(PieceTransport):
    backend = "nixl"

    def __init__(self, region: KVRegion, *, agent_name: str, backends: tuple[str, ...] = ("UCX",), **kw: Any):
        super().__init__(region, **kw)
        nixl_agent, nixl_agent_config = import_nixl()
        try:
            agent = nixl_agent(agent_name, nixl_agent_config(enable_prog_thread=False, backends=list(backends)))
        except Exception as e:
            raise DataPlaneUnavailable(
                f"NIXL agent {agent_name!r} could not start ({type(e).__name__}: {e}); "
                f"check the NIXL/UCX install, {_FALLBACK}"
            ) from e
        missing = [b for b in backends if b not in agent.backends]
        if missing:
            raise DataPlaneUnavailable(
                f"NIXL backend(s) {missing} could not be created (plugins found: {agent.get_plugin_list()}); "
                f"check the UCX install, {_FALLBACK}"
            )
        self._agent = agent
        self.agent_name = agent_name
        try:
            self._reg = agent.register_memory([(region.address, region.nbytes, 0, "")], "DRAM")
        except Exception as e:
            raise DataPlaneUnavailable(
                f"NIXL could not register the KV region ({region.nbytes} bytes at 0x{region.address:x}): "
                f"{type(e).__name__}: {e} (RLIMIT_MEMLOCK: {_memlock_limit()}); raise the memlock limit "
                f"(ulimit -l, or the container's memlock ulimit), {_FALLBACK}"
            ) from e
        try:
            # Once, here: a failure must show at construction, and every peer gets the same bytes
            # (PieceTransport compares them to tell a second link from a restarted peer).
            self._metadata = agent.get_agent_metadata()
        except Exception as e:
            try:
                self._deregister()  # nothing was posted: safe, and nothing else would ever undo it
            except Exception as e2:
                log.warning("deregistering after a failed start: %s", e2)
            raise DataPlaneUnavailable(
                f"NIXL agent {agent_name!r} could not produce its metadata: {type(e).__name__}: {e}; "
                f"check the UCX install, {_FALLBACK}"
            ) from e

    def local_info(self) -> PeerDataInfo:
        return self._info(metadata=self._metadata)

    def _remote_add(self, name: str, info: PeerDataInfo) -> Any:
        try:
            loaded = self._agent.add_remote_agent(info.metadata)
        except Exception as e:
            raise TransferFailed(f"NIXL refused the metadata of agent {name!r}: {type(e).__name__}: {e}") from e
        loaded = loaded.decode() if isinstance(loaded, bytes) else loaded
        if loaded != name:
            # The reference count is keyed by the advertised name; a remote loaded under another
            # name could never be removed at the right time.
            try:
                self._agent.remove_remote_agent(loaded)
            except Exception as e:
                log.debug("removing mislabelled remote agent %s: %s", loaded, e)
            raise TransferFailed(f"peer advertised agent {name!r} but its NIXL metadata names {loaded!r}")
        return None

    def _remote_forget(self, remote: Remote) -> None:
        self._agent.remove_remote_agent(remote.name)

    def _post_piece(self, t: Transfer, piece: np.ndarray) -> tuple[XferState, Any]:
        bb = self._bb
        local = np.empty((len(piece), 3), dtype=np.uint64)
        local[:, 0] = self._region.address + piece[:, 0] * bb
        local[:, 1] = piece[:, 2] * bb
        local[:, 2] = 0
        remote = local.copy()
        remote[:, 0] = t.peer.base_address + piece[:, 1] * bb
        agent = self._agent
        # Row writes (invariant 7): this READ writes OUR rows (local), copied by THIS process (UCX cma/TCP in our
        # worker); nothing ever writes into a peer.  Can a byte land after its job was reported?  No: the transfer
        # is reported only once no piece is posted (PieceTransport._settle), and the session reports the load only
        # after every transfer it posted was reported; a posted read that never settles makes the worker exit.
        handle = agent.initialize_xfer(
            "READ", agent.get_xfer_descs(local, "DRAM"), agent.get_xfer_descs(remote, "DRAM"), t.peer.remote.name
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
        # Also the passive side's progress: over TCP, UCX emulates a peer's READ of our rows
        # with messages that only our own calls into the worker move along.
        try:
            self._agent.get_new_notifs()
        except Exception as e:
            log.debug("get_new_notifs: %s", e)

    def _deregister(self) -> None:
        if self._reg is not None:
            reg, self._reg = self._reg, None
            self._agent.deregister_memory(reg)
