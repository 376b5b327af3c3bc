"""Where a model's weights come from: the one parser of model references, used by the daemon
(which fetches them) and by the operator (which refuses a malformed one at apply time, naming
the field). Standard library only: the operator imports it in an image without torch.

    hf://org/name[@revision]     a Hugging Face Hub repository (HF_ENDPOINT for a mirror)
    s3://bucket[/prefix]         an S3-compatible bucket (endpoint and credentials from the env)
    pvc://claim[/path]           a PersistentVolumeClaim of the InferenceService's namespace
    /a/local/path                a directory already on the filesystem (hostPath, a mounted PVC)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

SCHEMES = ("hf", "s3", "pvc")
# Hugging Face repository ids: an owner and a name of letters, digits, "-", "_" and "." (not
# starting or ending with "-" or ".", no "--" or ".."), 96 characters at most each (the Hub's rules).
_HF_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"
_HF_REPO = re.compile(rf"^(?:{_HF_PART}/)?{_HF_PART}$")
# A revision: a branch, tag or commit; no whitespace, no "..", not starting with "/" or "-".
_REVISION = re.compile(r"^[A-Za-z0-9._][A-Za-z0-9._/-]{0,254}$")
# S3 bucket names (the AWS rules: 3-63 lowercase letters, digits, "-" and "."; dots allowed for
# S3-compatible stores that accept them).
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
# Kubernetes object names (DNS-1123 subdomain); the operator's spec checks use it too.
DNS1123_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
_DNS1123 = re.compile(DNS1123_SUBDOMAIN)
MAX_URI_LENGTH = 1024


class InvalidModelUri(ValueError):
    """A model reference that cannot name a model; the message says which part and why."""


@dataclass(frozen=True)
class ModelUri:
    scheme: str  # "hf" | "s3" | "pvc" | "path"
    location: str  # the repository id, the bucket, the claim name, or the local path
    path: str = ""  # the prefix inside the bucket, or the path inside the claim ("" = its root)
    revision: str | None = None  # hf only: branch, tag or commit (None = the repository's default)

    @property
    def remote(self) -> bool:
        """Fetched over the network into the node's model cache (hf, s3)."""
        return self.scheme in ("hf", "s3")

    def __str__(self) -> str:
        if self.scheme == "path":
            return self.location
        tail = f"/{self.path}" if self.path else ""
        rev = f"@{self.revision}" if self.revision else ""
        return f"{self.scheme}://{self.location}{tail}{rev}"


def is_uri(reference: str) -> bool:
    return "://" in reference


def parse(reference: str) -> ModelUri:
    """The reference as a ModelUri, or InvalidModelUri saying what is wrong with it."""
    if not isinstance(reference, str):
        raise InvalidModelUri(f"a model reference is a string, not {type(reference).__name__}")
    if not reference or len(reference) > MAX_URI_LENGTH:
        raise InvalidModelUri(f"a model reference has 1 to {MAX_URI_LENGTH} characters; got {len(reference)}")
    if any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in reference):
        raise InvalidModelUri(f"{reference!r} contains whitespace or control characters")
    if not is_uri(reference):
        if not reference.startswith("/"):
            raise InvalidModelUri(f"{reference!r} is neither an absolute path nor a URI ({', '.join(SCHEMES)})")
        return ModelUri("path", reference)
    scheme, rest = reference.split("://", 1)
    if scheme not in SCHEMES:
        raise InvalidModelUri(f"{reference!r}: scheme {scheme!r} is not one of {', '.join(s + '://' for s in SCHEMES)}")
    if scheme == "hf":
        return _parse_hf(reference, rest)
    location, _, path = rest.partition("/")
    path = path.strip("/")
    if any(part in (".", "..") for part in path.split("/")) or "//" in path:
        raise InvalidModelUri(f"{reference!r}: the path may not contain '.', '..' or empty segments")
    if scheme == "s3":
        if not _BUCKET.match(location):
            raise InvalidModelUri(f"{reference!r}: {location!r} is not an S3 bucket name "
                                  "(3-63 lowercase letters, digits, '-' and '.')")
        return ModelUri("s3", location, path)
    if len(location) > 253 or not _DNS1123.match(location):
        raise InvalidModelUri(f"{reference!r}: {location!r} is not a PersistentVolumeClaim name")
    return ModelUri("pvc", location, path)


def _parse_hf(reference: str, rest: str) -> ModelUri:
    repo, at, revision = rest.partition("@")
    if (at and not _REVISION.match(revision)) or ".." in revision:
        raise InvalidModelUri(f"{reference!r}: {revision!r} is not a revision (a branch, tag or commit)")
    if not _HF_REPO.match(repo) or "--" in repo or ".." in repo:
        raise InvalidModelUri(f"{reference!r}: {repo!r} is not a Hugging Face repository id (org/name)")
    return ModelUri("hf", repo, revision=revision or None)
