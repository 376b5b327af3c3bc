"""API keys on a real `pagoda serve`, asked through the official openai client and httpx."""

from __future__ import annotations

import httpx
import openai
import pytest

from pagoda_daemon.server.auth import API_KEY_ENV, APIKeys
from tests.server.conftest import MODEL_NAME, ServerProcess

KEYS = ("first-key-3f9a", "second-key-77c1")


@pytest.fixture(scope="module")
def keyed(tiny_models, tmp_path_factory):
    srv = ServerProcess(tiny_models["llama"], "--max-model-len", "512", log_dir=tmp_path_factory.mktemp("keyed"),
                        env={API_KEY_ENV: ",".join(KEYS)})
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def _client(srv: ServerProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=60)


def test_every_configured_key_is_accepted(keyed):
    reply = _client(keyed, KEYS[0]).completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2)
    assert reply.usage.completion_tokens == 2
    assert [m.id for m in _client(keyed, KEYS[1]).models.list()] == [MODEL_NAME]


@pytest.mark.parametrize("authorization", [None, "Bearer wrong", f"Basic {KEYS[0]}", f"Bearer {KEYS[0]}x",
                                           f"Bearer {KEYS[0][:-1]}", "Bearer", f"Bearer {KEYS[0]},{KEYS[1]}"])
def test_requests_without_a_valid_key_get_401(keyed, authorization):
    headers = {} if authorization is None else {"Authorization": authorization}
    for method, path in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                         ("GET", "/version")):
        resp = httpx.request(method, keyed.url + path, headers=headers, timeout=10,
                             json={"model": MODEL_NAME, "prompt": "hi"} if method == "POST" else None)
        assert resp.status_code == 401, (path, resp.text)
        assert resp.headers["www-authenticate"] == "Bearer"
        error = resp.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == "invalid_api_key"


def test_the_openai_client_with_a_wrong_key_gets_an_authentication_error(keyed):
    with pytest.raises(openai.AuthenticationError) as caught:
        _client(keyed, "not-the-key").chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert caught.value.status_code == 401 and caught.value.code == "invalid_api_key"


def test_probes_and_metrics_stay_open_and_never_show_the_key(keyed):
    for path in ("/health", "/ready", "/metrics"):
        resp = httpx.get(keyed.url + path, timeout=10)
        assert resp.status_code == 200, path
        assert not any(key in resp.text for key in KEYS)
    log = keyed.log_path.read_text()
    assert not any(key in log for key in KEYS)
    assert "unauthenticated" not in log


def test_a_server_without_keys_warns_once_at_start(server):
    assert server.log_path.read_text().count("the API is unauthenticated") == 1


def test_exempt_paths_are_configurable_and_the_flag_wins_over_the_environment():
    keys = APIKeys.from_options("flag-key", {API_KEY_ENV: "env-key"}, exempt_paths=["/health"])
    bearer = [(b"authorization", b"Bearer flag-key")]
    assert keys.refusal("/metrics", []).status == 401  # no longer exempt
    assert keys.refusal("/metrics", bearer) is None
    assert keys.refusal("/health", []) is None
    assert keys.refusal("/v1/models", [(b"authorization", b"Bearer env-key")]).status == 401
    assert "flag-key" not in repr(keys)
    assert not APIKeys.from_options(None, {API_KEY_ENV: " , "}).enabled  # blank entries are no keys
