"""spec.lora: parsed, checked against the daemon's own rules (names, bounds, sources), rendered
into the engine's config file, which the daemon's own option parsing reads back to the same
adapters; refused where it does not combine."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from pagoda_daemon.config import EngineConfig
from pagoda_daemon.lora.names import parse_lora_modules
from pagoda_daemon.options import check_value, declared
from pagoda_operator.builders import CACHE_DIR, CONFIG_FILE, Settings, children
from pagoda_operator.spec import InvalidSpec, daemon_config, parse
from tests.operator.operator_fakes import every_capability, isvc

ADAPTERS = [{"name": "sql", "uri": "hf://org/sql-lora@v2"}, {"name": "org/chat", "uri": "s3://bucket/adapters/chat"}]


def lora_spec(lora: dict[str, Any], model: dict[str, Any] | None = None, **spec: Any):
    body = isvc("llama", model=model or {"name": "m", "pvc": {"claimName": "w"}}, lora=lora, **spec)
    return parse("llama", "default", body["spec"], supports=every_capability), body


def test_adapters_render_into_the_engine_config_the_daemon_reads_back():
    s, body = lora_spec({"maxLoras": 4, "maxRank": 64, "adapters": ADAPTERS})
    kids = children(s, body, 1, Settings(daemon_image="img:1"))
    config = yaml.safe_load(kids.config_map["data"][CONFIG_FILE])
    assert config["enable_lora"] is True and config["max_loras"] == 4 and config["max_lora_rank"] == 64
    options = {d.name: d for d in declared(EngineConfig)}
    for name in ("enable_lora", "max_loras", "max_lora_rank", "lora_modules"):  # as a --config file is checked
        check_value(options[name], config[name], "engine.yaml")
    engine = EngineConfig(model="/m", **{k: v for k, v in config.items() if k in options})
    assert parse_lora_modules(engine.lora_modules) == [(a["name"], a["uri"]) for a in ADAPTERS]
    env = {e["name"]: e for e in kids.workload["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["PAGODA_CACHE_DIR"]["value"] == CACHE_DIR  # a pvc model, fetched adapters: the writable cache


def test_no_lora_leaves_the_config_as_it_was():
    body = isvc("llama", model={"name": "m", "pvc": {"claimName": "w"}})
    config = daemon_config(parse("llama", "default", body["spec"], supports=every_capability))
    assert not {"enable_lora", "max_loras", "max_lora_rank", "lora_modules"} & set(config)


def test_slots_without_adapters_enable_lora_for_the_admin_routes():
    s, _ = lora_spec({"maxLoras": 2})
    config = daemon_config(s)
    assert config["enable_lora"] is True and "lora_modules" not in config


@pytest.mark.parametrize(("lora", "extra", "needle"), [
    ({"adapters": [ADAPTERS[0], ADAPTERS[0]]}, {}, "names 'sql' twice"),
    ({"adapters": [{"name": "m", "uri": "hf://org/x"}]}, {}, "base model's served name"),
    ({"adapters": [{"name": "a b", "uri": "hf://org/x"}]}, {}, "whitespace"),
    ({"adapters": [{"name": "a=b", "uri": "hf://org/x"}]}, {}, "'='"),
    ({"adapters": [{"name": "x" * 257, "uri": "hf://org/x"}]}, {}, "1 to 256"),
    ({"adapters": [{"name": "a", "uri": "pvc://claim/x"}]}, {}, "hf:// or s3://"),
    ({"adapters": [{"name": "a", "uri": "/local/dir"}]}, {}, "lora.adapters[0].uri"),
    ({"adapters": [{"name": "a", "uri": "ftp://host/x"}]}, {}, "lora.adapters[0].uri"),
    ({"adapters": [{"name": "a", "uri": "s3://Bad_Bucket/x"}]}, {}, "S3 bucket name"),
    ({"maxLoras": 0}, {}, "lora.maxLoras (0) must be 1 to 64"),
    ({"maxLoras": 65}, {}, "lora.maxLoras (65) must be 1 to 64"),
    ({"maxRank": 513}, {}, "lora.maxRank (513) must be 1 to 512"),
    ({"adapters": [{"name": f"a{i}", "uri": "hf://org/x"} for i in range(257)]}, {}, "at most 256"),
])
def test_what_the_daemon_would_refuse_is_refused_at_apply_time(lora, extra, needle):
    with pytest.raises(InvalidSpec) as refused:
        lora_spec(lora, **extra)
    assert needle in str(refused.value), str(refused.value)


def test_lora_does_not_combine_with_elastic_ep():
    with pytest.raises(InvalidSpec, match=r"lora does not combine with parallelism\.elastic"):
        lora_spec({"adapters": ADAPTERS}, model={"name": "m", "pvc": {"claimName": "w"}},
                  resources={"gpusPerReplica": 2},
                  parallelism={"expert": 2, "elastic": {"minExpert": 1, "maxExpert": 2}})


def test_lora_does_not_combine_with_a_replica_over_several_pods():
    with pytest.raises(InvalidSpec, match="podsPerReplica above 1"):
        lora_spec({"adapters": ADAPTERS}, resources={"gpusPerReplica": 2, "podsPerReplica": 2},
                  parallelism={"tensor": 2})


def test_the_crd_name_pattern_is_the_daemons_rule():
    """The CRD refuses at the API server what check_name refuses (whitespace, '='), nothing more."""
    import re
    from pathlib import Path

    from pagoda_daemon.lora.names import AdapterError, check_name

    crd = yaml.safe_load((Path(__file__).resolve().parents[2] / "crds" / "inferenceservices.pagoda.dev.yaml")
                         .read_text())
    lora = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["lora"]
    item = lora["properties"]["adapters"]["items"]["properties"]
    pattern = re.compile(item["name"]["pattern"])
    for name in ("sql", "org/chat-v2", "a.b_c", "東京", "a b", "a=b", "tab\there", "x" * 256):
        try:
            check_name(name)
            daemon_ok = True
        except AdapterError:
            daemon_ok = False
        assert bool(pattern.match(name)) == daemon_ok, name
    assert item["name"]["maxLength"] == 256 and lora["properties"]["adapters"]["maxItems"] == 256
