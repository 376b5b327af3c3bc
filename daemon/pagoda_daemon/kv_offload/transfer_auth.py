"""Who may fetch KV blocks from whom, between prefill and decode instances on different hosts
(``transfer.py`` moves the blocks): the shared key, the sources' URLs, and the signed header in
which a prefill instance names itself, through pd-proxy, to the decode instance of each request.

No torch and no ZMQ here: pd-proxy and the API server import it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

KEY_ENV = "PAGODA_KV_TRANSFER_KEY"
MIN_KEY_CHARS = 16
MAX_CLOCK_SKEW_S = 60.0  # a signed ask or header may be this old, or this far ahead (hosts keep NTP time)
# kv_offload_disk_source: fetch from the prefill instance each request names. The prefill
# instance names itself in a header of its answers, signed with the key; pd-proxy passes it on
# to the decode instance, whose API checks it before the engine connects anywhere.
FROM_REQUEST = "request"
SOURCE_HEADER = "x-pagoda-kv-source"
MAX_SOURCE_HEADER_CHARS = 512
_HOST = re.compile(r"[A-Za-z0-9][A-Za-z0-9.-]{0,252}|[0-9A-Fa-f:.]{2,45}")  # a DNS name, IPv4 or IPv6 address


def transfer_key(environ: Mapping[str, str] = os.environ) -> bytes:
    """The shared key, from ``PAGODA_KV_TRANSFER_KEY`` (never a flag: flags show in ``ps``)."""
    key = environ.get(KEY_ENV, "")
    if len(key) < MIN_KEY_CHARS:
        raise ValueError(f"KV transfer between instances needs a shared key of at least {MIN_KEY_CHARS} characters "
                         f"in {KEY_ENV} (on the prefill and the decode instance)")
    return key.encode()


def is_remote(source: str | None) -> bool:
    """Whether blocks are fetched over TCP: from one source, or from the one each request names."""
    return source is not None and (source == FROM_REQUEST or source.startswith("tcp://"))


def check_url(url: str) -> str:
    """``tcp://HOST:PORT``, or ValueError naming what is wrong."""
    refusal = ValueError(f"kv_offload_disk_source {url!r}: a remote source is tcp://HOST:PORT (port 1-65535)")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:  # brackets that do not hold an IPv6 address, a port that is not a number
        raise refusal from None
    if (parts.scheme != "tcp" or not parts.hostname or not _HOST.fullmatch(parts.hostname) or port is None
            or not 1 <= port <= 65535 or parts.path or parts.query or parts.fragment or parts.username
            or parts.password):
        raise refusal
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"tcp://{host}:{port}"


def now_ms(now_s: float | None = None) -> int:
    """Wall-clock time in ms, as signed asks and headers carry it (``now_s``: tests' clock)."""
    return int((time.time() if now_s is None else now_s) * 1000)


def is_fresh(issued_ms: int, now_s: float | None = None) -> bool:
    """Whether a signed ask or header issued then may be taken now: within ``MAX_CLOCK_SKEW_S``
    either way."""
    return abs((time.time() if now_s is None else now_s) - issued_ms / 1000) <= MAX_CLOCK_SKEW_S


def advertisement(key: bytes, source: str, now_s: float | None = None) -> str:
    """The ``SOURCE_HEADER`` value a prefill instance answers with: where its blocks are, when
    it said so, and its signature over both."""
    issued = str(now_ms(now_s))
    signature = hmac.new(key, b"source\n" + source.encode() + b"\n" + issued.encode(), hashlib.sha256).hexdigest()
    return f"{source} {issued} {signature}"


def verified_source(value: str, key: bytes, now_s: float | None = None) -> str:
    """The source a prefill instance holding ``key`` signed into ``value`` within the last
    ``MAX_CLOCK_SKEW_S``; ValueError for anything else (a client cannot make the decode instance
    connect where no prefill instance said it is)."""
    parts = value.split(" ") if len(value) <= MAX_SOURCE_HEADER_CHARS else []
    if len(parts) != 3 or not parts[1].isdigit() or len(parts[1]) > 16:
        raise ValueError(f"{SOURCE_HEADER} must be 'tcp://HOST:PORT ISSUED SIGNATURE', as a prefill instance sends it")
    source, issued, signature = parts
    expected = advertisement(key, source, int(issued) / 1000).rsplit(" ", 1)[1]
    if not hmac.compare_digest(signature.encode(), expected.encode()):
        raise ValueError(f"{SOURCE_HEADER} is not signed by a prefill instance holding this instance's key")
    if not is_fresh(int(issued), now_s):
        raise ValueError(f"{SOURCE_HEADER} was issued more than {MAX_CLOCK_SKEW_S:g} s ago (or the clocks differ)")
    return check_url(source)


@dataclass(frozen=True)
class SourceHeaders:
    """The API's side of per-request sources: a prefill instance names itself in its answers
    (``own_source``), a decode instance takes the source each request names (``accepts``)."""

    key: bytes
    own_source: str | None
    accepts: bool

    @classmethod
    def from_config(cls, config) -> SourceHeaders | None:
        """None unless the engine serves blocks on a transfer port or fetches per request."""
        accepts = config.kv_offload_disk_source == FROM_REQUEST
        if config.kv_transfer_host is not None and not config.kv_transfer_port:
            raise ValueError("kv_transfer_host needs kv_transfer_port (the address is the transfer port's)")
        if not config.kv_transfer_port and not accepts:
            return None
        own = None
        if config.kv_transfer_port:
            host = config.kv_transfer_host
            if host is None:
                try:
                    host = socket.gethostbyname(socket.gethostname())
                except OSError as e:
                    raise ValueError(f"kv_transfer_host: this host's name {socket.gethostname()!r} does not resolve "
                                     f"({e}); give the address decode instances reach it at") from e
            try:
                own = check_url(f"tcp://{f'[{host}]' if ':' in host else host}:{config.kv_transfer_port}")
            except ValueError:
                raise ValueError(f"kv_transfer_host {host!r} is not a host name or address") from None
        return cls(transfer_key(), own, accepts)

    def answer_header(self) -> str | None:
        return None if self.own_source is None else advertisement(self.key, self.own_source)

    def source_of(self, value: str | None) -> str | None:
        """The verified source a request's header names (None without one, or where this instance
        does not fetch per request); ValueError for a header that does not verify."""
        if value is None or not self.accepts:
            return None
        return verified_source(value, self.key)
