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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from pagoda_daemon.config import EngineConfig
from pagoda_daemon.engine.request import Request
from pagoda_daemon.engine.scheduler_output import GrammarBitmask, SchedulerOutput
from pagoda_daemon.executor import resize, step_plan
from pagoda_daemon.executor.abstract import Executor
from pagoda_daemon.executor.world import Rendezvous, all_gather_infos, broadcast, join_world, leave_world
from pagoda_daemon.logs import LEVEL_ENV
from pagoda_daemon.logs import configure as configure_logging
from pagoda_daemon.worker.model_runner import LaunchedStep
from pagoda_daemon.worker.worker import Worker, WorkerInfo

log = logging.getLogger(__name__)
_PROCESS_UP = time.time()  # once this module's imports (torch's among them) are done

# A node other than 0 is ready once its ranks are in the world with their KV caches: its first
# rank then writes the file this variable names (in the node's private folder), and the node
# starts answering on its ready port (a pod's tcpSocket readiness probe; a socket, unlike a file
# in the pod's /tmp volume, does not outlive a restarted container).
NODE_READY_ENV = "PAGODA_NODE_READY_FILE"
# Elastic EP: a spare rank, started ahead of need, imports torch and brings up the device this
# variable names (cuda:N or cpu), then waits for its arguments. A process started at the resize
# took 8.9-9.6 s to import what a rank needs while its replica waited (Qwen3-30B-A3B shape on
# 4 x H200, 2026-11-26: 9.2-9.7 s of a 17.9 s 2 -> 4), against 4.2 s on the same machine at rest.
SPARE_ENV = "PAGODA_SPARE_DEVICE"


def _exit_when_orphaned(parent_pid: int) -> None:
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


@dataclass(frozen=True)
class JoinSpec:
    """A rank started by an elastic resize: the transition it joins and the KV blocks to allocate."""

    epoch: int
    old_size: int
    new_size: int
    num_blocks: int
    handed_at: float = 0.0  # time.time() when rank 0 handed the rank over: how long it took to join, logged
    fault: str = ""  # resize.FAULT_ENV as rank 0 had it at the resize (a spare was started before)


def worker_main(rank: int, size: int, rdv: Rendezvous, config: EngineConfig, model_config, max_model_len: int,
                parent_pid: int, device_type: str, join: JoinSpec | None = None) -> None:
    """A rank other than 0: set up as rank 0 does (or join a running replica), then run each
    step it is sent."""
    configure_logging(os.environ.get(LEVEL_ENV, "INFO"), f"tp-rank-{rank}")
    _exit_when_orphaned(parent_pid)
    local_rank = config.device_offset + rank % config.ranks_per_node  # the GPU's index on the node
    os.environ["LOCAL_RANK"] = str(local_rank)
    stopped = threading.Event()  # set on Stop: node 0 going away after it is then no failure
    folder = os.path.dirname(rdv.file) if rdv.file else ""
    mirrors = step_plan.RequestMirrors(config.block_size)
    if join is not None:
        ahead = join.handed_at - _PROCESS_UP
        log.info("rank %d: joining %.2f s after rank 0 handed it the resize (its imports done %.2f s %s)", rank,
                 time.time() - join.handed_at, abs(ahead), "before: a spare" if ahead >= 0 else "after")
        if join.fault:
            os.environ[resize.FAULT_ENV] = join.fault
        t = resize.Transition(join.epoch, join.old_size, join.new_size, folder)
        control = join_world(rank, join.new_size, t.rendezvous("grow"), device_type, local_rank, stopped,
                             resize.TRANSITION_TIMEOUT)
        worker = Worker(config, model_config, max_model_len)
        worker.initialize_cache(join.num_blocks, capture=False)
        seat = resize.RankSeat(worker, rank, control, device_type, local_rank, stopped)
        if not resize.follow(seat, t, joined=True, mirrors=mirrors).committed:
            return
    else:
        control = join_world(rank, size, rdv, device_type, local_rank, stopped)
        worker = Worker(config, model_config, max_model_len)
        all_gather_infos(worker.info(), size, control)
        worker.available_kv_blocks()  # rank 0 takes the smallest over the ranks: a collective
        seat = resize.RankSeat(worker, rank, control, device_type, local_rank, stopped)
    if _serve(seat, mirrors, folder):
        leave_world(worker)


def _serve(seat: resize.RankSeat, mirrors: step_plan.RequestMirrors, folder: str) -> bool:
    """Run the steps rank 0 sends until it says Stop (True) or a resize leaves this rank out
    (False: it has left the world already).

    One step stays in flight, as on rank 0 under async scheduling: this rank takes the next
    plan and launches it while the GPU still runs the last one, and waits for a step only once
    the one after it is launched. Waiting for each step before taking the next plan left this
    rank's host work (the broadcast, the mirrors, the inputs) as an idle gap on every GPU at
    each step, since rank 0's GPU waits for it at the step's first collective."""
    worker = seat.worker
    in_flight: LaunchedStep | None = None
    while True:
        try:
            message = step_plan.decode(broadcast(None, seat.control))
        except RuntimeError as e:  # rank 0 left without a Stop: it failed, and says why itself
            log.error("rank 0 went away (%s); exiting", e)
            logging.shutdown()
            os._exit(1)
        if not isinstance(message, step_plan.StepPlan) and in_flight is not None:
            in_flight.wait()  # anything but a step waits for the steps before it
            in_flight = None
        if isinstance(message, step_plan.Stop):
            seat.stopped.set()
            return True
        if isinstance(message, step_plan.InitCache):
            worker.initialize_cache(message.num_blocks)
            ready = os.environ.get(NODE_READY_ENV)
            if ready and seat.local_rank == 0:
                Path(ready).write_text(f"ranks up to {worker.tp.size - 1} in the world\n")
            continue
        if isinstance(message, step_plan.Resize):
            t = resize.Transition(message.epoch, message.old_size, message.new_size, folder)
            if seat.rank >= resize.follow(seat, t).size:
                return False
            continue
        if not isinstance(message, step_plan.StepPlan):
            raise RuntimeError(f"rank 0 sent {type(message).__name__} where a step belongs")
        launched = worker.execute_model(mirrors.apply(message))
        if launched is None:  # constrained rows: the masks follow once rank 0 has made them
            masks = step_plan.decode(broadcast(None, seat.control))
            if not isinstance(masks, step_plan.SampleTokens):
                raise RuntimeError(f"rank 0 sent {type(masks).__name__} where the step's grammar masks belong")
            launched = worker.sample_tokens(mirrors.grammar_bitmask(masks))
        if in_flight is not None:
            in_flight.wait()  # two steps back: its host buffers may be written again (staging_buffers.py)
        in_flight = launched


def _device_type(config: EngineConfig) -> str:
    return "cuda" if config.device.startswith("cuda") or (
        config.device == "auto" and torch.cuda.is_available()) else "cpu"


def _spawn_ranks(ranks: range, rdv: Rendezvous, config: EngineConfig, model_config, max_model_len: int,
                 device_type: str, env: dict[str, str] | None = None,
                 join: JoinSpec | None = None) -> list[subprocess.Popen]:
    """Plain child processes (``python -m pagoda_daemon.executor.multiproc``, the arguments pickled
    on a local pipe): the engine core is itself a daemonic multiprocessing child, which
    multiprocessing forbids to have children of its own."""
    needed = max(config.ranks_per_node, config.elastic_ep_max_size)  # elastic EP may grow that far
    if device_type == "cuda" and torch.cuda.device_count() < needed:
        raise ValueError(f"{needed} ranks on this node need {needed} GPUs; this process sees "
                         f"{torch.cuda.device_count()}")
    procs = []
    for r in ranks:
        proc = _start_process(model_config, max_model_len, device_type, env)
        _hand_over(proc, (r, config.world_size, rdv, config, join))
        procs.append(proc)
    return procs


def _start_process(model_config, max_model_len: int, device_type: str,
                   env: dict[str, str] | None = None) -> subprocess.Popen:
    """A rank's process, sent at once what any rank of this replica needs (unpickling the
    model's transformers config imports transformers: 6.8 s of a spare's 7 s wait on 4 x H200,
    2026-11-26, when it came with the resize), then waiting for its rank on stdin. The fault hook
    travels in a JoinSpec only: a spare started before the resize must not inherit it, nor miss it."""
    inherited = {k: v for k, v in os.environ.items() if k != resize.FAULT_ENV}
    proc = subprocess.Popen([sys.executable, "-m", "pagoda_daemon.executor.multiproc"], stdin=subprocess.PIPE,
                            env={**inherited, **(env or {})})
    assert proc.stdin is not None
    proc.stdin.write(pickle.dumps((model_config, max_model_len, os.getpid(), device_type)))
    proc.stdin.flush()
    return proc


def _hand_over(proc: subprocess.Popen, args: tuple) -> None:
    """A rank's own arguments (rank, size, rendezvous, config, JoinSpec), pickled on its
    private pipe; closing the pipe starts the rank."""
    assert proc.stdin is not None
    proc.stdin.write(pickle.dumps(args))
    proc.stdin.close()


def _release(spares: list[subprocess.Popen]) -> None:
    """Spares no longer needed: an empty pipe ends them (they have started nothing)."""
    for proc in spares:
        if proc.stdin is not None and not proc.stdin.closed:
            proc.stdin.close()
    _stop(spares, 10.0)


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
    rdv = Rendezvous(host=config.master_addr, port=config.master_port,
                     heartbeat_timeout_s=config.node_heartbeat_timeout)
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
            rdv = Rendezvous(host=config.master_addr, port=config.master_port,
                             heartbeat_timeout_s=config.node_heartbeat_timeout)
        else:
            self._private = tempfile.mkdtemp(prefix="pagoda-tp-")  # mode 0700: the daemon's user only
            rdv = Rendezvous(file=os.path.join(self._private, "rendezvous"))
            # Every rank is in this pod: gloo's and NCCL's bootstrap sockets listen on loopback only
            # (unset, they pick the first interface: eth0 in a pod).
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        self.config, self.model_config, self.max_model_len, self.device_type = (config, model_config, max_model_len,
                                                                                device_type)
        self._epoch = 0  # elastic resizes so far
        self._spares: dict[int, subprocess.Popen] = {}  # elastic EP: a process waiting for each rank it may grow to
        self._resizing = threading.Event()  # a rank that exits meanwhile is the transition's business
        self.procs = _spawn_ranks(range(1, config.ranks_per_node), rdv, config, model_config, max_model_len,
                                  device_type)
        self._stopped = threading.Event()
        if exit_on_worker_death:
            threading.Thread(target=self._exit_when_a_rank_dies, name="rank-watch", daemon=True).start()
        os.environ.setdefault("LOCAL_RANK", str(config.device_offset))
        self.control = join_world(0, size, rdv, device_type, config.device_offset, self._stopped)
        self.worker = Worker(config, model_config, max_model_len)
        self.infos: list[WorkerInfo] = all_gather_infos(self.worker.info(), size, self.control)
        self.writer = step_plan.PlanWriter()
        # Whoever built the engine may simply exit (a script, the benchmark): stop the ranks
        # first, or they wait in the next broadcast until its connection breaks.
        atexit.register(self.shutdown)
        self._keep_spares()
        log.info("tensor parallel: %d ranks over %d node(s) (%s), local ranks 1..%d in pids %s", size,
                 config.nnodes, dist.get_backend(), config.ranks_per_node - 1, [p.pid for p in self.procs])

    def _exit_when_a_rank_dies(self) -> None:
        """Rank 0 may be waiting in a collective for the dead rank (start-up, a model step on
        NCCL) until COLLECTIVE_TIMEOUT: end this process instead; its parent (the API server)
        fails the requests and exits so that the pod restarts."""
        while not self._stopped.is_set():
            for r, p in enumerate(self.procs, 1):
                if p.poll() is not None and not self._stopped.is_set() and not self._resizing.is_set():
                    log.error("tensor-parallel worker rank %d exited (exit code %s): the engine stops", r,
                              p.returncode)
                    logging.shutdown()
                    os._exit(1)
            time.sleep(0.2)

    def _send(self, message: step_plan.ToWorker) -> None:
        dead = [f"rank {r} (exit code {p.returncode})" for r, p in enumerate(self.procs, 1) if p.poll() is not None]
        if dead:
            raise RuntimeError(f"tensor-parallel worker {', '.join(dead)} exited")
        broadcast(step_plan.encode(message), self.control)

    def available_kv_blocks(self) -> int:
        return self.worker.available_kv_blocks()

    def initialize_cache(self, num_blocks: int) -> None:
        self._send(step_plan.InitCache(num_blocks))
        self.worker.initialize_cache(num_blocks)
        self.num_blocks = num_blocks

    def execute_model(self, scheduler_output: SchedulerOutput) -> LaunchedStep | None:
        balancer = self.worker.balancer
        if balancer is not None and balancer.is_async:  # the layers to switch, the same on every rank
            scheduler_output.eplb_layers_held = balancer.layers_held_everywhere()
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

    def resize(self, new_size: int, requests: dict[str, Request], kv_block_ids: list[int],
               on_phase: Callable[[str], None]) -> resize.Outcome:
        """Elastic EP: serve on `new_size` ranks from the next step (executor/resize.py). Call
        between steps, with no step in flight; `requests` are the scheduler's, by id. A failed
        transition rolls back and the replica serves on at its old size."""
        if self._private is None:
            raise ValueError("elastic expert parallelism runs every rank in one pod")
        self._epoch += 1
        t = resize.Transition(self._epoch, self.config.world_size, new_size, self._private)
        on_phase("preparing")
        self._resizing.set()
        joiners: list[subprocess.Popen] = []
        laps = resize.Laps()
        try:
            state = self.writer.rank_state(requests, self.worker.runner, kv_block_ids)
            self.synchronize()
            if t.grows:
                config = dataclasses.replace(self.config, expert_parallel_size=new_size, load_format="dummy")
                join = JoinSpec(t.epoch, t.old_size, new_size, self.num_blocks, time.time(),
                                os.environ.get(resize.FAULT_ENV, ""))
                for r in t.joiners:
                    spare = self._spares.pop(r, None)
                    proc = (spare if spare is not None and spare.poll() is None
                            else _start_process(self.model_config, self.max_model_len, self.device_type))
                    _hand_over(proc, (r, new_size, t.rendezvous("grow"), config, join))
                    joiners.append(proc)
            self._send(step_plan.Resize(t.epoch, t.old_size, new_size))
            laps.lap("prepare")
            seat = resize.RankSeat(self.worker, 0, self.control, self.device_type, 0, self._stopped)
            outcome = resize.follow(seat, t, rank_state=state, on_phase=on_phase, decide=t.decide, joiners=joiners)
            outcome.seconds = {**laps.seconds, **outcome.seconds}
            self.control = seat.control
            if outcome.committed:
                leaving = self.procs[new_size - 1:]
                self.procs = self.procs[:new_size - 1] + joiners
                _stop(leaving)
                self.config = dataclasses.replace(self.config, expert_parallel_size=new_size)
            else:
                _terminate(joiners)
            self.infos = outcome.infos
            return outcome
        finally:
            self._resizing.clear()
            self._keep_spares()

    def _keep_spares(self) -> None:
        """Under elastic EP, one process started ahead of need for each rank the replica may
        grow to, its imports done and its GPU's context up (on the GPU it would use anyway)."""
        if not self.config.elastic_ep or self._private is None:
            return
        size = self.config.world_size
        for r, proc in list(self._spares.items()):
            if r < size or proc.poll() is not None:
                _release([self._spares.pop(r)])
        for r in range(size, self.config.elastic_ep_max_size):
            if r not in self._spares:
                device = f"cuda:{r}" if self.device_type == "cuda" else "cpu"
                self._spares[r] = _start_process(self.model_config, self.max_model_len, self.device_type,
                                                 {SPARE_ENV: device})

    def shutdown(self) -> None:
        """Stop the other ranks (they leave the world) and wait for the local ones. Runs once."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        atexit.unregister(self.shutdown)
        if all(p.poll() is None for p in self.procs):
            try:
                broadcast(step_plan.encode(step_plan.Stop()), self.control)
            except RuntimeError as e:
                log.warning("could not tell the workers to stop: %s", e)
        leave_world(self.worker)
        _release(list(self._spares.values()))
        _stop(self.procs)
        if self._private is not None:
            shutil.rmtree(self._private, ignore_errors=True)


def main() -> None:
    spare = os.environ.get(SPARE_ENV)
    if spare and spare.startswith("cuda"):  # a spare: its device's context up before the wait
        torch.cuda.set_device(torch.device(spare))
        torch.zeros(1, device=spare)
    model_config, max_model_len, parent_pid, device_type = pickle.load(sys.stdin.buffer)
    try:
        rank, size, rdv, config, join = pickle.load(sys.stdin.buffer)
    except EOFError:  # a spare no longer needed, or rank 0 gone: nothing to run
        return
    worker_main(rank, size, rdv, config, model_config, max_model_len, parent_pid, device_type, join)


if __name__ == "__main__":
    main()
