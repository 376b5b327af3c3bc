"""API keys: `--api-key` / `PAGODA_API_KEY`, checked like vLLM (`Authorization: Bearer KEY`); on
Anthropic's Messages routes also as Anthropic's clients send it (`x-api-key: KEY`).

Every configured key is compared with `hmac.compare_digest`, all of them every time, so
the time a refusal takes says nothing about how close a guess was. The keys never reach
a log line or a response body (`APIKeys.__repr__` hides them).
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from pagoda_daemon.server.errors import APIError

API_KEY_ENV = "PAGODA_API_KEY"
DEFAULT_EXEMPT_PATHS = ("/health", "/ready", "/metrics")  # probes and Prometheus scrape without a key
# The admin routes (server/admin.py) take the admin key instead, never a user's.
ADMIN_API_KEY_ENV = "PAGODA_ADMIN_API_KEY"
ADMIN_PATHS = ("/scale_elastic_ep", "/is_scaling_elastic_ep", "/elastic_ep", "/v1/load_lora_adapter",
               "/v1/unload_lora_adapter")
ANTHROPIC_PATHS = ("/v1/messages", "/v1/messages/count_tokens")  # where x-api-key is read too


def split_list(value: str | None) -> list[str]:
    """'a, b,,c' -> ['a', 'b', 'c']: comma-separated flag values, blanks dropped."""
    return [part.strip() for part in (value or "").split(",") if part.strip()]


@dataclass(frozen=True)
class APIKeys:
    """The keys a request may present, and the paths that need none."""

    keys: tuple[bytes, ...] = field(repr=False)
    exempt_paths: frozenset[str] = frozenset(DEFAULT_EXEMPT_PATHS)

    @classmethod
    def from_options(cls, api_key: str | None, environ: Mapping[str, str],
                     exempt_paths: Iterable[str] = DEFAULT_EXEMPT_PATHS, env: str = API_KEY_ENV) -> APIKeys:
        """The flag's keys, else the environment variable `env`'s; several keys are comma-separated."""
        keys = split_list(api_key) if api_key else split_list(environ.get(env))
        return cls(tuple(k.encode() for k in keys), frozenset(exempt_paths))

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def presented_key_matches(self, presented: bytes) -> bool:
        matched = False
        for key in self.keys:  # no early exit: every key costs the same time, match or not
            matched |= hmac.compare_digest(key, presented)
        return matched

    def refusal(self, path: str, headers: Iterable[tuple[bytes, bytes]]) -> APIError | None:
        """None when the request may go on; else the 401 to answer."""
        if not self.keys or path in self.exempt_paths:
            return None
        headers = list(headers)
        authorization = [value for name, value in headers if name.lower() == b"authorization"]
        if len(authorization) == 1:
            scheme, _, token = authorization[0].strip().partition(b" ")
            if scheme.lower() == b"bearer" and self.presented_key_matches(token.strip()):
                return None
        if path in ANTHROPIC_PATHS:
            api_key = [value for name, value in headers if name.lower() == b"x-api-key"]
            if len(api_key) == 1 and self.presented_key_matches(api_key[0].strip()):
                return None
        return APIError("a valid API key is required: send 'Authorization: Bearer <key>'", 401,
                        code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
