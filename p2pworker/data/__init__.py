"""Data plane: the consumer reads a peer's KV rows into its own rows.  NIXL (UCX, DRAM) or a ZMQ fallback."""

from __future__ import annotations

import logging
from typing import Any

from p2pworker.data.base import DataTransport, PeerDataInfo, XferState, coalesce
from p2pworker.errors import DataPlaneUnavailable
from p2pworker.shm.region import KVRegion

log = logging.getLogger(__name__)

BACKENDS = ("auto", "nixl", "zmq")


def make_data_transport(
    region: KVRegion, *, backend: str = "auto", agent_name: str, host: str = "127.0.0.1", **kw: Any
) -> DataTransport:
    """The data transport ``backend`` names.

    ``nixl`` fails fast with ``DataPlaneUnavailable`` naming the cause and the
    remedy (library missing, backend not created, region not registered, e.g.
    RLIMIT_MEMLOCK too low); ``auto`` tries NIXL and, if it cannot run here,
    logs that warning and uses the ZMQ fallback; ``zmq`` uses the fallback
    directly.
    """
    from p2pworker.data.zmq_transport import ZmqTransport

    if backend not in BACKENDS:
        raise ValueError(f"data backend must be one of {BACKENDS}, got {backend!r}")
    if backend in ("nixl", "auto"):
        from p2pworker.data.nixl_transport import NixlTransport

        try:
            return NixlTransport(region, agent_name=agent_name, **kw)
        except DataPlaneUnavailable as e:
            if backend == "nixl":
                raise
            log.warning("%s -- using the ZMQ fallback data transport (slower, same bytes)", e)
    return ZmqTransport(region, agent_name=agent_name, host=host, **kw)


__all__ = ["DataTransport", "PeerDataInfo", "XferState", "coalesce", "make_data_transport", "DataPlaneUnavailable"]
