"""Benchmarks and reports that run on the GPU machine or measure the engine's CPU overhead."""
