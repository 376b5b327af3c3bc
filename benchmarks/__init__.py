"""Benchmarks and the GPU-machine script: tools, not part of any installed package.

Run from the repository root: ``python -m benchmarks.throughput ...``, ``python -m
benchmarks.kernels``, ``python -m benchmarks.parity``, ``python -m benchmarks.step_overhead``,
``bash benchmarks/run_gpu.sh``. Results are recorded in docs/benchmarks/.
"""
