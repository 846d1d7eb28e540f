"""Remove /dev/shm entries left by a crashed owner (rings, bells, region files)."""

from __future__ import annotations

import os

SHM_DIR = "/dev/shm"


def leftovers(prefix: str, directory: str = SHM_DIR) -> list[str]:
    """Entries of ``directory`` whose name starts with ``prefix`` (sorted paths)."""
    if not prefix:
        raise ValueError("refusing to match every file: give a non-empty prefix")
    return sorted(os.path.join(directory, n) for n in os.listdir(directory) if n.startswith(prefix))


def sweep(prefix: str, directory: str = SHM_DIR) -> list[str]:
    """Unlink every entry :func:`leftovers` finds; returns what was removed."""
    removed = []
    for path in leftovers(prefix, directory):
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed
