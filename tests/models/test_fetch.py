"""Fetching hf:// and s3:// models into the node cache (models/fetch.py), against real servers:
the Hub-compatible server of hub_server.py (spoken to by the real `huggingface_hub`) and moto's
S3 server (spoken to by the real boto3). Nothing of either protocol is mocked."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pagoda_daemon.model_uri import parse
from pagoda_daemon.models.fetch import (
    COMPLETE_MARKER,
    FetchProgress,
    ModelFetchError,
    Retry,
    fetch,
    needed,
    resolve_model,
)
from tests.models.hub_server import HubServer

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "hf_test_token"
NO_WAIT = Retry(attempts=5, base_s=1.0, sleep=lambda s: None)
EXTRA = {"pytorch_model.bin": b"\0" * 4096, "README.md": b"# tiny\n", "original/consolidated.safetensors": b"x" * 64,
         "onnx/model.onnx": b"o" * 32, "logo.png": b"\x89PNG",
         "consolidated.safetensors": b"c" * 64}  # a copy the index does not name (as Mistral's repos have)


@pytest.fixture(autouse=True)
def _hub_online(monkeypatch):
    """tests/conftest.py sets HF_HUB_OFFLINE=1 for every test; these ones talk to a loopback Hub."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


@pytest.fixture
def hub(tiny_models):
    server = HubServer(token=TOKEN).start()
    server.add_repo("org/tiny", tiny_models["llama"], EXTRA)
    yield server
    server.stop()


def hf_env(hub: HubServer, token: str | None = TOKEN) -> dict[str, str]:
    return {"HF_ENDPOINT": hub.url, **({"HF_TOKEN": token} if token else {})}


def model_files(directory: str | Path) -> dict[str, bytes]:
    root = Path(directory)
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*")
            if p.is_file() and not p.name.startswith(".") and ".cache" not in p.parts}


def test_needed_files_are_what_the_loader_reads():
    assert all(needed(n) for n in ("config.json", "model-00001-of-00002.safetensors", "model.safetensors.index.json",
                                   "tokenizer.json", "tokenizer.model", "chat_template.jinja", "merges.txt",
                                   "additional_chat_templates/tool_use.jinja", "generation_config.json"))
    assert not any(needed(n) for n in ("pytorch_model.bin", "model.pt", "model.gguf", "README.md", "logo.png",
                                       "original/consolidated.safetensors", "onnx/model.onnx", "../config.json",
                                       "/config.json", "a//config.json", ".gitattributes"))


def test_a_fetched_model_generates_what_the_local_directory_does(hub, tiny_models, tmp_path):
    from pagoda_daemon import LLM, SamplingParams

    seen: list[FetchProgress] = []
    local = fetch(parse("hf://org/tiny"), tmp_path, env=hf_env(hub), on_progress=seen.append)
    assert local.parent.name == "org%2Ftiny" and local.name == hub.repos["org/tiny"].sha
    assert local.parent.parent == tmp_path / "hf"
    source = model_files(tiny_models["llama"])
    assert model_files(local) == source  # every file the loader reads, byte for byte, and nothing else
    marker = json.loads((local / COMPLETE_MARKER).read_text())
    assert marker["source"] == "hf://org/tiny" and marker["revision"] == local.name
    weights = next(n for n in source if n.endswith(".safetensors"))
    assert marker["files"][weights]["sha256"] == hashlib.sha256(source[weights]).hexdigest()
    assert seen[0].files_done <= 1 and seen[-1].files_done == seen[-1].files_total == len(source)  # (the index first)
    assert seen[-1].bytes_done == seen[-1].bytes_total == sum(map(len, source.values()))
    assert seen[-1].eta_s == 0.0

    params = SamplingParams(temperature=0.0, max_tokens=8)
    prompts = ["The capital of France is", "Paged attention stores"]
    outputs = []
    for path in (tiny_models["llama"], str(local)):
        llm = LLM(path, device="cpu", max_model_len=256, num_kv_blocks=32, numa_policy="none")
        outputs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        del llm
    assert outputs[0] == outputs[1] and all(outputs[0])


def test_only_needed_files_are_requested_and_a_second_fetch_downloads_nothing(hub, tmp_path):
    first = fetch(parse("hf://org/tiny"), tmp_path, env=hf_env(hub))
    requested = {r[1].rsplit("/resolve/", 1)[1].split("/", 1)[1] for r in hub.resolve_requests()}
    assert requested and all(needed(n) for n in requested)
    assert requested == set(model_files(first))
    assert not {"pytorch_model.bin", "README.md", "original/consolidated.safetensors", "logo.png",
                "consolidated.safetensors"} & requested
    assert all(len(hub.file_requests(n)) == 1 for n in requested)

    hub.requests.clear()
    marker = first / COMPLETE_MARKER
    os.utime(marker, (0, 0))
    again = fetch(parse("hf://org/tiny"), tmp_path, env=hf_env(hub))
    assert again == first
    assert hub.resolve_requests() == []  # the branch is resolved (one API call), no file is asked for
    assert [r[1] for r in hub.requests] == ["/api/models/org/tiny/revision/main"] or \
        [r[1] for r in hub.requests] == ["/api/models/org/tiny"]
    assert marker.stat().st_mtime > 0  # touched: the entry's last use, for LRU eviction

    hub.requests.clear()  # a pinned commit needs no request at all once complete
    assert fetch(parse(f"hf://org/tiny@{first.name}"), tmp_path, env=hf_env(hub)) == first
    assert hub.requests == []


def test_the_cached_revision_is_used_when_the_hub_is_unreachable(hub, tmp_path, caplog):
    first = fetch(parse("hf://org/tiny"), tmp_path, env=hf_env(hub))
    hub.fail_first["/api/models/"] = 100
    with caplog.at_level(logging.WARNING, "pagoda.fetch"):
        assert fetch(parse("hf://org/tiny"), tmp_path, env=hf_env(hub), retry=NO_WAIT) == first
    assert "using the cached revision" in caplog.text


def test_hf_hub_offline_serves_only_a_revision_fetched_before(hub, tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelFetchError, match=r"^hf://org/tiny: HF_HUB_OFFLINE is set"):
        fetch(parse("hf://org/tiny"), tmp_path, env=hf_env(hub))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    first = fetch(parse("hf://org/tiny"), tmp_path, env=hf_env(hub))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    hub.requests.clear()
    assert fetch(parse("hf://org/tiny"), tmp_path, env=hf_env(hub)) == first
    assert hub.requests == []


def test_two_processes_fetching_together_download_each_file_once(hub, tmp_path):
    hub.delay_s = 0.05  # the first holds the lock long enough for the second to wait on it
    script = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from pagoda_daemon.model_uri import parse
        from pagoda_daemon.models.fetch import fetch
        print(fetch(parse("hf://org/tiny"), Path(sys.argv[1]), env={json.dumps(hf_env(hub))}))
    """)
    env = {**os.environ, "HF_HUB_OFFLINE": "0", "PYTHONPATH": str(ROOT / "daemon")}
    procs = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    results = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    assert results[0][0] == results[1][0]
    gets = [r for r in hub.resolve_requests() if r[0] == "GET"]
    names = [r[1].rsplit("/", 1)[1] for r in gets]
    assert names and len(names) == len(set(names)), names  # each file once, over both processes


def test_a_fetch_waiting_on_a_replica_that_then_serves_the_entry_returns(hub, tmp_path):
    """A replica waits for another's fetch; the other finishes and, serving, keeps a shared lock
    on the entry for its lifetime (model_cache.hold). The waiter returns the complete entry
    instead of waiting for an exclusive lock no one will release."""
    import fcntl
    import threading

    from pagoda_daemon.models.fetch import lock_path

    entry = fetch(parse("hf://org/tiny"), tmp_path, env=hf_env(hub))
    marker = entry / COMPLETE_MARKER
    record = marker.read_bytes()
    marker.unlink()  # the entry as the fetching replica sees it before it is done
    fetching = open(lock_path(entry), "a")  # noqa: SIM115 (held across the test)
    fcntl.flock(fetching, fcntl.LOCK_EX)
    hub.requests.clear()
    result: list = []
    waiter = threading.Thread(target=lambda: result.append(fetch(parse("hf://org/tiny"), tmp_path,
                                                                 env=hf_env(hub))), daemon=True)
    waiter.start()
    waiter.join(1.0)
    assert waiter.is_alive()  # waiting for the lock
    try:
        marker.write_bytes(record)  # done: then the fetcher serves, holding the entry shared
        fcntl.flock(fetching, fcntl.LOCK_SH)  # (a conversion: no waiter gets in between)
        waiter.join(10.0)
        assert not waiter.is_alive() and result == [entry]
        assert hub.resolve_requests() == []  # no file asked for again
    finally:
        fetching.close()


def test_an_interrupted_download_resumes_with_a_range_request(hub, tmp_path, monkeypatch):
    """The server cuts the connection after 1000 bytes of a shard; `huggingface_hub` keeps what
    came (in chunks of DOWNLOAD_CHUNK_SIZE, 10 MB by default: made small here for a tiny file)
    and asks for the rest."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 500)
    weights = sorted(n for n in hub.repos["org/tiny"].files if n.startswith("model-"))[0]
    hub.cut_after[weights] = 1000
    local = fetch(parse("hf://org/tiny"), tmp_path, env=hf_env(hub), retry=NO_WAIT)
    ranges = [r[2] for r in hub.file_requests(weights)]
    assert ranges == [None, "bytes=1000-"]
    assert (local / weights).read_bytes() == hub.repos["org/tiny"].files[weights]


def test_a_bad_token_names_the_source_and_the_servers_401(hub, tmp_path):
    with pytest.raises(ModelFetchError) as e:
        fetch(parse("hf://org/tiny"), tmp_path, env=hf_env(hub, token="wrong"), retry=NO_WAIT)
    assert str(e.value).startswith("hf://org/tiny: 401 Unauthorized: ")
    assert "Invalid credentials in Authorization header" in str(e.value)
    assert len(hub.requests) == 1  # not retried


def test_a_missing_repository_is_a_404_with_the_hubs_message(hub, tmp_path):
    with pytest.raises(ModelFetchError, match=r"^hf://org/missing: 404 Not Found: .*Repository not found"):
        fetch(parse("hf://org/missing"), tmp_path, env=hf_env(hub), retry=NO_WAIT)
    with pytest.raises(ModelFetchError, match=r"^hf://org/tiny@nope: 404 Not Found: .*Invalid rev id: nope"):
        fetch(parse("hf://org/tiny@nope"), tmp_path, env=hf_env(hub), retry=NO_WAIT)
    assert len(hub.requests) == 2


@pytest.mark.parametrize("kind", ["lfs", "small"])
def test_a_checksum_mismatch_fails_deletes_the_file_and_leaves_no_marker(hub, tmp_path, kind):
    name = sorted(n for n in hub.repos["org/tiny"].files if n.startswith("model-"))[0] if kind == "lfs" \
        else "config.json"
    hub.corrupt.add(name)
    with pytest.raises(ModelFetchError, match=rf"^hf://org/tiny: {name} does not match its published checksum"):
        fetch(parse("hf://org/tiny"), tmp_path, env=hf_env(hub), retry=NO_WAIT)
    entry = tmp_path / "hf" / "org%2Ftiny" / hub.repos["org/tiny"].sha
    assert not (entry / name).exists() and not (entry / COMPLETE_MARKER).exists()
    hub.corrupt.clear()  # the next attempt fetches it anew and completes
    assert (fetch(parse("hf://org/tiny"), tmp_path, env=hf_env(hub)) / COMPLETE_MARKER).is_file()


def test_a_hostile_mirror_cannot_write_outside_the_cache(hub, tiny_models, tmp_path):
    cache = tmp_path / "cache"
    hub.add_repo("org/evil", tiny_models["qwen3"], {"../escape.safetensors": b"x", "/abs.json": b"{}",
                                                    "a/../../up.jinja": b"x"})
    fetch(parse("hf://org/evil"), cache, env=hf_env(hub))
    assert not any("escape" in r[1] or "abs.json" in r[1] or "up.jinja" in r[1] for r in hub.requests)
    assert {p.name for p in tmp_path.iterdir()} == {"cache"}
    (tmp_path / "empty").mkdir()
    index = json.dumps({"weight_map": {"w": "../../x.safetensors"}}).encode()
    hub.add_repo("org/index", tmp_path / "empty", {"config.json": b"{}", "model.safetensors.index.json": index})
    with pytest.raises(ModelFetchError, match=r"names weight files outside the model directory: \['\.\./\.\./x"):
        fetch(parse("hf://org/index"), cache, env=hf_env(hub), retry=NO_WAIT)
    hub.repos["org/evil"].branches["main"] = "../../../outside"
    with pytest.raises(ModelFetchError, match=r"^hf://org/evil: the Hub's answer names no commit"):
        fetch(parse("hf://org/evil"), cache, env=hf_env(hub), retry=NO_WAIT)
    assert {p.name for p in tmp_path.iterdir()} == {"cache", "empty"}


def test_transient_server_errors_are_retried_with_backoff(hub, tmp_path):
    delays: list[float] = []
    retry = Retry(attempts=5, base_s=1.0, max_s=3.0, sleep=delays.append)
    hub.fail_first["/api/models/"] = 2
    hub.fail_first["config.json"] = 2  # HEAD and GET
    local = fetch(parse("hf://org/tiny"), tmp_path, env=hf_env(hub), retry=retry)
    assert (local / COMPLETE_MARKER).is_file()
    assert delays[:2] == [1.0, 2.0] and max(delays) <= 3.0

    hub.fail_first["/api/models/"] = 10
    delays.clear()
    with pytest.raises(ModelFetchError, match=r"^hf://org/other: 500 Internal Server Error: .*bad day.*"
                                              r"gave up after 5 attempts"):
        fetch(parse("hf://org/other"), tmp_path, env=hf_env(hub), retry=retry)
    assert delays == [1.0, 2.0, 3.0, 3.0]


def test_an_unreachable_hub_is_retried_then_named(tmp_path):
    from tests.server.conftest import free_port

    delays: list[float] = []
    with pytest.raises(ModelFetchError, match=r"^hf://org/tiny: ConnectError: .*gave up after 3 attempts"):
        fetch(parse("hf://org/tiny"), tmp_path, env={"HF_ENDPOINT": f"http://127.0.0.1:{free_port()}"},
              retry=Retry(attempts=3, sleep=delays.append))
    assert delays == [1.0, 2.0]


def test_resolve_model_keeps_paths_and_refuses_what_it_cannot_fetch(hub, tmp_path):
    assert resolve_model("/models/llama", tmp_path) == "/models/llama"
    with pytest.raises(ValueError, match="pvc:// claims are mounted by the operator"):
        resolve_model("pvc://weights/llama", tmp_path)
    with pytest.raises(ValueError, match=r"model 'gs://b/m': scheme 'gs' is not one of"):
        resolve_model("gs://b/m", tmp_path)
    local = resolve_model("hf://org/tiny", None, env={**hf_env(hub), "PAGODA_CACHE_DIR": str(tmp_path / "c")})
    assert local.startswith(str(tmp_path / "c" / "hf"))


# --- S3, through moto's server ------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3_server():
    pytest.importorskip("boto3")
    moto_server = pytest.importorskip("moto.server")
    from tests.server.conftest import free_port

    port = free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1"}


@pytest.fixture
def bucket(s3_server, tiny_models, request):
    import boto3

    env = {**S3_ENV, "AWS_ENDPOINT_URL": s3_server}
    client = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
    name = "models-" + hashlib.sha1(request.node.name.encode()).hexdigest()[:12]
    client.create_bucket(Bucket=name)
    files = model_files(tiny_models["qwen3"])
    for rel, data in {**files, "pytorch_model.bin": b"\0" * 128, "README.md": b"hi"}.items():
        client.put_object(Bucket=name, Key=f"llm/qwen3/{rel}", Body=data)
    client.put_object(Bucket=name, Key="llm/qwen3-other/config.json", Body=b"{}")  # same prefix, other model
    return name, env, files, client


def test_an_s3_prefix_is_fetched_verified_and_cached(bucket, tmp_path):
    name, env, files, client = bucket
    local = fetch(parse(f"s3://{name}/llm/qwen3"), tmp_path, env=env)
    assert model_files(local) == files
    assert local.parent == tmp_path / "s3" / f"{name}%2Fllm%2Fqwen3" and len(local.name) == 16
    marker = json.loads((local / COMPLETE_MARKER).read_text())
    assert marker["files"]["config.json"]["md5"] == hashlib.md5(files["config.json"]).hexdigest()
    assert fetch(parse(f"s3://{name}/llm/qwen3"), tmp_path, env=env) == local

    client.put_object(Bucket=name, Key="llm/qwen3/config.json", Body=files["config.json"] + b"\n")
    changed = fetch(parse(f"s3://{name}/llm/qwen3"), tmp_path, env=env)
    assert changed != local and changed.parent == local.parent  # a new listing is a new revision


def test_an_interrupted_s3_download_resumes_from_its_part_file(bucket, tmp_path, caplog):
    """moto cannot cut a connection mid-body, so the interruption is what it leaves behind: a
    ``.part`` file with the first bytes. The resumed download asks for the rest only (a Range
    request): with the right first bytes the file verifies; with wrong ones the MD5 check fails,
    which shows that they were kept, not fetched again."""
    name, env, files, _ = bucket
    uri = parse(f"s3://{name}/llm/qwen3")
    entry = tmp_path / "s3" / f"{name}%2Fllm%2Fqwen3"
    revision = _s3_revision(uri, env)
    (entry / revision).mkdir(parents=True)
    (entry / revision / "tokenizer.json.part").write_bytes(b"X" * 100)
    with pytest.raises(ModelFetchError, match=rf"^s3://{name}/llm/qwen3: tokenizer.json does not match its "
                                              "published checksum \\(md5 "):
        fetch(uri, tmp_path, env=env)
    assert not (entry / revision / "tokenizer.json").exists() and not (entry / revision / COMPLETE_MARKER).exists()

    (entry / revision / "tokenizer.json.part").write_bytes(files["tokenizer.json"][:100])
    with caplog.at_level(logging.INFO, "pagoda.fetch"):
        local = fetch(uri, tmp_path, env=env)
    assert "resuming tokenizer.json at byte 100 of" in caplog.text
    assert (local / "tokenizer.json").read_bytes() == files["tokenizer.json"]


def _s3_revision(uri, env) -> str:
    from pagoda_daemon.models.fetch import _S3Source

    return _S3Source(uri, env, NO_WAIT).resolve()[0]


def test_bad_s3_credentials_name_the_source_and_the_s3_error_code(bucket, tmp_path):
    from moto.core.authorization import enable_iam_authentication

    name, env, _, _ = bucket
    with enable_iam_authentication(), pytest.raises(ModelFetchError) as e:
        fetch(parse(f"s3://{name}/llm/qwen3"), tmp_path, env={**env, "AWS_ACCESS_KEY_ID": "AKIAWRONG"},
              retry=NO_WAIT)
    assert str(e.value).startswith(f"s3://{name}/llm/qwen3: InvalidAccessKeyId: ")


def test_a_missing_bucket_and_an_empty_prefix_are_errors(bucket, tmp_path):
    name, env, _, _ = bucket
    with pytest.raises(ModelFetchError, match=r"^s3://no-such-bucket/m: NoSuchBucket: "):
        fetch(parse("s3://no-such-bucket/m"), tmp_path, env=env, retry=NO_WAIT)
    with pytest.raises(ModelFetchError, match=rf"^s3://{name}/llm/none: no config.json among"):
        fetch(parse(f"s3://{name}/llm/none"), tmp_path, env=env, retry=NO_WAIT)


def test_an_unreachable_s3_endpoint_is_retried_then_named(tmp_path):
    from tests.server.conftest import free_port

    delays: list[float] = []
    env = {**S3_ENV, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}"}
    with pytest.raises(ModelFetchError, match=r"^s3://bucket/m: EndpointConnectionError: .*gave up after 3 attempts"):
        fetch(parse("s3://bucket/m"), tmp_path, env=env, retry=Retry(attempts=3, sleep=delays.append))
    assert delays == [1.0, 2.0]
