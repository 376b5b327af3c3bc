"""The seam between the engine core and its workers.

The core schedules; an Executor carries each step to every worker and hands back one
launched step whose ``result()`` gives the sampled tokens. One in-process worker today
(``UniProcExecutor``), or one per tensor-parallel rank with ranks 1..N-1 in processes of their
own (``MultiprocExecutor``). vLLM's ``v1/executor/abstract.py`` is the model.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

    from pagoda_daemon.distributed.lockstep import Lockstep
    from pagoda_daemon.engine.request import Request
    from pagoda_daemon.engine.scheduler_output import GrammarBitmask, SchedulerOutput
    from pagoda_daemon.executor.resize import Outcome
    from pagoda_daemon.worker.model_runner import LaunchedStep
    from pagoda_daemon.worker.worker import WorkerInfo


class Executor(ABC):
    @abstractmethod
    def available_kv_blocks(self) -> int:
        """The KV blocks every worker can hold (the smallest, so one block table fits all)."""

    @abstractmethod
    def initialize_cache(self, num_blocks: int) -> None:
        """Allocate num_blocks KV blocks on every worker and capture their graphs."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> LaunchedStep | None:
        """Launch one step on every worker; the returned step's ``result()`` waits for it. None
        when the step has constrained rows: the forward pass is launched and the workers wait
        for ``sample_tokens`` (vLLM's execute_model / sample_tokens split)."""

    @abstractmethod
    def sample_tokens(self, grammar: GrammarBitmask) -> LaunchedStep:
        """Sample the step ``execute_model`` left waiting, under the grammar masks."""

    @abstractmethod
    def info(self) -> WorkerInfo:
        """The driver worker's device, dtype and placement."""

    @abstractmethod
    def synchronize(self) -> None:
        """Wait until every worker's device is idle."""

    def balancer(self):
        """Rank 0's expert balancer (EPLB), or None: every rank's is the replica's (the same
        rebalances and placement), reported once. With the experts spread over data-parallel
        engines the ranks are the engines, and only the first reports it."""
        worker = getattr(self, "worker", None)
        balancer = getattr(worker, "balancer", None)
        return balancer if balancer is not None and worker.tp.rank == 0 else None

    def lockstep(self) -> Lockstep | None:
        """With data-parallel attention, this engine's per-step agreement with the others
        (distributed/lockstep.py; its one in-process worker holds it), else None."""
        return getattr(getattr(self, "worker", None), "lockstep", None)

    def take_staged_kv(self) -> list[tuple[bytes, bool]]:
        """The disk blocks of the KV offload tiers that every rank has read into host memory
        since the last call (its in-process worker is rank 0, whose answer is agreed over the
        ranks)."""
        worker = getattr(self, "worker", None)
        return worker.take_staged_kv() if worker is not None else []

    def worker_infos(self) -> list[WorkerInfo]:
        """Every rank's worker, rank 0 first (the pod's GPUs and NUMA nodes, for READY)."""
        return [self.info()]

    def resize(self, new_size: int, requests: dict[str, Request], kv_block_ids: list[int],
               on_phase: Callable[[str], None]) -> Outcome:
        """Elastic EP: serve on `new_size` expert-parallel ranks (MultiprocExecutor only);
        `kv_block_ids` are the KV blocks with content, which a joining rank copies."""
        raise ValueError("elastic expert parallelism needs the engine to start its own ranks")

    def shutdown(self) -> None:  # noqa: B027 - nothing to release for an in-process worker
        """Release the workers (processes of their own, where there are any)."""
