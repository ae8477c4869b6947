"""Benchmarks and stress runs; not part of the test suite (each has a smoke test there)."""
