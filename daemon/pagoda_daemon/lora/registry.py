"""The adapters a server answers to, by the name requests give as their ``model``: filled from
``--lora-modules`` at start-up and by the admin routes while serving. An adapter is a local
directory, or an ``hf://`` or ``s3://`` reference fetched into the node's model cache first,
as a model is (models/fetch.py, with the same credentials). Each is read and checked against
the base model when it is registered (lora/adapter.py); what the registry keeps is the small
LoRARequest that travels with each request (the engine reads the weights itself)."""

from __future__ import annotations

import threading

from pagoda_daemon.lora.adapter import read_adapter
from pagoda_daemon.lora.names import AdapterError, check_name, parse_lora_modules
from pagoda_daemon.lora.request import LoRARequest
from pagoda_daemon.models.fetch import ADAPTER_CONFIG, ModelFetchError, resolve_model

# Registered adapters at most: each costs only its name and path here, but /v1/models lists them all.
MAX_ADAPTERS = 4096


class AdapterRegistry:
    def __init__(self, model_config, max_rank: int, served_model_name: str, cache_dir: str | None = None) -> None:
        self.model_config = model_config
        self.max_rank = max_rank
        self.served_model_name = served_model_name
        self.cache_dir = cache_dir  # where hf:// and s3:// adapters are fetched (None: the default model cache)
        self._by_name: dict[str, LoRARequest] = {}
        self._lock = threading.Lock()  # registrations run in worker threads

    @classmethod
    def from_modules(cls, modules: str | None, model_config, max_rank: int, served_model_name: str,
                     cache_dir: str | None = None) -> AdapterRegistry:
        """The registry of ``--lora-modules`` (each adapter fetched where it is remote, read and
        checked: AdapterError)."""
        registry = cls(model_config, max_rank, served_model_name, cache_dir)
        for name, path in parse_lora_modules(modules):
            registry.add(name, path)
        return registry

    def add(self, name: str, path: str) -> LoRARequest:
        """Read, check and register an adapter under a new name (AdapterError if it cannot be)."""
        check_name(name, self.served_model_name)
        if name in self._by_name:
            raise AdapterError(f"an adapter named {name!r} is already registered; unload it first")
        try:
            local = resolve_model(path, self.cache_dir, required=ADAPTER_CONFIG)
        except (ModelFetchError, ValueError) as e:
            raise AdapterError(f"adapter {name!r}: {e}") from e
        lora = read_adapter(name, local, self.model_config, self.max_rank).request()
        with self._lock:
            if name in self._by_name:
                raise AdapterError(f"an adapter named {name!r} is already registered; unload it first")
            if len(self._by_name) >= MAX_ADAPTERS:
                raise AdapterError(f"{MAX_ADAPTERS} adapters are registered already; unload one first")
            self._by_name[name] = lora
        return lora

    def remove(self, name: str) -> LoRARequest:
        """Unregister (KeyError if unknown). Requests already admitted finish with it."""
        with self._lock:
            return self._by_name.pop(name)

    def get(self, name: str) -> LoRARequest | None:
        return self._by_name.get(name)

    def names(self) -> list[str]:
        return list(self._by_name)
