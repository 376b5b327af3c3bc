"""`pagoda serve hf://...`: the model is fetched from a (loopback, real HTTP) Hub into the cache,
then served; references the daemon cannot fetch are refused at start, exit 2, in one line."""

from __future__ import annotations

import time

import httpx
import pytest

from pagoda_daemon.models.fetch import needed
from pagoda_daemon.models.model_cache import entries, evict
from tests.models.hub_server import HubServer
from tests.server.conftest import ServerProcess


def test_serve_fetches_an_hf_model_and_answers_a_completion(tiny_models, tmp_path):
    hub = HubServer(token="secret").start()
    sha = hub.add_repo("org/tiny", tiny_models["llama"], {"pytorch_model.bin": b"\0" * 1024})
    cache = tmp_path / "cache"
    env = {"HF_ENDPOINT": hub.url, "HF_TOKEN": "secret", "HF_HUB_OFFLINE": "0", "PAGODA_CACHE_DIR": str(cache)}
    hub.delay_s = 0.3  # about 4 s of download: long enough to ask the probes meanwhile
    srv = ServerProcess("hf://org/tiny", "--max-model-len", "512", log_dir=tmp_path, served_name=None, env=env)
    try:
        deadline = time.monotonic() + 30
        while not hub.file_requests("config.json") and time.monotonic() < deadline:
            time.sleep(0.05)
        health = httpx.get(srv.url + "/health", timeout=5)
        ready = httpx.get(srv.url + "/ready", timeout=5)
        assert health.status_code == 200 and ready.status_code == 503
        phase = ready.json()["startup"][0]
        assert phase["phase"] == "downloading model" and phase["files_total"] == sum(map(needed, hub.repos["org/tiny"].files)), phase
        assert httpx.get(srv.url + "/v1/models", timeout=5).status_code == 503
        hub.delay_s = 0
        srv.wait_ready()
        assert httpx.get(srv.url + "/v1/models", timeout=10).json()["data"][0]["id"] == "org/tiny"
        r = httpx.post(srv.url + "/v1/completions", timeout=60,
                       json={"model": "org/tiny", "prompt": "The capital of France is", "max_tokens": 4,
                             "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        # what the operator reads into status.placement[].modelRevision
        info = [line for line in httpx.get(srv.url + "/metrics", timeout=10).text.splitlines()
                if line.startswith("pagoda:model_info{")]
        assert len(info) == 1 and f'revision="{sha}"' in info[0] and 'source="hf://org/tiny"' in info[0], info
        # the serving daemon holds its entry: the node agent's eviction passes over it
        assert [(e.revision, e.in_use) for e in entries(cache)] == [(sha, True)]
        assert evict(cache, max_bytes=0) == []
    finally:
        srv.stop()
        hub.stop()
    log = srv.log_path.read_text()
    assert f"hf://org/tiny: resolved revision {sha}" in log
    assert "downloading model: " in log and "hf://org/tiny: done in" in log
    assert (cache / "hf" / "org%2Ftiny" / sha / ".pagoda-complete.json").is_file()
    assert not hub.file_requests("pytorch_model.bin")
    assert [e.in_use for e in entries(cache)] == [False]  # released with the process


@pytest.mark.parametrize("model, message", [
    ("gs://bucket/model", "model 'gs://bucket/model': scheme 'gs' is not one of hf://, s3://, pvc://"),
    ("hf://org/name/extra", "model 'hf://org/name/extra': 'org/name/extra' is not a Hugging Face repository id"),
    ("hf://org/name@../x", "model 'hf://org/name@../x': '../x' is not a revision"),
    ("s3://Bad_Bucket/m", "model 's3://Bad_Bucket/m': 'Bad_Bucket' is not an S3 bucket name"),
    ("s3://bucket/a/../b", "model 's3://bucket/a/../b': the path may not contain"),
    ("pvc://weights/llama", "model 'pvc://weights/llama': pvc:// claims are mounted by the operator"),
])
def test_references_the_daemon_cannot_fetch_exit_2_in_one_line(capsys, tmp_path, model, message):
    from pagoda_daemon.cli import main

    assert main(["serve", model, "--model-cache-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pagoda serve: " + message), err
    assert err.count("\n") == 1
    assert not any(tmp_path.iterdir())  # nothing was contacted or written


def test_a_fetch_failure_exits_1_naming_the_source(capsys, tmp_path, monkeypatch):
    from huggingface_hub import constants

    from pagoda_daemon.cli import main

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    hub = HubServer(token="secret").start()
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_TOKEN", "wrong")
    try:
        assert main(["serve", "hf://org/tiny", "--model-cache-dir", str(tmp_path)]) == 1
    finally:
        hub.stop()
    err = capsys.readouterr().err
    assert err.startswith("pagoda serve: cannot fetch the model: hf://org/tiny: 401 Unauthorized: "), err
