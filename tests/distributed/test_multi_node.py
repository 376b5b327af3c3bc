"""Ranks that span pods (``--nnodes``): node 0 is `pagoda serve` with the API and rank 0, node 1 a
second `pagoda serve --node-rank 1` with rank 1 and no API; they meet at node 0's TCP store, as
two pods of a group do (e2e/test_real_containers.py runs them as real pods). Here both nodes
are processes on loopback (gloo, CPU, float32)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from benchmarks.parity import random_prompts
from pagoda_daemon.config import EngineConfig
from pagoda_daemon.server.serve import node_rank_from_hostname
from tests.server.conftest import ServerProcess, free_port

LOOPBACK = {"GLOO_SOCKET_IFNAME": "lo"}


def _node(model: str, port: int, log: Path, rank: int = 1, ready_port: int = 0) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pagoda_daemon", "--log-level", "INFO", "serve", model, "--device", "cpu",
           "--numa-policy", "none", "--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory-bytes",
           str(64 << 20), "--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", str(rank),
           "--master-addr", "127.0.0.1", "--master-port", str(port), "--node-ready-port", str(ready_port)]
    env = {**os.environ, **LOOPBACK, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _leader(model: str, port: int, tmp_path: Path, *extra: str) -> ServerProcess:
    return ServerProcess(model, "--max-model-len", "256", "--dtype", "float32", "--tensor-parallel-size", "2",
                         "--nnodes", "2", "--master-port", str(port), *extra, log_dir=tmp_path, served_name="tiny",
                         env=LOOPBACK)


def test_two_nodes_answer_as_one_process_and_stop_together(tiny_models, tmp_path):
    from pagoda_daemon import LLM, SamplingParams

    path = tiny_models["qwen3"]
    port = free_port()
    ready_port = free_port()
    node = _node(path, port, tmp_path / "node1.log", ready_port=ready_port)
    deadline = time.monotonic() + 60
    while "node 1 of 2" not in (tmp_path / "node1.log").read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    with pytest.raises(ConnectionRefusedError):  # not ready: the leader is not there yet
        socket.create_connection(("127.0.0.1", ready_port), timeout=5)
    srv = _leader(path, port, tmp_path)
    try:
        srv.wait_ready(timeout=180)
        deadline = time.monotonic() + 30
        while "ready on port" not in (tmp_path / "node1.log").read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        socket.create_connection(("127.0.0.1", ready_port), timeout=5).close()
        prompts = random_prompts(512, [4, 40], seed=int(torch.randint(0, 2**31, ()).item()))
        got = [httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": p, "max_tokens": 10,
                                                             "temperature": 0, "ignore_eos": True},
                          timeout=60).json()["choices"][0]["text"] for p in prompts]
        one = LLM(path, dtype="float32", device="cpu", max_model_len=256, num_kv_blocks=64)
        want = one.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
        assert got == [w.outputs[0].text for w in want]
        engine = srv.engine_pid()
        assert Path(f"/proc/{engine}/task/{engine}/children").read_text().split() == []  # rank 1 is node 1's
        assert "node 1 of 2: ranks 1..1" in (tmp_path / "node1.log").read_text()
    finally:
        assert srv.stop() == 0
    assert node.wait(30) == 0, (tmp_path / "node1.log").read_text()[-2000:]  # told to stop, not failed


def test_an_idle_leader_finds_a_dead_node_and_exits(tiny_models, tmp_path):
    """No request runs, so no collective would notice: the heartbeat does, and the leader exits 1
    (its pod restarts, the group re-forms)."""
    port = free_port()
    node = _node(tiny_models["qwen3"], port, tmp_path / "node1.log")
    srv = _leader(tiny_models["qwen3"], port, tmp_path, "--node-heartbeat-timeout", "6")
    try:
        srv.wait_ready(timeout=180)
        os.killpg(node.pid, signal.SIGKILL)  # the whole pod: supervisor and rank
        killed = time.monotonic()
        assert srv.proc.wait(60) == 1
        assert time.monotonic() - killed < 30
        log_text = srv.log_path.read_text()
        assert "lost the other ranks" in log_text and "has not beaten for 6 s" in log_text
    finally:
        srv.stop()
        if node.poll() is None:
            os.killpg(node.pid, signal.SIGKILL)


def test_a_node_whose_leader_dies_exits_1(tiny_models, tmp_path):
    port = free_port()
    node = _node(tiny_models["qwen3"], port, tmp_path / "node1.log")
    srv = _leader(tiny_models["qwen3"], port, tmp_path)
    try:
        srv.wait_ready(timeout=180)
        os.kill(srv.engine_pid(), signal.SIGKILL)
        assert node.wait(30) == 1, (tmp_path / "node1.log").read_text()[-2000:]
    finally:
        srv.stop()
        if node.poll() is None:
            os.killpg(node.pid, signal.SIGKILL)


def test_node_rank_from_a_stateful_set_hostname():
    assert node_rank_from_hostname("llama-0-0") == 1
    assert node_rank_from_hostname("llama-12-6") == 7
    for bad in ("llama", "llama-", "-3x", "llama-a"):
        with pytest.raises(ValueError, match="does not end in -<ordinal>"):
            node_rank_from_hostname(bad)


@pytest.mark.parametrize("fields, message", [
    ({"tensor_parallel_size": 3, "nnodes": 2}, "cannot be split evenly over nnodes 2"),
    ({"tensor_parallel_size": 2, "nnodes": 2, "node_rank": 2}, "node_rank 2 must be below nnodes 2"),
    ({"nnodes": 0}, "nnodes"),
    ({"master_port": 70000}, "master_port"),
    ({"node_heartbeat_timeout": 4.0}, "node_heartbeat_timeout must be at least 5"),
    ({"node_heartbeat_timeout": float("nan")}, "node_heartbeat_timeout must be a finite number"),
    ({"node_heartbeat_timeout": 1e9}, "node_heartbeat_timeout must be at most 3600"),
])
def test_bad_node_layouts_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="/m", **fields)


def test_a_node_that_comes_back_restarts_the_group_at_once(tiny_models, tmp_path):
    """A member's pod restarted fast (before its silence would show): its new process sets a new
    heartbeat incarnation, and the leader leaves the old world instead of waiting for the silence."""
    port = free_port()
    node = _node(tiny_models["qwen3"], port, tmp_path / "node1.log")
    srv = _leader(tiny_models["qwen3"], port, tmp_path)
    again = None
    try:
        srv.wait_ready(timeout=180)
        os.killpg(node.pid, signal.SIGKILL)
        again = _node(tiny_models["qwen3"], port, tmp_path / "node1-again.log")
        assert srv.proc.wait(60) == 1
        assert "rank 1 restarted" in srv.log_path.read_text()
        assert again.wait(60) == 1  # the leader it joined went away: it exits too, and its pod restarts
    finally:
        srv.stop()
        for proc in (node, again):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
