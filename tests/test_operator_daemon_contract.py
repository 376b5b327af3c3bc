"""The operator renders what the daemon accepts: the example InferenceService's Deployment args
and engine ConfigMap parse through `pagoda serve`'s own option handling."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from pagoda_daemon import capabilities
from pagoda_daemon.capabilities import CAPABILITIES
from pagoda_daemon.cli import _explicit_options, build_parser
from pagoda_daemon.config import EngineConfig
from pagoda_daemon.options import OptionInfo, declared
from pagoda_daemon.server import serve
from pagoda_daemon.server.serve import resolve_options
from pagoda_operator import builders, leader_worker_set, pod_groups, spec
from tests.operator.operator_fakes import every_capability

ROOT = Path(__file__).resolve().parents[1]


def rendered(tmp_path: Path, overrides: dict | None = None):
    resource = yaml.safe_load((ROOT / "examples" / "inferenceservice.yaml").read_text())
    body = {**resource["spec"], **(overrides or {})}
    svc = spec.parse(resource["metadata"]["name"], "default", body)
    config_file = tmp_path / "engine.yaml"
    config_file.write_text(yaml.safe_dump(builders.daemon_config(svc)))
    argv = builders.daemon_args(svc)
    argv[argv.index("--config") + 1] = str(config_file)
    return svc, argv


def test_daemon_accepts_the_operators_rendering(tmp_path):
    svc, argv = rendered(tmp_path)
    args = build_parser().parse_args(argv)
    options = resolve_options(args, _explicit_options(argv))
    assert options["served_model_name"] == svc.model.name
    assert options["block_size"] == svc.engine.block_size
    assert options["enable_prefix_caching"] == svc.engine.enable_prefix_caching
    assert options["numa_policy"] == svc.placement.numa_policy


# Every option the operator can render, each set to a non-default value.
FULL_SPEC = {
    "resources": {"gpusPerReplica": 8},
    "parallelism": {"tensor": 2, "expert": 4, "data": 1, "eplb": {"redundantExperts": 4, "stepInterval": 100}},
    "engine": {
        "maxModelLen": 4096, "blockSize": 32, "maxNumSeqs": 64, "maxNumBatchedTokens": 4096, "dtype": "bfloat16",
        "kvCacheDtype": "fp8", "gpuMemoryUtilization": 0.8, "enablePrefixCaching": False, "enforceEager": True,
        "schedulingPolicy": "priority", "runner": "pooling",
    },
    "kvOffload": {"cpuGiB": 64, "disk": {"path": "/kv", "sizeGiB": 200}, "writePolicy": "write-through"},
    "placement": {"numaPolicy": "none"},
    "tracing": {"otlpEndpoint": "http://collector:4318"},
}


# The options FULL_SPEC's layout excludes: the experts spread over data-parallel engines of one GPU each.
DATA_EXPERTS_SPEC = {"resources": {"gpusPerReplica": 4},
                     "parallelism": {"data": 4, "dataParallelExperts": True, "all2allBackend": "alltoallv"}}


def test_every_key_the_operator_can_render_is_a_daemon_option():
    rendered_keys: set[str] = set()
    for fields in (FULL_SPEC, DATA_EXPERTS_SPEC):
        svc = spec.parse("llama", "default", {"model": {"name": "m", "pvc": {"claimName": "w"}}, **fields},
                         supports=every_capability)
        rendered_keys |= set(builders.daemon_config(svc))
    serve_options = set(vars(build_parser().parse_args(["serve", "/m"])))
    assert rendered_keys <= serve_options, rendered_keys - serve_options
    engine_options = {d.name for d in declared(EngineConfig)}
    assert {k for k in rendered_keys if k in engine_options} >= set(spec.CRD_FIELD_OF_OPTION)


def test_every_engine_option_is_a_flag_of_serve_and_generate():
    for command in (["serve", "/m"], ["generate", "/m"]):
        args = vars(build_parser().parse_args(command))
        for d in declared(EngineConfig):
            if d.info.cli:
                assert d.name in args and args[d.name] == d.default, (command[0], d.name)
    # the options a user could not reach before the declarations were one
    args = build_parser().parse_args(["serve", "/m", "--no-enable-chunked-prefill", "--num-kv-blocks", "64",
                                      "--max-cudagraph-batch-size", "32", "--tokenizer", "/tok"])
    assert (args.enable_chunked_prefill, args.num_kv_blocks, args.max_cudagraph_batch_size, args.tokenizer) == (
        False, 64, 32, "/tok")


def test_every_capability_gated_option_names_its_crd_field():
    gated = {d.name for d in declared(EngineConfig) if d.info.needs}
    assert gated == set(spec.CRD_FIELD_OF_OPTION)
    assert all(d.info.needs in CAPABILITIES for d in declared(EngineConfig) if d.info.needs)


def test_what_the_operator_refuses_the_daemon_refuses_too(tmp_path):
    """Both read one capability list: a spec the operator refuses renders options the daemon refuses."""
    svc = spec.parse("llama", "default", {"model": {"name": "m", "pvc": {"claimName": "w"}}, **FULL_SPEC},
                     supports=every_capability)
    with pytest.raises(spec.InvalidSpec) as refused:
        spec.validate(svc)
    config_file = tmp_path / "engine.yaml"
    config_file.write_text(yaml.safe_dump(builders.daemon_config(svc)))
    argv = ["serve", "/m", "--config", str(config_file)]
    with pytest.raises(ValueError) as daemon_refused:
        resolve_options(build_parser().parse_args(argv), _explicit_options(argv))
    needs = {d.name: d.info.needs for d in declared(EngineConfig) if d.info.needs}
    for option, field in spec.CRD_FIELD_OF_OPTION.items():
        refused_by_both = not capabilities.supported(needs[option])  # this build's list decides for both
        assert (field + ":" in str(refused.value)) == refused_by_both, field
        assert ("--" + option.replace("_", "-") in str(daemon_refused.value)) == refused_by_both, option


@pytest.mark.parametrize("key, value", [
    ("max_num_seqs", "7"), ("max_num_seqs", 7.0), ("max_num_seqs", True), ("enforce_eager", "yes"),
    ("gpu_memory_utilization", "0.5"), ("dtype", 16), ("tokenizer", ["a"]), ("block_size", None),
])
def test_a_config_file_value_of_the_wrong_type_exits_2(tmp_path, capsys, key, value):
    from pagoda_daemon.cli import main

    config_file = tmp_path / "engine.yaml"
    config_file.write_text(yaml.safe_dump({key: value}))
    assert main(["serve", str(tmp_path), "--config", str(config_file)]) == 2
    assert f"{key} must be" in capsys.readouterr().err


def test_unsupported_rendered_options_are_refused_by_name(tmp_path):
    """A --config the operator could only render for an unsupported spec: the daemon names the flag."""
    config_file = tmp_path / "engine.yaml"
    config_file.write_text(yaml.safe_dump({"kv_cache_dtype": "fp8"}))
    argv = ["serve", "/m", "--config", str(config_file)]
    with pytest.raises(ValueError, match="kv-cache-dtype=fp8: an fp8 KV cache is not supported"):
        resolve_options(build_parser().parse_args(argv), _explicit_options(argv))


def test_every_signal_the_operator_scrapes_is_a_daemon_metric_and_a_crd_choice():
    """The autoscalers' metrics: each names a series the daemon exports, and the CRD offers
    exactly the operator's choices (expertLoad to elastic EP only)."""
    from prometheus_client.parser import text_string_to_metric_families

    from pagoda_daemon.telemetry.metrics import EngineMetrics
    from pagoda_operator import metrics_scrape

    body, _ = EngineMetrics("m", max_model_len=64).render()
    exported = {s.name for f in text_string_to_metric_families(body.decode()) for s in f.samples}
    assert set(metrics_scrape.SIGNALS) == set(spec.ELASTIC_METRICS) >= set(spec.METRICS)
    for name, _how in metrics_scrape.SIGNALS.values():
        assert name in exported, name
    crd = yaml.safe_load((ROOT / "crds" / "inferenceservices.pagoda.dev.yaml").read_text())
    props = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    assert props["autoscaling"]["properties"]["metric"]["enum"] == list(spec.METRICS)
    elastic = props["parallelism"]["properties"]["elastic"]["properties"]
    assert elastic["metric"]["enum"] == list(spec.ELASTIC_METRICS)
    assert set(spec.DEFAULT_TARGETS) == set(spec.ELASTIC_METRICS)


def test_the_operator_reads_elastic_ep_as_the_daemon_writes_it():
    """The operator may not import the daemon's engine messages (msgspec); its copies must agree."""
    from pagoda_daemon.engine.messages import ELASTIC_PHASES
    from pagoda_daemon.server.auth import ADMIN_API_KEY_ENV, ADMIN_PATHS
    from pagoda_operator import elastic

    assert elastic.PHASES == ELASTIC_PHASES
    assert elastic.ADMIN_KEY_ENV == ADMIN_API_KEY_ENV
    assert {"/elastic_ep", "/scale_elastic_ep"} <= set(ADMIN_PATHS)


def test_the_disaggregated_pods_command_lines_are_the_daemons(tmp_path):
    """spec.disaggregation's engines and proxy: each command line parses through `pagoda`'s own
    parser, the role's flags win over the shared engine.yaml, and the proxy reaches the engines'
    ports."""
    from pagoda_operator import disaggregation

    body = {"model": {"name": "m", "pvc": {"claimName": "w"}}, "resources": {"gpusPerReplica": 2},
            "engine": {"maxNumSeqs": 64},
            "disaggregation": {"kvDiskGiB": 1.5, "prefill": {"maxNumSeqs": 4}, "decode": {"port": 8300}}}
    svc = spec.parse("llama", "default", body)
    config_file = tmp_path / "engine.yaml"
    config_file.write_text(yaml.safe_dump(builders.daemon_config(svc)))
    pod = disaggregation.pod(svc, builders.Settings(), "hash")
    containers = {c["name"]: c for c in pod["spec"]["containers"]}
    options = {}
    for role in ("prefill", "decode"):
        argv = list(containers[role]["args"])
        argv[argv.index("--config") + 1] = str(config_file)
        options[role] = resolve_options(build_parser().parse_args(argv), _explicit_options(argv))
        assert options[role]["kv_offload_disk_gib"] == 1.5
    assert (options["prefill"]["port"], options["decode"]["port"]) == (8100, 8300)
    assert (options["prefill"]["max_num_seqs"], options["decode"]["max_num_seqs"]) == (4, 64)
    assert options["decode"]["kv_offload_disk_source"] == options["prefill"]["kv_offload_disk_path"]
    assert options["prefill"]["kv_offload_disk_source"] is None
    proxy = build_parser().parse_args(containers["proxy"]["args"])
    assert (proxy.prefill, proxy.decode, proxy.port) == (["http://127.0.0.1:8100"], ["http://127.0.0.1:8300"], 8000)


def test_prefill_pods_apart_command_lines_are_the_daemons(tmp_path):
    """spec.disaggregation.prefill.replicas: the prefill pod's engine serves its blocks on the
    transfer port under its pod IP (the kubelet expands ``$(POD_IP)``), the decode engine fetches
    each request's from the prefill instance that computed it, the proxy follows the mounted list
    of prefill pods, and both engines read the transfer key from the variable the daemon reads."""
    from pagoda_daemon.kv_offload.transfer_auth import KEY_ENV
    from pagoda_operator import disaggregation

    body = {"model": {"name": "m", "pvc": {"claimName": "w"}}, "resources": {"gpusPerReplica": 2},
            "disaggregation": {"kvDiskGiB": 1.5, "prefill": {"replicas": 3, "maxNumSeqs": 4}}}
    svc = spec.parse("llama", "default", body)
    config_file = tmp_path / "engine.yaml"
    config_file.write_text(yaml.safe_dump(builders.daemon_config(svc)))
    settings = builders.Settings()
    (prefill,) = disaggregation.prefill_pod(svc, settings, "hash")["spec"]["containers"]
    decode, proxy = disaggregation.pod(svc, settings, "hash")["spec"]["containers"]
    options = {}
    for c in (prefill, decode):
        argv = [a.replace("$(POD_IP)", "10.1.2.3") for a in c["args"]]
        argv[argv.index("--config") + 1] = str(config_file)
        options[c["name"]] = resolve_options(build_parser().parse_args(argv), _explicit_options(argv))
        assert options[c["name"]]["kv_offload_disk_gib"] == 1.5
        assert {"name": KEY_ENV, "valueFrom": {"secretKeyRef": {
            "name": "llama-kv-transfer", "key": "key"}}} in c["env"]
    assert "$(POD_IP)" in prefill["args"] and {e["name"] for e in prefill["env"]} >= {"POD_IP", KEY_ENV}
    assert (options["prefill"]["kv_transfer_port"], options["prefill"]["kv_transfer_host"]) == (
        spec.KV_TRANSFER_PORT, "10.1.2.3")
    assert options["prefill"]["max_num_seqs"] == 4 and options["prefill"]["kv_offload_disk_source"] is None
    assert options["decode"]["kv_offload_disk_source"] == "request" and options["decode"]["kv_transfer_port"] == 0
    args = build_parser().parse_args(proxy["args"])
    mount = next(m for m in proxy["volumeMounts"] if m["name"] == disaggregation.INSTANCES_VOLUME)
    assert args.prefill_file == f"{mount['mountPath']}/{disaggregation.INSTANCES_KEY}" and not args.prefill
    assert args.decode == ["http://127.0.0.1:8200"] and args.port == svc.port


def test_every_option_a_layout_refusal_names_is_an_inferenceservice_field(tiny_models):
    """check_layout's refusals, put in the spec's terms by the operator (status.pod_problems),
    name no daemon option the user did not write."""
    from types import SimpleNamespace

    from pagoda_daemon.distributed.layout import check_layout
    from pagoda_daemon.models.loader import load_config

    moe = load_config(tiny_models["qwen3_moe"])
    dense = load_config(tiny_models["llama"])
    refusals = []
    for model, args in [(moe, (3, 1)), (moe, (1, 3, True, 1)), (dense, (1, 2, True, 0)), (moe, (1, 2, False, 2)),
                        (moe, (1, 2, True, 99)), (moe, (3, 1)),
                        (SimpleNamespace(num_attention_heads=6, num_key_value_heads=4, intermediate_size=7), (2, 1)),
                        (moe, (1, 1, False, 0, 99)), (dense, (1, 1, False, 0, 2))]:
        with pytest.raises(ValueError) as refused:
            check_layout(model, *args)
        refusals.append(str(refused.value))
    options = {d.name for d in declared(EngineConfig) if "_" in d.name}  # one-word names read as prose

    def named(text: str) -> set[str]:
        return {w for w in options if re.search(rf"\b{w}\b", text)}

    for message in refusals:
        assert named(message), message  # each names what to change
        assert not named(spec.in_crd_terms(message)), spec.in_crd_terms(message)


def _crd_properties(schema: dict, path: str = "spec") -> dict[str, dict]:
    """Every field of the InferenceService's schema by its path (spec.parallelism.tensor, ...)."""
    out = {path: schema}
    for name, sub in schema.get("properties", {}).items():
        out.update(_crd_properties(sub, f"{path}.{name}"))
    return out


def _crd_fields_of_options() -> list[tuple[str, str, dict, OptionInfo]]:
    """(daemon option, its CRD field's path, that field's schema, the option's declaration) for
    every CRD field rendered into a daemon option."""
    crd = yaml.safe_load((ROOT / "crds" / "inferenceservices.pagoda.dev.yaml").read_text())
    (version,) = crd["spec"]["versions"]
    fields = _crd_properties(version["schema"]["openAPIV3Schema"]["properties"]["spec"])
    options = {d.name: d.info for d in declared(EngineConfig)}
    pairs = {**spec.CRD_FIELD_OF_OPTION, **spec.CRD_FIELD_OF_LAYOUT_OPTION,
             "eplb_step_interval": "spec.parallelism.eplb.stepInterval",
             "elastic_ep_min_size": "spec.parallelism.elastic.minExpert",
             "max_loras": "spec.lora.maxLoras", "max_lora_rank": "spec.lora.maxRank"}
    for path in fields:  # spec.engine.<camelCase> is option <snake_case>
        name = re.sub(r"(?<!^)(?=[A-Z])", "_", path.removeprefix("spec.engine.")).lower()
        if path.startswith("spec.engine.") and name in options:
            pairs[name] = path
    return [(option, path, fields[path], options[option]) for option, path in pairs.items()]


def test_every_number_the_crd_admits_the_daemon_takes():
    """A field rendered into a daemon option has CRD bounds within the option's (one declaration
    each, checked here): nothing the API server admits is refused by the pod it becomes."""
    checked, wider = [], []
    for option, path, field, info in _crd_fields_of_options():
        if field.get("type") not in ("integer", "number"):
            continue
        low, high = field.get("minimum"), field.get("maximum")
        if info.minimum is not None and (low is None or low < info.minimum or (
                info.exclusive_minimum and low == info.minimum and not field.get("exclusiveMinimum"))):
            wider.append(f"{path}: minimum {low}, {option}'s {info.minimum}")
        if info.maximum is not None and (high is None or high > info.maximum):
            wider.append(f"{path}: maximum {high}, {option}'s {info.maximum}")
        checked.append(path)
    assert not wider, wider
    assert {"spec.parallelism.data", "spec.parallelism.eplb.asyncSteps", "spec.parallelism.eplb.stepInterval",
            "spec.engine.maxNumSeqs"} <= set(checked), checked


def test_every_choice_the_crd_admits_the_daemon_takes():
    """The same for fields with a list of values: each value the CRD's enum admits is one of the
    option's choices."""
    checked, wider = [], []
    for option, path, field, info in _crd_fields_of_options():
        if "enum" not in field or info.choices is None:
            continue
        extra = [v for v in field["enum"] if v not in info.choices]
        if extra:
            wider.append(f"{path}: {extra} are not {option}'s choices {info.choices}")
        checked.append(path)
    assert not wider, wider
    assert {"spec.engine.dtype", "spec.engine.schedulingPolicy", "spec.engine.runner"} <= set(checked), checked


@pytest.mark.parametrize("layout", ["StatefulSets", "LeaderWorkerSet"])
def test_a_groups_worker_takes_its_node_rank_and_leader_as_rendered(tmp_path, monkeypatch, layout):
    """A worker of a group of 2 pods is node 1 and meets its leader, in either layout: from its
    StatefulSet hostname (``<name>-<g>-0``) and the leader's IP, or from the variables the
    LeaderWorkerSet controller's webhook sets (worker index 1; the kubelet expands ``$(VAR)``)."""
    body = {"model": {"name": "m", "pvc": {"claimName": "w"}},
            "resources": {"gpusPerReplica": 2, "podsPerReplica": 2}, "parallelism": {"tensor": 2}}
    svc = spec.parse("llama", "default", body, supports=every_capability)
    owner = {"metadata": {"name": "llama", "uid": "u"}}
    settings = builders.Settings()
    config_file = tmp_path / "engine.yaml"
    config_file.write_text(yaml.safe_dump(builders.daemon_config(svc)))
    if layout == "StatefulSets":
        (workers,) = pod_groups.children(svc, owner, 1, settings, {0: "10.0.0.7"}).workers
        argv = workers["spec"]["template"]["spec"]["containers"][0]["args"]
        monkeypatch.setattr(serve.socket, "gethostname", lambda: "llama-0-0")
        leader = "10.0.0.7"
    else:
        lws = leader_worker_set.children(svc, owner, 1, settings).workload
        argv = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["args"]
        leader = "llama-group-0.llama-group.default"
        env = {leader_worker_set.WORKER_INDEX_ENV: "1", leader_worker_set.LEADER_ADDRESS_ENV: leader}
        argv = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in argv]
    argv = list(argv)
    argv[argv.index("--config") + 1] = str(config_file)
    options = resolve_options(build_parser().parse_args(argv), _explicit_options(argv))
    assert (options["node_rank"], options["master_addr"], options["nnodes"]) == (1, leader, 2)
