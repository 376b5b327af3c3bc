"""Joining and leaving a torch.distributed world, and the control messages rank 0 sends
over it: what every rank of a replica does, whether it started with the replica
(``multiproc.py``) or joined it later (``resize.py``, elastic EP)."""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import json
import logging
import math
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pagoda_daemon.worker.worker import Worker, WorkerInfo

log = logging.getLogger(__name__)

# A collective that waits longer than this means a rank is gone or hung: fail, do not hang.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)
# How long the ranks of several pods wait for each other to appear (pods start, images pull).
STARTUP_TIMEOUT_S = 600.0
# How long the ranks may take to leave the world together at shutdown.
LEAVE_TIMEOUT_S = 30.0
# Across pods: every rank bumps its counter in node 0's store this often; a peer whose counter
# has not moved for the rendezvous's heartbeat_timeout_s (the node_heartbeat_timeout option) is
# taken for dead (an idle engine runs no collective that would notice).
HEARTBEAT_S = 2.0


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks meet: a file in a private folder when all of them are in this pod (a TCP
    store would listen on every interface of the pod), node 0's TCP store when they span pods."""

    file: str | None = None
    host: str = ""
    port: int = 0
    heartbeat_timeout_s: float = math.inf  # across pods: the node_heartbeat_timeout option


def join_world(rank: int, size: int, rdv: Rendezvous, device_type: str, local_rank: int,
               stopped: threading.Event, timeout: datetime.timedelta = COLLECTIVE_TIMEOUT) -> Any:
    """Join the world; return the gloo group for control messages. Across pods the heartbeats
    start before the world forms: a peer that dies while the others wait for it ends them too."""
    backend = "nccl" if device_type == "cuda" else "gloo"
    laps = [time.monotonic()]
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
    laps.append(time.monotonic())
    store = None
    if rdv.file is not None:
        dist.init_process_group(backend, init_method=f"file://{rdv.file}", rank=rank, world_size=size,
                                timeout=timeout)
    else:
        store = dist.TCPStore(rdv.host, rdv.port, size, is_master=rank == 0,
                              timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT_S), wait_for_workers=False)
        incarnation = _incarnation()
        store.set(f"pagoda/alive/{rank}", f"{incarnation}:0")
        threading.Thread(target=_watch_peers, args=(store, rank, size, stopped, incarnation, rdv.heartbeat_timeout_s),
                         name="peer-watch", daemon=True).start()
        dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT)
    laps.append(time.monotonic())
    control = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD
    laps.append(time.monotonic())
    device_s, world_s, control_s = (b - a for a, b in itertools.pairwise(laps))
    log.info("rank %d: joined a world of %d in %.2f s (device %.2f s, process group %.2f s, control group %.2f s)",
             rank, size, laps[-1] - laps[0], device_s, world_s, control_s)
    return control


def _incarnation() -> str:
    """This process, as its heartbeats name it: a restarted rank is another incarnation."""
    return f"{os.getpid()}.{_STARTED_NS}"


_STARTED_NS = time.time_ns()


def broadcast(frame: bytes | None, group: Any) -> bytes:
    """Rank 0's frame to every rank, as its length and then its bytes."""
    length = torch.tensor([len(frame) if frame is not None else 0], dtype=torch.int64)
    dist.broadcast(length, src=0, group=group)
    data = (torch.frombuffer(bytearray(frame), dtype=torch.uint8) if frame is not None
            else torch.empty(int(length.item()), dtype=torch.uint8))
    dist.broadcast(data, src=0, group=group)
    return data.numpy().tobytes()


def all_gather_infos(info: WorkerInfo, size: int, group: Any) -> list[WorkerInfo]:
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


def _watch_peers(store: Any, rank: int, size: int, stopped: threading.Event, incarnation: str,
                 timeout_s: float) -> None:
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
                elif now - seen[peer][1] > timeout_s:
                    raise RuntimeError(f"rank {peer} has not beaten for {timeout_s:g} s")
        except Exception as e:  # the store's connection broke, or a peer is gone
            if stopped.is_set():
                return
            log.error("rank %d: lost the other ranks (%s): exiting so that the group restarts", rank, e)
            logging.shutdown()
            os._exit(1)


def abandon_world(worker: Worker) -> None:
    """Leave a world in which a transfer failed. NCCL reports no dead peer by itself: its
    kernels wait for the peer, and a destroy waits for them; aborting every communicator ends
    them, so that the device's stream is free for the next world. gloo has reported the dead
    peer already, and its world is left as usual."""
    if not dist.is_initialized() or dist.get_backend() != "nccl":
        leave_world(worker)
        return
    worker.release_cuda_graphs()
    abort_groups()


def abort_groups() -> None:
    """Abort every process group of this process (NCCL's communicators: their pending kernels
    and any call blocked on them end). Safe from another thread; a no-op once done."""
    if not dist.is_initialized():
        return
    try:
        dist.distributed_c10d._abort_process_group()
    except Exception as e:  # already torn down, or a backend without abort: the next world forms anyway
        log.warning("aborting the process groups: %s", e)


def leave_world(worker: Worker) -> None:
    """Leave the world at shutdown, every rank together (rank 0 once it has sent Stop). The
    captured CUDA graphs go first: NCCL's teardown waited forever while they held collectives
    (2 × H100, 2026-11-25; 2 × H200, 2026-11-26, torch 2.11, NCCL 2.28), and an abort instead
    timed out after 120 s. Should the teardown still hang, a worker exits without it (the driver
    frees what the process held) and rank 0 goes on with a warning."""
    if worker.offload is not None:  # its disk writes still under way: a restart reads the files
        worker.offload.flush()
    worker.release_cuda_graphs()
    if not dist.is_initialized():
        return
    rank = dist.get_rank()
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
