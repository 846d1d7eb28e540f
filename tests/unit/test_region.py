"""KV region: creation, geometry validation, handles, multi-segment contiguity, ownership."""

from __future__ import annotations

import os

import msgspec
import numpy as np
import pytest

from p2pworker.errors import RegionError, RegionGeometryError
from p2pworker.shm import KVRegion, RegionHandle, Segment, discover
from p2pworker.shm.vm import PAGE_BYTES


def _maps_for(addr: int, nbytes: int) -> list[tuple[int, int, str]]:
    """(start, end, path) of every /proc/self/maps line overlapping [addr, addr+nbytes)."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo < addr + nbytes and hi > addr:
                out.append((lo, hi, parts[5] if len(parts) > 5 else ""))
    return sorted(out)


def test_single_segment_roundtrip(shm_prefix):
    with KVRegion.create(shm_prefix + "kv", 16, 4096) as reg:
        arr = reg.array()
        assert arr.shape == (16, 4096)
        arr[3] = 0xAB
        with open(reg.handle.segments[0].path, "rb") as f:
            f.seek(3 * 4096)
            assert f.read(4096) == b"\xab" * 4096
        assert reg.row_address(3) == reg.address + 3 * 4096
        with pytest.raises(IndexError):
            reg.row_address(16)
        del arr


def test_multi_segment_is_one_contiguous_range(shm_prefix):
    # 5 blocks of 3 pages over segments of 4 pages: blocks straddle file boundaries.
    block = 3 * PAGE_BYTES
    with KVRegion.create(shm_prefix + "kv", 5, block, segment_bytes=4 * PAGE_BYTES) as reg:
        segs = reg.handle.segments
        assert [s.path for s in segs] == [segs[0].path] + [f"{segs[0].path}.{i}" for i in range(1, 4)]
        assert sum(s.nbytes for s in segs) == 5 * block
        arr = reg.array()
        rng = np.random.default_rng(1)
        data = rng.integers(0, 256, size=arr.shape, dtype=np.uint8)
        arr[:] = data
        # The files, concatenated in order, hold exactly the rows: the range is contiguous.
        on_disk = b"".join(open(s.path, "rb").read() for s in segs)
        assert on_disk == data.tobytes()
        maps = _maps_for(reg.address, reg.nbytes)
        assert maps[0][0] <= reg.address and maps[-1][1] >= reg.address + reg.nbytes
        assert all(a[1] == b[0] for a, b in zip(maps, maps[1:])), f"gaps in {maps}"
        assert [m[2] for m in maps] == [s.path for s in segs]
        del arr


def test_handle_crosses_as_msgpack_not_pickle(shm_prefix):
    with KVRegion.create(shm_prefix + "kv", 4, 8192, segment_bytes=2 * 8192) as reg:
        wire = reg.handle.encode()
        assert isinstance(wire, bytes) and b"\x80\x04" not in wire[:2]  # not a pickle header
        assert RegionHandle.decode(wire) == reg.handle
        with pytest.raises(msgspec.ValidationError):
            RegionHandle.decode(msgspec.msgpack.encode({"segments": [], "num_blocks": "x", "block_bytes": 1}))
        with pytest.raises(msgspec.ValidationError):
            RegionHandle.decode(
                msgspec.msgpack.encode({"segments": [], "num_blocks": 1, "block_bytes": 1, "evil": 1})
            )


def test_attach_by_name_discovers_segments_and_sees_same_bytes(shm_prefix):
    with KVRegion.create(shm_prefix + "kv", 6, 8192, segment_bytes=4 * 8192) as owner:
        handle = discover(shm_prefix + "kv", 6, 8192)
        assert len(handle.segments) == 2
        with KVRegion.attach_files(shm_prefix + "kv", 6, 8192) as other:
            assert not other.owner
            assert other.address != owner.address
            owner.array()[5, :8] = np.arange(8, dtype=np.uint8)
            assert list(other.array()[5, :8]) == list(range(8))
        # a non-owner close does not unlink
        assert all(os.path.exists(s.path) for s in owner.handle.segments)
    assert not any(os.path.exists(s.path) for s in owner.handle.segments)


def test_geometry_is_validated_against_file_size(shm_prefix):
    with KVRegion.create(shm_prefix + "kv", 4, 4096):
        with pytest.raises(RegionGeometryError) as ei:
            KVRegion.attach_files(shm_prefix + "kv", 5, 4096)
        assert "16384" in str(ei.value) and "20480" in str(ei.value)  # both values named
        bad = RegionHandle(
            segments=(Segment(path=f"/dev/shm/{shm_prefix}kv", nbytes=8192, file_offset=12288),),
            num_blocks=2,
            block_bytes=4096,
        )
        with pytest.raises(RegionGeometryError, match="16384 bytes"):
            KVRegion.attach(bad)


@pytest.mark.parametrize(
    "handle, match",
    [
        (RegionHandle(segments=(), num_blocks=1, block_bytes=1), "at least one segment"),
        (RegionHandle(segments=(Segment("/x", 4096),), num_blocks=0, block_bytes=1), "positive"),
        (RegionHandle(segments=(Segment("/x", 4096, file_offset=100),), num_blocks=1, block_bytes=1), "page size"),
        (
            RegionHandle(segments=(Segment("/x", 1000), Segment("/y", 4096)), num_blocks=1, block_bytes=1),
            "back to back",
        ),
        (RegionHandle(segments=(Segment("/x", 4096),), num_blocks=2, block_bytes=4096), "needs 8192"),
        (
            RegionHandle(segments=(Segment("/x", 4096),), num_blocks=1, block_bytes=4096, data_offset=1),
            "needs 4097",
        ),
    ],
)
def test_handle_validation(handle, match):
    with pytest.raises(RegionGeometryError, match=match):
        handle.validate()


def test_data_offset_shifts_row_zero(shm_prefix):
    with KVRegion.create(shm_prefix + "kv", 3, 4096) as owner:
        h = owner.handle
        shifted = RegionHandle(segments=h.segments, num_blocks=2, block_bytes=4096, data_offset=4096)
        with KVRegion.attach(shifted) as view:
            owner.array()[1, 0] = 77
            assert view.array()[0, 0] == 77


def test_missing_file_and_existing_name(shm_prefix):
    with pytest.raises(RegionError, match="no region file"):
        KVRegion.attach_files(shm_prefix + "missing", 1, 4096)
    with KVRegion.create(shm_prefix + "kv", 1, 4096):
        with pytest.raises(FileExistsError):
            KVRegion.create(shm_prefix + "kv", 1, 4096)


def test_close_is_idempotent_and_blocks_use(shm_prefix):
    reg = KVRegion.create(shm_prefix + "kv", 2, 4096, segment_bytes=4096)
    reg.close()
    reg.close()
    with pytest.raises(RegionError, match="closed"):
        reg.address
