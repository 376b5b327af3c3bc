"""The EngineCore process: the scheduler loop behind two ZMQ sockets.

It never waits on HTTP: requests arrive already tokenized and validated, token ids
go back, and the loop blocks on its input socket only while it has nothing to run.
It lives exactly as long as the API server: when that dies, even by SIGKILL, the engine
stops within a fraction of a second, busy or not, and removes the IPC socket files.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
import time
import traceback
from pathlib import Path

import zmq

from pagoda_daemon.config import EngineConfig
from pagoda_daemon.server import wire

log = logging.getLogger(__name__)

IDLE_POLL_MS = 500  # how often an idle engine checks that its parent is alive
PARENT_CHECK_S = 0.25  # how often a busy engine checks it (behind PR_SET_PDEATHSIG, which is at once)
PR_SET_PDEATHSIG = 1  # linux/prctl.h


class ParentGone(BaseException):
    """The API server died: stop at once, whatever the engine is doing (BaseException so
    no `except Exception` on the way out swallows it)."""


def run_engine_core(config: EngineConfig, input_addr: str, output_addr: str, parent_pid: int,
                    log_level: str = "INFO", kv_events_endpoint: str | None = None) -> None:
    """Process entry point (multiprocessing spawn target)."""
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s engine-core %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the API server decides when we stop
    try:
        _exit_with_parent(parent_pid)
        _run(config, input_addr, output_addr, parent_pid, kv_events_endpoint)
    except ParentGone:
        log.warning("API server is gone; engine core exits")
    finally:
        remove_ipc_files(input_addr, output_addr)


def _exit_with_parent(parent_pid: int) -> None:
    """Ask Linux for SIGTERM when the API server dies (even by SIGKILL), and turn that
    SIGTERM into ParentGone. A SIGTERM while the API server lives is ignored: the server
    drains on SIGTERM and still needs the engine."""

    def on_sigterm(_signum: int, _frame: object) -> None:
        if os.getppid() != parent_pid:
            raise ParentGone

    signal.signal(signal.SIGTERM, on_sigterm)
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
            log.warning("prctl(PR_SET_PDEATHSIG) failed (errno %d); relying on polling", ctypes.get_errno())
    if os.getppid() != parent_pid:  # it died before the signal was asked for
        raise ParentGone


def remove_ipc_files(*addresses: str) -> None:
    """Remove the IPC socket files and their folder (if nothing else is in it): the API
    server does so itself, but not when it was killed."""
    paths = [Path(a.removeprefix("ipc://")) for a in addresses if a.startswith("ipc://")]
    for path in paths:
        path.unlink(missing_ok=True)
    for folder in {p.parent for p in paths}:
        with contextlib.suppress(OSError):
            folder.rmdir()


def _run(config: EngineConfig, input_addr: str, output_addr: str, parent_pid: int,
         kv_events_endpoint: str | None) -> None:
    ctx = zmq.Context()
    inputs = ctx.socket(zmq.PULL)
    inputs.connect(input_addr)
    outputs = ctx.socket(zmq.PUSH)
    outputs.setsockopt(zmq.LINGER, 2000)
    outputs.connect(output_addr)
    publisher = None
    try:
        try:
            from pagoda_daemon.engine.engine_core import EngineCore

            core = EngineCore(config)
            core.warm_up()
        except Exception as e:  # startup failures go back to the API server as text, then we exit
            log.exception("engine core failed to start")
            outputs.send(wire.pack(wire.FAILED, f"engine failed to start: {e}"))
            sys.exit(1)
        outputs.send(wire.pack(wire.READY, {
            "max_model_len": core.max_model_len,
            "num_kv_blocks": core.kv_cache.num_blocks,
            "block_size": config.block_size,
            "device": str(core.device),
            "dtype": str(core.dtype).removeprefix("torch."),
            "gpus": [] if core.cpu_pin is None or core.cpu_pin.gpu is None else [core.cpu_pin.gpu],
            "numa_nodes": [] if core.cpu_pin is None or core.cpu_pin.numa_node is None else [core.cpu_pin.numa_node],
            "expert_parallel_size": 1,
        }))
        outputs.send(wire.pack(wire.OUTPUTS, [[], _stats(core)]))  # gauges start from the truth
        if kv_events_endpoint:
            from pagoda_daemon.telemetry.kv_events import KVEventPublisher

            publisher = KVEventPublisher(kv_events_endpoint)
            log.info("publishing KV events on %s", publisher.endpoint)
        try:
            _loop(core, inputs, outputs, parent_pid, config.block_size, publisher)
        except Exception:
            message = traceback.format_exc()
            log.error("engine core crashed:\n%s", message)
            outputs.send(wire.pack(wire.FAILED, f"engine core crashed: {message.strip().splitlines()[-1]}"))
            sys.exit(1)
    except ParentGone:
        outputs.setsockopt(zmq.LINGER, 0)  # nobody will read what is queued
        raise
    finally:
        if publisher is not None:
            publisher.close()
        inputs.close(0)
        outputs.close()
        ctx.term()


def _loop(core, inputs, outputs, parent_pid: int, block_size: int, publisher=None) -> None:
    poller = zmq.Poller()
    poller.register(inputs, zmq.POLLIN)
    next_parent_check = time.monotonic() + PARENT_CHECK_S
    while True:
        busy = core.has_unfinished_requests()
        if (not busy and not poller.poll(IDLE_POLL_MS)) or time.monotonic() >= next_parent_check:
            if os.getppid() != parent_pid:
                raise ParentGone
            next_parent_check = time.monotonic() + PARENT_CHECK_S
        changed = False
        while True:  # drain everything that arrived
            try:
                frame = inputs.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            kind, payload = wire.unpack(frame)
            changed = True
            if kind == wire.ADD:
                try:
                    core.add_request(wire.decode_request(payload, block_size, core.model_config.vocab_size))
                except Exception as e:  # never expected (the API validates): fail this request, not the engine
                    rid = payload.get("id") if isinstance(payload, dict) else None
                    log.error("rejected request %s: %s: %s", rid, type(e).__name__, e)
                    if isinstance(rid, str):
                        outputs.send(wire.pack(wire.OUTPUTS, [[[rid, [], "abort", f"rejected by the engine: {e}",
                                                                [], 0, None]], _stats(core)]))
            elif kind == wire.ABORT:
                core.abort_requests(payload)
            elif kind == wire.FINISH:
                request_id, stop_reason = payload
                core.finish_request(request_id, stop_reason)
            elif kind == wire.SHUTDOWN:
                return
        if core.has_unfinished_requests():
            step_outputs = core.step()
            outputs.send(wire.pack(wire.OUTPUTS, [wire.encode_outputs(step_outputs), _stats(core)]))
        elif changed:
            outputs.send(wire.pack(wire.OUTPUTS, [[], _stats(core)]))
        if publisher is not None:
            events = core.kv_cache.pool.drain_events()
            if events:
                publisher.publish(kv_events_for_publishing(events, block_size))


def kv_events_for_publishing(events: list, block_size: int) -> list:
    """The block pool's events in the published (vLLM-compatible) shapes."""
    from pagoda_daemon.engine.block_pool import CLEARED, RemovedBlock, StoredBlock
    from pagoda_daemon.telemetry.kv_events import AllCleared, BlockRemoved, BlockStored, block_hash_to_int

    out = []
    for e in events:
        if isinstance(e, StoredBlock):
            parent = None if e.parent_hash is None else block_hash_to_int(e.parent_hash)
            extra = [[list(k) for k in e.extra_keys]] if e.extra_keys else None
            out.append(BlockStored([block_hash_to_int(e.block_hash)], parent, e.token_ids, block_size, extra))
        elif isinstance(e, RemovedBlock):
            out.append(BlockRemoved([block_hash_to_int(e.block_hash)]))
        elif e == CLEARED:
            out.append(AllCleared())
    return out


def _stats(core) -> dict:
    s = core.stats()
    return {
        "running": s.num_running,
        "waiting": s.num_waiting,
        "kv_usage": s.kv_cache_usage,
        "prefix_queries": s.prefix_cache.queries,
        "prefix_hits": s.prefix_cache.hits,
        "preemptions": s.num_preemptions,
        "steps": s.num_steps,
        "free_blocks": s.num_free_kv_blocks,
        "num_blocks": s.num_kv_blocks,
    }
