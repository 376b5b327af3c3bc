"""The HTTP limits of `pagoda serve`, as plain values.

They are the defaults of the command's flags, and the `pagoda` command builds every
subcommand's flags at start, `pagoda operator` included, whose image has none of the
server's packages: so this module imports nothing but the standard library.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_BODY_BYTES = 32 << 20
DEFAULT_MAX_WAITING_REQUESTS = 4096  # queued beyond the running batch before new requests get 503


@dataclass(frozen=True)
class ConnectionLimits:
    """Per-connection bounds (the `--header-read-timeout`, `--body-read-timeout` and
    `--max-connections` flags)."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_connections: int = 8192


@dataclass(frozen=True)
class RequestLimits:
    """`--max-request-body-bytes`: 32 MiB holds a prompt of the longest contexts served
    (1M tokens as token-id JSON is about 7 MB) with room for chat and logit options."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
