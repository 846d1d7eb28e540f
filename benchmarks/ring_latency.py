#!/usr/bin/env python3
"""Ring round-trip latency vs multiprocessing.Queue and ZMQ ipc PAIR (one JSON line each).

    python benchmarks/ring_latency.py [-n 20000]
"""

import sys

from p2pworker.bench.ring_latency import main

if __name__ == "__main__":
    sys.exit(main())
