import os

os.environ.setdefault("P2PWORKER_SECRET", "vllm-adapter-tests")
