"""Find the shared file(s) behind an address range of this process, from /proc/self/maps.

The adapter receives vLLM's CPU KV cache as a memoryview; the worker needs the
files behind it.  vLLM maps one file, or several segment files back to back;
either way the range must be covered, without gaps, by MAP_SHARED mappings of
regular files.  Anything else (anonymous memory, a private mapping, a deleted
file) cannot be shared with another process and is refused by name.
"""

from __future__ import annotations

from typing import NamedTuple

from p2pworker.errors import RegionError
from p2pworker.shm.region import RegionHandle, Segment
from p2pworker.shm.vm import PAGE_BYTES


class Mapping(NamedTuple):
    start: int
    end: int
    perms: str
    offset: int
    path: str


def read_maps(pid: str | int = "self") -> list[Mapping]:
    out = []
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.rstrip("\n").split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            out.append(Mapping(lo, hi, parts[1], int(parts[2], 16), parts[5] if len(parts) > 5 else ""))
    return out


def handle_for_range(address: int, nbytes: int, num_blocks: int, block_bytes: int,
                     maps: list[Mapping] | None = None) -> RegionHandle:
    """A RegionHandle naming the files that back ``[address, address + nbytes)`` here."""
    if nbytes < num_blocks * block_bytes:
        raise RegionError(f"range of {nbytes} bytes is smaller than {num_blocks} x {block_bytes}")
    end = address + nbytes
    start = address - address % PAGE_BYTES
    cover = [m for m in (maps if maps is not None else read_maps()) if m.start < end and m.end > start]
    segments: list[Segment] = []
    at = start
    for m in sorted(cover):
        if m.start > at:
            raise RegionError(f"the KV range {address:#x}+{nbytes} has an unmapped gap at {at:#x}")
        what = m.path or "[anonymous]"
        if not m.path.startswith("/") or m.path.endswith(" (deleted)"):
            raise RegionError(
                f"the KV range {address:#x}+{nbytes} is backed by {what}, not a file another process can map; "
                f"p2pworker needs vLLM's CPU KV cache in /dev/shm (vllm_offload_<engine_id>.mmap)"
            )
        if "s" not in m.perms:
            raise RegionError(f"the KV range maps {m.path} privately ({m.perms}): writes would not be shared")
        lo, hi = max(m.start, at), min(m.end, end)
        off = m.offset + (lo - m.start)
        prev = segments[-1] if segments else None
        if prev is not None and prev.path == m.path and prev.file_offset + prev.nbytes == off:
            segments[-1] = Segment(prev.path, prev.nbytes + (hi - lo), prev.file_offset)  # split only by perms
        else:
            segments.append(Segment(m.path, hi - lo, off))
        at = hi
        if at >= end:
            break
    if at < end:
        raise RegionError(f"the KV range {address:#x}+{nbytes} is not fully mapped (mapped up to {at:#x})")
    handle = RegionHandle(segments=tuple(segments), num_blocks=num_blocks, block_bytes=block_bytes,
                          data_offset=address - start)
    handle.validate()
    return handle
