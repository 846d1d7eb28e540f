"""Shared-memory plane: the KV region both processes map, and the SPSC rings between them."""

from p2pworker.shm.region import KVRegion, RegionHandle, Segment, discover
from p2pworker.shm.ring import Ring, Role

__all__ = ["KVRegion", "RegionHandle", "Segment", "discover", "Ring", "Role"]
