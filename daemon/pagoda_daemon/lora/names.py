"""Adapters by name: what a name may be, and ``--lora-modules`` (NAME=PATH, or vLLM's JSON form).
Torch-free: the operator checks spec.lora's names with the same rules."""

from __future__ import annotations

import json

MAX_NAME_CHARS = 256


class AdapterError(ValueError):
    """An adapter that cannot be served; the message names it and what is wrong."""


def check_name(name: object, served_model_name: str | None = None) -> str:
    """An adapter's name, as requests send it in ``model``."""
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS:
        raise AdapterError(f"an adapter name must be a string of 1 to {MAX_NAME_CHARS} characters, got {name!r}")
    if any(c.isspace() or not c.isprintable() for c in name) or "=" in name:
        raise AdapterError(f"adapter name {name!r} has whitespace, '=' or unprintable characters")
    if name == served_model_name:
        raise AdapterError(f"adapter name {name!r} is the base model's served name")
    return name


def parse_lora_modules(text: str | None) -> list[tuple[str, str]]:
    """(name, path) pairs from ``--lora-modules``: one per line (each flag value is a line), as
    ``NAME=PATH`` or vLLM's JSON form ``{"name": NAME, "path": PATH}``; names unique."""
    pairs: list[tuple[str, str]] = []
    for line in (text or "").splitlines():
        item = line.strip()
        if not item:
            continue
        if item.startswith("{"):
            try:
                spec = json.loads(item)
            except json.JSONDecodeError as e:
                raise AdapterError(f"--lora-modules entry {item!r} is not valid JSON: {e}") from e
            if not isinstance(spec, dict) or not isinstance(spec.get("path"), str) or not spec["path"]:
                raise AdapterError(f"--lora-modules entry {item!r} needs a string name and path")
            name, path = spec.get("name"), spec["path"]
        else:
            name, sep, path = item.partition("=")
            if not sep or not path:
                raise AdapterError(f"--lora-modules entry {item!r} is not NAME=PATH")
        pairs.append((check_name(name), path))
    names = [n for n, _ in pairs]
    if len(set(names)) != len(names):
        raise AdapterError(f"--lora-modules names an adapter twice: {sorted({n for n in names if names.count(n) > 1})}")
    return pairs
