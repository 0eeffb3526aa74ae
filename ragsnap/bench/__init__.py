"""Benchmarks behind `ragsnap bench`."""
