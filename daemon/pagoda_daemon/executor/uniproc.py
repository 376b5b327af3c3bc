"""One worker in the engine core's own process: the executor of a one-device engine."""

from __future__ import annotations

from pagoda_daemon.config import EngineConfig
from pagoda_daemon.engine.scheduler_output import GrammarBitmask, SchedulerOutput
from pagoda_daemon.executor.abstract import Executor
from pagoda_daemon.worker.model_runner import LaunchedStep
from pagoda_daemon.worker.worker import Worker, WorkerInfo


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig, model_config, max_model_len: int) -> None:
        self.worker = Worker(config, model_config, max_model_len)

    def available_kv_blocks(self) -> int:
        return self.worker.available_kv_blocks()

    def initialize_cache(self, num_blocks: int) -> None:
        self.worker.initialize_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> LaunchedStep | None:
        return self.worker.execute_model(scheduler_output)

    def sample_tokens(self, grammar: GrammarBitmask) -> LaunchedStep:
        return self.worker.sample_tokens(grammar)

    def info(self) -> WorkerInfo:
        return self.worker.info()

    def synchronize(self) -> None:
        self.worker.synchronize()

    def shutdown(self) -> None:
        """With data-parallel attention the engines leave their world together (they stop after
        the same agreement): a process group left behind aborted the process at exit."""
        if self.worker.offload is not None:  # its disk writes still under way: a restart reads the files
            self.worker.offload.flush()
        if self.worker.lockstep is not None:
            from pagoda_daemon.executor.world import leave_world

            leave_world(self.worker)
