"""Leader election on a coordination.k8s.io/v1 Lease, so that two operator replicas never act at once.

The rule is client-go's: a replica takes the lease when it is free or when its record (holder
and renew time) has not changed for a whole ``leaseDurationSeconds`` *as seen by this replica's
own clock* (so clock skew between nodes does not matter); the holder renews it every
``renew_s``, and a holder that stops cleanly releases the lease so its successor starts at once.

API server outages. A replica that cannot read the lease has seen nothing: its wait starts
again at its next successful read, so after an outage every waiting replica gives the holder a
whole lease duration to renew. The holder, in turn, keeps leading while its renewals fail for
want of an API server (no answer, 429, 5xx) for up to ``grace_s`` (default 60 s): nobody can
take the lease while nobody can reach the API server, and whatever the holder does meanwhile
fails the same way. A renewal the API server answers otherwise (403, 404), or a lease seen held
by another replica, ends the holder's leadership at once, as does an outage longer than the
grace. One case this trades away: a holder cut off from an API server that the other replicas
still reach keeps believing it leads until the grace ends, while another replica leads after
one lease duration; it can write nothing in that time, and its first renewal after the cut
heals sees the new holder and stops it.

Identity: the pod's name (``POD_NAME``), so a restarted container finds the lease still its own
and leads again at once instead of waiting out its own lease; elsewhere the host name and a
random suffix.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

import urllib3

from pagoda_operator.kube import ApiError, Kube
from pagoda_operator.telemetry import LEADER

log = logging.getLogger("pagoda_operator.leader")


def micro_time(t: float) -> str:
    return datetime.fromtimestamp(t, tz=UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def default_identity() -> str:
    return os.environ.get("POD_NAME") or f"{socket.gethostname()}_{uuid.uuid4().hex[:8]}"


def api_unreachable(error: BaseException) -> bool:
    """The API server did not answer, or answered that it cannot serve now: an outage, not a
    refusal of this request."""
    if isinstance(error, ApiError):
        return error.status in (429, 500, 502, 503, 504)
    return isinstance(error, (OSError, urllib3.exceptions.HTTPError))


def decide(
    spec: Mapping[str, Any] | None,
    identity: str,
    observed_at: float | None,
    now: float,
    default_duration: int,
) -> str:
    """'take', 'renew' or 'wait' for a Lease spec last seen changing at local time ``observed_at``."""
    spec = spec or {}
    holder = spec.get("holderIdentity")
    if holder == identity:
        return "renew"
    if not holder:
        return "take"
    duration = int(spec.get("leaseDurationSeconds") or default_duration)
    if observed_at is not None and now - observed_at > duration:
        return "take"
    return "wait"


class LeaderElector:
    def __init__(
        self,
        kube: Kube,
        namespace: str,
        name: str = "pagoda-operator",
        identity: str | None = None,
        lease_s: int = 15,
        renew_s: float = 5.0,
        retry_s: float = 2.0,
        grace_s: float = 60.0,
        clock: Callable[[], float] = time.time,
    ):
        self.kube, self.namespace, self.name = kube, namespace, name
        self.identity = identity or default_identity()
        self.lease_s, self.renew_s, self.retry_s = lease_s, renew_s, retry_s
        self.grace_s = max(grace_s, float(lease_s))
        self.clock = clock
        self.held_by_other = False  # the last read showed another replica holding the lease
        self._seen: tuple[Any, Any] | None = None
        self._seen_at: float | None = None
        self.last_renewed: float | None = None

    def _body(self, lease: Mapping[str, Any] | None, now: float) -> dict[str, Any]:
        old = dict((lease or {}).get("spec") or {})
        taking = old.get("holderIdentity") != self.identity
        spec = {
            **old,
            "holderIdentity": self.identity,
            "leaseDurationSeconds": self.lease_s,
            "renewTime": micro_time(now),
        }
        if taking:
            spec["acquireTime"] = micro_time(now)
            spec["leaseTransitions"] = int(old.get("leaseTransitions") or 0) + (
                1 if old.get("holderIdentity") else 0
            )
        meta: dict[str, Any] = {"name": self.name, "namespace": self.namespace}
        if lease:
            meta["resourceVersion"] = lease["metadata"]["resourceVersion"]
        return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta, "spec": spec}

    def try_acquire(self) -> bool:
        """One attempt to take or renew the lease."""
        now = self.clock()
        try:
            lease = self.kube.get("Lease", self.namespace, self.name)
        except Exception:
            self._seen = self._seen_at = None  # nothing seen: a wait starts again at the next read
            raise
        self.held_by_other = False
        try:
            if lease is None:
                self.kube.create(self._body(None, now))
                self.last_renewed = now
                return True
            spec = lease.get("spec") or {}
            record = (spec.get("holderIdentity"), spec.get("renewTime"))
            if record != self._seen:
                self._seen, self._seen_at = record, now
            action = decide(spec, self.identity, self._seen_at, now, self.lease_s)
            if action == "wait":
                self.held_by_other = True
                return False
            self.kube.replace(self._body(lease, now))
            if action == "take":
                log.info(
                    "took the leader lease %s/%s from %r",
                    self.namespace,
                    self.name,
                    spec.get("holderIdentity"),
                )
            self.last_renewed = now
            return True
        except ApiError as e:
            if e.status in (409, 422):
                return False
            raise

    def acquire(self, stop: threading.Event | None = None) -> bool:
        """Block until this replica leads (True) or ``stop`` is set (False)."""
        log.info("waiting for the leader lease %s/%s as %s", self.namespace, self.name, self.identity)
        while not (stop and stop.is_set()):
            try:
                if self.try_acquire():
                    LEADER.set(1)
                    log.info("leading as %s", self.identity)
                    return True
            except Exception as e:  # API unavailable: keep trying
                log.warning("leader election: %s", e)
            (stop or threading.Event()).wait(self.retry_s)
        return False

    def renew(self) -> str | None:
        """One renewal; None while this replica still leads, else why it no longer does."""
        try:
            if self.try_acquire():
                return None
            if self.held_by_other:
                return "another replica holds the lease"
            failure, outage = "the lease changed while renewing", False  # 409/422: retried
        except Exception as e:
            failure, outage = str(e), api_unreachable(e)
            log.warning("lease renewal failed%s: %s", " (API server unreachable)" if outage else "", e)
        silent = self.clock() - (self.last_renewed if self.last_renewed is not None else -1e18)
        limit = self.grace_s if outage else self.lease_s
        if silent > limit:
            return f"not renewed for {silent:.0f} s (limit {limit:.0f} s): {failure}"
        return None

    def keep(self, stop: threading.Event, on_lost: Callable[[], None]) -> threading.Thread:
        """Renew in a daemon thread; call ``on_lost`` once when this replica no longer leads."""

        def loop() -> None:
            while not stop.wait(self.renew_s):
                why = self.renew()
                if why is not None:
                    LEADER.set(0)
                    log.error("lost the leader lease %s/%s (%s); stopping", self.namespace, self.name, why)
                    on_lost()
                    return

        thread = threading.Thread(target=loop, name="leader-lease", daemon=True)
        thread.start()
        return thread

    def release(self) -> None:
        """Give the lease up (clean shutdown) so a successor need not wait for it to expire."""
        LEADER.set(0)
        try:
            lease = self.kube.get("Lease", self.namespace, self.name)
            if lease and (lease.get("spec") or {}).get("holderIdentity") == self.identity:
                body = self._body(lease, self.clock())
                body["spec"]["holderIdentity"] = None
                self.kube.replace(body)
                log.info("released the leader lease %s/%s", self.namespace, self.name)
        except Exception as e:
            log.warning("could not release the leader lease: %s", e)
