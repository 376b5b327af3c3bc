"""One worker per tensor-parallel rank: rank 0 in the engine core's process, ranks 1..N-1 in
processes of their own, all in one torch.distributed world that this executor starts (NCCL on
GPUs, gloo on CPU).

Every step, rank 0 turns the SchedulerOutput into a ``StepPlan`` (``step_plan.py``) and
broadcasts it over a gloo group kept for control messages; every rank runs the same step (the
model's collectives inside keep them in step) and rank 0's sampled tokens go back to the
scheduler. The other ranks sample too, from the same gathered logits, so their copies of the
last step's tokens (which async scheduling feeds to the next step on the device) are the same.

A rank that dies is found before the next broadcast (its process is polled) and fails the
engine; the workers exit when the engine core's process goes away.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from pagoda_daemon.config import EngineConfig
from pagoda_daemon.engine.scheduler_output import SchedulerOutput
from pagoda_daemon.executor import step_plan
from pagoda_daemon.executor.abstract import Executor
from pagoda_daemon.logs import LEVEL_ENV
from pagoda_daemon.logs import configure as configure_logging
from pagoda_daemon.worker.model_runner import LaunchedStep
from pagoda_daemon.worker.worker import Worker, WorkerInfo

log = logging.getLogger(__name__)

# A collective that waits longer than this means a rank is gone or hung: fail, do not hang.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)
STARTUP_TIMEOUT_S = 600.0


def _init_world(rank: int, size: int, rendezvous: str, device_type: str) -> Any:
    """Join the world; return the gloo group for control messages. The ranks meet through a
    file in a private folder (a TCP store would listen on every interface of the pod)."""
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{rendezvous}", rank=rank, world_size=size,
                            timeout=COLLECTIVE_TIMEOUT)
    return dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT) if backend != "gloo" else dist.group.WORLD


def _broadcast(frame: bytes | None, group: Any) -> bytes:
    box: list[Any] = [frame]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def _exit_when_orphaned(parent_pid: int) -> None:
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def worker_main(rank: int, size: int, rendezvous: str, config: EngineConfig, model_config, max_model_len: int,
                parent_pid: int, device_type: str) -> None:
    """A rank other than 0: set up as rank 0 does, then run each step it is sent."""
    configure_logging(os.environ.get(LEVEL_ENV, "INFO"), f"tp-rank-{rank}")
    _exit_when_orphaned(parent_pid)
    os.environ["LOCAL_RANK"] = str(rank)
    control = _init_world(rank, size, rendezvous, device_type)
    worker = Worker(config, model_config, max_model_len)
    dist.gather_object(worker.info(), None, dst=0, group=control)
    worker.available_kv_blocks()  # rank 0 takes the smallest over the ranks: a collective
    mirrors = step_plan.RequestMirrors(config.block_size)
    while True:
        try:
            message = step_plan.decode(_broadcast(None, control))
        except RuntimeError as e:  # rank 0 left without a Stop: it failed, and says why itself
            log.error("rank 0 went away (%s); exiting", e)
            os._exit(1)
        if isinstance(message, step_plan.Stop):
            break
        if isinstance(message, step_plan.InitCache):
            worker.initialize_cache(message.num_blocks)
            continue
        worker.execute_model(mirrors.apply(message)).result()
    dist.destroy_process_group()


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig, model_config, max_model_len: int,
                 exit_on_worker_death: bool = False) -> None:
        size = config.world_size
        device_type = "cuda" if config.device.startswith("cuda") or (
            config.device == "auto" and torch.cuda.is_available()) else "cpu"
        if device_type == "cuda" and torch.cuda.device_count() < size:
            raise ValueError(f"{size} ranks (tensor × expert parallel size) need {size} GPUs; this process sees "
                             f"{torch.cuda.device_count()}")
        self._private = tempfile.mkdtemp(prefix="pagoda-tp-")  # mode 0700: the daemon's user only
        rendezvous = os.path.join(self._private, "rendezvous")
        # Every rank is in this pod: gloo's and NCCL's bootstrap sockets listen on loopback only
        # (unset, they pick the first interface: eth0 in a pod).
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        # Plain child processes (`python -m pagoda_daemon.executor.multiproc`, the arguments
        # pickled on stdin): the engine core is itself a daemonic multiprocessing child, which
        # multiprocessing forbids to have children of its own.
        self.procs: list[subprocess.Popen] = []
        for r in range(1, size):
            proc = subprocess.Popen([sys.executable, "-m", "pagoda_daemon.executor.multiproc"], stdin=subprocess.PIPE)
            assert proc.stdin is not None
            proc.stdin.write(pickle.dumps((r, size, rendezvous, config, model_config, max_model_len, os.getpid(),
                                           device_type)))
            proc.stdin.close()
            self.procs.append(proc)
        self._stopped = False
        if exit_on_worker_death:
            threading.Thread(target=self._exit_when_a_rank_dies, name="rank-watch", daemon=True).start()
        os.environ.setdefault("LOCAL_RANK", "0")
        self.control = _init_world(0, size, rendezvous, device_type)
        self.worker = Worker(config, model_config, max_model_len)
        infos: list[Any] = [None] * size
        dist.gather_object(self.worker.info(), infos, dst=0, group=self.control)
        self.infos: list[WorkerInfo] = infos
        self.writer = step_plan.PlanWriter()
        # Whoever built the engine may simply exit (a script, the benchmark): stop the ranks
        # first, or they wait in the next broadcast until its connection breaks.
        atexit.register(self.shutdown)
        log.info("tensor parallel: %d ranks (%s), ranks 1..%d in pids %s", size, dist.get_backend(),
                 size - 1, [p.pid for p in self.procs])

    def _exit_when_a_rank_dies(self) -> None:
        """Rank 0 may be waiting in a collective for the dead rank (start-up, a model step on
        NCCL) until COLLECTIVE_TIMEOUT: end this process instead; its parent (the API server)
        fails the requests and exits so that the pod restarts."""
        while not self._stopped:
            for r, p in enumerate(self.procs, 1):
                if p.poll() is not None and not self._stopped:
                    log.error("tensor-parallel worker rank %d exited (exit code %s): the engine stops", r,
                              p.returncode)
                    logging.shutdown()
                    os._exit(1)
            time.sleep(0.2)

    def _send(self, message: step_plan.ToWorker) -> None:
        dead = [f"rank {r} (exit code {p.returncode})" for r, p in enumerate(self.procs, 1) if p.poll() is not None]
        if dead:
            raise RuntimeError(f"tensor-parallel worker {', '.join(dead)} exited")
        _broadcast(step_plan.encode(message), self.control)

    def available_kv_blocks(self) -> int:
        return self.worker.available_kv_blocks()

    def initialize_cache(self, num_blocks: int) -> None:
        self._send(step_plan.InitCache(num_blocks))
        self.worker.initialize_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> LaunchedStep:
        self._send(self.writer.plan(scheduler_output))
        return self.worker.execute_model(scheduler_output)

    def info(self) -> WorkerInfo:
        return self.worker.info()

    def worker_infos(self) -> list[WorkerInfo]:
        return list(self.infos)

    def synchronize(self) -> None:
        self.worker.synchronize()

    def shutdown(self) -> None:
        """Stop the other ranks (they leave the world) and wait for them. Runs once."""
        if self._stopped:
            return
        self._stopped = True
        atexit.unregister(self.shutdown)
        if all(p.poll() is None for p in self.procs):
            try:
                _broadcast(step_plan.encode(step_plan.Stop()), self.control)
            except RuntimeError as e:
                log.warning("could not tell the workers to stop: %s", e)
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if dist.is_initialized():
            dist.destroy_process_group()
        shutil.rmtree(self._private, ignore_errors=True)


def main() -> None:
    worker_main(*pickle.loads(sys.stdin.buffer.read()))


if __name__ == "__main__":
    main()
