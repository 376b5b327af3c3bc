"""Admission policy: which parts of an InferenceService spec widen what its pods may do.

The operator creates the daemon pods with its own service account, so without a check anyone who
may write an InferenceService would get pods they could not create themselves (a confused
deputy): any image, a hostPath of ``/``, tolerations for control-plane taints, another service
account, env from a Secret they cannot read. :func:`findings` lists every such part of a spec
with the access that would justify it; :func:`review` keeps those the requester lacks:

- a widening (image, hostPath, service account, tolerations, node selector, pod annotations and
  labels, priority class, extended resources, kvOffload disk path) outside the admin's allowlists
  (:class:`Policy`, from the chart's ``admission.policy`` values) needs ``create pods`` in the namespace:
  such a user could create that pod directly, and the namespace's pod security admission governs
  both paths equally;
- a reference to a Secret or ConfigMap needs ``get`` on that object, whoever asks (the pod's env
  from it, the API key, the model's credentials);
- a kvOffload disk path over a system directory is refused for everyone.

Pure: the requester's access is a function passed in (a SubjectAccessReview in the operator).
"""

from __future__ import annotations

import dataclasses
import posixpath
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

# The image reference grammar of the distribution project, reduced to what matters here: a
# lower-case repository (optionally with a registry host and port), an optional tag, an
# optional digest.
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
IMAGE_REFERENCE = re.compile(
    rf"^(?P<repository>(?:[a-zA-Z0-9.-]+(?::[0-9]+)?/)?{_COMPONENT}(?:/{_COMPONENT})*)"
    r"(?::[\w][\w.-]{0,127})?(?:@[a-z0-9]+(?:[+._-][a-z0-9]+)*:[0-9a-fA-F]{32,})?$"
)

# An emptyDir mounted over one of these (or over a parent of one) hides the image's own files.
SYSTEM_PATHS = (
    "/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/opt", "/proc", "/root",
    "/run", "/sbin", "/sys", "/usr", "/var/lib", "/var/run",
)  # fmt: skip
# Kubernetes' own resources; anything else in pod.resources comes from a device plugin.
STANDARD_RESOURCES = ("cpu", "memory", "ephemeral-storage", "hugepages-*")
# Distinct Secret/ConfigMap references checked per request: each costs one SubjectAccessReview.
MAX_REFERENCES = 32
# Violations spelled out in one refusal; the rest are counted.
MAX_LISTED = 20


@dataclass(frozen=True)
class Access:
    """A permission the requester needs for a part of the spec: ``verb`` on ``resource``
    (core API group) in the object's namespace, on one object when ``name`` is set."""

    verb: str
    resource: str
    name: str | None = None

    def __str__(self) -> str:
        return f"{self.verb} {self.resource}" + (f" {self.name!r}" if self.name is not None else "")


CREATE_PODS = Access("create", "pods")


@dataclass(frozen=True)
class Violation:
    """One part of a spec the requester may not set.

    ``needs`` is the access that would allow it anyway (None: nobody may set it); ``widen`` says
    what an admin changes to allow it for everyone.
    """

    field: str
    message: str
    needs: Access | None = CREATE_PODS
    widen: str = ""

    def explain(self, namespace: str) -> str:
        text = f"{self.field}: {self.message}"
        if self.needs == CREATE_PODS:
            text += f"; allowed for users who may create pods in namespace {namespace!r}"
        elif self.needs is not None:
            text += f"; needs permission to {self.needs} in namespace {namespace!r}"
        return text + (f"; {self.widen}" if self.widen else "")


@dataclass(frozen=True)
class Policy:
    """The admin's allowlists (chart values ``admission.policy.*``, camelCase there).

    Entries of key lists match exactly, or by prefix when they end in ``*`` (``pagoda.dev/*``).
    Image entries without ``*`` name a repository (any tag or digest of it) or one exact image.
    Path entries allow that directory and everything below it.
    """

    images: tuple[str, ...] = ()
    host_path_prefixes: tuple[str, ...] = ()
    kv_disk_path_prefixes: tuple[str, ...] = ("/var/cache/pagoda-kv", "/scratch", "/kv-cache")
    service_accounts: tuple[str, ...] = ()
    toleration_keys: tuple[str, ...] = ("nvidia.com/gpu", "amd.com/gpu", "pagoda.dev/*")
    node_selector_keys: tuple[str, ...] = (
        "nvidia.com/*",
        "amd.com/*",
        "pagoda.dev/*",
        "feature.node.kubernetes.io/*",
        "node.kubernetes.io/instance-type",
        "topology.kubernetes.io/*",
        "cloud.google.com/gke-accelerator",
        "k8s.amazonaws.com/accelerator",
    )
    pod_annotation_keys: tuple[str, ...] = ("prometheus.io/*", "pagoda.dev/*")
    pod_label_keys: tuple[str, ...] = ()
    priority_class_names: tuple[str, ...] = ()
    gpu_resource_names: tuple[str, ...] = ("nvidia.com/gpu", "amd.com/gpu")
    pod_resource_names: tuple[str, ...] = ()
    # Not an allowlist: host directories no spec.model.hostPath may reach, whatever the prefixes
    # allow (the node model cache: every namespace's downloads, mounted one namespace at a time).
    reserved_host_paths: tuple[str, ...] = ()

    @classmethod
    def from_values(cls, values: Mapping[str, Any], extra_images: tuple[str, ...] = (),
                    reserved_host_paths: tuple[str, ...] = ()) -> Policy:
        """From the chart's camelCase values (every key optional; unknown keys are an error, so a
        typo never silently leaves a default in place). ``extra_images`` are always allowed (the
        operator's own daemon image); ``reserved_host_paths`` come from the operator's settings."""
        by_value = {_camel(f.name): f.name for f in dataclasses.fields(cls) if f.name != "reserved_host_paths"}
        unknown = sorted(set(values) - set(by_value))
        if unknown:
            raise ValueError(f"unknown admission policy keys {unknown}; known: {sorted(by_value)}")
        kwargs: dict[str, tuple[str, ...]] = {}
        for key, value in values.items():
            if value is None:
                continue
            if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
                raise ValueError(f"admission policy {key} must be a list of non-empty strings")
            kwargs[by_value[key]] = tuple(value)
        policy = cls(**kwargs)
        bad = [p for p in policy.kv_disk_path_prefixes if system_path(p)]
        if bad:
            raise ValueError(f"admission policy kvDiskPathPrefixes {bad} cover system directories")
        return dataclasses.replace(policy, images=tuple(dict.fromkeys(extra_images + policy.images)),
                                   reserved_host_paths=reserved_host_paths)


def image_repository(image: str) -> str:
    """``registry/name`` of an image reference, without tag or digest."""
    m = IMAGE_REFERENCE.match(image)
    return m.group("repository") if m else image


def key_allowed(key: str, patterns: tuple[str, ...]) -> bool:
    return any(key == p or (p.endswith("*") and key.startswith(p[:-1])) for p in patterns)


def image_allowed(image: str, patterns: tuple[str, ...]) -> bool:
    repository = image_repository(image)
    return any(image.startswith(p[:-1]) if p.endswith("*") else p in (image, repository) for p in patterns)


def path_within(path: str, prefixes: tuple[str, ...]) -> bool:
    """True when the absolute ``path`` is one of ``prefixes`` or below one (whole components)."""
    norm = posixpath.normpath(path)
    for prefix in prefixes:
        p = posixpath.normpath(prefix)
        if norm == p or norm.startswith(p.rstrip("/") + "/"):
            return True
    return False


def system_path(path: str) -> bool:
    norm = posixpath.normpath(path)
    return norm == "/" or any(
        norm == s or norm.startswith(s + "/") or s.startswith(norm + "/") for s in SYSTEM_PATHS
    )


def _camel(snake: str) -> str:
    head, *rest = snake.split("_")
    return head + "".join(w.capitalize() for w in rest)


def _map(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _allow(field: str) -> str:
    return f"an admin can allow it for everyone in the chart value admission.policy.{_camel(field)}"


def _shown(patterns: tuple[str, ...]) -> str:
    return ", ".join(patterns) if patterns else "none"


def _keys(where: str, keys: Any, patterns: tuple[str, ...], what: str, field: str) -> Iterator[Violation]:
    for key in _map(keys):
        if not key_allowed(str(key), patterns):
            yield Violation(
                f"{where}[{str(key)!r}]",
                f"{what} {key!r} is not allowed (allowed: {_shown(patterns)})",
                widen=_allow(field),
            )


def _path(field: str, path: Any, prefixes: tuple[str, ...], what: str, value: str) -> Iterator[Violation]:
    if not isinstance(path, str) or not path.startswith("/") or ".." in path.split("/"):
        yield Violation(field, f"{what} {path!r} must be an absolute path without '..'", needs=None)
    elif not path_within(path, prefixes):
        yield Violation(
            field,
            f"{what} {path!r} is outside the allowed prefixes ({_shown(prefixes)})",
            widen=_allow(value),
        )


def findings(policy: Policy, spec: Mapping[str, Any]) -> list[Violation]:
    """Every part of ``spec`` that needs more than writing InferenceServices, whoever asks."""
    spec = _map(spec)
    out: list[Violation] = []

    image = spec.get("image")
    if image:
        if not isinstance(image, str) or not IMAGE_REFERENCE.match(image):
            out.append(Violation("spec.image", f"{image!r} is not a valid image reference", needs=None))
        elif not image_allowed(image, policy.images):
            out.append(
                Violation(
                    "spec.image",
                    f"image {image!r} is not allowed (allowed: {_shown(policy.images)})",
                    widen=_allow("images"),
                )
            )

    host_path = _map(_map(spec.get("model")).get("hostPath"))
    path = host_path.get("path")
    reserved = [r for r in policy.reserved_host_paths
                if isinstance(path, str) and (path_within(path, (r,)) or path_within(r, (path,)))]
    if reserved:
        out.append(Violation("spec.model.hostPath.path", f"{path!r} reaches the node model cache {reserved[0]!r}, "
                             "which holds every namespace's models; name the model by spec.model.uri instead",
                             needs=None))
    elif host_path:
        out += _path(
            "spec.model.hostPath.path",
            host_path.get("path"),
            policy.host_path_prefixes,
            "hostPath",
            "host_path_prefixes",
        )

    disk_path = _map(_map(spec.get("kvOffload")).get("disk")).get("path")
    if disk_path is not None:
        field = "spec.kvOffload.disk.path"
        if isinstance(disk_path, str) and disk_path.startswith("/") and system_path(disk_path):
            out.append(
                Violation(field, f"{disk_path!r} would be mounted over a system directory", needs=None)
            )
        else:
            out += _path(field, disk_path, policy.kv_disk_path_prefixes, "disk path", "kv_disk_path_prefixes")

    gpu_resource = _map(spec.get("resources")).get("gpuResourceName")
    if gpu_resource is not None and not key_allowed(str(gpu_resource), policy.gpu_resource_names):
        out.append(
            Violation(
                "spec.resources.gpuResourceName",
                f"{gpu_resource!r} is not an allowed GPU resource (allowed: {_shown(policy.gpu_resource_names)})",
                widen=_allow("gpu_resource_names"),
            )
        )

    placement = _map(spec.get("placement"))
    for i, toleration in enumerate(_list(placement.get("tolerations"))):
        key = _map(toleration).get("key")
        field = f"spec.placement.tolerations[{i}]"
        if not key:
            if "*" not in policy.toleration_keys:
                out.append(
                    Violation(
                        field,
                        "a toleration without a key tolerates every taint, control-plane ones included",
                        widen=f"{_allow('toleration_keys')} as '*'",
                    )
                )
        elif not key_allowed(str(key), policy.toleration_keys):
            out.append(
                Violation(
                    f"{field}.key",
                    f"toleration key {key!r} is not allowed (allowed: {_shown(policy.toleration_keys)})",
                    widen=_allow("toleration_keys"),
                )
            )
    out += _keys(
        "spec.placement.nodeSelector",
        placement.get("nodeSelector"),
        policy.node_selector_keys,
        "node selector key",
        "node_selector_keys",
    )

    pod = _map(spec.get("pod"))
    account = pod.get("serviceAccountName")
    if account and account != "default" and account not in policy.service_accounts:
        out.append(
            Violation(
                "spec.pod.serviceAccountName",
                f"service account {account!r} is not allowed (allowed: default, {_shown(policy.service_accounts)})",
                widen=_allow("service_accounts"),
            )
        )
    priority = pod.get("priorityClassName")
    if priority and priority not in policy.priority_class_names:
        out.append(
            Violation(
                "spec.pod.priorityClassName",
                f"priority class {priority!r} is not allowed (allowed: {_shown(policy.priority_class_names)})",
                widen=_allow("priority_class_names"),
            )
        )
    out += _keys(
        "spec.pod.annotations", pod.get("annotations"), policy.pod_annotation_keys, "pod annotation",
        "pod_annotation_keys",
    )  # fmt: skip
    out += _keys("spec.pod.labels", pod.get("labels"), policy.pod_label_keys, "pod label", "pod_label_keys")
    for part in ("requests", "limits"):
        out += _keys(
            f"spec.pod.resources.{part}",
            {
                k: v
                for k, v in _map(_map(pod.get("resources")).get(part)).items()
                if not key_allowed(k, STANDARD_RESOURCES)
            },
            policy.pod_resource_names,
            "extended resource",
            "pod_resource_names",
        )

    references: list[Violation] = []
    for i, env in enumerate(_list(pod.get("env"))):
        value_from = _map(_map(env).get("valueFrom"))
        for ref, resource in (("secretKeyRef", "secrets"), ("configMapKeyRef", "configmaps")):
            if ref in value_from:
                name = str(_map(value_from[ref]).get("name") or "")
                references.append(
                    Violation(
                        f"spec.pod.env[{i}].valueFrom.{ref}",
                        f"reads {resource[:-1]} {name!r}",
                        needs=Access("get", resource, name),
                    )
                )
    api_key = _map(_map(spec.get("server")).get("apiKeySecretRef"))
    if api_key:
        name = str(api_key.get("name") or "")
        references.append(
            Violation(
                "spec.server.apiKeySecretRef", f"reads secret {name!r}", needs=Access("get", "secrets", name)
            )
        )
    credentials = _map(_map(spec.get("model")).get("credentials"))
    if credentials:
        name = str(credentials.get("secretName") or "")
        references.append(
            Violation(
                "spec.model.credentials.secretName",
                f"reads secret {name!r}",
                needs=Access("get", "secrets", name),
            )
        )
    if len({v.needs for v in references}) > MAX_REFERENCES:
        out.append(
            Violation(
                "spec.pod.env",
                f"more than {MAX_REFERENCES} distinct Secret and ConfigMap references",
                needs=None,
            )
        )
    else:
        out += references
    return out


RequesterCan = Callable[[Access], bool]


def review(policy: Policy, spec: Mapping[str, Any], requester_can: RequesterCan) -> list[Violation]:
    """The violations the requester may not make: those whose access they lack (asked once per
    distinct access, and only when some part of the spec needs it)."""
    answers: dict[Access, bool] = {}

    def can(access: Access) -> bool:
        if access not in answers:
            answers[access] = requester_can(access)
        return answers[access]

    return [v for v in findings(policy, spec) if v.needs is None or not can(v.needs)]


def refusal(namespace: str, name: str, violations: list[Violation]) -> str:
    """One readable message naming every violation (the first :data:`MAX_LISTED`)."""
    lines = [v.explain(namespace) for v in violations[:MAX_LISTED]]
    if len(violations) > MAX_LISTED:
        lines.append(f"and {len(violations) - MAX_LISTED} more")
    return (
        f"InferenceService {namespace}/{name} widens what its pods may do beyond what the requester "
        f"may do: " + " | ".join(lines)
    )
