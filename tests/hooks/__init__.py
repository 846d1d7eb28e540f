"""Test code the spawned worker loads through its one documented hook ($P2PWORKER_HOOK=module:function, see
p2pworker.worker.install_hook): never part of the installed package."""
