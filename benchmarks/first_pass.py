"""The first pass over a same-host producer's region, with and without [data] prefault_peers.

    .venv/bin/python benchmarks/first_pass.py [--rounds 3] [--mib 1024] [--block-kib 256] [--blocks 64]

``PDRig`` (two workers on loopback, the same-host path and its lane), a producer region of ``--mib``: one warm-up
request (session, handover, lane; the pre-fault walk starts here), a 1 s pause, then one request at a time over
every source slot of the region once ("first pass": pages never copied from before) and then once more ("second
pass": every page mapped by then, whatever the setting).  Per round both arms in a fresh rig each, the order
flipped every round; medians of the rounds' p50 and the median of the paired first-pass ratios (off / on).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from p2pworker.bench.pd import PDRig  # noqa: E402


class _Slots:
    """Stands in for the rig's rng: contiguous source slots in the order given."""

    def __init__(self, order):
        self._it = iter(order)

    def integers(self, n: int) -> int:
        return next(self._it)


def one(prefault: bool, mib: int, block_bytes: int, blocks: int) -> tuple[float, float]:
    n = (mib << 20) // block_bytes
    slots = n // blocks
    settings = json.dumps({"data": {"prefault_peers": prefault}})
    with PDRig(n, block_bytes, worker_args=["--settings-json", settings]) as rig:
        rig.rng = _Slots(itertools.chain([slots - 1], range(slots - 1), range(slots - 1), range(4)))
        warm = rig.run(1, blocks, inflight=1, contiguous=True, verify=True)
        time.sleep(1.0)
        # unverified: a 16 MiB comparison between requests would let the workers fall asleep before the next one
        first = rig.run(slots - 1, blocks, inflight=1, contiguous=True, verify=False)
        second = rig.run(slots - 1, blocks, inflight=1, contiguous=True, verify=False)
        check = rig.run(4, blocks, inflight=1, contiguous=True, verify=True)
    for r in (warm, first, second, check):
        if r.failures or r.mismatches:
            raise SystemExit(f"failures: {r.failures[:3]}, mismatches: {r.mismatches}")
    return first.latency_ms(0.5), second.latency_ms(0.5)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--block-kib", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=64)
    args = ap.parse_args()
    got: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for r in range(args.rounds):
        for arm in ((True, False) if r % 2 == 0 else (False, True)):
            got[arm].append(one(arm, args.mib, args.block_kib << 10, args.blocks))
            print(f"round {r} prefault {'on' if arm else 'off'}: first pass p50 {got[arm][-1][0]:.2f} ms, "
                  f"second pass p50 {got[arm][-1][1]:.2f} ms", file=sys.stderr, flush=True)
    med = {arm: [statistics.median(x[i] for x in got[arm]) for i in (0, 1)] for arm in got}
    paired = statistics.median(off[0] / on[0] for on, off in zip(got[True], got[False]))
    req = f"{args.block_kib} KiB x {args.blocks}"
    for arm in (False, True):
        print(f"{req}, prefault {'on ' if arm else 'off'}: first pass p50 {med[arm][0]:.2f} ms, "
              f"second pass p50 {med[arm][1]:.2f} ms")
    print(f"first pass off / on (paired, median of {args.rounds}): {paired:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
