"""The typed spec: schema defaults repeated in Python, and the cross-field rules the schema cannot express."""

from __future__ import annotations

import dataclasses

import pytest

from pagoda_daemon import capabilities
from pagoda_daemon.config import EngineConfig
from pagoda_operator.admission import Policy
from pagoda_operator.spec import InvalidSpec, Parallelism, daemon_config, desired_replicas, parse, validate
from pagoda_operator.webhook import decide
from tests.operator.operator_fakes import every_capability
from tests.operator.test_admission import admission_review
from tests.operator.test_model_sources import everyone_can, review_request

MODEL = {"name": "m", "pvc": {"claimName": "weights"}}


def test_defaults_match_the_schema():
    s = parse("svc", "ns", {"model": MODEL})
    assert (s.replicas, s.gpus, s.gpu_resource, s.port) == (1, 1, "nvidia.com/gpu", 8000)
    assert (s.parallelism.tensor, s.parallelism.expert, s.parallelism.data) == (1, 1, 1)
    assert s.engine.block_size == 16 and s.engine.gpu_memory_utilization == 0.9
    assert s.engine.enable_prefix_caching is True and s.engine.enforce_eager is False
    assert s.placement.numa_policy == "auto" and s.placement.require_nvlink is False
    assert s.autoscaling is None and s.device == "cuda"
    assert s.parallelism.data_parallel_experts is False


@pytest.mark.parametrize(
    "metric, target, expected",
    [
        ("kvCacheUsage", None, 0.8),
        ("requestsWaiting", None, 2.0),
        ("requestsRunning", None, 16.0),
        ("requestsRunning", 4, 4.0),
    ],
)
def test_autoscaling_target_defaults_per_metric(metric, target, expected):
    a = {"maxReplicas": 4, "metric": metric}
    if target is not None:
        a["target"] = target
    s = parse("svc", "ns", {"model": MODEL, "autoscaling": a})
    assert s.autoscaling is not None and s.autoscaling.target == expected
    assert (s.autoscaling.scale_up_window_s, s.autoscaling.scale_down_window_s) == (0, 300)


def test_autoscaling_disabled_is_none():
    assert (
        parse("svc", "ns", {"model": MODEL, "autoscaling": {"enabled": False, "maxReplicas": 3}}).autoscaling
        is None
    )


VALID = [
    ({"resources": {"gpusPerReplica": 8}, "parallelism": {"tensor": 2, "expert": 4}}),
    ({"resources": {"gpusPerReplica": 8}, "parallelism": {"tensor": 1, "expert": 8}}),
    ({"resources": {"gpusPerReplica": 4}, "parallelism": {"tensor": 4, "data": 1}}),
    ({"resources": {"gpusPerReplica": 0}}),
    ({"resources": {"gpusPerReplica": 0}, "parallelism": {"tensor": 2, "expert": 2}}),  # CPU ranks over gloo
    (
        {
            "resources": {"gpusPerReplica": 8},
            "parallelism": {"expert": 4, "elastic": {"minExpert": 2, "maxExpert": 8}},
        }
    ),
    ({"autoscaling": {"minReplicas": 2, "maxReplicas": 2}}),
    # elastic EP on CPU (gloo ranks in one pod): what the e2e test runs
    ({"resources": {"gpusPerReplica": 0}, "parallelism": {"expert": 2, "elastic": {"minExpert": 2, "maxExpert": 3}}}),
]


@pytest.mark.parametrize("extra", VALID)
def test_valid_combinations(extra):
    parse("svc", "ns", {"model": MODEL, **extra}, supports=every_capability)


INVALID = [
    (
        {"resources": {"gpusPerReplica": 8}, "parallelism": {"tensor": 3}},
        "tensor (3) × expert (1) × data (1) = 3 must equal resources.gpusPerReplica (8)",
    ),
    (
        {"resources": {"gpusPerReplica": 4}, "parallelism": {"tensor": 2, "expert": 4}},
        "= 8 must equal resources.gpusPerReplica (4)",
    ),
    (
        {"resources": {"gpusPerReplica": 4}, "parallelism": {"data": 2}, "disaggregation": {"kvDiskGiB": 10}},
        "parallelism.data above 1 does not combine with spec.disaggregation",
    ),
    (  # GPUs the engine would leave idle
        {"resources": {"gpusPerReplica": 4}, "parallelism": {"tensor": 2}},
        "tensor (2) × expert (1) × data (1) = 2 must equal resources.gpusPerReplica (4)",
    ),
    (
        {
            "resources": {"gpusPerReplica": 8},
            "parallelism": {"expert": 4, "elastic": {"minExpert": 5, "maxExpert": 8}},
        },
        "minExpert (5) <= expert (4)",
    ),
    (
        {
            "resources": {"gpusPerReplica": 4},
            "parallelism": {"expert": 2, "elastic": {"minExpert": 2, "maxExpert": 8}},
        },
        "elastic.maxExpert (8) exceeds resources.gpusPerReplica (4)",
    ),
    (
        {
            "resources": {"gpusPerReplica": 8},
            "parallelism": {"tensor": 2, "expert": 2, "elastic": {"minExpert": 2, "maxExpert": 4}},
        },
        "parallelism.elastic needs parallelism.tensor 1",
    ),
    (
        {"resources": {"gpusPerReplica": 4}, "parallelism": {"expert": 2, "elastic": {"minExpert": 0, "maxExpert": 4}}},
        "1 <= minExpert (0)",
    ),
    (
        {"resources": {"gpusPerReplica": 4}, "parallelism": {"expert": 2, "elastic": {"minExpert": 2, "maxExpert": 4}},
         "kvOffload": {"cpuGiB": 4}},
        "does not combine with kvOffload",
    ),
    (
        {"parallelism": {"expert": 2, "elastic": {"minExpert": 2, "maxExpert": 4, "metric": "kvCacheUsage",
                                                  "target": 70}}},
        "elastic.target for kvCacheUsage is a fraction",
    ),
    ({"autoscaling": {"minReplicas": 5, "maxReplicas": 2}}, "minReplicas (5) is larger than maxReplicas (2)"),
    ({"autoscaling": {"maxReplicas": 2, "target": 80}}, "fraction in (0, 1]"),
    ({"kvOffload": {"disk": {"path": "/models", "sizeGiB": 10}}}, "collides"),
    ({"model": {"name": "m"}}, "exactly one source"),
    ({"model": {"name": "m", "uri": "hf://a/b", "hostPath": {"path": "/x"}}}, "exactly one source"),
]


@pytest.mark.parametrize("extra, message", INVALID)
def test_invalid_combinations_say_why(extra, message):
    with pytest.raises(InvalidSpec) as e:
        parse("svc", "ns", {"model": MODEL, **extra}, supports=every_capability)
    assert message in str(e.value)


HOSTILE_FIELDS = [
    ({"model": {"name": "--port=1", "pvc": {"claimName": "w"}}}, "model.name '--port=1' must not begin with '-'"),
    ({"model": {"name": "-h", "uri": "hf://a/b"}}, "must not begin with '-'"),
    ({"model": {"name": "m", "pvc": {"claimName": "w", "path": "../other-team"}}}, "model.pvc.path '../other-team'"),
    ({"model": {"name": "m", "pvc": {"claimName": "w", "path": "a/../../b"}}}, "model.pvc.path"),
    ({"model": {"name": "m", "pvc": {"claimName": "w", "path": "/etc"}}}, "must be a relative path"),
    ({"model": {"name": "m", "hostPath": {"path": "models/x"}}}, "model.hostPath.path 'models/x' must be an absolute"),
    ({"model": {"name": "m", "hostPath": {"path": "/var/lib/models/../../../etc"}}}, "model.hostPath.path"),
    ({"model": {"name": "m", "hostPath": {"path": "/data//m"}}}, "normal form"),
    ({"model": {"name": "m", "hostPath": {"path": "/data/m/"}}}, "normal form"),
    ({"kvOffload": {"disk": {"path": "/kv/../usr/local/bin", "sizeGiB": 1}}}, "kvOffload.disk.path"),
    ({"kvOffload": {"disk": {"path": "kv", "sizeGiB": 1}}}, "kvOffload.disk.path 'kv' must be an absolute"),
    ({"kvOffload": {"disk": {"path": "/tmp", "sizeGiB": 1}}}, "collides"),
    ({"kvOffload": {"disk": {"path": "/var/cache/pagoda/", "sizeGiB": 1}}}, "collides"),
    ({"kvOffload": {"cpuGiB": 1, "writePolicy": "write-around"}}, "kvOffload.writePolicy 'write-around' must be one of"),
    ({"kvOffload": {"cpuGiB": 1, "writePolicy": 1}}, "kvOffload.writePolicy 1 must be one of"),
    ({"kvOffload": {"cpuGiB": 1, "writePolicy": ["write-back"]}}, "kvOffload.writePolicy ['write-back'] must be"),
    ({"server": {"apiKeySecretRef": {"name": "Bad_Name"}}}, "server.apiKeySecretRef.name 'Bad_Name'"),
    ({"server": {"apiKeySecretRef": {"name": "k", "key": "a/b"}}}, "server.apiKeySecretRef.key 'a/b'"),
]


@pytest.mark.parametrize("extra, message", HOSTILE_FIELDS)
def test_hostile_names_and_paths_are_refused(extra, message):
    with pytest.raises(InvalidSpec) as e:
        parse("svc", "ns", {"model": MODEL, **extra}, supports=every_capability)
    assert message in str(e.value)


@pytest.mark.parametrize(
    "extra",
    [
        {"model": {"name": "Qwen/Qwen3-8B", "pvc": {"claimName": "w", "path": "hub/qwen3-8b"}}},
        {"model": {"name": "m", "pvc": {"claimName": "w", "path": ".snapshots/v1..2"}}},
        {"model": {"name": "m", "pvc": {"claimName": "w", "path": ""}}},
        {"model": {"name": "m", "hostPath": {"path": "/var/lib/pagoda/models/tiny-qwen3"}}},
        {"kvOffload": {"disk": {"path": "/kv-cache", "sizeGiB": 1}}},
        {"server": {"apiKeySecretRef": {"name": "llm.keys"}}},
    ],
)
def test_ordinary_names_and_paths_pass(extra):
    parse("svc", "ns", {"model": MODEL, **extra}, supports=every_capability)


def test_api_key_secret_ref_defaults_its_key():
    s = parse("svc", "ns", {"model": MODEL, "server": {"apiKeySecretRef": {"name": "llm-key"}}})
    assert (s.api_key_secret.name, s.api_key_secret.key) == ("llm-key", "api-key")
    assert parse("svc", "ns", {"model": MODEL}).api_key_secret is None


@pytest.mark.parametrize("name", ["9lives", "a" * 64, "has.dot", "Upper"])
def test_names_that_cannot_name_a_service_are_invalid(name):
    with pytest.raises(InvalidSpec, match="DNS-1035"):
        parse(name, "ns", {"model": MODEL})


def test_all_violations_are_listed_together():
    with pytest.raises(InvalidSpec) as e:
        parse(
            "svc",
            "ns",
            {
                "model": MODEL,
                "resources": {"gpusPerReplica": 8},
                "parallelism": {"tensor": 3},
                "autoscaling": {"minReplicas": 3, "maxReplicas": 1},
            },
        )
    assert "tensor (3)" in str(e.value) and "minReplicas (3)" in str(e.value)


@pytest.mark.parametrize(
    "replicas, autoscaling, autoscaled, expected",
    [
        (3, None, None, 3),  # no autoscaling: the spec (scale subresource) is the truth
        (3, None, 7, 3),  # a stale autoscaler value is ignored
        (3, {"minReplicas": 1, "maxReplicas": 5}, None, 3),  # before the first decision: spec
        (9, {"minReplicas": 1, "maxReplicas": 5}, None, 5),  # bounded by max
        (1, {"minReplicas": 2, "maxReplicas": 5}, None, 2),  # bounded by min
        (1, {"minReplicas": 1, "maxReplicas": 5}, 4, 4),  # the autoscaler decides
        (1, {"minReplicas": 1, "maxReplicas": 3}, 4, 3),  # max lowered below the last decision
    ],
)
def test_desired_replicas(replicas, autoscaling, autoscaled, expected):
    spec = {"model": MODEL, "replicas": replicas}
    if autoscaling:
        spec["autoscaling"] = autoscaling
    assert desired_replicas(parse("svc", "ns", spec), autoscaled) == expected


@pytest.mark.parametrize(
    "extra, field",
    [
        ({"engine": {"kvCacheDtype": "fp8"}}, "spec.engine.kvCacheDtype"),
    ],
)
def test_what_the_daemon_cannot_do_is_refused_naming_the_field(extra, field):
    """The daemon's capability list decides: refused at apply time, not by a crash-looping pod."""
    with pytest.raises(InvalidSpec, match=f"{field}: .* is not supported by this Pagoda build yet"):
        parse("svc", "ns", {"model": MODEL, **extra})
    parse("svc", "ns", {"model": MODEL, **extra}, supports=every_capability)  # valid otherwise


def test_kv_offload_is_accepted_and_refused_naming_the_field_by_a_build_without_it():
    spec = parse("svc", "ns", {"model": MODEL, "kvOffload": {"cpuGiB": 8, "disk": {"path": "/kv", "sizeGiB": 1}}})
    config = daemon_config(spec)
    assert (config["kv_offload_cpu_gib"], config["kv_offload_disk_path"], config["kv_offload_disk_gib"]) == (
        8, "/kv", 1)
    assert "kv_offload_write_policy" not in config  # the daemon's default
    for policy in ("write-through", "write-back"):
        spec = parse("svc", "ns", {"model": MODEL, "kvOffload": {"cpuGiB": 8, "writePolicy": policy}})
        assert daemon_config(spec)["kv_offload_write_policy"] == policy
    for extra, field in (({"cpuGiB": 8}, "spec.kvOffload.cpuGiB"),
                         ({"disk": {"path": "/kv", "sizeGiB": 1}}, "spec.kvOffload.disk.path")):
        with pytest.raises(InvalidSpec, match=f"{field}: KV cache offload .* is not supported by this Pagoda build"):
            parse("svc", "ns", {"model": MODEL, "kvOffload": extra}, supports=lambda c: c != "kv_offload")


def test_tensor_and_expert_parallelism_are_accepted_by_this_build():
    spec = parse("svc", "ns", {"model": MODEL, "resources": {"gpusPerReplica": 4},
                               "parallelism": {"tensor": 2, "expert": 2}})
    assert daemon_config(spec)["tensor_parallel_size"] == 2 and daemon_config(spec)["expert_parallel_size"] == 2


def test_a_model_uri_is_accepted_when_the_daemon_fetches_models_and_refused_otherwise():
    uri = {"model": {"name": "m", "uri": "hf://Qwen/Qwen3-0.6B"}}
    s = parse("svc", "ns", uri, supports=lambda capability: capability == "model_uri")
    assert (s.model.source, s.model.scheme, s.model.uri) == ("uri", "hf", "hf://Qwen/Qwen3-0.6B")
    # a daemon that does not fetch (the capability the daemon declares, read by default)
    with pytest.raises(InvalidSpec, match=r"spec\.model\.uri: fetching the model from a URI"):
        parse("svc", "ns", uri, supports=lambda capability: capability != "model_uri")


def test_eplb_renders_the_daemons_eplb_options():
    spec = parse("svc", "ns", {"model": MODEL, "resources": {"gpusPerReplica": 4},
                               "parallelism": {"expert": 4, "eplb": {"redundantExperts": 4, "stepInterval": 500}}})
    cfg = daemon_config(spec)
    assert (cfg["enable_eplb"], cfg["num_redundant_experts"], cfg["eplb_step_interval"]) == (True, 4, 500)
    assert "enable_eplb" not in daemon_config(parse("svc", "ns", {"model": MODEL}))
    with pytest.raises(InvalidSpec, match=r"parallelism\.eplb needs parallelism\.expert of 2 or more"):
        parse("svc", "ns", {"model": MODEL, "parallelism": {"eplb": {}}})
    assert "eplb_async_steps" not in cfg  # rendered only when set: existing pods stay as they were
    two = {"gpusPerReplica": 2}
    cfg = daemon_config(parse("svc", "ns", {"model": MODEL, "resources": two,
                                            "parallelism": {"expert": 2, "eplb": {"asyncSteps": 8}}}))
    assert (cfg["enable_eplb"], cfg["eplb_async_steps"]) == (True, 8)
    with pytest.raises(InvalidSpec, match=r"parallelism\.eplb\.asyncSteps does not combine with parallelism\.elastic"):
        parse("svc", "ns", {"model": MODEL, "resources": two, "parallelism": {
            "expert": 2, "eplb": {"asyncSteps": 8}, "elastic": {"minExpert": 1, "maxExpert": 4}}})


# spec.parallelism.dataParallelExperts: a MoE model's experts spread over 4 engines of one GPU each.
FIELD = "spec.parallelism.dataParallelExperts"
DATA_EXPERTS = {"resources": {"gpusPerReplica": 4}, "parallelism": {"data": 4, "dataParallelExperts": True}}


def test_data_parallel_experts_renders_the_daemon_option_the_daemon_takes():
    s = parse("svc", "ns", {"model": MODEL, **DATA_EXPERTS})  # this build's capabilities
    assert s.parallelism.data_parallel_experts is True
    cfg = daemon_config(s)
    assert cfg["data_parallel_experts"] is True
    assert (cfg["data_parallel_size"], cfg["tensor_parallel_size"], cfg["expert_parallel_size"]) == (4, 1, 1)
    assert EngineConfig(model="/m", **cfg).data_experts_engines == 4


@pytest.mark.parametrize("parallelism", [{"data": 4}, {"data": 4, "dataParallelExperts": False},
                                         {"data": 4, "dataParallelExperts": None}])
def test_data_parallel_experts_is_rendered_only_when_true(parallelism):
    """Pods of InferenceServices without it keep the engine config they were rendered with."""
    s = parse("svc", "ns", {"model": MODEL, "resources": {"gpusPerReplica": 4}, "parallelism": parallelism})
    assert s.parallelism.data_parallel_experts is False and "data_parallel_experts" not in daemon_config(s)


def test_all2all_backend_renders_the_daemon_option_only_when_set():
    """Unset, pods keep the engine config they were rendered with (the daemon's default)."""
    s = parse("svc", "ns", {"model": MODEL, **DATA_EXPERTS})
    assert "all2all_backend" not in daemon_config(s)
    for backend in ("alltoallv", "allgather_reducescatter"):
        fields = {**DATA_EXPERTS, "parallelism": {**DATA_EXPERTS["parallelism"], "all2allBackend": backend}}
        cfg = daemon_config(parse("svc", "ns", {"model": MODEL, **fields}))
        assert cfg["all2all_backend"] == backend
        assert EngineConfig(model="/m", **cfg).all2all_backend == backend


@pytest.mark.parametrize("parallelism, message", [
    ({"data": 4, "dataParallelExperts": True, "all2allBackend": "deepep"}, "must be one of allgather_reducescatter"),
    ({"data": 4, "dataParallelExperts": True, "all2allBackend": 3}, "must be one of"),
    ({"data": 4, "dataParallelExperts": True, "all2allBackend": ["alltoallv"]}, "must be one of"),
    ({"data": 4, "all2allBackend": "alltoallv"}, "it needs parallelism.dataParallelExperts"),
])
def test_all2all_backend_refusals_name_the_field(parallelism, message):
    spec = {"model": MODEL, "resources": {"gpusPerReplica": 4}, "parallelism": parallelism}
    with pytest.raises(InvalidSpec) as e:
        parse("svc", "ns", spec, supports=every_capability)
    assert "parallelism.all2allBackend" in str(e.value) and message in str(e.value)
    if "needs" in message:  # (the schema's enum refuses other values before the webhook sees them)
        out = decide(review_request(spec), Policy(), everyone_can)["response"]
        assert out["allowed"] is False and message in out["status"]["message"]


# The daemon's own rules for data_parallel_experts, refused naming the field by the operator and the webhook.
DATA_EXPERTS_REFUSED = [
    ({"parallelism": {"dataParallelExperts": True}}, "it needs parallelism.data 2 or more (got 1)"),
    ({"resources": {"gpusPerReplica": 8}, "parallelism": {"data": 4, "tensor": 2, "dataParallelExperts": True}},
     "it needs parallelism.tensor 1 and expert 1 (got 2 and 1)"),
    ({"resources": {"gpusPerReplica": 8}, "parallelism": {"data": 4, "expert": 2, "dataParallelExperts": True}},
     "it needs parallelism.tensor 1 and expert 1 (got 1 and 2)"),
]


@pytest.mark.parametrize("extra, message", DATA_EXPERTS_REFUSED)
def test_data_parallel_experts_refusals_name_the_field(extra, message):
    with pytest.raises(InvalidSpec) as e:
        parse("svc", "ns", {"model": MODEL, **extra}, supports=every_capability)
    assert f"{FIELD} " in str(e.value) and message in str(e.value)
    out = decide(review_request({"model": MODEL, **extra}), Policy(), everyone_can)["response"]
    assert out["allowed"] is False and (out["status"]["code"], out["status"]["reason"]) == (422, "Invalid")
    assert f"{FIELD} " in out["status"]["message"] and message in out["status"]["message"]


@pytest.mark.parametrize("extra, message", [
    ({"resources": {"gpusPerReplica": 8}, "parallelism": {"data": 4, "dataParallelExperts": True},
      "disaggregation": {"kvDiskGiB": 10}}, "parallelism.data above 1 does not combine with spec.disaggregation"),
    ({"resources": {"gpusPerReplica": 4}, "parallelism": {
        "data": 2, "dataParallelExperts": True, "elastic": {"minExpert": 1, "maxExpert": 2}}},
     "parallelism.data above 1 does not combine with parallelism.elastic"),
    ({"resources": {"gpusPerReplica": 4, "podsPerReplica": 2}, "parallelism": {"data": 4, "dataParallelExperts": True}},
     "resources.podsPerReplica above 1 needs parallelism.data 1"),
    # one GPU per engine: no more, no fewer
    ({"resources": {"gpusPerReplica": 8}, "parallelism": {"data": 4, "dataParallelExperts": True}},
     "tensor (1) × expert (1) × data (4) = 4 must equal resources.gpusPerReplica (8)"),
])
def test_data_parallel_experts_keeps_the_rules_of_data_above_1(extra, message):
    with pytest.raises(InvalidSpec) as e:
        parse("svc", "ns", {"model": MODEL, **extra}, supports=every_capability)
    assert message in str(e.value)


@pytest.mark.parametrize("value", ["yes", "true", 1, 0, 1.0, [True], {"enabled": True}])
def test_data_parallel_experts_of_the_wrong_type_is_refused_naming_the_field(value):
    extra = {"resources": {"gpusPerReplica": 4}, "parallelism": {"data": 4, "dataParallelExperts": value}}
    message = f"{FIELD} must be true or false, not {type(value).__name__} {value!r}"
    with pytest.raises(InvalidSpec) as e:
        parse("svc", "ns", {"model": MODEL, **extra}, supports=every_capability)
    assert message in str(e.value)
    out = decide(review_request({"model": MODEL, **extra}), Policy(), everyone_can)["response"]
    assert out["allowed"] is False and out["status"]["code"] == 422 and message in out["status"]["message"]


def test_the_webhook_admits_data_parallel_experts_the_daemon_takes():
    for extra in (DATA_EXPERTS, {"parallelism": {"dataParallelExperts": False}}, {"parallelism": {"data": 1}}):
        assert decide(review_request({"model": MODEL, **extra}), Policy(), everyone_can)["response"]["allowed"]
    # an update that turns it on without data-parallel engines is refused like a create
    update = admission_review("UPDATE", {"model": MODEL, "parallelism": {"dataParallelExperts": True}},
                              {"model": MODEL})
    out = decide(update, Policy(), everyone_can)["response"]
    assert out["allowed"] is False and out["status"]["code"] == 422 and FIELD in out["status"]["message"]


@pytest.mark.parametrize("parallelism", [
    Parallelism(data=1, data_parallel_experts=True),
    Parallelism(data=2, tensor=2, data_parallel_experts=True),
    Parallelism(data=2, expert=2, data_parallel_experts=True),
])
def test_what_the_operator_refuses_for_data_parallel_experts_the_daemon_refuses(parallelism):
    """The same rules on both sides: the rendering of a refused spec is a configuration the daemon refuses."""
    s = dataclasses.replace(parse("svc", "ns", {"model": MODEL}), gpus=0, parallelism=parallelism)
    with pytest.raises(InvalidSpec, match=FIELD):
        validate(s)
    with pytest.raises(ValueError, match="data_parallel_experts"):
        EngineConfig(model="/m", **daemon_config(s))


def test_eplb_over_data_parallel_engines_is_accepted_on_both_sides():
    """parallelism.eplb with dataParallelExperts: the balancer's ranks are the engines."""
    s = dataclasses.replace(parse("svc", "ns", {"model": MODEL}), gpus=0, parallelism=Parallelism(
        data=2, eplb_redundant_experts=2, eplb_async_steps=4, data_parallel_experts=True))
    validate(s)
    config = EngineConfig(model="/m", **daemon_config(s))
    assert (config.data_parallel_experts, config.enable_eplb, config.num_redundant_experts,
            config.eplb_async_steps) == (True, True, 2, 4)
    with pytest.raises(InvalidSpec, match=r"parallelism\.eplb needs parallelism\.expert of 2 or more, or "
                                          "dataParallelExperts"):
        validate(dataclasses.replace(s, parallelism=Parallelism(data=2, eplb_redundant_experts=2)))


def test_data_parallel_experts_is_refused_naming_the_field_by_a_build_without_it():
    assert capabilities.supported("data_parallel_experts")
    with pytest.raises(InvalidSpec, match=rf"{FIELD}: MoE experts spread over data-parallel engines .* is not "
                                          "supported by this Pagoda build yet"):
        parse("svc", "ns", {"model": MODEL, **DATA_EXPERTS}, supports=lambda c: c != "data_parallel_experts")
