"""The PD router (`p2pworker router`): prefill then decode, over several instances of each."""
