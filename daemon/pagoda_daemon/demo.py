"""`pagoda demo`: the main job on an embedded default, end to end on one machine.

Builds a tiny random-weight model, starts `pagoda serve` on loopback, asks it a chat
question through the official `openai` client (plain and streamed), prints what came
back and the server's metrics, and stops the server.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 180.0) -> None:
    """Until ``pagoda serve`` at ``url`` answers /ready with 200 (also used by benchmarks)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the server was not ready after {timeout_s:.0f} s")


def run_demo(arch: str = "llama", question: str = "What is paged attention?") -> int:
    import openai

    from pagoda_daemon.cli import tiny_model_dir
    from pagoda_daemon.server.auth import API_KEY_ENV, split_list

    model = tiny_model_dir(arch)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile(prefix="pagoda-demo-", suffix=".log", delete=False)  # noqa: SIM115
    cmd = [sys.executable, "-m", "pagoda_daemon", "--log-level", "INFO", "serve", str(model), "--host", "127.0.0.1",
           "--port", str(port), "--served-model-name", f"tiny-{arch}", "--kv-cache-memory-bytes", str(64 << 20)]
    print(f"[1/3] starting: {' '.join(cmd[1:])}\n      (log: {log.name})", flush=True)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
    try:
        wait_ready(url, proc)
        keys = split_list(os.environ.get(API_KEY_ENV))  # the server inherits the key from this environment
        client = openai.OpenAI(base_url=url + "/v1", api_key=keys[0] if keys else "none", max_retries=0)
        messages = [{"role": "user", "content": question}]
        print(f"[2/3] POST /v1/chat/completions: {question!r}", flush=True)
        reply = client.chat.completions.create(model=f"tiny-{arch}", messages=messages, max_tokens=24, temperature=0)
        print(f"      -> {reply.choices[0].message.content!r}  ({reply.usage.completion_tokens} tokens, "
              f"finish_reason={reply.choices[0].finish_reason})")
        stream = client.chat.completions.create(model=f"tiny-{arch}", messages=messages, max_tokens=24,
                                                temperature=0, stream=True)
        pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
        print(f"      streamed in {len(pieces)} chunks, same text: {''.join(pieces) == reply.choices[0].message.content}")
        print("      (a tiny model with random weights: the text is noise by design; the serving path is real)")
        with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
            metrics = [line for line in r.read().decode().splitlines()
                       if line.startswith(("vllm:generation_tokens_total", "vllm:request_success_total",
                                           "vllm:kv_cache_usage_perc"))]
        print("[3/3] GET /metrics (excerpt):\n      " + "\n      ".join(metrics))
        print(f"\nNext: `pagoda serve {model}` to keep it running, docs/server.md for the API, "
              "docs/architecture.md for the design.")
        return 0
    except (RuntimeError, TimeoutError, openai.OpenAIError, OSError) as e:
        print(f"pagoda demo failed: {e}; server log: {log.name}", file=sys.stderr)
        return 1
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
