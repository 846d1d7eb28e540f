"""vllm_adapter: the out-of-tree vLLM secondary tier that drives a p2pworker process.

This is the only package that imports vLLM.  ``tier.P2PWorkerTier`` is the tier vLLM loads; its rooms are described
in tier.py's docstring.  supervisor.py, outbox.py, finished.py, roles.py and metrics.py import no vLLM at module
level, so their unit tests run in the worker suite's environment.
"""
