#!/usr/bin/env python3
"""Data-plane read (pull) throughput: raw NIXL vs our NIXL transport vs ZMQ fallback vs memcpy (JSON lines).

    python benchmarks/data_throughput.py [--block-bytes 16384 262144] [--blocks 64 512] [--reps 11] [--batch-mib 32]
"""

import sys

from p2pworker.bench.data_throughput import main

if __name__ == "__main__":
    sys.exit(main())
