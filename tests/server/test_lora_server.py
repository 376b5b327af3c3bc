"""LoRA adapters through a real `pagoda serve` and the openai client: an adapter named as the
model at start-up (`--lora-modules`), another registered and unregistered while serving through
the admin routes (vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter), each answering as
PEFT does on the same weights; /v1/models lists them; what cannot be served is a 4xx in the
OpenAI error shape and the server serves on."""

from __future__ import annotations

import random

import httpx
import pytest

from benchmarks.lora_parity import make_adapter, peft_greedy
from tests.server.conftest import MODEL_NAME, running

USER, ADMIN = "user-key", "admin-key"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def lora_server(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    path = tiny_models["llama"]
    seed = random.randrange(2**31)
    adapters = {
        "sql": make_adapter(path, root / "sql", seed, 8, 16.0),
        "chat": make_adapter(path, root / "chat", seed + 1, 4, 8.0, ("q_proj", "v_proj")),
        "late": make_adapter(path, root / "late", seed + 2, 16, 16.0, ("o_proj", "down_proj")),
        "too-wide": make_adapter(path, root / "wide", seed + 3, 32, 32.0, ("q_proj",)),
    }
    modules = [f"sql={adapters['sql']}", f'{{"name": "chat", "path": "{adapters["chat"]}"}}']
    with running(path, "--max-model-len", "512", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
                 "--lora-modules", *modules, "--api-key", USER, "--admin-api-key", ADMIN,
                 log_dir=tmp_path_factory.mktemp("logs")) as srv:
        yield srv, adapters


def _client(srv):
    import openai

    return openai.OpenAI(base_url=srv.url + "/v1", api_key=USER, max_retries=0, timeout=60)


def _greedy(client, model: str, prompt: list[int]) -> list[int]:
    reply = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
                                      logprobs=0)
    return [int(t.removeprefix("token_id:")) for t in reply.choices[0].logprobs.tokens]


def _admin(srv, path: str, body: dict, key: str | None = ADMIN) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(srv.url + path, json=body, headers=headers, timeout=60)


def test_adapters_answer_as_peft_does(lora_server, tiny_models):
    srv, adapters = lora_server
    client = _client(srv)
    path = tiny_models["llama"]
    prompt = [random.randrange(3, 500) for _ in range(random.randint(4, 30))]
    for model, adapter in ((MODEL_NAME, None), ("sql", adapters["sql"]), ("chat", adapters["chat"])):
        assert _greedy(client, model, prompt) == peft_greedy(path, adapter, prompt, MAX_TOKENS), model
    listed = {m.id: m for m in client.models.list().data}
    assert set(listed) == {MODEL_NAME, "sql", "chat"}
    assert listed["sql"].parent == MODEL_NAME and "/" not in listed["sql"].root  # the path on the server stays there
    chat = client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat.model == "chat" and chat.usage.completion_tokens == 4
    tokens = httpx.post(srv.url + "/tokenize", json={"model": "sql", "prompt": "hello"},
                        headers={"Authorization": f"Bearer {USER}"}).json()
    assert tokens["count"] > 0
    # vLLM's gauge for LoRA-aware routers: idle now, so no adapter running or waiting
    srv.wait_idle()
    metrics = httpx.get(srv.url + "/metrics").text
    assert 'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""}' in metrics


def test_the_lora_gauge_names_the_adapters_in_flight(lora_server):
    srv, _ = lora_server
    import re
    import threading

    client = _client(srv)
    seen: list[str] = []
    done = threading.Event()

    def scrape() -> None:
        while not done.is_set():
            seen.extend(re.findall(r'running_lora_adapters="([^"]*)"', httpx.get(srv.url + "/metrics").text))

    scraper = threading.Thread(target=scrape)
    scraper.start()
    try:
        client.completions.create(model="sql", prompt=[5] * 8, max_tokens=200, extra_body={"ignore_eos": True})
    finally:
        done.set()
        scraper.join()
    assert "sql" in seen, seen[-5:]


def test_an_adapter_registered_while_serving_then_unregistered(lora_server, tiny_models):
    srv, adapters = lora_server
    client = _client(srv)
    import openai

    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="late", prompt="x", max_tokens=2)
    assert refused.value.body["code"] == "model_not_found"
    assert _admin(srv, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": adapters["late"]},
                  key=USER).status_code == 401  # a user's key does not register adapters
    ok = _admin(srv, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": adapters["late"]})
    assert ok.status_code == 200, ok.text
    prompt = [random.randrange(3, 500) for _ in range(12)]
    # three adapters, two slots: "late" takes the slot of the one used least recently
    assert _greedy(client, "late", prompt) == peft_greedy(tiny_models["llama"], adapters["late"], prompt, MAX_TOKENS)
    assert _greedy(client, "sql", prompt) == peft_greedy(tiny_models["llama"], adapters["sql"], prompt, MAX_TOKENS)
    again = _admin(srv, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": adapters["late"]})
    assert again.status_code == 400 and "already registered" in again.json()["error"]["message"]
    assert _admin(srv, "/v1/unload_lora_adapter", {"lora_name": "late"}).status_code == 200
    assert _admin(srv, "/v1/unload_lora_adapter", {"lora_name": "late"}).status_code == 404
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="late", prompt="x", max_tokens=2)
    srv.wait_idle()


@pytest.mark.parametrize(("body", "status", "needle"), [
    ({"lora_name": "wide", "lora_path": "TOO_WIDE"}, 400, "--max-lora-rank 16"),
    ({"lora_name": "nowhere", "lora_path": "/nonexistent/adapter"}, 400, "not a directory"),
    ({"lora_name": "etc", "lora_path": "/etc"}, 400, "adapter_model.safetensors"),
    ({"lora_name": MODEL_NAME, "lora_path": "SQL"}, 400, "base model's served name"),
    ({"lora_name": "sql", "lora_path": "SQL"}, 400, "already registered"),
    ({"lora_name": "a b", "lora_path": "SQL"}, 400, "whitespace"),
    ({"lora_name": "", "lora_path": "SQL"}, 400, "lora_name"),
    ({"lora_name": "x" * 300, "lora_path": "SQL"}, 400, "lora_name"),
    ({"lora_name": 5, "lora_path": "SQL"}, 400, "lora_name"),
    ({"lora_name": "x", "lora_path": "SQL", "extra": 1}, 400, "extra"),
    ({"lora_name": "x"}, 400, "lora_path"),
])
def test_hostile_registrations_are_4xx_and_the_server_serves_on(lora_server, body, status, needle):
    srv, adapters = lora_server
    body = {k: (adapters["too-wide"] if v == "TOO_WIDE" else adapters["sql"] if v == "SQL" else v)
            for k, v in body.items()}
    reply = _admin(srv, "/v1/load_lora_adapter", body)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert needle in error["message"] or needle == error.get("param"), error
    assert srv.health().status_code == 200


def test_an_unknown_model_names_the_adapters_route(lora_server):
    srv, _ = lora_server
    import openai

    with pytest.raises(openai.BadRequestError) as refused:
        _client(srv).chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    assert "LoRA adapters" in refused.value.body["message"]
    assert httpx.get(srv.url + "/v1/models/nope", headers={"Authorization": f"Bearer {USER}"}).status_code == 404
    card = httpx.get(srv.url + "/v1/models/sql", headers={"Authorization": f"Bearer {USER}"}).json()
    assert card["id"] == "sql" and card["parent"] == MODEL_NAME


def test_a_bad_adapter_at_start_up_is_refused_in_one_line(tiny_models, tmp_path):
    import subprocess
    import sys

    (tmp_path / "empty").mkdir()
    done = subprocess.run([sys.executable, "-m", "pagoda_daemon", "serve", tiny_models["llama"], "--device", "cpu",
                           "--enable-lora", "--lora-modules", f"bad={tmp_path / 'empty'}"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "adapter 'bad'" in done.stderr and "adapter_model.safetensors" in done.stderr
    done = subprocess.run([sys.executable, "-m", "pagoda_daemon", "serve", tiny_models["llama"], "--device", "cpu",
                           "--lora-modules", f"bad={tmp_path}"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "need enable_lora" in done.stderr, done.stderr


def test_an_adapter_from_the_hub_is_fetched_at_start_up_and_served(tiny_models, tmp_path):
    """`--lora-modules NAME=hf://...`: fetched into the model cache by the real huggingface_hub
    client from a Hub-compatible server on loopback (the files an adapter needs, nothing else),
    then served as PEFT serves it; a repository that is not there fails the start in one line."""
    from tests.models.hub_server import HubServer
    from tests.server.conftest import ServerProcess

    path = tiny_models["llama"]
    adapter = make_adapter(path, tmp_path / "adapter", random.randrange(2**31), 8, 16.0)
    hub = HubServer().start()
    env = {"HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0", "PAGODA_CACHE_DIR": str(tmp_path / "cache")}
    try:
        hub.add_repo("org/sql-lora", adapter, {"training_args.bin": b"\0" * 64})
        srv = ServerProcess(path, "--max-model-len", "512", "--enable-lora", "--lora-modules",
                            "sql=hf://org/sql-lora", log_dir=tmp_path, env=env)
        try:
            srv.wait_ready()
            import openai

            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
            prompt = [random.randrange(3, 500) for _ in range(10)]
            assert _greedy(client, "sql", prompt) == peft_greedy(path, adapter, prompt, MAX_TOKENS)
        finally:
            srv.stop()
        fetched = {p.name for p in (tmp_path / "cache").rglob("*") if p.is_file() and not p.name.startswith(".")}
        assert {"adapter_config.json", "adapter_model.safetensors"} <= fetched and "training_args.bin" not in fetched
        missing = ServerProcess(path, "--enable-lora", "--lora-modules", "gone=hf://org/not-there", log_dir=tmp_path,
                                env=env)
        assert missing.proc.wait(120) == 2
        missing.stop()
        assert "adapter 'gone'" in missing.log_path.read_text()
    finally:
        hub.stop()
