"""One worker per tensor-parallel rank: rank 0 in the engine core's process, the other ranks
in processes of their own, all in one torch.distributed world that this executor starts (NCCL
on GPUs, gloo on CPU).

Every step, rank 0 turns the SchedulerOutput into a ``StepPlan`` (``step_plan.py``) and
broadcasts it over a gloo group kept for control messages; every rank runs the same step (the
model's collectives inside keep them in step) and rank 0's sampled tokens go back to the
scheduler. The other ranks sample too, from the same gathered logits, so their copies of the
last step's tokens (which async scheduling feeds to the next step on the device) are the same.

The ranks may span pods (``nnodes`` > 1, docs/parallelism.md "Across pods"): node 0 runs the
engine core with ranks 0..k-1, node n runs ranks n·k..n·k+k-1 under :func:`run_node` (no API
server), and they meet at node 0's TCP store. Only bytes cross the wire (msgpack step plans,
JSON worker reports): nothing a peer sends is unpickled.

A rank that dies is found before the next broadcast (a local rank's process is polled; a rank
in another pod stops its heartbeat in the store) and fails the engine; ranks exit when rank 0
goes away, so a group of pods restarts and re-forms as one unit.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import json
import logging
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pagoda_daemon.config import EngineConfig
from pagoda_daemon.engine.scheduler_output import GrammarBitmask, SchedulerOutput
from pagoda_daemon.executor import step_plan
from pagoda_daemon.executor.abstract import Executor
from pagoda_daemon.logs import LEVEL_ENV
from pagoda_daemon.logs import configure as configure_logging
from pagoda_daemon.worker.model_runner import LaunchedStep
from pagoda_daemon.worker.worker import Worker, WorkerInfo

log = logging.getLogger(__name__)

# A collective that waits longer than this means a rank is gone or hung: fail, do not hang.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)
# How long the ranks of several pods wait for each other to appear (pods start, images pull).
STARTUP_TIMEOUT_S = 600.0
# How long the ranks may take to leave the world together at shutdown.
LEAVE_TIMEOUT_S = 30.0
# Across pods: every rank bumps its counter in node 0's store this often; a peer whose counter
# has not moved for HEARTBEAT_TIMEOUT_S is taken for dead (an idle engine runs no collective
# that would notice).
HEARTBEAT_S = 2.0
HEARTBEAT_TIMEOUT_S = 20.0
# A node other than 0 is ready once its ranks are in the world with their KV caches: its first
# rank then writes the file this variable names (in the node's private folder), and the node
# starts answering on its ready port (a pod's tcpSocket readiness probe; a socket, unlike a file
# in the pod's /tmp volume, does not outlive a restarted container).
NODE_READY_ENV = "PAGODA_NODE_READY_FILE"


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks meet: a file in a private folder when all of them are in this pod (a TCP
    store would listen on every interface of the pod), node 0's TCP store when they span pods."""

    file: str | None = None
    host: str = ""
    port: int = 0


def _join_world(rank: int, size: int, rdv: Rendezvous, device_type: str, local_rank: int,
                stopped: threading.Event) -> Any:
    """Join the world; return the gloo group for control messages. Across pods the heartbeats
    start before the world forms: a peer that dies while the others wait for it ends them too."""
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
    store = None
    if rdv.file is not None:
        dist.init_process_group(backend, init_method=f"file://{rdv.file}", rank=rank, world_size=size,
                                timeout=COLLECTIVE_TIMEOUT)
    else:
        store = dist.TCPStore(rdv.host, rdv.port, size, is_master=rank == 0,
                              timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT_S), wait_for_workers=False)
        incarnation = _incarnation()
        store.set(f"pagoda/alive/{rank}", f"{incarnation}:0")
        threading.Thread(target=_watch_peers, args=(store, rank, size, stopped, incarnation), name="peer-watch",
                         daemon=True).start()
        dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT)
    return dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT) if backend != "gloo" else dist.group.WORLD


def _incarnation() -> str:
    """This process, as its heartbeats name it: a restarted rank is another incarnation."""
    return f"{os.getpid()}.{_STARTED_NS}"


_STARTED_NS = time.time_ns()


def _broadcast(frame: bytes | None, group: Any) -> bytes:
    """Rank 0's frame to every rank, as its length and then its bytes."""
    length = torch.tensor([len(frame) if frame is not None else 0], dtype=torch.int64)
    dist.broadcast(length, src=0, group=group)
    data = (torch.frombuffer(bytearray(frame), dtype=torch.uint8) if frame is not None
            else torch.empty(int(length.item()), dtype=torch.uint8))
    dist.broadcast(data, src=0, group=group)
    return data.numpy().tobytes()


def _all_gather_infos(info: WorkerInfo, size: int, group: Any) -> list[WorkerInfo]:
    """Every rank's WorkerInfo (JSON bytes, padded to the longest)."""
    mine = json.dumps(dataclasses.asdict(info)).encode()
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
    dist.all_gather(lengths, torch.tensor([len(mine)], dtype=torch.int64), group=group)
    longest = max(int(t.item()) for t in lengths)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
    frames = [torch.empty(longest, dtype=torch.uint8) for _ in range(size)]
    dist.all_gather(frames, padded, group=group)
    return [WorkerInfo(**json.loads(f[: int(n.item())].numpy().tobytes())) for f, n in zip(frames, lengths)]


def _watch_peers(store: Any, rank: int, size: int, stopped: threading.Event, incarnation: str) -> None:
    """Across pods: beat, and end this process when a peer stops beating, comes back as another
    process (its pod restarted and it is trying to join again), or the store is gone (node 0
    died). Rank 0 watches every rank; the others watch rank 0."""
    peers = range(1, size) if rank == 0 else range(0, 1)
    seen: dict[int, tuple[bytes, float]] = {}
    first: dict[int, bytes] = {}
    beat = 0
    while not stopped.wait(HEARTBEAT_S):
        beat += 1
        try:
            store.set(f"pagoda/alive/{rank}", f"{incarnation}:{beat}")
            now = time.monotonic()
            for peer in peers:
                key = f"pagoda/alive/{peer}"
                if peer not in first and not store.check([key]):
                    continue  # not started yet: the world waits for it (up to STARTUP_TIMEOUT_S)
                value = store.get(key)
                who = value.split(b":")[0]
                if first.setdefault(peer, who) != who:
                    raise RuntimeError(f"rank {peer} restarted")
                if seen.get(peer, (None, 0.0))[0] != value:
                    seen[peer] = (value, now)
                elif now - seen[peer][1] > HEARTBEAT_TIMEOUT_S:
                    raise RuntimeError(f"rank {peer} has not beaten for {HEARTBEAT_TIMEOUT_S:g} s")
        except Exception as e:  # the store's connection broke, or a peer is gone
            if stopped.is_set():
                return
            log.error("rank %d: lost the other ranks (%s): exiting so that the group restarts", rank, e)
            logging.shutdown()
            os._exit(1)


def _exit_when_orphaned(parent_pid: int) -> None:
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def worker_main(rank: int, size: int, rdv: Rendezvous, config: EngineConfig, model_config, max_model_len: int,
                parent_pid: int, device_type: str) -> None:
    """A rank other than 0: set up as rank 0 does, then run each step it is sent."""
    configure_logging(os.environ.get(LEVEL_ENV, "INFO"), f"tp-rank-{rank}")
    _exit_when_orphaned(parent_pid)
    local_rank = rank % config.ranks_per_node
    os.environ["LOCAL_RANK"] = str(local_rank)
    stopped = threading.Event()  # set on Stop: node 0 going away after it is then no failure
    control = _join_world(rank, size, rdv, device_type, local_rank, stopped)
    worker = Worker(config, model_config, max_model_len)
    _all_gather_infos(worker.info(), size, control)
    worker.available_kv_blocks()  # rank 0 takes the smallest over the ranks: a collective
    mirrors = step_plan.RequestMirrors(config.block_size)
    while True:
        try:
            message = step_plan.decode(_broadcast(None, control))
        except RuntimeError as e:  # rank 0 left without a Stop: it failed, and says why itself
            log.error("rank 0 went away (%s); exiting", e)
            logging.shutdown()
            os._exit(1)
        if isinstance(message, step_plan.Stop):
            stopped.set()
            break
        if isinstance(message, step_plan.InitCache):
            worker.initialize_cache(message.num_blocks)
            ready = os.environ.get(NODE_READY_ENV)
            if ready and local_rank == 0:
                Path(ready).write_text(f"ranks up to {size - 1} in the world\n")
            continue
        if isinstance(message, step_plan.SampleTokens):
            raise RuntimeError("rank 0 sent grammar masks with no step waiting for them")
        launched = worker.execute_model(mirrors.apply(message))
        if launched is None:  # constrained rows: the masks follow once rank 0 has made them
            masks = step_plan.decode(_broadcast(None, control))
            if not isinstance(masks, step_plan.SampleTokens):
                raise RuntimeError(f"rank 0 sent {type(masks).__name__} where the step's grammar masks belong")
            launched = worker.sample_tokens(mirrors.grammar_bitmask(masks))
        launched.result()
    _leave_world(worker)


def _leave_world(worker: Worker) -> None:
    """Leave the world at shutdown, every rank together (rank 0 once it has sent Stop). The
    captured CUDA graphs go first: NCCL's teardown waited forever while they held collectives
    (2 × H100, 2026-11-25; 2 × H200, 2026-11-26, torch 2.11, NCCL 2.28), and an abort instead
    timed out after 120 s. Should the teardown still hang, a worker exits without it (the driver
    frees what the process held) and rank 0 goes on with a warning."""
    if not dist.is_initialized():
        return
    rank = dist.get_rank()
    worker.release_cuda_graphs()
    left = threading.Event()

    def destroy() -> None:
        dist.destroy_process_group()
        left.set()

    threading.Thread(target=destroy, name="leave-world", daemon=True).start()
    if left.wait(LEAVE_TIMEOUT_S):
        return
    log.warning("rank %d: leaving the world took more than %.0f s; going on without it", rank, LEAVE_TIMEOUT_S)
    if rank != 0:
        logging.shutdown()
        os._exit(0)


def _device_type(config: EngineConfig) -> str:
    return "cuda" if config.device.startswith("cuda") or (
        config.device == "auto" and torch.cuda.is_available()) else "cpu"


def _spawn_ranks(ranks: range, rdv: Rendezvous, config: EngineConfig, model_config, max_model_len: int,
                 device_type: str, env: dict[str, str] | None = None) -> list[subprocess.Popen]:
    """Plain child processes (``python -m pagoda_daemon.executor.multiproc``, the arguments pickled
    on a local pipe): the engine core is itself a daemonic multiprocessing child, which
    multiprocessing forbids to have children of its own."""
    if device_type == "cuda" and torch.cuda.device_count() < config.ranks_per_node:
        raise ValueError(f"{config.ranks_per_node} ranks on this node need {config.ranks_per_node} GPUs; this "
                         f"process sees {torch.cuda.device_count()}")
    procs = []
    for r in ranks:
        proc = subprocess.Popen([sys.executable, "-m", "pagoda_daemon.executor.multiproc"], stdin=subprocess.PIPE,
                                env={**os.environ, **(env or {})})
        assert proc.stdin is not None
        proc.stdin.write(pickle.dumps((r, config.world_size, rdv, config, model_config, max_model_len, os.getpid(),
                                       device_type)))
        proc.stdin.close()
        procs.append(proc)
    return procs


def _stop(procs: list[subprocess.Popen], timeout_s: float = 30.0) -> None:
    for p in procs:
        try:
            p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _answer_on(port: int) -> None:
    """Accept and close connections on ``port`` (every interface), for as long as this process lives."""
    server = socket.create_server(("", port), reuse_port=False)

    def serve() -> None:
        while True:
            conn, _ = server.accept()
            conn.close()

    threading.Thread(target=serve, name="ready-port", daemon=True).start()


def run_node(config: EngineConfig, model_config, max_model_len: int, ready_port: int = 0) -> int:
    """Node ``config.node_rank`` > 0 of a group of pods: run this node's ranks until they end.
    Once they are up, accept connections on ``ready_port`` (0: none). A rank that fails ends the
    others and the node (exit 1: the pod restarts and rejoins); SIGTERM ends them too (exit 0)."""
    k = config.ranks_per_node
    ranks = range(config.node_rank * k, (config.node_rank + 1) * k)
    rdv = Rendezvous(host=config.master_addr, port=config.master_port)
    log.info("node %d of %d: ranks %d..%d, meeting node 0 at %s:%d", config.node_rank, config.nnodes, ranks[0],
             ranks[-1], rdv.host, rdv.port)
    private = tempfile.mkdtemp(prefix="pagoda-node-")
    ready = Path(private, "ready")
    try:
        procs = _spawn_ranks(ranks, rdv, config, model_config, max_model_len, _device_type(config),
                             env={NODE_READY_ENV: str(ready)})
        return _supervise(config.node_rank, ranks, procs, ready, ready_port)
    finally:
        shutil.rmtree(private, ignore_errors=True)


def _supervise(node: int, ranks: range, procs: list[subprocess.Popen], ready: Path, ready_port: int) -> int:
    terminated = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: terminated.set())
    announced = False
    while not terminated.wait(0.2):
        if not announced and ready.exists():
            announced = True
            if ready_port:
                _answer_on(ready_port)
            log.info("node %d: ranks %d..%d are up%s", node, ranks[0], ranks[-1],
                     f"; ready on port {ready_port}" if ready_port else "")
        codes = [p.poll() for p in procs]
        failed = [(r, c) for r, c in zip(ranks, codes) if c not in (None, 0)]
        if failed:
            log.error("rank %d exited (exit code %d): this node stops its other ranks", *failed[0])
            _terminate(procs)
            return 1
        if all(c == 0 for c in codes):
            log.info("node %d: every rank stopped", node)
            return 0
    _terminate(procs)
    return 0


def _terminate(procs: list[subprocess.Popen]) -> None:
    """SIGTERM the ranks still running, and wait for all of them."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    _stop(procs, 10.0)


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig, model_config, max_model_len: int,
                 exit_on_worker_death: bool = False) -> None:
        size = config.world_size
        device_type = _device_type(config)
        self._private: str | None = None
        if config.nnodes > 1:
            rdv = Rendezvous(host=config.master_addr, port=config.master_port)
        else:
            self._private = tempfile.mkdtemp(prefix="pagoda-tp-")  # mode 0700: the daemon's user only
            rdv = Rendezvous(file=os.path.join(self._private, "rendezvous"))
            # Every rank is in this pod: gloo's and NCCL's bootstrap sockets listen on loopback only
            # (unset, they pick the first interface: eth0 in a pod).
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        self.procs = _spawn_ranks(range(1, config.ranks_per_node), rdv, config, model_config, max_model_len,
                                  device_type)
        self._stopped = threading.Event()
        if exit_on_worker_death:
            threading.Thread(target=self._exit_when_a_rank_dies, name="rank-watch", daemon=True).start()
        os.environ.setdefault("LOCAL_RANK", "0")
        self.control = _join_world(0, size, rdv, device_type, 0, self._stopped)
        self.worker = Worker(config, model_config, max_model_len)
        self.infos: list[WorkerInfo] = _all_gather_infos(self.worker.info(), size, self.control)
        self.writer = step_plan.PlanWriter()
        # Whoever built the engine may simply exit (a script, the benchmark): stop the ranks
        # first, or they wait in the next broadcast until its connection breaks.
        atexit.register(self.shutdown)
        log.info("tensor parallel: %d ranks over %d node(s) (%s), local ranks 1..%d in pids %s", size,
                 config.nnodes, dist.get_backend(), config.ranks_per_node - 1, [p.pid for p in self.procs])

    def _exit_when_a_rank_dies(self) -> None:
        """Rank 0 may be waiting in a collective for the dead rank (start-up, a model step on
        NCCL) until COLLECTIVE_TIMEOUT: end this process instead; its parent (the API server)
        fails the requests and exits so that the pod restarts."""
        while not self._stopped.is_set():
            for r, p in enumerate(self.procs, 1):
                if p.poll() is not None and not self._stopped.is_set():
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

    def execute_model(self, scheduler_output: SchedulerOutput) -> LaunchedStep | None:
        self._send(self.writer.plan(scheduler_output))
        return self.worker.execute_model(scheduler_output)

    def sample_tokens(self, grammar: GrammarBitmask) -> LaunchedStep:
        self._send(self.writer.sample_tokens(grammar))
        return self.worker.sample_tokens(grammar)

    def info(self) -> WorkerInfo:
        return self.worker.info()

    def worker_infos(self) -> list[WorkerInfo]:
        return list(self.infos)

    def synchronize(self) -> None:
        self.worker.synchronize()

    def shutdown(self) -> None:
        """Stop the other ranks (they leave the world) and wait for the local ones. Runs once."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        atexit.unregister(self.shutdown)
        if all(p.poll() is None for p in self.procs):
            try:
                _broadcast(step_plan.encode(step_plan.Stop()), self.control)
            except RuntimeError as e:
                log.warning("could not tell the workers to stop: %s", e)
        _leave_world(self.worker)
        _stop(self.procs)
        if self._private is not None:
            shutil.rmtree(self._private, ignore_errors=True)


def main() -> None:
    worker_main(*pickle.loads(sys.stdin.buffer.read()))


if __name__ == "__main__":
    main()
