"""Benchmarks: each module is a command writing JSON to bench/results/."""
