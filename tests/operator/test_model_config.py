"""Apply-time layout checks from a model's config.json (pagoda_operator.model_config): the check
itself, what the operator reads and from where (a real Hub-compatible server on loopback), and a
reconcile pass that refuses a layout before any child is written."""

from __future__ import annotations

import json

import pytest

from pagoda_operator import model_config
from pagoda_operator.builders import Settings
from pagoda_operator.model_config import MAX_CONFIG_BYTES, RETRY_S, ModelConfigs, layout_error
from pagoda_operator.reconcile import Context, reconcile
from pagoda_operator.spec import parse
from pagoda_operator.status import condition
from tests.models.hub_server import HubServer
from tests.operator.operator_fakes import every_capability, isvc

DENSE = {"architectures": ["Qwen3ForCausalLM"], "num_attention_heads": 32, "num_key_value_heads": 8,
         "intermediate_size": 12288}
MOE = {"architectures": ["Qwen3MoeForCausalLM"], "num_attention_heads": 32, "num_key_value_heads": 4,
       "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "intermediate_size": 6144}


def spec(endpoint: str | None = None, credentials: str | None = None, uri: str = "hf://org/model", **fields):
    model = {"name": "m", "uri": uri, **({"endpoint": endpoint} if endpoint else {}),
             **({"credentials": {"secretName": credentials}} if credentials else {})}
    return parse("svc", "default", {"model": model, **fields}, every_capability)


def layout(tensor: int = 1, expert: int = 1, **fields):
    return spec(resources={"gpusPerReplica": tensor * expert}, parallelism={"tensor": tensor, "expert": expert},
                **fields)


def test_a_layout_the_heads_or_experts_cannot_take_is_named_in_the_specs_fields():
    msg = layout_error(layout(tensor=3), DENSE)
    assert msg and "attention heads (32)" in msg and "spec.parallelism.tensor × spec.parallelism.expert = 3" in msg
    msg = layout_error(layout(expert=3), MOE)
    assert msg and "experts (128)" in msg and "spec.parallelism.expert 3" in msg
    msg = layout_error(layout(expert=2), DENSE)
    assert msg and "no experts" in msg
    assert layout_error(layout(tensor=8), DENSE) is None
    assert layout_error(layout(tensor=2, expert=4), MOE) is None
    # a multimodal config keeps the language model's fields in text_config
    assert "attention heads (32)" in (layout_error(layout(tensor=3), {"text_config": DENSE}) or "")


def test_data_parallel_experts_needs_experts_the_engines_divide_named_in_the_specs_fields():
    def engines(data: int):
        return spec(resources={"gpusPerReplica": data}, parallelism={"data": data, "dataParallelExperts": True})

    msg = layout_error(engines(4), DENSE)
    assert msg and "spec.parallelism.dataParallelExperts needs a mixture-of-experts model" in msg
    msg = layout_error(engines(3), MOE)
    assert msg and "experts (128) is not divisible by spec.parallelism.data 3" in msg
    assert "data_parallel" not in msg
    assert layout_error(engines(4), MOE) is None
    assert layout_error(spec(resources={"gpusPerReplica": 3}, parallelism={"data": 3}), MOE) is None  # experts whole

    def balanced(data: int, redundant: int):  # EPLB over the engines: its copies must divide evenly too
        return spec(resources={"gpusPerReplica": data}, parallelism={
            "data": data, "dataParallelExperts": True, "eplb": {"redundantExperts": redundant}})

    assert layout_error(balanced(2, 4), MOE) is None
    msg = layout_error(balanced(2, 3), MOE)
    assert msg and ("experts (128) plus spec.parallelism.eplb.redundantExperts (3) is not divisible by "
                    "spec.parallelism.data 2") in msg
    msg = layout_error(balanced(2, 129), MOE)
    assert msg and "more than experts × (spec.parallelism.data - 1) = 128" in msg


@pytest.mark.parametrize("heads, kv_heads", [(None, 8), ("32", 8), (32, "8"), (0, 0), (32, None), ([32], 8),
                                             (-32, 8), (10**30, 8), (32, {"a": 1})])
def test_a_config_of_odd_values_never_raises(heads, kv_heads):
    config = {**DENSE, "num_attention_heads": heads, "num_key_value_heads": kv_heads}
    result = layout_error(layout(tensor=3), config)
    assert result is None or result.startswith("the model's config.json does not allow this layout")


@pytest.fixture
def hub(tmp_path):
    server = HubServer().start()
    for repo, config in (("org/model", DENSE), ("org/moe", MOE)):
        folder = tmp_path / repo.replace("/", "_")
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
        server.add_repo(repo, folder)
    big = tmp_path / "big"
    big.mkdir()
    (big / "config.json").write_text(json.dumps({**DENSE, "pad": " " * MAX_CONFIG_BYTES}))
    server.add_repo("org/big", big)
    yield server
    server.stop()


def config_gets(hub: HubServer) -> list[str]:
    return [path for method, path, _ in hub.requests if method == "GET" and path.endswith("/config.json")]


def test_reads_an_allowed_endpoints_config_once_and_remembers_it(hub):
    configs = ModelConfigs((hub.url + "/",))
    assert configs.get(spec(hub.url)) == DENSE
    assert configs.get(spec(hub.url)) == DENSE
    assert config_gets(hub) == ["/org/model/resolve/main/config.json"]
    sha = hub.repos["org/moe"].sha
    assert configs.get(spec(hub.url, uri=f"hf://org/moe@{sha}")) == MOE
    assert config_gets(hub)[-1] == f"/org/moe/resolve/{sha}/config.json"


def test_reads_nothing_it_was_not_allowed_to(hub):
    configs = ModelConfigs((hub.url,))
    assert configs.get(spec("http://127.0.0.1:1")) is None  # a spec cannot aim the operator elsewhere
    assert configs.get(spec()) is None  # the default Hub is not on this list
    assert configs.get(spec(hub.url, credentials="hf-token")) is None  # the user's Secret is never read
    assert configs.get(parse("svc", "default", {"model": {"name": "m", "pvc": {"claimName": "w"}}},
                             every_capability)) is None
    assert config_gets(hub) == []
    assert ModelConfigs(()).get(spec(hub.url)) is None


def test_a_failed_read_leaves_the_check_to_the_daemon_and_is_retried_later(hub):
    now = [100.0]
    configs = ModelConfigs((hub.url,), clock=lambda: now[0])
    assert configs.get(spec(hub.url, uri="hf://org/missing")) is None  # 404
    assert configs.get(spec(hub.url, uri="hf://org/big")) is None  # more than MAX_CONFIG_BYTES
    assert configs.get(spec(hub.url, uri="hf://org/missing")) is None
    assert len(config_gets(hub)) == 2  # the failure is remembered
    now[0] += RETRY_S + 1
    assert configs.get(spec(hub.url, uri="hf://org/missing")) is None
    assert len(config_gets(hub)) == 3
    dead = ModelConfigs(("http://127.0.0.1:1",), timeout_s=0.5)  # nothing listens: refused at once
    assert dead.get(spec("http://127.0.0.1:1")) is None


def test_the_cache_is_bounded(hub, monkeypatch):
    monkeypatch.setattr(model_config, "MAX_ENTRIES", 2)
    configs = ModelConfigs((hub.url,), http_get=lambda url, timeout: json.dumps(DENSE).encode())
    for i in range(5):
        configs.get(spec(hub.url, uri=f"hf://org/m{i}"))
    assert len(configs._cache) == 2


def test_a_reconcile_pass_refuses_the_layout_before_writing_any_child(hub, fake_kube):
    ctx = Context(kube=fake_kube, settings=Settings(daemon_image="img:1"), supports=every_capability,
                  model_configs=ModelConfigs((hub.url,)))
    model = {"name": "m", "uri": "hf://org/model", "endpoint": hub.url}
    fake_kube.put(isvc(model=model, resources={"gpusPerReplica": 3}, parallelism={"tensor": 3}))
    r = reconcile(ctx, "default", "llama", "create")
    deg = condition(r.status, "Degraded")
    assert (deg["status"], deg["reason"]) == ("True", "InvalidSpec")
    assert "attention heads (32)" in deg["message"] and "spec.parallelism.tensor" in deg["message"]
    assert [w for w in fake_kube.writes if w[1] != "InferenceService"] == []
    obj = fake_kube.objects[("InferenceService", "default", "llama")]
    obj["spec"].update(resources={"gpusPerReplica": 4}, parallelism={"tensor": 4})
    obj["metadata"]["generation"] += 1
    r = reconcile(ctx, "default", "llama", "update")
    assert condition(r.status, "Degraded")["status"] == "False"
    assert any(w[1] == "Deployment" for w in fake_kube.writes)
    assert len(config_gets(hub)) == 1  # both passes, one read
