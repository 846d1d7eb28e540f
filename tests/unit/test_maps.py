"""Recovering the shared files behind an address range (what the adapter does with vLLM's KV view)."""

from __future__ import annotations

import mmap

import numpy as np
import pytest

from p2pworker.errors import RegionError
from p2pworker.shm import KVRegion
from p2pworker.shm.maps import Mapping, handle_for_range


def test_single_and_multi_segment_regions_are_recovered(shm_prefix):
    for seg in (None, 3 * 4096):
        name = f"{shm_prefix}kv{seg}"
        with KVRegion.create(name, 10, 4096, segment_bytes=seg) as reg:
            h = handle_for_range(reg.address, reg.nbytes, 10, 4096)
            assert [s.path for s in h.segments] == [s.path for s in reg.handle.segments]
            assert [s.nbytes for s in h.segments] == [s.nbytes for s in reg.handle.segments]
            with KVRegion.attach(h) as other:  # the recovered handle maps the same bytes
                reg.array()[9, -1] = 42
                assert other.array()[9, -1] == 42


def test_a_range_starting_inside_the_mapping(shm_prefix):
    with KVRegion.create(shm_prefix + "kv", 8, 4096) as reg:
        addr = reg.address + 2 * 4096 + 100  # not page aligned
        h = handle_for_range(addr, 4 * 1000, 4, 1000)
        assert h.data_offset == 100 and h.segments[0].file_offset == 2 * 4096
        with KVRegion.attach(h) as view:
            reg.buffer()[2 * 4096 + 100] = 7
            assert view.array()[0, 0] == 7


def test_anonymous_and_private_memory_are_refused_by_name(tmp_path):
    arr = np.zeros(1 << 20, dtype=np.uint8)
    with pytest.raises(RegionError, match="not a file another process can map"):
        handle_for_range(arr.ctypes.data, arr.nbytes, 256, 4096)
    p = tmp_path / "private"
    p.write_bytes(b"\0" * 8192)
    with open(p, "r+b") as f, mmap.mmap(f.fileno(), 8192, flags=mmap.MAP_PRIVATE) as mm:
        buf = np.frombuffer(mm, dtype=np.uint8)
        with pytest.raises(RegionError, match="privately"):
            handle_for_range(buf.ctypes.data, 8192, 2, 4096)
        del buf


def test_gaps_and_short_coverage_are_refused():
    maps = [Mapping(0x1000, 0x3000, "rw-s", 0, "/dev/shm/a"), Mapping(0x4000, 0x5000, "rw-s", 0, "/dev/shm/b")]
    with pytest.raises(RegionError, match="gap at 0x3000"):
        handle_for_range(0x1000, 0x4000, 4, 0x1000, maps)
    with pytest.raises(RegionError, match="not fully mapped"):
        handle_for_range(0x1000, 0x2800, 2, 0x1000, maps[:1] + [Mapping(0x3000, 0x3400, "rw-s", 0, "/dev/shm/c")])
    deleted = [Mapping(0x1000, 0x3000, "rw-s", 0, "/dev/shm/a (deleted)")]
    with pytest.raises(RegionError, match="deleted"):
        handle_for_range(0x1000, 0x2000, 2, 0x1000, deleted)
