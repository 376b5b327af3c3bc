"""Typed view of an InferenceService spec.

The CRD schema validates types, enums, ranges and defaults. This module repeats the defaults (so
pure code and tests can start from a partial spec) and checks what a schema without CEL cannot:
rules that tie two fields together. A violation raises :class:`InvalidSpec`, which the operator
reports as ``Degraded/InvalidSpec`` while leaving running children untouched.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

# Standard library only (the operator image has no torch): the daemon's declared options and
# capabilities, so both sides refuse the same things.
from pagoda_daemon import capabilities, model_uri
from pagoda_daemon.config import EngineConfig, is_template_text
from pagoda_daemon.hf_overrides import parse_hf_overrides
from pagoda_daemon.lora.names import AdapterError, check_name
from pagoda_daemon.options import declared, refusals

Supports = Callable[[str], bool]  # capability name -> whether to accept it

DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")

# The same patterns are in the CRD (a test keeps them equal); these regexes use no lookaround, so
# the API server's RE2 reads them as Python does. A path segment: not empty, not "." or "..".
_SEGMENT = r"([^/.][^/]*|\.[^/.][^/]*|\.\.[^/]+)"
# An absolute path written in normal form: no "..", ".", empty segments or trailing "/".
ABSOLUTE_PATH = rf"^/$|^(/{_SEGMENT})+$"
# A path inside a volume in normal form (empty: the volume's root).
RELATIVE_PATH = rf"^$|^{_SEGMENT}(/{_SEGMENT})*$"
# Passed as the argument of --served-model-name: a leading "-" would read as another option.
MODEL_NAME = r"^[^-]"
DNS1123_SUBDOMAIN = model_uri.DNS1123_SUBDOMAIN
SECRET_KEY = r"^[-._a-zA-Z0-9]+$"
DEFAULT_API_KEY_KEY = "api-key"
# spec.model.uri: the schemes the daemon's parser (pagoda_daemon.model_uri) reads, no whitespace.
MODEL_URI = r"^(hf|s3|pvc)://\S+$"
# spec.model.endpoint: an http(s) URL whose authority holds no userinfo ("user:pass@").
ENDPOINT = r"^https?://[^/?#@\s]+([/?#]\S*)?$"
MAX_ENDPOINT = 2048
# spec.model.region (s3).
REGION = r"^[a-z0-9-]{1,32}$"
# spec.model.cacheSize: a Kubernetes quantity without sign or exponent (the cache emptyDir's sizeLimit).
QUANTITY = r"^[0-9]+(\.[0-9]+)?([KMGTPE]i|[kMGTPE])?$"
MAX_QUANTITY = 32
_QUANTITY_UNITS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
                   "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
# The options of a model fetched over the network (hf://, s3://), under spec.model.
REMOTE_OPTIONS = ("credentials", "endpoint", "region", "cacheSize")

METRICS = ("kvCacheUsage", "requestsWaiting", "requestsRunning")
# Elastic EP may also follow the expert load EPLB measures: the busiest rank's routed (token,
# expert) pairs per MoE layer per step, which the expert-parallel size divides (at decode, 256
# sequences routed to 8 experts each over 4 ranks: about 512).
ELASTIC_METRICS = (*METRICS, "expertLoad")
DEFAULT_TARGETS = {"kvCacheUsage": 0.8, "requestsWaiting": 2.0, "requestsRunning": 16.0, "expertLoad": 512.0}
# spec.disaggregation: the engines' ports inside the pod, and the bounds of its numbers (the CRD
# carries the same ones).
DEFAULT_PREFILL_PORT, DEFAULT_DECODE_PORT = 8100, 8200
MAX_KV_DISK_GIB = 65536.0  # 64 TiB: above any node's local disk
MAX_SCHEDULER_LIMIT = 2**20
DISAGGREGATION_KEYS = ("enabled", "kvDiskGiB", "prefill", "decode")
ROLE_KEYS = ("port", "maxNumSeqs", "maxNumBatchedTokens", "replicas", "autoscaling")
MAX_PREFILL_REPLICAS = 1024
# spec.autoscaling's fields, and the bound of its stabilisation windows (the CRD carries the same).
AUTOSCALING_KEYS = ("enabled", "minReplicas", "maxReplicas", "metric", "target", "tolerance",
                    "scaleUpStabilizationSeconds", "scaleDownStabilizationSeconds")
MAX_STABILIZATION_S = 3600
# spec.disaggregation.prefill.autoscaling's default metric: the prefill queue. A prefill engine
# answers each prompt with one token, so its KV usage is only the prompts in flight and its running
# requests stop at what one step's token budget (maxNumBatchedTokens) holds; the prompts that got
# no tokens this step are those waiting (scheduler.py), which grow exactly when prompts come
# faster than the pods compute them.
PREFILL_METRIC = "requestsWaiting"
# Where a prefill pod serves its disk tier's blocks to decode pods (spec.disaggregation.prefill.replicas).
KV_TRANSFER_PORT = 8300
# The field that spreads a MoE model's experts over the data-parallel engines of a pod.
DATA_PARALLEL_EXPERTS = "spec.parallelism.dataParallelExperts"


class InvalidSpec(ValueError):
    """The spec passed the schema but cannot be served; the message says why and how to fix it."""


@dataclass(frozen=True)
class Model:
    name: str
    # "pvc" (spec.model.pvc, or a pvc:// uri: mounted like one) | "hostPath" | "uri" (hf://, s3://:
    # the daemon fetches it into the cache volume)
    source: str
    claim_name: str | None = None
    path: str = ""
    read_only: bool = True
    uri: str | None = None  # spec.model.uri as written
    scheme: str | None = None  # of the uri: "hf" | "s3" | "pvc"
    canonical_uri: str | None = None  # hf://, s3://: as the node model cache records it (model_uri)
    # Remote sources only (hf, s3): a Secret of the namespace the pod reads its credentials from,
    # the store's endpoint, the S3 region, the cache emptyDir's sizeLimit.
    credentials_secret: str | None = None
    endpoint: str | None = None
    region: str | None = None
    cache_size: str | None = None


@dataclass(frozen=True)
class SecretKeyRef:
    """One key of a Secret in the InferenceService's namespace."""

    name: str
    key: str = DEFAULT_API_KEY_KEY


@dataclass(frozen=True)
class Parallelism:
    tensor: int = 1
    expert: int = 1
    data: int = 1
    elastic: Elastic | None = None
    eplb_redundant_experts: int | None = None  # set: EPLB on
    eplb_step_interval: int = 3000
    eplb_async_steps: int = 0  # > 0: the experts move in the background (the daemon's eplb_async_steps)
    # The MoE experts spread over the `data` engines of a pod, each engine one GPU (data-parallel attention)
    data_parallel_experts: bool = False
    # How those engines' MoE layers move tokens (the daemon's all2all_backend); None: its default
    all2all_backend: str | None = None


@dataclass(frozen=True)
class Engine:
    max_model_len: int | None = None
    block_size: int = 16
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    num_kv_blocks: int | None = None
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    scheduling_policy: str | None = None  # fcfs | priority; unset: the daemon's (fcfs)
    runner: str | None = None  # auto | generate | pooling (embeddings); unset: the daemon's (auto)
    # the daemon's hf_overrides (a JSON object, as compact JSON) and chat_template (the Jinja text
    # itself: a pod's files are never named), e.g. to serve the original Qwen3-Reranker
    hf_overrides: str | None = None
    chat_template: str | None = None


@dataclass(frozen=True)
class LoraAdapter:
    name: str  # what requests send as their model
    uri: str  # hf:// or s3://, fetched by each pod into its model cache


@dataclass(frozen=True)
class Lora:
    """spec.lora: LoRA adapters served beside the model (docs/lora.md), each pod fetching them
    from their source as it fetches a remote model; the slots and the largest rank."""

    adapters: tuple[LoraAdapter, ...] = ()
    max_loras: int = 1
    max_rank: int = 16


# spec.lora.adapters at most (the CRD's maxItems): each is fetched and read at every pod's start.
MAX_LORA_ADAPTERS = 256


@dataclass(frozen=True)
class KVOffload:
    cpu_gib: float | None = None
    disk_path: str | None = None
    disk_gib: float | None = None
    write_policy: str | None = None  # None: the daemon's default


@dataclass(frozen=True)
class Role:
    """One engine of a prefill/decode unit (spec.disaggregation.prefill or .decode): the port it
    serves on, the scheduler limits it sets apart from spec.engine's, and for the prefill role
    how many pods of its own run it (None: it shares each replica's pod with the decode engine)."""

    port: int
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    replicas: int | None = None
    # the prefill pods' autoscaler (spec.autoscaling's rule over them; replicas is its starting size)
    autoscaling: Autoscaling | None = None


@dataclass(frozen=True)
class Disaggregation:
    """spec.disaggregation: prefill engines, decode engines that load the prompts' KV blocks from
    a prefill engine's disk tier, and the pd-proxy in front. Either each replica is one pod of
    the three (the blocks move by hard link), or with ``prefill.replicas`` the prefill engines
    run in pods of their own and each replica's pod holds a decode engine and the proxy (the
    blocks move over TCP; disaggregation.py)."""

    kv_disk_gib: float  # each engine's disk KV tier
    prefill: Role = field(default_factory=lambda: Role(DEFAULT_PREFILL_PORT))
    decode: Role = field(default_factory=lambda: Role(DEFAULT_DECODE_PORT))

    @property
    def prefill_pods(self) -> bool:
        """Whether the prefill engines run in pods of their own."""
        return self.prefill.replicas is not None


@dataclass(frozen=True)
class Autoscaling:
    min_replicas: int
    max_replicas: int
    metric: str = "kvCacheUsage"
    target: float = 0.8
    tolerance: float = 0.1
    scale_up_window_s: int = 0
    scale_down_window_s: int = 300


@dataclass(frozen=True)
class Elastic:
    """spec.parallelism.elastic: the replica autoscaler's rule (``Autoscaling``) over a replica's
    expert-parallel size, its bounds minExpert and maxExpert (elastic.py)."""

    rule: Autoscaling

    @property
    def min_expert(self) -> int:
        return self.rule.min_replicas

    @property
    def max_expert(self) -> int:
        return self.rule.max_replicas

    @property
    def metric(self) -> str:
        return self.rule.metric


@dataclass(frozen=True)
class Placement:
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    numa_policy: str = "auto"
    require_nvlink: bool = False


@dataclass(frozen=True)
class Tracing:
    otlp_endpoint: str | None = None
    sampling_ratio: float = 1.0


@dataclass(frozen=True)
class PodOverrides:
    env: list[dict[str, Any]] = field(default_factory=list)
    annotations: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    resources: dict[str, dict[str, Any]] = field(default_factory=dict)
    service_account_name: str | None = None
    priority_class_name: str | None = None


@dataclass(frozen=True)
class ServiceSpec:
    name: str
    namespace: str
    model: Model
    replicas: int = 1
    gpus: int = 1
    # A replica spread over this many pods (a group: one leader with the API, workers with
    # ranks only; pod_groups.py), for models that need more GPUs than one node has.
    pods_per_replica: int = 1
    gpu_resource: str = "nvidia.com/gpu"
    parallelism: Parallelism = field(default_factory=Parallelism)
    engine: Engine = field(default_factory=Engine)
    kv_offload: KVOffload = field(default_factory=KVOffload)
    autoscaling: Autoscaling | None = None
    placement: Placement = field(default_factory=Placement)
    tracing: Tracing = field(default_factory=Tracing)
    image: str | None = None
    image_pull_policy: str | None = None
    port: int = 8000
    pod: PodOverrides = field(default_factory=PodOverrides)
    # spec.server.apiKeySecretRef: the daemon's API key (PAGODA_API_KEY); None serves without one.
    api_key_secret: SecretKeyRef | None = None
    disaggregation: Disaggregation | None = None
    lora: Lora | None = None

    @property
    def device(self) -> str:
        return "cuda" if self.gpus > 0 else "cpu"

    @property
    def gpus_per_engine(self) -> int:
        """The GPUs one engine holds: a replica's, or half of them with disaggregation (two engines)."""
        return self.gpus // 2 if self.disaggregation is not None else self.gpus

    @property
    def gpus_per_pod(self) -> int:
        return self.gpus // self.pods_per_replica


def _get(d: Mapping[str, Any] | None, key: str, default: Any = None) -> Any:
    if not d:
        return default
    value = d.get(key)
    return default if value is None else value


def _json_text(value: Any) -> str | None:
    """A JSON object field as the compact JSON a daemon option takes (None when unset; a
    non-finite number is written as Python's JSON writes it, for the check to refuse)."""
    if value is None:
        return None
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _rule(d: Mapping[str, Any], minimum: int, maximum: int, default_metric: str) -> Autoscaling:
    """The rule spec.autoscaling and spec.parallelism.elastic share: metric, target, tolerance,
    stabilisation windows, between `minimum` and `maximum`."""
    metric = _get(d, "metric", default_metric)
    return Autoscaling(
        min_replicas=minimum,
        max_replicas=maximum,
        metric=metric,
        target=float(_get(d, "target", DEFAULT_TARGETS.get(metric, 1.0))),
        tolerance=float(_get(d, "tolerance", 0.1)),
        scale_up_window_s=int(_get(d, "scaleUpStabilizationSeconds", 0)),
        scale_down_window_s=int(_get(d, "scaleDownStabilizationSeconds", 300)),
    )


def parse(
    name: str, namespace: str, spec: Mapping[str, Any], supports: Supports = capabilities.supported
) -> ServiceSpec:
    """Build the typed spec, applying the schema's defaults, then :func:`validate` it
    (``supports``: which daemon capabilities to accept; tests of what the operator renders for
    features the daemon does not have yet pass one that accepts everything)."""
    spec = spec or {}
    m = _get(spec, "model", {})
    sources = [k for k in ("pvc", "hostPath", "uri") if m.get(k)]
    if len(sources) != 1:
        raise InvalidSpec(
            f"spec.model needs exactly one source of weights (pvc, hostPath or uri); got {sources or 'none'}"
        )
    source = sources[0]
    errors = model_source_errors(m)
    if errors:
        raise InvalidSpec("; ".join(errors))
    if source == "pvc":
        model = Model(
            name=_get(m, "name", name),
            source="pvc",
            claim_name=m["pvc"].get("claimName"),
            path=_get(m["pvc"], "path", ""),
            read_only=bool(_get(m["pvc"], "readOnly", True)),
        )
    elif source == "hostPath":
        model = Model(name=_get(m, "name", name), source="hostPath", path=m["hostPath"]["path"])
    else:
        ref = model_uri.parse(m["uri"])
        if ref.scheme == "pvc":  # mounted exactly like spec.model.pvc, read-only
            model = Model(
                name=_get(m, "name", name), source="pvc", claim_name=ref.location, path=ref.path,
                read_only=True, uri=m["uri"], scheme="pvc",
            )  # fmt: skip
        else:
            model = Model(
                name=_get(m, "name", name),
                source="uri",
                uri=m["uri"],
                scheme=ref.scheme,
                canonical_uri=str(ref),
                credentials_secret=_get(_get(m, "credentials", {}), "secretName"),
                endpoint=_get(m, "endpoint"),
                region=_get(m, "region"),
                cache_size=_get(m, "cacheSize"),
            )

    r = _get(spec, "resources", {})
    p = _get(spec, "parallelism", {})
    data_experts = _get(p, "dataParallelExperts", False)
    if not isinstance(data_experts, bool):
        raise InvalidSpec(_not_a_boolean(DATA_PARALLEL_EXPERTS, data_experts))
    el = _get(p, "elastic", None)
    eplb = _get(p, "eplb", None)
    elastic = Elastic(_rule(el, int(el["minExpert"]), int(el["maxExpert"]), "requestsRunning")) if el else None
    parallelism = Parallelism(
        tensor=int(_get(p, "tensor", 1)),
        expert=int(_get(p, "expert", 1)),
        data=int(_get(p, "data", 1)),
        elastic=elastic,
        eplb_redundant_experts=int(_get(eplb, "redundantExperts", 0)) if eplb is not None else None,
        eplb_step_interval=int(_get(eplb, "stepInterval", 3000)),
        eplb_async_steps=int(_get(eplb, "asyncSteps", 0)),
        data_parallel_experts=data_experts,
        all2all_backend=_get(p, "all2allBackend"),
    )
    e = _get(spec, "engine", {})
    engine = Engine(
        max_model_len=_get(e, "maxModelLen"),
        block_size=int(_get(e, "blockSize", 16)),
        max_num_seqs=_get(e, "maxNumSeqs"),
        max_num_batched_tokens=_get(e, "maxNumBatchedTokens"),
        num_kv_blocks=_get(e, "numKvBlocks"),
        dtype=_get(e, "dtype", "auto"),
        kv_cache_dtype=_get(e, "kvCacheDtype", "auto"),
        gpu_memory_utilization=float(_get(e, "gpuMemoryUtilization", 0.9)),
        enable_prefix_caching=bool(_get(e, "enablePrefixCaching", True)),
        enforce_eager=bool(_get(e, "enforceEager", False)),
        scheduling_policy=_get(e, "schedulingPolicy"),
        runner=_get(e, "runner"),
        hf_overrides=_json_text(_get(e, "hfOverrides")),
        chat_template=_get(e, "chatTemplate"),
    )
    kv = _get(spec, "kvOffload", {})
    disk = _get(kv, "disk", {})
    kv_offload = KVOffload(
        cpu_gib=_get(kv, "cpuGiB"),
        disk_path=_get(disk, "path"),
        disk_gib=_get(disk, "sizeGiB"),
        write_policy=_get(kv, "writePolicy"),
    )
    a = spec.get("autoscaling")
    autoscaling = None
    if a and _get(a, "enabled", True):
        autoscaling = _rule(a, int(_get(a, "minReplicas", 1)), int(_get(a, "maxReplicas", _get(a, "minReplicas", 1))),
                            "kvCacheUsage")
    pl = _get(spec, "placement", {})
    placement = Placement(
        node_selector=dict(_get(pl, "nodeSelector", {})),
        tolerations=[dict(t) for t in _get(pl, "tolerations", [])],
        numa_policy=_get(pl, "numaPolicy", "auto"),
        require_nvlink=bool(_get(pl, "requireNVLink", False)),
    )
    t = _get(spec, "tracing", {})
    tracing = Tracing(
        otlp_endpoint=_get(t, "otlpEndpoint"), sampling_ratio=float(_get(t, "samplingRatio", 1.0))
    )
    po = _get(spec, "pod", {})
    pod = PodOverrides(
        env=[dict(x) for x in _get(po, "env", [])],
        annotations=dict(_get(po, "annotations", {})),
        labels=dict(_get(po, "labels", {})),
        resources={k: dict(v) for k, v in _get(po, "resources", {}).items() if v},
        service_account_name=_get(po, "serviceAccountName"),
        priority_class_name=_get(po, "priorityClassName"),
    )
    ref = _get(_get(spec, "server", {}), "apiKeySecretRef")
    api_key_secret = (
        SecretKeyRef(name=str(_get(ref, "name", "")), key=str(_get(ref, "key", DEFAULT_API_KEY_KEY)))
        if ref
        else None
    )
    parsed = ServiceSpec(
        name=name,
        namespace=namespace,
        model=model,
        replicas=int(_get(spec, "replicas", 1)),
        gpus=int(_get(r, "gpusPerReplica", 1)),
        pods_per_replica=int(_get(r, "podsPerReplica", 1)),
        gpu_resource=_get(r, "gpuResourceName", "nvidia.com/gpu"),
        parallelism=parallelism,
        engine=engine,
        kv_offload=kv_offload,
        autoscaling=autoscaling,
        placement=placement,
        tracing=tracing,
        image=_get(spec, "image") or None,
        image_pull_policy=_get(spec, "imagePullPolicy"),
        port=int(_get(spec, "port", 8000)),
        pod=pod,
        api_key_secret=api_key_secret,
        disaggregation=parse_disaggregation(spec.get("disaggregation")),
        lora=parse_lora(spec.get("lora")),
    )
    validate(parsed, supports)
    return parsed


def parse_lora(lo: Mapping[str, Any] | None) -> Lora | None:
    if not lo:
        return None
    adapters = tuple(LoraAdapter(str(_get(a, "name", "")), str(_get(a, "uri", ""))) for a in _get(lo, "adapters", []))
    return Lora(adapters, int(_get(lo, "maxLoras", 1)), int(_get(lo, "maxRank", 16)))


def lora_errors(s: ServiceSpec) -> list[str]:
    """spec.lora: names as the daemon takes them, each once and not the model's; sources it can
    fetch; slots and rank within the daemon's bounds; what it does not combine with yet."""
    lo = s.lora
    if lo is None:
        return []
    errors = []
    for option, value, where in (("max_loras", lo.max_loras, "maxLoras"), ("max_lora_rank", lo.max_rank, "maxRank")):
        low, high = _option_bounds(option)
        if not low <= value <= high:
            errors.append(f"lora.{where} ({value}) must be {low:g} to {high:g}")
    if len(lo.adapters) > MAX_LORA_ADAPTERS:
        errors.append(f"lora.adapters lists {len(lo.adapters)} adapters; at most {MAX_LORA_ADAPTERS}")
    names = [a.name for a in lo.adapters]
    for dup in sorted({n for n in names if names.count(n) > 1}):
        errors.append(f"lora.adapters names {dup!r} twice")
    for i, a in enumerate(lo.adapters):
        try:
            check_name(a.name, s.model.name)
        except AdapterError as e:
            errors.append(f"lora.adapters[{i}].name: {e}")
        try:
            ref = model_uri.parse(a.uri)
        except model_uri.InvalidModelUri as e:
            errors.append(f"lora.adapters[{i}].uri: {e}")
            continue
        if not ref.remote:
            errors.append(f"lora.adapters[{i}].uri {a.uri!r}: an adapter comes from hf:// or s3:// (each pod fetches "
                          "it); pvc:// is not read for adapters")
    if s.parallelism.elastic is not None:
        errors.append("lora does not combine with parallelism.elastic: a rank that joins would start without the "
                      "adapters the others hold")
    if s.disaggregation is not None:
        errors.append("lora does not combine with spec.disaggregation yet")
    if s.engine.runner == "pooling":
        errors.append("lora does not combine with engine.runner pooling yet (adapters are served for generation)")
    if s.pods_per_replica > 1:
        errors.append("lora does not combine with resources.podsPerReplica above 1 yet (the daemon's nnodes)")
    return errors


def _option_bounds(name: str) -> tuple[float, float]:
    """The daemon's declared bounds of one of its options (one declaration: options.py)."""
    info = next(d.info for d in declared(EngineConfig) if d.name == name)
    assert info.minimum is not None and info.maximum is not None
    return info.minimum, info.maximum


def _bounded_int(value: Any, name: str, low: int, high: int, errors: list[str]) -> int | None:
    """``value`` when it is an integer in [low, high]; else None, with an error naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        errors.append(f"{name} must be an integer, not {type(value).__name__} {value!r}")
        return None
    if not low <= value <= high:
        errors.append(f"{name} must be {low} to {high}; got {value}")
        return None
    return value


def _unknown_keys(raw: Mapping[str, Any], known: tuple[str, ...], name: str) -> list[str]:
    return [f"{name}.{k} is not a field (known: {', '.join(known)})" for k in sorted(set(raw) - set(known))]


def _role(raw: Any, name: str, default_port: int, errors: list[str]) -> Role | None:
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        errors.append(f"{name} must be an object, not {type(raw).__name__}")
        return None
    errors += _unknown_keys(raw, ROLE_KEYS, name)
    port = _bounded_int(_get(raw, "port", default_port), f"{name}.port", 1, 65535, errors)
    limits = {key: _bounded_int(raw[key], f"{name}.{key}", 1, MAX_SCHEDULER_LIMIT, errors)
              for key in ("maxNumSeqs", "maxNumBatchedTokens") if raw.get(key) is not None}
    replicas = None
    if raw.get("replicas") is not None:
        replicas = _bounded_int(raw["replicas"], f"{name}.replicas", 1, MAX_PREFILL_REPLICAS, errors)
        if replicas is None:
            return None
    autoscaling = _read_autoscaling(raw.get("autoscaling"), f"{name}.autoscaling", errors)
    if port is None or None in limits.values():
        return None
    return Role(port, limits.get("maxNumSeqs"), limits.get("maxNumBatchedTokens"), replicas, autoscaling)


def _bounded_number(value: Any, name: str, errors: list[str], low: float, high: float = math.inf,
                    above: bool = False) -> float | None:
    """``value`` when it is a finite number in [low, high] (above ``low`` with ``above``); else
    None, with an error naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        errors.append(f"{name} must be a number, not {type(value).__name__} {value!r}")
        return None
    if not (math.isfinite(value) and (low < value if above else low <= value) and value <= high):
        bounds = [f"above {low:g}" if above else f"at least {low:g}", *([f"at most {high:g}"] if high < math.inf else [])]
        errors.append(f"{name} must be {' and '.join(bounds)}; got {value}")
        return None
    return float(value)


def _read_autoscaling(raw: Any, name: str, errors: list[str], max_replicas: int = MAX_PREFILL_REPLICAS,
                      default_metric: str = PREFILL_METRIC) -> Autoscaling | None:
    """An object of spec.autoscaling's shape read field by field (for a field the admission webhook
    checks too): the rule (:func:`_rule`), None when absent or ``enabled: false``; every wrong type,
    unknown field, number out of bounds or rule :func:`validate` refuses goes to ``errors``, named."""
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        errors.append(f"{name} must be an object, not {type(raw).__name__}")
        return None
    found = _unknown_keys(raw, AUTOSCALING_KEYS, name)
    enabled = _get(raw, "enabled", True)
    if not isinstance(enabled, bool):
        found.append(_not_a_boolean(f"{name}.enabled", enabled))
    low = _bounded_int(_get(raw, "minReplicas", 1), f"{name}.minReplicas", 1, max_replicas, found)
    high = None
    if raw.get("maxReplicas") is None:
        found.append(f"{name}.maxReplicas is required: the most pods the autoscaler may run")
    else:
        high = _bounded_int(raw["maxReplicas"], f"{name}.maxReplicas", 1, max_replicas, found)
    if low is not None and high is not None and low > high:
        found.append(f"{name}.minReplicas ({low}) is larger than maxReplicas ({high})")
    metric = _get(raw, "metric", default_metric)
    if metric not in METRICS:
        found.append(f"{name}.metric must be one of {', '.join(METRICS)}; got {metric!r}")
    if raw.get("target") is not None:
        _bounded_number(raw["target"], f"{name}.target", found, 0, above=True)
    _bounded_number(_get(raw, "tolerance", 0.1), f"{name}.tolerance", found, 0, 1)
    for key, default in (("scaleUpStabilizationSeconds", 0), ("scaleDownStabilizationSeconds", 300)):
        _bounded_int(_get(raw, key, default), f"{name}.{key}", 0, MAX_STABILIZATION_S, found)
    if found or low is None or high is None:
        errors += found
        return None
    rule = _rule(raw, low, high, default_metric)
    errors += _rule_errors(rule, name)
    return rule if enabled else None


def _rule_errors(rule: Autoscaling, name: str, metrics: tuple[str, ...] = METRICS) -> list[str]:
    """What an autoscaling rule (spec.autoscaling, spec.parallelism.elastic,
    spec.disaggregation.prefill.autoscaling) must be beyond its fields' types: a known metric,
    and a kvCacheUsage target a fraction."""
    errors = []
    if rule.metric not in metrics:
        errors.append(f"{name}.metric must be one of {', '.join(metrics)}; got {rule.metric!r}")
    if rule.metric == "kvCacheUsage" and not 0 < rule.target <= 1:
        errors.append(f"{name}.target for kvCacheUsage is a fraction in (0, 1]; got {rule.target}")
    return errors


def _read_disaggregation(raw: Any) -> tuple[Disaggregation | None, list[str]]:
    """spec.disaggregation read field by field: (the value, None when absent or ``enabled: false``;
    every wrong type, unknown field or number out of bounds, named)."""
    if raw is None:
        return None, []
    name = "spec.disaggregation"
    if not isinstance(raw, Mapping):
        return None, [f"{name} must be an object, not {type(raw).__name__}"]
    errors = _unknown_keys(raw, DISAGGREGATION_KEYS, name)
    enabled = _get(raw, "enabled", True)
    if not isinstance(enabled, bool):
        errors.append(f"{name}.enabled must be true or false, not {enabled!r}")
    gib = raw.get("kvDiskGiB")
    if gib is None:
        errors.append(f"{name}.kvDiskGiB is required: the disk space of each engine's KV tier, GiB (the prefill "
                      "engine's tier is where the decode engine takes the prompts' blocks from)")
    else:
        _bounded_number(gib, f"{name}.kvDiskGiB", errors, 0, MAX_KV_DISK_GIB, above=True)
    prefill = _role(raw.get("prefill"), f"{name}.prefill", DEFAULT_PREFILL_PORT, errors)
    decode = _role(raw.get("decode"), f"{name}.decode", DEFAULT_DECODE_PORT, errors)
    raw_decode, raw_prefill = (r if isinstance(r, Mapping) else {} for r in (raw.get("decode"), raw.get("prefill")))
    if raw_decode.get("replicas") is not None:
        errors.append(f"{name}.decode.replicas is not set here: the decode engines are spec.replicas (each "
                      "replica's pod holds one, and the proxy the Service sends to)")
    if raw_decode.get("autoscaling") is not None:
        errors.append(f"{name}.decode.autoscaling is not set here: the decode engines are spec.replicas, "
                      "autoscaled by spec.autoscaling")
    if raw_prefill.get("autoscaling") is not None and raw_prefill.get("replicas") is None:
        errors.append(f"{name}.prefill.autoscaling needs {name}.prefill.replicas (prefill pods of their own, "
                      "its starting size): the prefill engines in the replicas' pods scale with them")
    if errors or enabled is False or gib is None or prefill is None or decode is None:
        return None, errors
    return Disaggregation(float(gib), prefill, decode), []


def _not_a_boolean(name: str, value: Any) -> str:
    return f"{name} must be true or false, not {type(value).__name__} {value!r}"


def data_parallel_experts_field_errors(raw: Any) -> list[str]:
    """What is wrong with the dataParallelExperts of a raw spec.parallelism, its type or the
    daemon's rules for it: the admission webhook refuses at apply time what :func:`parse` and
    :func:`validate` refuse."""
    if not isinstance(raw, Mapping):
        return []
    value = raw.get("dataParallelExperts")
    if value is None or value is False:
        return []
    if not isinstance(value, bool):
        return [_not_a_boolean(DATA_PARALLEL_EXPERTS, value)]
    sizes = {key: raw.get(key) for key in ("data", "tensor", "expert")}
    if any(v is not None and (isinstance(v, bool) or not isinstance(v, int)) for v in sizes.values()):
        return []  # a size of the wrong type is the schema's to refuse
    data, tensor, expert = (1 if v is None else v for v in sizes.values())
    return _data_parallel_experts_rules(data, tensor, expert)


def _data_parallel_experts_rules(data: int, tensor: int, expert: int) -> list[str]:
    """The daemon's rules for data_parallel_experts (EngineConfig), in the CRD's field names."""
    errors = []
    if data < 2:
        errors.append(f"{DATA_PARALLEL_EXPERTS} spreads the experts over the data-parallel engines: it needs "
                      f"parallelism.data 2 or more (got {data})")
    if tensor != 1 or expert != 1:
        errors.append(f"{DATA_PARALLEL_EXPERTS} runs each engine on one GPU, the experts spread over the engines: it "
                      f"needs parallelism.tensor 1 and expert 1 (got {tensor} and {expert})")
    return errors


def all2all_backend_field_errors(raw: Any) -> list[str]:
    """The daemon's rule for all2allBackend in a raw spec.parallelism (the schema's enum refuses
    other values): refused by the webhook as by :func:`validate`."""
    if not isinstance(raw, Mapping):
        return []
    return _all2all_backend_rules(raw.get("all2allBackend"), raw.get("dataParallelExperts") is True)


def _all2all_backend_rules(backend: Any, data_parallel_experts: bool) -> list[str]:
    if backend in (None, ALL2ALL_BACKENDS[0]) or data_parallel_experts:
        return []
    return [f"parallelism.all2allBackend {backend} moves tokens between the engines the experts are spread over: "
            "it needs parallelism.dataParallelExperts"]


def disaggregation_field_errors(raw: Any) -> list[str]:
    """What is malformed in a raw spec.disaggregation: :func:`parse` refuses it, and so does the
    admission webhook at apply time."""
    return _read_disaggregation(raw)[1]


def parse_disaggregation(raw: Any) -> Disaggregation | None:
    """spec.disaggregation, or :class:`InvalidSpec` naming every malformed field."""
    value, errors = _read_disaggregation(raw)
    if errors:
        raise InvalidSpec("; ".join(errors))
    return value


def disaggregation_errors(s: ServiceSpec, supports: Supports = capabilities.supported) -> list[str]:
    """What cannot combine with spec.disaggregation: each refused rather than rendered half-working."""
    d = s.disaggregation
    if d is None:
        return []
    name = "spec.disaggregation"
    errors = []
    ports = {"spec.port": s.port, f"{name}.prefill.port": d.prefill.port, f"{name}.decode.port": d.decode.port}
    if len(set(ports.values())) < len(ports):
        errors.append(f"{', '.join(f'{k} ({v})' for k, v in ports.items())} must differ: the proxy and the two "
                      "engines listen in one pod")
    if not supports("kv_offload"):
        errors.append(f"{name}: {capabilities.refusal('kv_offload')} (the decode engine loads the prompts' KV "
                      "from the prefill engine's disk tier)")
    if s.gpus % 2:
        errors.append(f"{name} needs an even resources.gpusPerReplica (got {s.gpus}): it is split evenly between "
                      "the prefill and the decode engine")
    if d.prefill_pods and d.prefill.port == KV_TRANSFER_PORT:
        errors.append(f"{name}.prefill.port must not be {KV_TRANSFER_PORT}: the prefill pods serve KV blocks on "
                      "that port")
    if s.pods_per_replica > 1:
        errors.append(f"{name} needs resources.podsPerReplica 1: each engine runs in one pod (for prefill "
                      f"and decode engines in pods of their own, set {name}.prefill.replicas)")
    if s.parallelism.elastic is not None:
        errors.append(f"{name} does not combine with parallelism.elastic (the two engines' layouts must stay equal)")
    if s.kv_offload.cpu_gib or s.kv_offload.disk_path:
        errors.append(f"{name} renders each engine's disk KV tier itself: leave kvOffload unset (a second tier "
                      "per engine is not built)")
    if not s.engine.enable_prefix_caching:
        errors.append(f"{name} needs engine.enablePrefixCaching true: the decode engine finds the prompts' "
                      "blocks by their prefix hashes")
    if s.engine.runner == "pooling":
        errors.append(f"{name} serves generation: it does not combine with engine.runner pooling (embeddings)")
    return errors


def model_source_errors(model: Any) -> list[str]:
    """What is wrong with ``spec.model.uri`` and the options of a remote source (credentials,
    endpoint, region, cacheSize), read from the raw spec: :func:`parse` refuses them, and so does
    the admission webhook at apply time. The URI is read by the daemon's own parser."""
    if not isinstance(model, Mapping):
        return []
    errors: list[str] = []
    ref: model_uri.ModelUri | None = None
    uri = model.get("uri")
    if uri is not None:
        try:
            ref = model_uri.parse(uri)
        except model_uri.InvalidModelUri as e:
            return [f"spec.model.uri: {e}"]
        if ref.scheme == "path":
            return [
                f"spec.model.uri: {uri!r} is a local path: use spec.model.hostPath, or spec.model.pvc "
                "(or a pvc://claim/path URI) for a volume"
            ]
    given = [k for k in REMOTE_OPTIONS if model.get(k) is not None]
    if ref is None or not ref.remote:
        return [f"spec.model.{k}: only for a model fetched over the network (an hf:// or s3:// uri)" for k in given]
    creds = model.get("credentials")
    if creds is not None:
        secret = creds.get("secretName") if isinstance(creds, Mapping) else None
        if not isinstance(secret, str) or len(secret) > 253 or not re.search(DNS1123_SUBDOMAIN, secret):
            errors.append(
                f"spec.model.credentials.secretName {secret!r} is not a Secret name (DNS-1123 subdomain, "
                "at most 253 characters)"
            )
    endpoint = model.get("endpoint")
    if endpoint is not None:
        why = endpoint_error(endpoint)
        if why:
            errors.append(f"spec.model.endpoint: {why}")
    region = model.get("region")
    if region is not None:
        if ref.scheme != "s3":
            errors.append("spec.model.region: only for an s3:// uri")
        elif not isinstance(region, str) or not re.search(REGION, region):
            errors.append(f"spec.model.region {region!r} is not a region (1 to 32 lowercase letters, digits and '-')")
    size = model.get("cacheSize")
    if size is not None and (
        not isinstance(size, str)
        or len(size) > MAX_QUANTITY
        or not re.search(QUANTITY, size)
        or not (quantity_bytes(size) or 0) > 0
    ):
        errors.append(f"spec.model.cacheSize {size!r} is not a positive quantity of bytes (e.g. 100Gi)")
    return errors


def quantity_bytes(quantity: Any) -> int | None:
    """A quantity of bytes written as :data:`QUANTITY` reads it ("16Gi", "500M", 2**30), rounded
    up; None for a form it does not read (an exponent, milli-bytes)."""
    text = str(quantity).strip()
    m = re.search(QUANTITY, text)
    if m is None:
        return None
    unit = m.group(2) or ""
    return math.ceil(float(text[: len(text) - len(unit)]) * _QUANTITY_UNITS[unit])


def endpoint_error(endpoint: Any) -> str | None:
    """Why ``endpoint`` is not an http(s) URL with a host and no user information; None when it is."""
    if not isinstance(endpoint, str):
        return f"an endpoint is a string, not {type(endpoint).__name__}"
    if not endpoint or len(endpoint) > MAX_ENDPOINT:
        return f"an endpoint has 1 to {MAX_ENDPOINT} characters; got {len(endpoint)}"
    if any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in endpoint):
        return f"{endpoint!r} contains whitespace or control characters"
    try:
        url = urlsplit(endpoint)
        url.port  # noqa: B018 (raises on a port that is not a number in range)
    except ValueError as e:
        return f"{endpoint!r} is not a URL: {e}"
    if url.scheme not in ("http", "https") or not url.hostname:
        return f"{endpoint!r} is not an http:// or https:// URL with a host"
    if "@" in url.netloc:
        return (
            f"{endpoint!r} carries user information ('user:password@'): credentials belong in the Secret "
            "of spec.model.credentials"
        )
    if not re.search(ENDPOINT, endpoint):
        return f"{endpoint!r} is not an http:// or https:// URL"
    return None


# StatefulSet names end up in their pods' controller-revision-hash label (at most 63 characters,
# 11 of them the hash): a grouped InferenceService's name leaves room for "-<group>".
MAX_GROUPED_NAME = 40
# Where the ranks of a group of pods meet: the leader's TCP store (docs/parallelism.md).
RENDEZVOUS_PORT = 29500


def daemon_config(spec: ServiceSpec) -> dict[str, Any]:
    """The daemon's options (its CLI flag names in snake_case) for ``pagoda serve --config``;
    the builders mount them in the engine ConfigMap, and :func:`validate` checks them against
    the daemon's capabilities."""
    e, p, kv = spec.engine, spec.parallelism, spec.kv_offload
    cfg: dict[str, Any] = {
        "dtype": e.dtype,
        "block_size": e.block_size,
        "kv_cache_dtype": e.kv_cache_dtype,
        "gpu_memory_utilization": e.gpu_memory_utilization,
        "enable_prefix_caching": e.enable_prefix_caching,
        "enforce_eager": e.enforce_eager,
        "tensor_parallel_size": p.tensor,
        "expert_parallel_size": p.expert,
        "data_parallel_size": p.data,
        "numa_policy": spec.placement.numa_policy,
    }
    if spec.pods_per_replica > 1:  # the address and each pod's place are arguments (pod_groups.py)
        cfg.update(nnodes=spec.pods_per_replica, master_port=RENDEZVOUS_PORT)
    optional = {
        "max_model_len": e.max_model_len,
        "max_num_seqs": e.max_num_seqs,
        "max_num_batched_tokens": e.max_num_batched_tokens,
        "num_kv_blocks": e.num_kv_blocks,
        "scheduling_policy": e.scheduling_policy,  # only when set: pods without it stay as rendered
        "runner": e.runner,  # likewise
        "hf_overrides": e.hf_overrides,  # likewise
        "chat_template": e.chat_template,  # likewise
        "otlp_traces_endpoint": spec.tracing.otlp_endpoint,
        "kv_offload_cpu_gib": kv.cpu_gib,
        "kv_offload_disk_path": kv.disk_path,
        "kv_offload_disk_gib": kv.disk_gib if kv.disk_path else None,
        "kv_offload_write_policy": kv.write_policy,
    }
    if p.eplb_redundant_experts is not None or p.elastic is not None:  # elastic EP places experts by EPLB
        optional.update(enable_eplb=True, num_redundant_experts=p.eplb_redundant_experts or 0,
                        eplb_step_interval=p.eplb_step_interval)
    if p.eplb_async_steps:  # only when set: the pods of InferenceServices without it stay as rendered
        optional["eplb_async_steps"] = p.eplb_async_steps
    if p.data_parallel_experts:  # only when set, likewise
        optional["data_parallel_experts"] = True
    if p.all2all_backend is not None:
        optional["all2all_backend"] = p.all2all_backend
    if p.elastic is not None:
        optional.update(elastic_ep_min_size=p.elastic.min_expert, elastic_ep_max_size=p.elastic.max_expert)
    if spec.lora is not None:  # each NAME=URI a line of lora_modules; the pod fetches them as it starts
        optional.update(enable_lora=True, max_loras=spec.lora.max_loras, max_lora_rank=spec.lora.max_rank,
                        lora_modules="\n".join(f"{a.name}={a.uri}" for a in spec.lora.adapters) or None)
    cfg.update({k: v for k, v in optional.items() if v is not None})
    return cfg


# The InferenceService field each capability-gated daemon option comes from, so that a refusal
# names what the user wrote (tests/test_operator_daemon_contract.py checks the list is complete).
CRD_FIELD_OF_OPTION = {
    "tensor_parallel_size": "spec.parallelism.tensor",
    "expert_parallel_size": "spec.parallelism.expert",
    "data_parallel_size": "spec.parallelism.data",
    "data_parallel_experts": DATA_PARALLEL_EXPERTS,
    "kv_cache_dtype": "spec.engine.kvCacheDtype",
    "kv_offload_cpu_gib": "spec.kvOffload.cpuGiB",
    "kv_offload_disk_path": "spec.kvOffload.disk.path",
    "kv_offload_disk_gib": "spec.kvOffload.disk.sizeGiB",
    "kv_offload_write_policy": "spec.kvOffload.writePolicy",
}
# spec.kvOffload.writePolicy's values: the daemon's option's
WRITE_POLICIES: tuple[str, ...] = next(d.info.choices or () for d in declared(EngineConfig)
                                       if d.name == "kv_offload_write_policy")
MAX_CRD_TEMPLATE_CHARS = 65536  # engine.chatTemplate: the CRD's maxLength; an object's whole size is bounded too
# spec.engine.runner's values, likewise
RUNNERS: tuple[str, ...] = next(d.info.choices or () for d in declared(EngineConfig) if d.name == "runner")
# spec.parallelism.all2allBackend's values, likewise
ALL2ALL_BACKENDS: tuple[str, ...] = next(d.info.choices or () for d in declared(EngineConfig)
                                         if d.name == "all2all_backend")


# The fields of the options a daemon's refusal of its configuration may name beyond the gated ones
# (distributed/layout.check_layout: layouts only the model's config.json can rule out).
CRD_FIELD_OF_LAYOUT_OPTION = {
    "enable_eplb": "spec.parallelism.eplb",
    "num_redundant_experts": "spec.parallelism.eplb.redundantExperts",
    "eplb_async_steps": "spec.parallelism.eplb.asyncSteps",
    "elastic_ep_max_size": "spec.parallelism.elastic.maxExpert",
    "all2all_backend": "spec.parallelism.all2allBackend",
}


_CRD_FIELDS = {**CRD_FIELD_OF_OPTION, **CRD_FIELD_OF_LAYOUT_OPTION}
_OPTION_NAMES = re.compile(r"\b(" + "|".join(map(re.escape, sorted(_CRD_FIELDS, key=len, reverse=True))) + r")\b")


def in_crd_terms(message: str) -> str:
    """A daemon's message with the options it names replaced by the InferenceService fields
    they come from (``tensor_parallel_size`` -> ``spec.parallelism.tensor``)."""
    return _OPTION_NAMES.sub(lambda m: _CRD_FIELDS[m.group(1)], message)


def capability_errors(s: ServiceSpec, supports: Supports = capabilities.supported) -> list[str]:
    """What the spec asks for that this Pagoda build's daemon cannot do (``pagoda_daemon.capabilities``,
    the list the daemon itself refuses with): refused here, at apply time, instead of by a crash loop."""
    errors = [
        f"{CRD_FIELD_OF_OPTION.get(option, option)}: {capabilities.refusal(capability)}"
        for option, capability in refusals(daemon_config(s), EngineConfig, supports).items()
    ]
    if s.model.source == "uri" and not supports("model_uri"):  # hf://, s3:// (pvc:// is mounted)
        errors.append(f"spec.model.uri: {capabilities.refusal('model_uri')}")
    if s.parallelism.elastic is not None and not supports("elastic_expert_parallel"):
        errors.append(f"spec.parallelism.elastic: {capabilities.refusal('elastic_expert_parallel')}")
    return errors


def validate(s: ServiceSpec, supports: Supports = capabilities.supported) -> None:
    """Cross-field rules; raises :class:`InvalidSpec` listing every violation."""
    errors: list[str] = []
    if len(s.name) > 63 or not DNS1035.match(s.name):
        errors.append(
            f"metadata.name {s.name!r} must be a DNS-1035 label (lowercase letters, digits and '-', "
            "starting with a letter, at most 63 characters): it names the Service and pod labels"
        )
    errors += _field_errors(s)
    errors += capability_errors(s, supports)
    errors += disaggregation_errors(s, supports)
    errors += lora_errors(s)
    par = s.parallelism
    ranks = par.tensor * par.expert * par.data
    if par.data > 1 and s.disaggregation:
        errors.append("parallelism.data above 1 does not combine with spec.disaggregation (each of its two engines "
                      "runs alone)")
    if par.data > 1 and par.elastic is not None:
        errors.append("parallelism.data above 1 does not combine with parallelism.elastic (a resize changes one "
                      "engine)")
    if par.data_parallel_experts:
        errors += _data_parallel_experts_rules(par.data, par.tensor, par.expert)
    # (gpusPerReplica 0: CPU ranks over gloo share the pod's cores, so a layout can be tried without GPUs)
    if s.gpus and par.elastic is None and ranks != s.gpus_per_engine and not (s.disaggregation and s.gpus % 2):
        # one engine rank per GPU: none idle, none shared
        per = " / 2 (each of the two engines of spec.disaggregation)" if s.disaggregation else ""
        errors.append(
            f"parallelism.tensor ({par.tensor}) × expert ({par.expert}) × data ({par.data}) = {ranks} "
            f"must equal resources.gpusPerReplica ({s.gpus}){per}: the engine runs one rank per GPU"
        )
    pods = s.pods_per_replica
    if not 1 <= pods <= 64:
        errors.append(f"resources.podsPerReplica ({pods}) must be 1 to 64")
    elif pods > 1:
        if len(s.name) > MAX_GROUPED_NAME:
            errors.append(
                f"metadata.name may have at most {MAX_GROUPED_NAME} characters with resources.podsPerReplica "
                "above 1: it names StatefulSets whose pods carry it in a 63-character label"
            )
        if par.data != 1 or par.elastic is not None:
            errors.append("resources.podsPerReplica above 1 needs parallelism.data 1 and elastic unset")
        if (par.tensor * par.expert) % pods or (s.gpus and s.gpus % pods):
            errors.append(
                f"resources.podsPerReplica ({pods}) must divide parallelism.tensor × expert "
                f"({par.tensor * par.expert}) and resources.gpusPerReplica ({s.gpus}): every pod runs "
                "an equal share of the ranks"
            )
    if par.eplb_redundant_experts is not None and par.expert < 2 and not par.data_parallel_experts:
        errors.append("parallelism.eplb needs parallelism.expert of 2 or more, or dataParallelExperts (it balances "
                      "experts between ranks, or engines)")
    if par.all2all_backend is not None and par.all2all_backend not in ALL2ALL_BACKENDS:
        errors.append(f"parallelism.all2allBackend {par.all2all_backend!r} must be one of {', '.join(ALL2ALL_BACKENDS)}")
    else:
        errors += _all2all_backend_rules(par.all2all_backend, par.data_parallel_experts)
    if par.eplb_async_steps and par.elastic is not None:
        errors.append("parallelism.eplb.asyncSteps does not combine with parallelism.elastic (a resize moves the "
                      "experts itself)")
    el = par.elastic
    if el is not None:
        if not 1 <= el.min_expert <= par.expert <= el.max_expert or el.max_expert < 2:
            errors.append(
                f"parallelism.elastic needs 1 <= minExpert ({el.min_expert}) <= expert ({par.expert}) "
                f"<= maxExpert ({el.max_expert}), and maxExpert >= 2"
            )
        if par.tensor != 1:
            errors.append("parallelism.elastic needs parallelism.tensor 1: attention is whole on every rank "
                          "(docs/elastic-ep.md)")
        if s.gpus > 0 and el.max_expert > s.gpus:
            errors.append(
                f"parallelism.elastic.maxExpert ({el.max_expert}) exceeds resources.gpusPerReplica ({s.gpus}): "
                "the pod holds the GPUs of the largest size"
            )
        if s.kv_offload.cpu_gib or s.kv_offload.disk_path:
            errors.append("parallelism.elastic does not combine with kvOffload yet")
        errors += _rule_errors(el.rule, "parallelism.elastic", ELASTIC_METRICS)
    a = s.autoscaling
    if a is not None:
        if a.min_replicas > a.max_replicas:
            errors.append(
                f"autoscaling.minReplicas ({a.min_replicas}) is larger than maxReplicas ({a.max_replicas})"
            )
        errors += _rule_errors(a, "autoscaling")
    if s.kv_offload.disk_path and s.kv_offload.disk_path.rstrip("/") in (
        "",
        "/models",
        "/etc/pagoda",
        "/dev/shm",
        "/tmp",
        "/var/cache/pagoda",
    ):
        errors.append(
            f"kvOffload.disk.path {s.kv_offload.disk_path!r} collides with a path the pod already mounts"
        )
    if errors:
        raise InvalidSpec("; ".join(errors))


def _field_errors(s: ServiceSpec) -> list[str]:
    """The CRD's patterns again, for specs that did not pass through the API server's schema
    (pure code, tests, a CRD from an older chart)."""
    m = s.model
    checks = [
        (
            m.name,
            MODEL_NAME,
            f"model.name {m.name!r} must not begin with '-' (it is passed as --served-model-name)",
        ),
    ]
    if m.source == "pvc":
        checks.append(
            (
                m.path,
                RELATIVE_PATH,
                f"model.pvc.path {m.path!r} must be a relative path inside the volume in normal form "
                "(no '..' or '.' segments, no leading, trailing or double '/')",
            )
        )
    if m.source == "hostPath":
        checks.append((m.path, ABSOLUTE_PATH, _absolute("model.hostPath.path", m.path)))
    if s.kv_offload.disk_path is not None:
        checks.append(
            (s.kv_offload.disk_path, ABSOLUTE_PATH, _absolute("kvOffload.disk.path", s.kv_offload.disk_path))
        )

    key = s.api_key_secret
    if key is not None:
        checks += [
            (
                key.name,
                DNS1123_SUBDOMAIN,
                f"server.apiKeySecretRef.name {key.name!r} is not a Secret name (DNS-1123 subdomain)",
            ),
            (
                key.key,
                SECRET_KEY,
                f"server.apiKeySecretRef.key {key.key!r} is not a Secret key (letters, digits, '-', '_', '.')",
            ),
        ]
    errors = [message for value, pattern, message in checks if not re.search(pattern, value)]
    policy = s.kv_offload.write_policy
    if policy is not None and policy not in WRITE_POLICIES:
        errors.append(f"kvOffload.writePolicy {policy!r} must be one of {', '.join(WRITE_POLICIES)}")
    if s.engine.runner is not None and s.engine.runner not in RUNNERS:
        errors.append(f"engine.runner {s.engine.runner!r} must be one of {', '.join(RUNNERS)}")
    errors += _model_override_errors(s.engine)
    return errors


def _model_override_errors(e: Engine) -> list[str]:
    """engine.hfOverrides must be what the daemon's hf_overrides takes; engine.chatTemplate the
    Jinja text itself, never a path: the daemon reads a chat_template without ``{{`` or ``{%`` as
    a file, and a pod's files are not the requesting user's to read back through prompts."""
    errors = []
    if e.hf_overrides is not None:
        try:
            parse_hf_overrides(e.hf_overrides)
        except ValueError as err:
            errors.append(f"engine.hfOverrides: {err}")
    template = e.chat_template
    if template is not None and (not isinstance(template, str) or not is_template_text(template)
                                 or len(template) > MAX_CRD_TEMPLATE_CHARS):
        errors.append(f"engine.chatTemplate must be a Jinja template of at most {MAX_CRD_TEMPLATE_CHARS} characters "
                      "(the text itself, holding {{ or {%; not a path)")
    return errors


def _absolute(field_name: str, value: str) -> str:
    return (
        f"{field_name} {value!r} must be an absolute path in normal form "
        "(starting with '/', no '..' or '.' segments, no trailing or double '/')"
    )


def scaled(rule: Autoscaling | None, start: int, autoscaled: int | None) -> int:
    """How many pods to run now: without a rule, ``start`` (the spec's count); with one, the
    autoscaler's last decision (kept in status), before the first one ``start``, bounded by min/max."""
    if rule is None:
        return start
    base = start if autoscaled is None else autoscaled
    return max(rule.min_replicas, min(rule.max_replicas, base))


def desired_replicas(s: ServiceSpec, autoscaled: int | None) -> int:
    """How many pods the Deployment should run now: spec.replicas (hence the scale subresource)
    without spec.autoscaling, the autoscaler's count with it (:func:`scaled`)."""
    return scaled(s.autoscaling, s.replicas, autoscaled)


def prefill_replicas(s: ServiceSpec, autoscaled: int | None) -> int | None:
    """How many prefill pods their Deployment should run now (None: no prefill pods apart):
    prefill.replicas, or with prefill.autoscaling the autoscaler's count (:func:`scaled`)."""
    d = s.disaggregation
    if d is None or d.prefill.replicas is None:
        return None
    return scaled(d.prefill.autoscaling, d.prefill.replicas, autoscaled)
