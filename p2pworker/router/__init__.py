"""The router (`p2pworker router`): prefill then decode over several instances of each (PD), or one instance per
request (aggregated); docs/router.md."""
