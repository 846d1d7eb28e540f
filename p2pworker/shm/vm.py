"""Thin ctypes wrappers over mmap(2)/munmap(2) for fixed-address mappings.

Python's ``mmap`` module cannot place a mapping at a chosen address, which is
what mapping several segment files back to back into ONE contiguous virtual
range needs: reserve the whole range with an inaccessible anonymous mapping,
then map each file over its part with ``MAP_FIXED``.
"""

from __future__ import annotations

import ctypes
import mmap
import os

import numpy as np

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]

PAGE_BYTES = mmap.PAGESIZE
MAP_FAILED = ctypes.c_void_p(-1).value
MAP_FIXED = 0x10
MAP_NORESERVE = 0x4000
MAP_POPULATE = 0x8000
PROT_NONE = 0
PROT_RW = mmap.PROT_READ | mmap.PROT_WRITE


def _check(addr: int | None, what: str) -> int:
    if addr is None or addr == MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return addr


def reserve(nbytes: int) -> int:
    """Reserve ``nbytes`` of address space (no memory, no access); returns its address."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE
    return _check(_libc.mmap(None, nbytes, PROT_NONE, flags, -1, 0), f"reserve {nbytes} bytes")


def map_file_fixed(addr: int, nbytes: int, fd: int, file_offset: int, populate: bool = False,
                   readonly: bool = False) -> None:
    """Map ``nbytes`` of ``fd`` from ``file_offset`` shared, exactly at ``addr``; read-write unless ``readonly``.

    ``populate`` pre-faults the page tables now (MAP_POPULATE), so the first
    transfers into the range do not pay a page fault per page.
    """
    flags = mmap.MAP_SHARED | MAP_FIXED | (MAP_POPULATE if populate else 0)
    got = _check(
        _libc.mmap(addr, nbytes, mmap.PROT_READ if readonly else PROT_RW, flags, fd, file_offset),
        f"map {nbytes} bytes of fd {fd} at {addr:#x}",
    )
    if got != addr:  # pragma: no cover - MAP_FIXED either succeeds at addr or fails
        raise OSError(f"mmap placed the segment at {got:#x}, not {addr:#x}")


def unmap(addr: int, nbytes: int) -> None:
    if _libc.munmap(addr, nbytes) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"munmap {addr:#x}+{nbytes}: {os.strerror(err)}")


def round_up(nbytes: int, align: int = PAGE_BYTES) -> int:
    return (nbytes + align - 1) // align * align


_libc.madvise.restype = ctypes.c_int
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mincore.restype = ctypes.c_int
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
# Linux 5.14+: fault the range's page tables in now, as reads would, without reading.  Where a read would raise
# SIGBUS (a file shrunk under the mapping) the call fails with EFAULT instead: safe on another process's file.
MADV_POPULATE_READ = 22


def populate_read(addr: int, nbytes: int) -> int:
    """Pre-fault ``[addr, addr + nbytes)`` for reading; 0, or the errno (EINVAL: a kernel before 5.14)."""
    # ctypes drops the GIL for the call: the event loop runs on while a background thread sits in here.
    return 0 if _libc.madvise(addr, nbytes, MADV_POPULATE_READ) == 0 else ctypes.get_errno()


def resident(addr: int, nbytes: int):
    """Which pages of ``[addr, addr + nbytes)`` (page-aligned) are in memory (mincore): a numpy bool per page.
    For a file mapping that is the file's page cache, so a hole of a sparse file reads False."""
    vec = np.zeros(-(-nbytes // PAGE_BYTES), dtype=np.uint8)
    if _libc.mincore(addr, nbytes, vec.ctypes.data) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mincore {addr:#x}+{nbytes}: {os.strerror(err)}")
    return (vec & 1).astype(bool)
