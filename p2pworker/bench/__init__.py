"""Measurement code shared by ``benchmarks/`` scripts and the CLI.  Not tests."""
