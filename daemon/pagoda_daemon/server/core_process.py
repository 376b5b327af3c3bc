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
from pagoda_daemon.engine.messages import (
    STARTUP_PHASES,
    AbortRequests,
    AddRequest,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineFailed,
    EngineReady,
    EngineStarting,
    FinishRequest,
    ResizeExperts,
    Shutdown,
    WakeUp,
)
from pagoda_daemon.logs import configure as configure_logging
from pagoda_daemon.server import wire

log = logging.getLogger(__name__)

IDLE_POLL_MS = 500  # how often an idle engine checks that its parent is alive
# Data-parallel attention: how long an idle engine waits for input before it agrees the next
# step with the other engines, at first; doubled after each idle agreement up to an idle engine's
# usual wait. An agreement every 2 ms cost each idle engine 37-39% of a core; doubling up to 64 ms,
# 4%; up to 500 ms, 0.8% (2 CPU engines, 20 s idle, 2026-11-29). The API server wakes the idle
# engines when it sends a request (WakeUp), so the longer waits delay only a request that arrives
# as a burst of work ends (an engine took its WakeUp during the burst), and then by the few
# milliseconds waited so far.
LOCKSTEP_IDLE_POLL_MS = 2
LOCKSTEP_IDLE_POLL_MAX_MS = IDLE_POLL_MS
PARENT_CHECK_S = 0.25  # how often a busy engine checks it (behind PR_SET_PDEATHSIG, which is at once)
PR_SET_PDEATHSIG = 1  # linux/prctl.h


class ParentGone(BaseException):
    """The API server died: stop at once, whatever the engine is doing (BaseException so
    no `except Exception` on the way out swallows it)."""


def run_engine_core(config: EngineConfig, input_addr: str, output_addr: str, parent_pid: int,
                    log_level: str = "INFO", kv_events_endpoint: str | None = None) -> None:
    """Process entry point (multiprocessing spawn target)."""
    configure_logging(log_level, "engine-core" + (f"-{config.data_parallel_rank}" if config.data_parallel_size > 1 else ""))
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
    core = None
    try:
        try:
            from pagoda_daemon.engine.engine_core import EngineCore
            from pagoda_daemon.heap import freeze_startup_heap

            started = time.monotonic()

            def enter(name: str) -> None:  # where start-up is, for /ready
                outputs.send(wire.encode(EngineStarting(name, round(time.monotonic() - started, 3))))

            core = EngineCore(config, exit_on_worker_death=True, on_phase=enter)
            built = time.monotonic()
            enter(STARTUP_PHASES[3])
            core.warm_up()
            freeze_startup_heap()  # this process only runs the engine: its start-up heap lives as long
            log.info("start-up: warm-up in %.1f s; engine ready in %.1f s (%s, %s, max_model_len %d)",
                     time.monotonic() - built, time.monotonic() - started, core.worker_info.device,
                     core.worker_info.dtype, core.max_model_len)
        except Exception as e:  # startup failures go back to the API server as text, then we exit
            log.exception("engine core failed to start")
            outputs.send(wire.encode(EngineFailed(f"engine failed to start: {e}")))
            sys.exit(1)
        info = core.worker_info
        ranks = core.executor.worker_infos()
        outputs.send(wire.encode(EngineReady(
            max_model_len=core.max_model_len,
            num_kv_blocks=core.kv_cache.num_blocks,
            block_size=config.block_size,
            device=info.device,
            dtype=info.dtype,
            gpus=[r.gpu for r in ranks if r.gpu is not None],
            numa_nodes=sorted({r.numa_node for r in ranks if r.numa_node is not None}),
            expert_parallel_size=config.data_experts_engines or config.expert_parallel_size,
            startup_seconds=round(time.monotonic() - started, 3),
        )))
        outputs.send(wire.encode(EngineCoreOutputs([], core.make_stats())))  # gauges start from the truth
        if kv_events_endpoint:
            from pagoda_daemon.telemetry.kv_events import KVEventPublisher, offset_endpoint

            rank = config.data_parallel_rank
            publisher = KVEventPublisher(offset_endpoint(kv_events_endpoint, rank), data_parallel_rank=rank)
            log.info("publishing KV events on %s", publisher.endpoint)
        try:
            _loop(core, inputs, outputs, parent_pid, config.block_size, publisher)
        except Exception:
            message = traceback.format_exc()
            log.error("engine core crashed:\n%s", message)
            outputs.send(wire.encode(EngineFailed(f"engine core crashed: {message.strip().splitlines()[-1]}")))
            sys.exit(1)
    except ParentGone:
        outputs.setsockopt(zmq.LINGER, 0)  # nobody will read what is queued
        raise
    finally:
        if core is not None:
            with contextlib.suppress(Exception):  # tensor-parallel workers also exit with this process
                core.shutdown()
        if publisher is not None:
            publisher.close()
        inputs.close(0)
        outputs.close()
        ctx.term()


def _loop(core, inputs, outputs, parent_pid: int, block_size: int, publisher=None) -> None:
    poller = zmq.Poller()
    poller.register(inputs, zmq.POLLIN)
    next_parent_check = time.monotonic() + PARENT_CHECK_S
    lockstep = core.lockstep  # data-parallel attention: every step agreed with the other engines
    idle_poll_ms = IDLE_POLL_MS if lockstep is None else LOCKSTEP_IDLE_POLL_MS
    while True:
        if lockstep is not None:  # longer waits while every engine stays idle, short ones after work
            idle_poll_ms = (min(2 * idle_poll_ms, LOCKSTEP_IDLE_POLL_MAX_MS) if not lockstep.others_may_be_busy
                            else LOCKSTEP_IDLE_POLL_MS)
        busy = core.has_unfinished_requests() or (lockstep is not None and lockstep.others_may_be_busy)
        if (not busy and not poller.poll(idle_poll_ms)) or time.monotonic() >= next_parent_check:
            if os.getppid() != parent_pid:
                raise ParentGone
            next_parent_check = time.monotonic() + PARENT_CHECK_S
        changed = False
        resize_to = None
        while True:  # drain everything that arrived
            try:
                frame = inputs.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            changed = True
            try:  # never expected (the API validates): a bad frame or ADD fails its request, not the engine
                message = wire.decode_to_core(frame)
                if isinstance(message, WakeUp):  # it has ended the idle wait: agree the next step now
                    idle_poll_ms = LOCKSTEP_IDLE_POLL_MS
                    continue
                if isinstance(message, AddRequest):
                    try:
                        core.add_request(wire.to_request(message, block_size, core.model_config.vocab_size))
                    except Exception as e:
                        raise wire.BadFrame(f"{type(e).__name__}: {e}", message.request_id) from e
            except wire.BadFrame as e:
                log.error("rejected %s: %s", f"request {e.request_id}" if e.request_id else "a frame", e)
                if e.request_id is not None:
                    failed = EngineCoreOutput(e.request_id, [], "abort", f"rejected by the engine: {e}")
                    outputs.send(wire.encode(EngineCoreOutputs([failed], core.make_stats())))
                continue
            if isinstance(message, AbortRequests):
                core.abort_requests(message.request_ids)
            elif isinstance(message, FinishRequest):
                core.finish_request(message.request_id, message.stop_reason)
            elif isinstance(message, ResizeExperts):
                resize_to = message.size
            elif isinstance(message, Shutdown):
                if lockstep is None:
                    return
                lockstep.stopping = True  # leave with the others, none waiting in a collective for us
        if resize_to is not None:
            _resize(core, resize_to, outputs)
        if lockstep is not None:
            had_work = core.has_unfinished_requests()
            done = core.step()  # an agreement every time round, busy or not (lockstep.py)
            if done or had_work or changed:
                outputs.send(wire.encode(EngineCoreOutputs(done, core.make_stats())))
            if lockstep.last.all_stopping:
                return
        elif core.has_unfinished_requests():
            outputs.send(wire.encode(EngineCoreOutputs(core.step(), core.make_stats())))
        elif changed:
            outputs.send(wire.encode(EngineCoreOutputs([], core.make_stats())))
        if publisher is not None:
            events = core.take_kv_events()
            if events:
                publisher.publish(kv_events_for_publishing(events, block_size))


def _resize(core, size: int, outputs) -> None:
    """Elastic EP between two steps; each phase's stats go out as it begins (the admin endpoint
    and the metrics show it), then the outputs of the step that was in flight."""

    def progress(_phase: str) -> None:
        outputs.send(wire.encode(EngineCoreOutputs([], core.make_stats())))

    try:
        collected = core.resize_experts(size, progress)
    except ValueError as e:  # never expected (the API checks the bounds first)
        log.error("elastic EP: resize to %d refused: %s", size, e)
        return
    outputs.send(wire.encode(EngineCoreOutputs(collected, core.make_stats())))


def kv_events_for_publishing(events: list, block_size: int) -> list:
    """The block pool's events in the published (vLLM-compatible) shapes."""
    from pagoda_daemon.engine.block_pool import CLEARED, RemovedBlock, StoredBlock
    from pagoda_daemon.telemetry.kv_events import AllCleared, BlockRemoved, BlockStored, block_hash_to_int

    out: list[BlockStored | BlockRemoved | AllCleared] = []
    for e in events:
        if isinstance(e, StoredBlock):
            parent = None if e.parent_hash is None else block_hash_to_int(e.parent_hash)
            extra = [[list(k) for k in e.extra_keys]] if e.extra_keys else None
            out.append(BlockStored([block_hash_to_int(e.block_hash)], parent, e.token_ids, block_size, extra,
                                   e.medium))
        elif isinstance(e, RemovedBlock):
            out.append(BlockRemoved([block_hash_to_int(e.block_hash)], e.medium))
        elif e == CLEARED:
            out.append(AllCleared())
    return out
