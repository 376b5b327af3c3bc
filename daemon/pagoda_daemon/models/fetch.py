"""Materialize a remote model (``hf://org/name[@revision]``, ``s3://bucket/prefix``) into the
node's model cache, so that the loader reads it like any local directory.

Only the files the engine reads are fetched (:data:`NEEDED_FILES`, :func:`needed`): configs,
tokenizer files, chat templates and safetensors weights, never ``.bin``/``.pt``/``.gguf``
copies of the same weights. Each fetch lands in
``<cache_dir>/<scheme>/<quoted location>/<resolved revision>/`` and is marked complete by a
``.pagoda-complete.json`` written last; a complete entry is returned at once. Processes on one
node share the directory: an exclusive ``flock`` per entry makes replicas that start together
download once (the others wait, then find the marker). Every file is checked (size, and the
sha256 / git blob id / MD5 the source publishes) before the entry is marked; a mismatch deletes
the file and raises, so a corrupt model is never loaded. Transient failures (connection errors,
HTTP 5xx/429, S3 throttling) are retried with exponential backoff; authentication, missing
repositories and checksum mismatches fail at once. Errors are :class:`ModelFetchError` naming
the source URI and what the server said.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import fnmatch
import hashlib
import inspect
import json
import logging
import os
import time
import urllib.parse
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

from pagoda_daemon.model_uri import InvalidModelUri, ModelUri, is_uri, parse

log = logging.getLogger("pagoda.fetch")

# What the loader (models/loader.py: AutoConfig, AutoTokenizer, safetensors) reads. Top-level
# names only (plus the extra chat templates transformers reads from their folder): weights in
# subfolders ("original/", "onnx/") are other formats of the same model.
NEEDED_FILES = (
    "config.json", "generation_config.json",
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
    "vocab.json", "merges.txt", "added_tokens.json",
    "chat_template.jinja", "chat_template.json", "*.jinja", "additional_chat_templates/*.jinja",
    "*.safetensors", "model.safetensors.index.json",
    "adapter_config.json",  # a LoRA adapter's (lora/adapter.py): its weights are adapter_model.safetensors
)
# The file without which a fetched directory is not what was asked for, by kind.
MODEL_CONFIG = "config.json"
ADAPTER_CONFIG = "adapter_config.json"
INDEX = "model.safetensors.index.json"
COMPLETE_MARKER = ".pagoda-complete.json"
DEFAULT_CACHE_DIR = "~/.cache/pagoda/models"
CACHE_DIR_ENV = "PAGODA_CACHE_DIR"
CHUNK_BYTES = 1 << 20
LOCK_POLL_S = 0.2  # how often a replica waiting for another's fetch looks again


class ModelFetchError(RuntimeError):
    """A model could not be fetched; the message names the source URI and the server's answer.
    ``transient``: the source was unreachable or overloaded (a cached revision may stand in)."""

    def __init__(self, message: str, *, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient


@dataclasses.dataclass(frozen=True)
class FetchProgress:
    """How far a fetch is, reported after each file (and when it starts)."""

    bytes_done: int
    bytes_total: int
    files_done: int
    files_total: int
    rate_bytes_per_s: float
    eta_s: float | None


@dataclasses.dataclass(frozen=True)
class RemoteFile:
    """One file of the model as the source lists it."""

    name: str  # relative to the model directory, "/"-separated
    size: int  # -1: the source does not say
    sha256: str | None = None  # hf: LFS files
    git_sha1: str | None = None  # hf: small files (the git blob id)
    md5: str | None = None  # s3: single-part uploads (their ETag)
    key: str = ""  # s3: the object key
    etag: str = ""  # s3: the object's ETag, as listed


@dataclasses.dataclass(frozen=True)
class Retry:
    """Exponential backoff for transient failures; ``sleep`` is injectable for tests."""

    attempts: int = 5
    base_s: float = 1.0
    max_s: float = 30.0
    sleep: Callable[[float], None] = dataclasses.field(default=time.sleep)

    def delay(self, attempt: int) -> float:
        return min(self.max_s, self.base_s * (2 ** attempt))


def _inside(name: str) -> bool:
    """A plain relative path ("a/b.json"): nothing that could land outside the model directory."""
    return bool(name) and not PurePosixPath(name).is_absolute() and all(
        p not in ("", ".", "..") for p in name.split("/"))


def needed(name: str) -> bool:
    """Whether the engine reads this file of a model repository."""
    if not _inside(name):
        return False
    return any(fnmatch.fnmatchcase(name, pattern) and name.count("/") == pattern.count("/")
               for pattern in NEEDED_FILES)


def default_cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """$PAGODA_CACHE_DIR (the operator sets it to the pod's cache volume), else ~/.cache/pagoda/models."""
    env = os.environ if env is None else env
    return Path(env.get(CACHE_DIR_ENV) or DEFAULT_CACHE_DIR).expanduser()


def resolve_model(reference: str, cache_dir: str | Path | None = None, *,
                  env: Mapping[str, str] | None = None,
                  on_progress: Callable[[FetchProgress], None] | None = None, required: str = MODEL_CONFIG) -> str:
    """The local directory to load ``reference`` from: a path as it is, an hf:// or s3:// URI
    fetched into the cache first (``required``: the file it must hold, a model's config.json or
    a LoRA adapter's adapter_config.json). ``pvc://`` and malformed references raise ValueError
    (the operator mounts claims and passes their path; the daemon cannot mount anything)."""
    uri = check_reference(reference)
    if uri is None:
        return reference
    cache = Path(cache_dir).expanduser() if cache_dir else default_cache_dir(env)
    return str(fetch(uri, cache, env=env, on_progress=on_progress, required=required))


def fetched_from(model_dir: str | Path) -> tuple[str, str] | None:
    """(source URI, resolved revision) of a directory this module fetched (its complete marker),
    None for any other directory: what the daemon reports as the model it serves."""
    try:
        marker = json.loads((Path(model_dir) / COMPLETE_MARKER).read_text())
        return str(marker["source"]), str(marker["revision"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_reference(reference: str) -> ModelUri | None:
    """The parsed URI of a remote model, None for a local path; ValueError (naming the model) for a
    malformed reference or one the daemon cannot fetch. Cheap: nothing is contacted."""
    if not is_uri(reference):
        return None
    try:
        uri = parse(reference)
    except InvalidModelUri as e:  # the parser's messages mostly start with the reference already
        raise ValueError(f"model {e}" if str(e).startswith(repr(reference)) else f"model {reference!r}: {e}") from e
    if uri.scheme == "pvc":
        raise ValueError(f"model {reference!r}: pvc:// claims are mounted by the operator; give the daemon the "
                         "mounted directory instead")
    return uri


def fetch(uri: ModelUri, cache_dir: Path, *, env: Mapping[str, str] | None = None,
          on_progress: Callable[[FetchProgress], None] | None = None, retry: Retry | None = None,
          required: str = MODEL_CONFIG) -> Path:
    """Fetch the model's (or adapter's) needed files into the node cache (once per node and
    revision) and return its local directory."""
    if not uri.remote:
        raise ValueError(f"{uri} is not fetched: only hf:// and s3:// models are")
    try:
        return _fetch(uri, cache_dir, env, on_progress, retry, required)
    except OSError as e:  # the node's disk: full, read-only, not ours
        raise ModelFetchError(f"{uri}: {e}") from e


def _fetch(uri: ModelUri, cache_dir: Path, env: Mapping[str, str] | None,
           on_progress: Callable[[FetchProgress], None] | None, retry: Retry | None, required: str) -> Path:
    env = os.environ if env is None else env
    retry = retry or Retry()
    source: _Source = _HfSource(uri, env, retry) if uri.scheme == "hf" else _S3Source(uri, env, retry)
    base = Path(cache_dir).expanduser() / uri.scheme / urllib.parse.quote(_entry_name(uri), safe="")
    pinned = source.pinned_revision()
    if pinned is not None and (base / pinned / COMPLETE_MARKER).is_file():
        return _used(base / pinned)
    started = time.monotonic()
    try:
        revision, files = source.resolve()
    except ModelFetchError as e:
        cached = _cached_ref(base, source.ref_name())
        if cached is None or not e.transient:
            raise
        log.warning("%s: %s; using the cached revision %s", uri, e, cached.name)
        return _used(cached)
    if not any(f.name == required for f in files):
        what = "a Hugging Face-format model" if required == MODEL_CONFIG else "a PEFT LoRA adapter"
        raise ModelFetchError(f"{uri}: no {required} among its files (is it {what}?)")
    entry = base / revision
    log.info("%s: resolved revision %s (%.2f s)", uri, revision, time.monotonic() - started)
    if (entry / COMPLETE_MARKER).is_file():
        _write_ref(base, source.ref_name(), revision)
        return _used(entry)
    base.mkdir(parents=True, exist_ok=True)
    complete = entry / COMPLETE_MARKER
    with _locked(lock_path(entry), complete.is_file) as locked:
        if not locked or complete.is_file():  # another process fetched it while this one waited
            log.info("%s: fetched by another process meanwhile", uri)
            return _used(entry)
        entry.mkdir(parents=True, exist_ok=True)
        _download_all(uri, source, entry, files, revision, on_progress)
        _write_ref(base, source.ref_name(), revision)
    return _used(entry)


def lock_path(entry: Path) -> Path:
    """The lock file of a cache entry, beside it: a fetch holds it exclusively, a serving daemon
    shared (model_cache.hold)."""
    return entry.parent / f"{entry.name}.lock"


def _entry_name(uri: ModelUri) -> str:
    return f"{uri.location}/{uri.path}" if uri.path else uri.location


def _used(entry: Path) -> Path:
    """Touch the marker: its mtime is the entry's last use, for LRU eviction."""
    with contextlib.suppress(OSError):
        os.utime(entry / COMPLETE_MARKER)
    return entry


def _cached_ref(base: Path, ref: str) -> Path | None:
    """The complete entry a revision name resolved to last time (used when the source is unreachable)."""
    try:
        revision = (base / "refs" / urllib.parse.quote(ref, safe="")).read_text().strip()
    except OSError:
        return None
    entry = base / revision
    return entry if revision and (entry / COMPLETE_MARKER).is_file() else None


def _write_ref(base: Path, ref: str, revision: str) -> None:
    refs = base / "refs"
    refs.mkdir(parents=True, exist_ok=True)
    tmp = refs / f".{os.getpid()}.tmp"
    tmp.write_text(revision)
    os.replace(tmp, refs / urllib.parse.quote(ref, safe=""))


@contextlib.contextmanager
def _locked(path: Path, done: Callable[[], bool]) -> Iterator[bool]:
    """Hold the entry's lock exclusively (True), or stop waiting for it once ``done()`` (False).
    Tries, not a blocking wait: the process that fetched the entry takes a shared lock on it as
    soon as it serves (model_cache.hold) and keeps it, so a replica blocked on the exclusive lock
    would wait forever unless it won the moment between the two (seen in e2e: a second replica
    "downloading model" for 5 minutes beside a Ready first)."""
    with open(path, "a") as handle:
        waiting = False
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if done():
                    yield False
                    return
                if not waiting:
                    log.info("waiting for another process fetching into %s", path.parent)
                    waiting = True
                time.sleep(LOCK_POLL_S)
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _download_all(uri: ModelUri, source: _Source, entry: Path, listed: Sequence[RemoteFile], revision: str,
                  on_progress: Callable[[FetchProgress], None] | None) -> None:
    started = time.monotonic()
    fetched_bytes = 0  # over the network, for the rate
    hashes: dict[str, dict[str, Any]] = {}

    def get(f: RemoteFile) -> None:
        """Download ``f`` unless a checked copy is there already; verify it; record it for the marker."""
        nonlocal fetched_bytes
        target = entry / f.name
        if not (target.is_file() and target.stat().st_size == f.size and _verified(target, f)):
            target.parent.mkdir(parents=True, exist_ok=True)
            fetched_bytes += source.download(f, entry)
            if f.size < 0:
                f = dataclasses.replace(f, size=target.stat().st_size)
            if target.stat().st_size != f.size:
                target.unlink(missing_ok=True)
                raise ModelFetchError(f"{uri}: {f.name} has {target.stat().st_size} bytes, the source lists {f.size}")
            f = source.checkable(f)
            if not _verified(target, f):
                target.unlink(missing_ok=True)
                source.forget(f, entry)
                raise ModelFetchError(f"{uri}: {f.name} does not match its published checksum "
                                      f"({_checksum_label(f)}); the file was deleted")
        hashes[f.name] = {"size": f.size, **{k: v for k, v in (("sha256", f.sha256), ("git_sha1", f.git_sha1),
                                                                   ("md5", f.md5)) if v}}

    files = [f for f in listed if needed(f.name)]
    index = next((f for f in files if f.name == INDEX), None)
    if index is not None:  # the index names the shards: other *.safetensors (a consolidated copy) are not read
        get(index)
        shards = _index_shards(uri, entry / INDEX)
        files = [f for f in listed if f.name == INDEX or (f.name in shards if f.name.endswith(".safetensors")
                                                            else needed(f.name))]
        missing = sorted(shards - {f.name for f in files})
        if missing:
            raise ModelFetchError(f"{uri}: {INDEX} names weight files the source does not have: {missing[:5]}")
    total = sum(max(f.size, 0) for f in files)
    log.info("%s: fetching %d files, %.1f MB into %s", uri, len(files), total / 1e6, entry)

    def report() -> None:
        if on_progress is None:
            return
        done = sum(h["size"] for h in hashes.values())
        rate = fetched_bytes / max(time.monotonic() - started, 1e-6)
        remaining = total - done
        on_progress(FetchProgress(done, total, len(hashes), len(files), rate,
                                  remaining / rate if rate > 0 else (0.0 if remaining == 0 else None)))

    report()
    for f in files:
        if f.name not in hashes:
            get(f)
            report()
    marker = {"source": str(uri), "revision": revision, "files": hashes, "completed": time.time()}
    tmp = entry / f".{COMPLETE_MARKER}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(marker, indent=1, sort_keys=True))
    os.replace(tmp, entry / COMPLETE_MARKER)
    elapsed = max(time.monotonic() - started, 1e-6)
    log.info("%s: done in %.1f s at %.1f MB/s (%.1f MB fetched)", uri, elapsed, fetched_bytes / elapsed / 1e6,
             fetched_bytes / 1e6)


def _index_shards(uri: ModelUri, index: Path) -> set[str]:
    """The weight files a safetensors index names, each a plain relative path (as the loader demands)."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        shards = {str(v) for v in weight_map.values()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ModelFetchError(f"{uri}: {INDEX} is not a safetensors index: {e}") from e
    bad = sorted(s for s in shards if not s.endswith(".safetensors") or not _inside(s))
    if bad:
        raise ModelFetchError(f"{uri}: {INDEX} names weight files outside the model directory: {bad[:5]}")
    return shards


def _checksum_label(f: RemoteFile) -> str:
    if f.sha256:
        return f"sha256 {f.sha256}"
    if f.git_sha1:
        return f"git blob {f.git_sha1}"
    return f"md5 {f.md5}"


def _verified(path: Path, f: RemoteFile) -> bool:
    """The file's bytes against the checksum its source publishes (size only when none is)."""
    if f.sha256:
        return _digest(path, hashlib.sha256()) == f.sha256.lower()
    if f.git_sha1:
        return _digest(path, hashlib.sha1(f"blob {f.size}\0".encode(), usedforsecurity=False)) == f.git_sha1.lower()
    if f.md5:
        return _digest(path, hashlib.md5(usedforsecurity=False)) == f.md5.lower()
    return True


def _digest(path: Path, h: Any) -> str:
    with open(path, "rb") as src:
        while chunk := src.read(CHUNK_BYTES):
            h.update(chunk)
    return str(h.hexdigest())


def _with_retries(uri: ModelUri, what: str, retry: Retry, call: Callable[[], Any],
                  classify: Callable[[BaseException], tuple[bool, str] | None]) -> Any:
    """``call()``, retried while ``classify`` calls its failure transient; a ModelFetchError otherwise."""
    for attempt in range(retry.attempts):
        try:
            return call()
        except ModelFetchError:
            raise
        except Exception as e:  # classified below; unknown errors propagate
            verdict = classify(e)
            if verdict is None and isinstance(e, OSError):  # the node's disk: full, read-only, permissions
                raise ModelFetchError(f"{uri}: {e}") from e
            if verdict is None:
                raise
            transient, message = verdict
            if not transient:
                raise ModelFetchError(f"{uri}: {message}") from e
            if attempt + 1 == retry.attempts:
                raise ModelFetchError(f"{uri}: {message} (gave up after {retry.attempts} attempts at {what})",
                                      transient=True) from e
            delay = retry.delay(attempt)
            log.warning("%s: %s while %s; retrying in %.1f s (attempt %d of %d)", uri, message, what, delay,
                        attempt + 2, retry.attempts)
            retry.sleep(delay)
    raise AssertionError("unreachable")


class _Source:
    def pinned_revision(self) -> str | None:
        """The revision, when the URI pins it (so a complete entry needs no network at all)."""
        return None

    def ref_name(self) -> str:
        """The name the resolved revision is remembered under."""
        return "latest"

    def resolve(self) -> tuple[str, list[RemoteFile]]:
        raise NotImplementedError

    def download(self, f: RemoteFile, entry: Path) -> int:
        """Fetch ``f`` to ``entry / f.name``; the bytes that came over the network."""
        raise NotImplementedError

    def checkable(self, f: RemoteFile) -> RemoteFile:
        """``f`` with only the checksums its download can be checked against."""
        return f

    def forget(self, f: RemoteFile, entry: Path) -> None:
        """Drop what the source remembers of a file that failed its check, so a retry fetches it anew."""


# --- Hugging Face Hub ---------------------------------------------------------------------------

_HEX = "0123456789abcdef"


def _is_hex(text: str, length: int) -> bool:
    """``length`` lowercase hex digits: a git commit (40), an MD5 (32)."""
    return len(text) == length and all(c in _HEX for c in text)


class _HfSource(_Source):
    def __init__(self, uri: ModelUri, env: Mapping[str, str], retry: Retry) -> None:
        self.uri, self.retry = uri, retry
        self.endpoint = (env.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")
        self.token: str | bool = env.get("HF_TOKEN") or env.get("HUGGING_FACE_HUB_TOKEN") or False
        self.revision = ""

    def pinned_revision(self) -> str | None:
        rev = self.uri.revision or ""
        return rev if _is_hex(rev, 40) else None

    def ref_name(self) -> str:
        return self.uri.revision or "default"

    def resolve(self) -> tuple[str, list[RemoteFile]]:
        from huggingface_hub import HfApi, constants

        if constants.HF_HUB_OFFLINE:
            raise ModelFetchError(f"{self.uri}: HF_HUB_OFFLINE is set, so the Hub is not asked; unset it to fetch "
                                  "the model (a revision fetched before is used when the Hub is unreachable)",
                                  transient=True)
        for name in ("httpx", "httpx2"):  # one line per request at INFO: the fetch logs its own progress
            if logging.getLogger(name).level == logging.NOTSET:
                logging.getLogger(name).setLevel(logging.WARNING)

        api = HfApi(endpoint=self.endpoint, token=self.token)
        info = _with_retries(self.uri, "resolving the revision", self.retry,
                             lambda: api.model_info(self.uri.location, revision=self.uri.revision,
                                                    files_metadata=True), _hf_failure)
        if not (isinstance(info.sha, str) and _is_hex(info.sha, 40)):
            # it becomes a directory name: nothing but a commit id (never "../..") from a mirror
            raise ModelFetchError(f"{self.uri}: the Hub's answer names no commit (sha {info.sha!r})")
        self.revision = info.sha
        files = []
        for s in info.siblings or []:
            lfs = s.lfs
            size = lfs.size if lfs is not None else s.size  # None from a mirror that lists no sizes: unchecked
            files.append(RemoteFile(s.rfilename, -1 if size is None else int(size),
                                    sha256=lfs.sha256 if lfs is not None else None,
                                    git_sha1=s.blob_id if lfs is None else None))
        return info.sha, files

    def download(self, f: RemoteFile, entry: Path) -> int:
        from huggingface_hub import hf_hub_download

        quiet = {"tqdm_class": _quiet_tqdm()} if "tqdm_class" in inspect.signature(hf_hub_download).parameters else {}

        def call() -> Any:
            return hf_hub_download(self.uri.location, f.name, revision=self.revision, local_dir=entry,
                                   cache_dir=entry.parent / ".hf-cache", endpoint=self.endpoint, token=self.token,
                                   **quiet)

        _with_retries(self.uri, f"fetching {f.name}", self.retry, call, _hf_failure)
        return (entry / f.name).stat().st_size

    def forget(self, f: RemoteFile, entry: Path) -> None:
        for meta in (entry / ".cache" / "huggingface" / "download").glob(f"{f.name}.*"):
            meta.unlink(missing_ok=True)


def _quiet_tqdm() -> Any:
    """No progress bars on stderr: the daemon logs its own progress."""
    from huggingface_hub.utils import tqdm

    class Quiet(tqdm):  # type: ignore[misc,valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return Quiet


def _hf_failure(e: BaseException) -> tuple[bool, str] | None:
    """(transient?, message) for a failure talking to the Hub; None: not a Hub failure."""
    from huggingface_hub.errors import HfHubHTTPError

    for cause in _causes(e):
        if isinstance(cause, HfHubHTTPError) and cause.response is not None:
            status = cause.response.status_code
            reason = getattr(cause.response, "reason_phrase", None) or getattr(cause.response, "reason", "") or ""
            server = (cause.server_message or "").strip().replace("\n", " ")
            message = f"{status} {reason}".strip() + (f": {server}" if server else "")
            return (status >= 500 or status in (408, 429)), message
        if isinstance(cause, (ConnectionError, TimeoutError)):
            return True, f"{type(cause).__name__}: {cause}"
        if type(cause).__module__.split(".")[0] in ("httpx", "httpx2", "requests", "urllib3"):
            # network trouble is transient; a malformed URL or an unsupported scheme is not
            return type(cause).__name__ in _TRANSIENT_HTTP_ERRORS, f"{type(cause).__name__}: {cause}"
    return None


_TRANSIENT_HTTP_ERRORS = {
    "ConnectError", "ConnectTimeout", "ReadTimeout", "WriteTimeout", "PoolTimeout", "TimeoutException", "ReadError",
    "WriteError", "NetworkError", "RemoteProtocolError", "ConnectionError", "Timeout", "ChunkedEncodingError",
    "ProtocolError", "ReadTimeoutError", "NewConnectionError", "MaxRetryError",
}


def _causes(e: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = e
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


# --- S3 -----------------------------------------------------------------------------------------

_TRANSIENT_S3_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeTooSkewed",
                       "InternalError", "ServiceUnavailable", "503", "500", "502", "504"}


class _S3Source(_Source):
    def __init__(self, uri: ModelUri, env: Mapping[str, str], retry: Retry) -> None:
        self.uri, self.env, self.retry = uri, env, retry
        self.prefix = f"{uri.path}/" if uri.path else ""
        self._client: Any = None
        self._no_md5: set[str] = set()  # SSE-KMS / SSE-C objects: their ETag is not the MD5 of their bytes

    @property
    def client(self) -> Any:
        if self._client is None:
            import boto3
            from botocore.config import Config

            session = boto3.session.Session(
                aws_access_key_id=self.env.get("AWS_ACCESS_KEY_ID"),
                aws_secret_access_key=self.env.get("AWS_SECRET_ACCESS_KEY"),
                aws_session_token=self.env.get("AWS_SESSION_TOKEN"),
                region_name=self.env.get("AWS_REGION") or self.env.get("AWS_DEFAULT_REGION") or "us-east-1",
            )
            endpoint = self.env.get("AWS_ENDPOINT_URL_S3") or self.env.get("AWS_ENDPOINT_URL") or None
            # retries are this module's (one policy for both sources, injectable delays)
            self._client = session.client("s3", endpoint_url=endpoint,
                                          config=Config(retries={"total_max_attempts": 1}))
        return self._client

    def resolve(self) -> tuple[str, list[RemoteFile]]:
        def listing() -> list[dict]:
            objects = []
            paginator = self.client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.uri.location, Prefix=self.prefix):
                objects.extend(page.get("Contents", []))
            return objects

        objects = _with_retries(self.uri, "listing the objects", self.retry, listing, _s3_failure)
        files = []
        for o in objects:
            name = o["Key"][len(self.prefix):]
            if not needed(name):
                continue
            etag = str(o.get("ETag", "")).strip('"')
            single_part = _is_hex(etag.lower(), 32)
            files.append(RemoteFile(name, int(o["Size"]), md5=etag if single_part else None, key=o["Key"],
                                    etag=etag))
        files.sort(key=lambda f: f.name)
        digest = hashlib.sha256(json.dumps([(f.key, f.etag, f.size) for f in files]).encode()).hexdigest()
        return digest[:16], files

    def download(self, f: RemoteFile, entry: Path) -> int:
        target = entry / f.name
        part = target.with_name(target.name + ".part")
        fetched = 0

        def attempt() -> None:
            nonlocal fetched
            have = part.stat().st_size if part.exists() else 0
            if have > f.size:
                part.unlink()
                have = 0
            if have < f.size:
                kwargs: dict[str, Any] = {"Bucket": self.uri.location, "Key": f.key}
                if f.etag:
                    kwargs["IfMatch"] = f'"{f.etag}"'  # the object listed, not one replaced since
                if have:
                    kwargs["Range"] = f"bytes={have}-"
                    log.info("%s: resuming %s at byte %d of %d", self.uri, f.name, have, f.size)
                response = self.client.get_object(**kwargs)
                if response.get("ServerSideEncryption") == "aws:kms" or response.get("SSECustomerAlgorithm"):
                    self._no_md5.add(f.name)
                body = response["Body"]
                with open(part, "ab") as out:
                    for chunk in body.iter_chunks(CHUNK_BYTES):
                        out.write(chunk)
                        fetched += len(chunk)

        _with_retries(self.uri, f"fetching {f.name}", self.retry, attempt, _s3_failure)
        os.replace(part, target)
        return fetched

    def checkable(self, f: RemoteFile) -> RemoteFile:
        return dataclasses.replace(f, md5=None) if f.name in self._no_md5 else f


def _s3_failure(e: BaseException) -> tuple[bool, str] | None:
    from botocore.exceptions import (
        BotoCoreError,
        ClientError,
        HTTPClientError,
        IncompleteReadError,
        NoCredentialsError,
        PartialCredentialsError,
    )
    from botocore.exceptions import ConnectionError as BotoConnectionError

    for cause in _causes(e):
        if isinstance(cause, ClientError):
            error = cause.response.get("Error", {})
            code = str(error.get("Code", "")) or "error"
            status = int(cause.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
            text = str(error.get("Message", "")) or str(cause)
            return (code in _TRANSIENT_S3_CODES or status >= 500 or status == 429), f"{code}: {text}"
        if isinstance(cause, (NoCredentialsError, PartialCredentialsError)):
            return False, f"{type(cause).__name__}: {cause}"
        if isinstance(cause, (BotoConnectionError, HTTPClientError, IncompleteReadError, ConnectionError,
                              TimeoutError)):
            return True, f"{type(cause).__name__}: {cause}"
        if isinstance(cause, BotoCoreError):  # a bad endpoint URL, region or parameter
            return False, f"{type(cause).__name__}: {cause}"
        if type(cause).__module__.split(".")[0] == "urllib3":  # a body cut mid-stream
            return True, f"{type(cause).__name__}: {cause}"
    return None
