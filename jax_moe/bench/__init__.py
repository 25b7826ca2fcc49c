"""Benchmarks: `python -m jax_moe.bench {moe,fabric} ...`."""
