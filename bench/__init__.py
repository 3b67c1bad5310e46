"""Benchmarks for attn-parity. ``python -m bench.attention --help``."""
