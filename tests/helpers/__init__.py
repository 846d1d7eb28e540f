"""The one home of test helpers: what more than one test module uses, and the processes tests start.

    ports.py          loopback ports outside the kernel's ephemeral range
    session.py        two sans-IO sessions wired back to back (unit tests of the protocol)
    peers.py          a real control acceptor for integration tests
    fault.py          the fault suite's worker nodes, jobs, probes and figures
    vllm_engines.py   a real TieringOffloadingManager with the tier (tests/vllm)
    e2e.py            a PD pair of `vllm serve` started by scripts/pd.sh, requests, answer checks (tests/e2e)
    tiny_model.py     the tiny Llama with random weights and its tokenizer, built locally
    adapter_child.py  a process that plays vLLM's side of the rings (adapter fault tests)
    fakes/            fake engines and a fake worker port for router tests
    hosts/            two emulated hosts (network namespaces) and the agent each runs

Test modules import from here, never from one another; fixtures stay in each suite's conftest.py.  Test-only code
loaded into a worker lives in tests/hooks/ (the worker's instrument points).
"""
