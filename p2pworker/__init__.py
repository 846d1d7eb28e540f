"""p2pworker: a peer-to-peer KV-cache tier for vLLM with an out-of-process transfer worker.

This package is importable without vLLM or torch; NIXL is imported lazily by the
data plane only.
"""

__version__ = "0.1.0"
