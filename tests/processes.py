"""How tests start the processes that run an engine of their own (a rank, a second engine).

A fork server that has imported torch, transformers and the engine once per test process forks
each child, instead of a fresh interpreter importing them again: spawn costs a child about 4 s of
CPU on the 2-core CI machine (torch 2.6 s, transformers 1.5 s, 2026-12-03), and the suites start
dozens. The server imports modules and runs nothing, so forking it is as clean as spawning; a
child sees the environment the server started with, so a test sets what its child needs inside
the child. The daemon's own processes start as they do in production (executor/multiproc.py,
server/engine_client.py), and the tests that start `pagoda serve` or those run the same way.
"""

from __future__ import annotations

import multiprocessing

PRELOAD = [
    "torch",
    "torch.distributed",
    "transformers.models.auto.configuration_auto",
    "transformers.models.auto.tokenization_auto",
    "pagoda_daemon.llm",
    "pagoda_daemon.engine.engine_core",
    "pagoda_daemon.worker.worker",
    "benchmarks.parity",
]


def warm_start_method() -> str:
    """The start method for torch.multiprocessing's start_processes and get_context."""
    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    return "forkserver"
