"""vllm_adapter: the out-of-tree vLLM secondary tier that drives a p2pworker process.

This is the only package that imports vLLM.  The tier class lands with the
adapter issue; until then the package holds nothing but this docstring.
"""
