"""A model's config.json, read at apply time, so that a parallel layout the model cannot take is
refused in the InferenceService's status before any pod starts (the daemon refuses it too, at
its start: the check is the same function, ``pagoda_daemon.distributed.layout.check_layout``).

What the operator reads, and from where, is narrow on purpose (docs/security.md): only
``hf://`` models without a credentials Secret (the operator never reads the user's Secrets),
only from endpoints the operator's administrator listed (``--model-config-endpoint``; a spec's
``model.endpoint`` elsewhere is not contacted, so a spec cannot aim the operator at an internal
address), one GET of at most ``MAX_CONFIG_BYTES``, parsed as JSON and never rendered anywhere.
Whatever cannot be read leaves the check to the daemon (a ``ConfigurationRefused`` condition
once its pod has started), as for ``pvc://``, ``s3://`` and host paths.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.request
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any
from urllib.parse import quote

from pagoda_daemon import model_uri
from pagoda_daemon.distributed.layout import check_layout
from pagoda_operator.spec import ServiceSpec, daemon_config, in_crd_terms

log = logging.getLogger(__name__)

DEFAULT_ENDPOINT = "https://huggingface.co"
MAX_CONFIG_BYTES = 1 << 20  # the largest config.json of the Hub's LLMs is ~10 KB
# Cached answers: a config read is kept this long (a branch may move), a failure is retried
# after RETRY_S; at most MAX_ENTRIES models are remembered (least recently used goes first).
KEEP_S = 3600.0
RETRY_S = 300.0
MAX_ENTRIES = 1024

HttpGet = Callable[[str, float], bytes]


def layout_error(spec: ServiceSpec, config: Mapping[str, Any]) -> str | None:
    """Why ``spec``'s parallel layout does not fit the model of ``config`` (its config.json), in
    the InferenceService's field names; None when it fits."""
    text = config.get("text_config") if "num_attention_heads" not in config else None
    fields = text if isinstance(text, Mapping) else config
    model = SimpleNamespace(**{k: v for k, v in fields.items() if isinstance(k, str) and k.isidentifier()})
    if not isinstance(getattr(model, "num_attention_heads", None), int):
        return None  # not a config this check understands: the daemon decides
    options = daemon_config(spec)
    try:
        check_layout(model, options["tensor_parallel_size"], options["expert_parallel_size"],
                     bool(options.get("enable_eplb")), int(options.get("num_redundant_experts") or 0),
                     int(options.get("elastic_ep_max_size") or 0),
                     int(options.get("data_parallel_size") or 1) if options.get("data_parallel_experts") else 0)
    except ValueError as e:
        return f"the model's config.json does not allow this layout: {in_crd_terms(str(e))}"
    except (TypeError, ZeroDivisionError, AttributeError):  # fields of odd types or zero heads: the daemon decides
        return None
    return None


def config_url(endpoint: str, repo: str, revision: str | None) -> str:
    """Where a Hub-compatible endpoint (no trailing slash) serves a repository's config.json at a revision."""
    return f"{endpoint}/{quote(repo, safe='/')}/resolve/{quote(revision or 'main', safe='')}/config.json"


def http_get(url: str, timeout: float) -> bytes:
    """One anonymous GET, at most MAX_CONFIG_BYTES (more is an error, not a truncation)."""
    request = urllib.request.Request(url, headers={"Accept": "application/json", "User-Agent": "pagoda-operator"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        body: bytes = response.read(MAX_CONFIG_BYTES + 1)
    if len(body) > MAX_CONFIG_BYTES:
        raise ValueError(f"more than {MAX_CONFIG_BYTES} bytes")
    return body


@dataclass
class ModelConfigs:
    """The config.json of the InferenceServices' models, read once and remembered."""

    endpoints: tuple[str, ...] = (DEFAULT_ENDPOINT,)  # the only endpoints ever contacted
    timeout_s: float = 2.0
    http_get: HttpGet = http_get
    clock: Callable[[], float] = time.monotonic
    _cache: OrderedDict[str, tuple[float, dict[str, Any] | None]] = field(default_factory=OrderedDict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.endpoints = tuple(e.rstrip("/") for e in self.endpoints if e)

    def url_for(self, spec: ServiceSpec) -> str | None:
        """The URL this operator would read ``spec``'s config.json from; None when it reads none."""
        m = spec.model
        if m.scheme != "hf" or m.credentials_secret or not m.uri:
            return None
        endpoint = (m.endpoint or DEFAULT_ENDPOINT).rstrip("/")
        if endpoint not in self.endpoints:
            return None
        try:
            uri = model_uri.parse(m.uri)
        except model_uri.InvalidModelUri:
            return None
        return config_url(endpoint, uri.location, uri.revision)

    def get(self, spec: ServiceSpec) -> dict[str, Any] | None:
        """``spec``'s model config, or None when it is not read here or could not be read."""
        url = self.url_for(spec)
        if url is None:
            return None
        now = self.clock()
        with self._lock:
            hit = self._cache.get(url)
            if hit is not None and now - hit[0] < (KEEP_S if hit[1] is not None else RETRY_S):
                self._cache.move_to_end(url)
                return hit[1]
        config = self._read(url)
        with self._lock:
            self._cache[url] = (now, config)
            self._cache.move_to_end(url)
            while len(self._cache) > MAX_ENTRIES:
                self._cache.popitem(last=False)
        return config

    def _read(self, url: str) -> dict[str, Any] | None:
        try:
            config = json.loads(self.http_get(url, self.timeout_s))
        except (OSError, ValueError, RecursionError) as e:  # HTTP errors, timeouts, bad JSON, too big, too deep
            log.info("cannot read %s (%s): the daemon checks the layout at its start instead", url, e)
            return None
        return config if isinstance(config, dict) else None
