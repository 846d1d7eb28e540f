import os

import pytest

os.environ.setdefault("P2PWORKER_SECRET", "vllm-adapter-tests")


@pytest.fixture
def free_port():
    import socket

    ports = []

    def get() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
            return ports[-1]

    return get
