"""Benchmarks (not part of the installed package): `python -m bench.serving`."""
