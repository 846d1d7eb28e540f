"""The KV region: a file-backed shared mapping of ``num_blocks x block_bytes``.

vLLM keeps its CPU KV cache in ``/dev/shm/vllm_offload_<engine_id>.mmap`` and,
for large regions, in extra segment files (``.1``, ``.2``, ...) mapped back to
back.  The worker maps the same files, so both processes see the same physical
pages and nothing is copied between them.

Several segment files always appear as ONE contiguous virtual range here: the
whole range is reserved first, then every file is mapped over its part with
``MAP_FIXED`` (see :mod:`p2pworker.shm.vm`), so the region can be registered
with NIXL once.

A :class:`RegionHandle` names the files, their offsets and the geometry.
:attr:`KVRegion.file_ids` is what the files ARE (device and inode, from
``fstat`` of the descriptors actually mapped): a same-host peer compares
them with what it opens under the same paths (``p2pworker.data.samehost``),
because a path alone names another file in another mount namespace.  It
crosses processes as a msgpack message (:meth:`RegionHandle.encode`), never as
a pickle.  Only the process that created the files unlinks them, in
:meth:`KVRegion.close`.
"""

from __future__ import annotations

import ctypes
import os
import stat
from typing import Iterator

import msgspec
import numpy as np

from p2pworker.errors import RegionError, RegionGeometryError, RegionIdentityError
from p2pworker.shm import vm

SHM_DIR = "/dev/shm"


class Segment(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``nbytes`` of the file ``path`` starting at ``file_offset`` (page aligned)."""

    path: str
    nbytes: int
    file_offset: int = 0


class RegionHandle(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Everything another process needs to map a region: files and geometry.

    ``data_offset`` is where row 0 starts, counted from the start of the first
    segment's mapping (lets a region start inside a page-aligned mapping).
    """

    segments: tuple[Segment, ...]
    num_blocks: int
    block_bytes: int
    data_offset: int = 0

    @property
    def nbytes(self) -> int:
        """Bytes of KV data: ``num_blocks * block_bytes``."""
        return self.num_blocks * self.block_bytes

    @property
    def mapped_bytes(self) -> int:
        return sum(s.nbytes for s in self.segments)

    def validate(self) -> None:
        """Check the geometry without touching the files; raises RegionGeometryError."""
        if self.num_blocks <= 0 or self.block_bytes <= 0:
            raise RegionGeometryError(
                f"geometry must be positive: num_blocks={self.num_blocks}, block_bytes={self.block_bytes}"
            )
        if not self.segments:
            raise RegionGeometryError("a region needs at least one segment file")
        if self.data_offset < 0:
            raise RegionGeometryError(f"data_offset must be >= 0, got {self.data_offset}")
        for i, seg in enumerate(self.segments):
            if seg.nbytes <= 0 or seg.file_offset < 0 or seg.file_offset % vm.PAGE_BYTES:
                raise RegionGeometryError(
                    f"segment {i} ({seg.path}): nbytes={seg.nbytes} must be > 0 and "
                    f"file_offset={seg.file_offset} a multiple of the page size {vm.PAGE_BYTES}"
                )
            last = i == len(self.segments) - 1
            if not last and seg.nbytes % vm.PAGE_BYTES:
                raise RegionGeometryError(
                    f"segment {i} ({seg.path}) is {seg.nbytes} bytes: every segment but the last must be "
                    f"a multiple of the page size {vm.PAGE_BYTES} to map back to back"
                )
        need = self.data_offset + self.nbytes
        if self.mapped_bytes < need:
            raise RegionGeometryError(
                f"segments hold {self.mapped_bytes} bytes but the geometry needs {need} "
                f"(data_offset {self.data_offset} + {self.num_blocks} blocks x {self.block_bytes} bytes)"
            )

    def encode(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @staticmethod
    def decode(data: bytes) -> "RegionHandle":
        return msgspec.msgpack.decode(data, type=RegionHandle)


def segment_paths(path: str) -> Iterator[str]:
    """vLLM's naming: ``path``, then ``path.1``, ``path.2``, ..."""
    yield path
    i = 1
    while True:
        yield f"{path}.{i}"
        i += 1


# How we open a file another process owns (read-only maps; the same-host handover of our own files): never block
# (a FIFO), never follow a link, never take a terminal.
READONLY_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC


def file_id(fd: int) -> tuple[int, int] | None:
    """What the open file IS, (st_dev, st_ino), or None when it is not a regular file (only those are mapped)."""
    st = os.fstat(fd)
    return (st.st_dev, st.st_ino) if stat.S_ISREG(st.st_mode) else None


def _resolve(name_or_path: str) -> str:
    return name_or_path if "/" in name_or_path else f"{SHM_DIR}/{name_or_path}"


def _open_segment(i: int, seg: Segment, readonly: bool, expect_id: tuple[int, int] | None,
                  fds: list[int]) -> tuple[int, int]:
    """Open segment ``i`` (its descriptor appended to ``fds``, which the caller closes) and check it is the regular
    file ``expect_id`` names, large enough for what the handle maps; returns its identity (st_dev, st_ino)."""
    # read-only is how we open ANOTHER process's files, by paths a peer named
    flags = READONLY_OPEN_FLAGS if readonly else os.O_RDWR | os.O_CLOEXEC
    try:
        fd = os.open(seg.path, flags)
    except FileNotFoundError as e:
        raise RegionError(f"segment {i} of the region does not exist: {seg.path}") from e
    fds.append(fd)
    fid = file_id(fd)
    if fid is None:
        raise RegionIdentityError(f"segment {i} ({seg.path}) is not a regular file")
    size = os.fstat(fd).st_size
    # the identity of the descriptor we are about to map, not of a path looked up again later
    if expect_id is not None and tuple(expect_id) != fid:
        raise RegionIdentityError(
            f"segment {i} ({seg.path}) is another file here: device/inode {fid}, expected {tuple(expect_id)}"
        )
    if size < seg.file_offset + seg.nbytes:
        raise RegionGeometryError(
            f"segment {i} ({seg.path}) is {size} bytes but the handle maps "
            f"{seg.nbytes} bytes from offset {seg.file_offset}"
        )
    return fid


class KVRegion:
    """A mapped KV region.  Use :meth:`create` (owner) or :meth:`attach` / :meth:`attach_files`.

    ``address`` is row 0; rows are ``block_bytes`` apart.  Views from
    :meth:`buffer`/:meth:`array` must not be used after :meth:`close`.
    """

    def __init__(self, handle: RegionHandle, *, owner: bool, populate: bool = False, readonly: bool = False,
                 expect_ids: tuple[tuple[int, int], ...] | None = None):
        handle.validate()
        self.handle = handle
        self.owner = owner
        self.readonly = readonly
        self._closed = False
        self._reserved = vm.round_up(handle.mapped_bytes)
        fds: list[int] = []
        ids: list[tuple[int, int]] = []
        base = 0
        if expect_ids is not None and len(expect_ids) != len(handle.segments):
            raise RegionGeometryError(f"{len(expect_ids)} file identities for {len(handle.segments)} segments")
        try:
            for i, seg in enumerate(handle.segments):
                ids.append(_open_segment(i, seg, readonly, None if expect_ids is None else expect_ids[i], fds))
            base = vm.reserve(self._reserved)
            at = base
            for seg, fd in zip(handle.segments, fds):
                vm.map_file_fixed(at, seg.nbytes, fd, seg.file_offset, populate, readonly=readonly)
                at += seg.nbytes
        except BaseException:
            if base:
                vm.unmap(base, self._reserved)
            for fd in fds:
                os.close(fd)
            raise
        if readonly:
            self._fds = fds  # kept: sizes_ok() asks them (not the paths, which may name another file by then)
        else:
            self._fds = []
            for fd in fds:
                os.close(fd)  # the mappings keep the pages
        self._base = base
        self.file_ids: tuple[tuple[int, int], ...] = tuple(ids)  # (st_dev, st_ino) per segment, as mapped

    # ------------------------------------------------------------ constructors
    @classmethod
    def create(
        cls,
        name: str,
        num_blocks: int,
        block_bytes: int,
        *,
        segment_bytes: int | None = None,
        preallocate: bool = True,
    ) -> "KVRegion":
        """Create the files of a new region (in /dev/shm unless ``name`` is a path).

        ``segment_bytes`` splits the region into several files named like
        vLLM's (``name``, ``name.1``, ...).  ``preallocate`` reserves the pages
        now, so a full /dev/shm is an ``OSError`` here instead of a SIGBUS later.
        """
        path = _resolve(name)
        total = num_blocks * block_bytes
        if num_blocks <= 0 or block_bytes <= 0:
            raise RegionGeometryError(f"geometry must be positive: {num_blocks} x {block_bytes}")
        seg_bytes = total if segment_bytes is None else segment_bytes
        if seg_bytes <= 0 or (seg_bytes < total and seg_bytes % vm.PAGE_BYTES):
            raise RegionGeometryError(
                f"segment_bytes={segment_bytes} must be a positive multiple of the page size {vm.PAGE_BYTES}"
            )
        segments: list[Segment] = []
        left = total
        try:
            for seg_path in segment_paths(path):
                if left <= 0:
                    break
                n = min(seg_bytes, left)
                fd = os.open(seg_path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                segments.append(Segment(path=seg_path, nbytes=n))
                try:
                    if preallocate:
                        os.posix_fallocate(fd, 0, n)
                    else:
                        os.ftruncate(fd, n)
                finally:
                    os.close(fd)
                left -= n
            handle = RegionHandle(segments=tuple(segments), num_blocks=num_blocks, block_bytes=block_bytes)
            return cls(handle, owner=True)
        except BaseException:
            for seg in segments:
                _unlink_quiet(seg.path)
            raise

    @classmethod
    def attach(cls, handle: RegionHandle, *, populate: bool = False) -> "KVRegion":
        """Map the files a handle names (created by another process).

        ``populate`` pre-faults the page tables (the worker does: a cold region
        otherwise costs a page fault per 4 KiB page during the first transfers,
        measured here as 3x lower throughput on the first pass over 512 MiB).
        """
        return cls(handle, owner=False, populate=populate)

    @classmethod
    def attach_readonly(cls, handle: RegionHandle, expect_ids: tuple[tuple[int, int], ...]) -> "KVRegion":
        """Map another process's region read-only, only if every segment path opens the file ``expect_ids`` names
        (``RegionIdentityError`` otherwise).  Writing through it faults: this process never writes those rows."""
        return cls(handle, owner=False, readonly=True, expect_ids=expect_ids)

    @classmethod
    def attach_files(cls, name: str, num_blocks: int, block_bytes: int) -> "KVRegion":
        """Map an existing region by name, discovering segment files ``.1``, ``.2``, ..."""
        return cls(discover(name, num_blocks, block_bytes), owner=False)

    # ------------------------------------------------------------ geometry
    @property
    def address(self) -> int:
        """Virtual address of row 0 in this process."""
        self._check_open()
        return self._base + self.handle.data_offset

    @property
    def fds(self) -> tuple[int, ...]:
        """The descriptors of a read-only mapping's files, as mapped (empty for the others: closed after mapping)."""
        return tuple(self._fds)

    @property
    def num_blocks(self) -> int:
        return self.handle.num_blocks

    @property
    def block_bytes(self) -> int:
        return self.handle.block_bytes

    @property
    def nbytes(self) -> int:
        return self.handle.nbytes

    def row_address(self, row: int) -> int:
        if not 0 <= row < self.num_blocks:
            raise IndexError(f"row {row} outside 0..{self.num_blocks - 1}")
        return self.address + row * self.block_bytes

    def buffer(self) -> memoryview:
        """A byte view of the KV data (``nbytes`` long); writable unless the region is mapped read-only."""
        arr = (ctypes.c_ubyte * self.nbytes).from_address(self.address)
        view = memoryview(arr).cast("B")
        return view.toreadonly() if self.readonly else view  # a write into PROT_READ pages would be a SIGSEGV

    def array(self) -> np.ndarray:
        """The KV data as a ``(num_blocks, block_bytes)`` uint8 array (no copy)."""
        return np.frombuffer(self.buffer(), dtype=np.uint8).reshape(self.num_blocks, self.block_bytes)

    # ------------------------------------------------------------ teardown
    @property
    def closed(self) -> bool:
        """Unmapped (by :meth:`close`)."""
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise RegionError("the region is closed")

    def sizes_ok(self) -> bool:
        """Every mapped file still holds the bytes the mapping covers (read-only mappings: another process owns
        the files and could shrink one, after which touching its pages would be a SIGBUS)."""
        return all(os.fstat(fd).st_size >= seg.file_offset + seg.nbytes
                   for fd, seg in zip(self._fds, self.handle.segments))

    def close(self) -> None:
        """Unmap; the owner also unlinks the files.  Idempotent."""
        if self._closed:
            return
        self._closed = True
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        vm.unmap(self._base, self._reserved)
        if self.owner:
            for seg in self.handle.segments:
                _unlink_quiet(seg.path)

    def __enter__(self) -> "KVRegion":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        h = self.handle
        return (
            f"KVRegion({h.segments[0].path!r}, segments={len(h.segments)}, "
            f"{h.num_blocks} x {h.block_bytes} B, owner={self.owner})"
        )


def discover(name: str, num_blocks: int, block_bytes: int) -> RegionHandle:
    """A handle for the existing files ``name``, ``name.1``, ... (whole files, back to back)."""
    segments = []
    for seg_path in segment_paths(_resolve(name)):
        try:
            size = os.stat(seg_path).st_size
        except FileNotFoundError:
            break
        segments.append(Segment(path=seg_path, nbytes=size))
    if not segments:
        raise RegionError(f"no region file {_resolve(name)}")
    handle = RegionHandle(segments=tuple(segments), num_blocks=num_blocks, block_bytes=block_bytes)
    handle.validate()
    return handle


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
