"""Child-process roles for multiprocess tests (importable by spawned children)."""

from __future__ import annotations

import os
import queue
import time

import msgspec
import numpy as np


def region_bytes(seed: int, num_blocks: int, block_bytes: int) -> np.ndarray:
    """Seeded content for a ``num_blocks x block_bytes`` region: no two rows alike, cheap to make."""
    tile = np.frombuffer(np.random.default_rng(seed).bytes(1_000_003), dtype=np.uint8)  # prime: rows differ
    return np.resize(tile, num_blocks * block_bytes).reshape(num_blocks, block_bytes)


def data_peer(backend: str, name: str, num_blocks: int, block_bytes: int, q_out, q_in, seed: int = 0) -> None:
    """A passive producer: fills its region with ``region_bytes(seed, ...)``, publishes its
    PeerDataInfo, makes progress (serves reads), answers commands.  ``backend`` "same_host": NIXL, and the
    region file offered to same-host peers.

    Commands on ``q_in``: ("dump",) -> region bytes on ``q_out``; ("exit",).
    """
    from p2pworker.data import make_data_transport
    from p2pworker.shm import KVRegion

    with KVRegion.create(name, num_blocks, block_bytes) as reg:
        arr = reg.array()
        arr[:] = region_bytes(seed, num_blocks, block_bytes)
        del arr
        tr = make_data_transport(reg, backend="nixl" if backend == "same_host" else backend,
                                 agent_name=f"peer-{os.getpid()}-{time.monotonic_ns()}",
                                 same_host=backend == "same_host")
        q_out.put(msgspec.msgpack.encode(tr.local_info()))
        try:
            while True:
                tr.poll()
                try:
                    cmd = q_in.get(timeout=0.001)
                except queue.Empty:
                    continue
                if cmd[0] == "dump":
                    arr = reg.array()
                    q_out.put(arr.tobytes())
                    del arr
                elif cmd[0] == "exit":
                    break
        finally:
            ok = tr.close()
        if not ok:
            os._exit(9)


def control_acceptor(port: int, secret: str, node_id: str, interval_s: float, q_out) -> None:
    """A control endpoint that echoes every payload back, until killed or told b"exit"."""
    from p2pworker.control import ControlConfig, Received, ZmqControl

    ctl = ZmqControl(
        ControlConfig(port=port, secret=secret, heartbeat_interval_s=interval_s, heartbeat_liveness=3),
        node_id=node_id,
    )
    q_out.put(ctl.address)
    try:
        while True:
            for ev in ctl.poll(50):
                if isinstance(ev, Received):
                    if ev.payload == b"exit":
                        return
                    ctl.send(ev.link, b"echo:" + ev.payload)
    finally:
        ctl.close()


def random_rows(rng: np.random.Generator, n: int, num_blocks: int, run_len: int = 4) -> np.ndarray:
    """``n`` distinct rows in shuffled runs of up to ``run_len`` contiguous rows."""
    starts = rng.permutation(num_blocks // run_len)[: (n + run_len - 1) // run_len] * run_len
    rows = np.concatenate([np.arange(s, s + run_len) for s in starts])[:n]
    return rows
