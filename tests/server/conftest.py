"""A real `pagoda serve` process on loopback, with the tiny models from tests/conftest.py."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

MODEL_NAME = "tiny-llama"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, model: str, *extra: str, log_dir: Path, served_name: str | None = MODEL_NAME,
                 env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"server-{self.port}.log"
        self.tmp_dir = log_dir / f"tmp-{self.port}"  # the server's TMPDIR: its IPC folder is found here
        self.tmp_dir.mkdir()
        name = ["--served-model-name", served_name] if served_name else []
        self.cmd = cmd = [sys.executable, "-m", "pagoda_daemon", "--log-level", "INFO", "serve", model,
                          "--host", "127.0.0.1", "--port", str(self.port), *name,
                          "--device", "cpu", "--numa-policy", "none", "--kv-cache-memory-bytes", str(64 << 20), *extra]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "TMPDIR": str(self.tmp_dir),
               **(env or {})}
        self.log = open(self.log_path, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"server not ready:\n{self.log_path.read_text()[-3000:]}")

    def engine_pid(self) -> int:
        """The EngineCore process: the server's child started by multiprocessing's spawn."""
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        for pid in children:
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return int(pid)
        raise AssertionError(f"no engine process among {children}")

    def ipc_dirs(self) -> list[Path]:
        return sorted(self.tmp_dir.glob("pagoda-*"))

    def health(self) -> httpx.Response:
        return httpx.get(self.url + "/health", timeout=5)

    def wait_idle(self, timeout: float = 20.0) -> dict:
        """Until the engine holds no request and no block (what 'every block came back' means)."""
        deadline = time.monotonic() + timeout
        engine = {}
        while time.monotonic() < deadline:
            engine = self.health().json()["engine"]
            if engine.get("num_running") == 0 and engine.get("num_waiting") == 0 and \
                    engine.get("num_free_kv_blocks") == engine.get("num_kv_blocks"):
                return engine
            time.sleep(0.2)
        raise AssertionError(f"engine not idle: {engine}")

    def stop(self, sig=signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


@contextlib.contextmanager
def running(model: str, *extra: str, log_dir: Path, served_name: str = MODEL_NAME) -> Iterator[ServerProcess]:
    """A server of `model`, ready; stopped on exit."""
    srv = ServerProcess(model, *extra, log_dir=log_dir, served_name=served_name)
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def server(tiny_models, tmp_path_factory):
    with running(tiny_models["llama"], "--max-model-len", "512", log_dir=tmp_path_factory.mktemp("logs")) as srv:
        yield srv


REASONING_MODEL_NAME = "tiny-qwen3"
REASONING_SERVER_ARGS = ("--max-model-len", "1024", "--reasoning-parser", "qwen3")


@pytest.fixture(scope="module")
def reasoning_server(tiny_models, tmp_path_factory):
    """The tiny Qwen3 with `--reasoning-parser qwen3`: <think> reasoning, hermes tool calls."""
    with running(tiny_models["qwen3"], *REASONING_SERVER_ARGS, log_dir=tmp_path_factory.mktemp("logs"),
                 served_name=REASONING_MODEL_NAME) as srv:
        yield srv


@pytest.fixture(scope="session")
def openai_client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@contextlib.contextmanager
def server_starter(model: str, log_dir: Path) -> Iterator[Callable[..., ServerProcess]]:
    """A function that starts dedicated servers of `model`, ready when it returns; every one
    started is killed on exit."""
    started: list[ServerProcess] = []

    def start(*extra: str, **kwargs) -> ServerProcess:
        srv = ServerProcess(model, "--max-model-len", "512", *extra, log_dir=log_dir, **kwargs)
        started.append(srv)
        srv.wait_ready()
        return srv

    try:
        yield start
    finally:
        for srv in started:
            srv.stop(signal.SIGKILL)


@pytest.fixture
def start_server(tiny_models, tmp_path):
    """Start a dedicated server (for tests that break or stop it)."""
    with server_starter(tiny_models["llama"], tmp_path) as start:
        yield start
