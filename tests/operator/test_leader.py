"""Leader election on a Lease: one leader at a time, takeover after expiry, fast hand-over on release."""

from __future__ import annotations

import pytest

from pagoda_operator.kube import ApiError
from pagoda_operator.leader import LeaderElector, decide, default_identity


@pytest.mark.parametrize(
    "spec, observed_at, now, expected",
    [
        (None, None, 0, "take"),
        ({"holderIdentity": None}, 0, 0, "take"),
        ({"holderIdentity": "me"}, 0, 100, "renew"),
        ({"holderIdentity": "other", "leaseDurationSeconds": 15}, 0, 10, "wait"),
        ({"holderIdentity": "other", "leaseDurationSeconds": 15}, 0, 16, "take"),
        ({"holderIdentity": "other"}, 0, 14, "wait"),  # default duration 15
        ({"holderIdentity": "other", "leaseDurationSeconds": 15}, None, 1000, "wait"),  # never observed yet
    ],
)
def test_decide(spec, observed_at, now, expected):
    assert decide(spec, "me", observed_at, now, 15) == expected


class Clock:
    t = 1000.0

    def __call__(self):
        return self.t


def test_one_leader_takeover_and_release(fake_kube):
    clock = Clock()
    a = LeaderElector(fake_kube, "ops", identity="a", lease_s=15, clock=clock)
    b = LeaderElector(fake_kube, "ops", identity="b", lease_s=15, clock=clock)
    assert a.try_acquire() is True
    assert b.try_acquire() is False
    clock.t += 10
    assert a.try_acquire() is True  # renew
    assert b.try_acquire() is False  # b sees a new renewTime: its expiry clock restarts
    clock.t += 14
    assert b.try_acquire() is False
    clock.t += 2  # a silent for 16 s as b saw it
    assert b.try_acquire() is True
    lease = fake_kube.get("Lease", "ops", "pagoda-operator")
    assert lease["spec"]["holderIdentity"] == "b" and lease["spec"]["leaseTransitions"] == 1
    assert a.try_acquire() is False  # the old leader does not grab it back
    b.release()
    assert fake_kube.get("Lease", "ops", "pagoda-operator")["spec"]["holderIdentity"] is None
    assert a.try_acquire() is True  # released: no waiting


class Outage:
    """The fake API server, unreachable (or answering ``status``) while ``down`` is set."""

    def __init__(self, kube, status: int | None = None):
        self.kube, self.status, self.down = kube, status, False

    def _check(self):
        if self.down:
            if self.status is None:
                raise ConnectionRefusedError("connection refused")
            raise ApiError(self.status, "Refused", {"message": "refused"})

    def get(self, *a):
        self._check()
        return self.kube.get(*a)

    def create(self, obj):
        self._check()
        return self.kube.create(obj)

    def replace(self, obj):
        self._check()
        return self.kube.replace(obj)


def test_identity_is_the_pod_name_so_a_restart_leads_at_once(fake_kube, monkeypatch):
    monkeypatch.setenv("POD_NAME", "pagoda-operator-7d9f-abcde")
    assert default_identity() == "pagoda-operator-7d9f-abcde"
    clock = Clock()
    first = LeaderElector(fake_kube, "ops", lease_s=15, clock=clock)
    assert first.try_acquire() is True
    # killed (no release); the restarted container has the same pod name: no wait
    clock.t += 1
    again = LeaderElector(fake_kube, "ops", lease_s=15, clock=clock)
    assert again.identity == first.identity and again.try_acquire() is True
    monkeypatch.delenv("POD_NAME")
    assert default_identity() != default_identity()  # elsewhere: host name and a random suffix


@pytest.mark.parametrize("status", [None, 503, 500, 429])
def test_the_leader_rides_through_an_outage_shorter_than_the_grace(fake_kube, status):
    clock = Clock()
    api = Outage(fake_kube, status)
    leader = LeaderElector(api, "ops", identity="a", lease_s=15, grace_s=60, clock=clock)
    standby = LeaderElector(api, "ops", identity="b", lease_s=15, grace_s=60, clock=clock)
    assert leader.renew() is None and standby.try_acquire() is False
    api.down = True
    for _ in range(11):  # 55 s without an API server, renewing every 5 s
        clock.t += 5
        assert leader.renew() is None
        with pytest.raises((ConnectionRefusedError, ApiError)):
            standby.try_acquire()
    api.down = False
    # back: the standby has seen nothing for 55 s and starts its wait afresh, so the leader's
    # next renewal keeps the lease
    clock.t += 1
    assert standby.try_acquire() is False
    assert leader.renew() is None
    clock.t += 14
    assert standby.try_acquire() is False
    assert fake_kube.get("Lease", "ops", "pagoda-operator")["spec"]["holderIdentity"] == "a"


def test_an_outage_longer_than_the_grace_ends_leadership(fake_kube):
    clock = Clock()
    api = Outage(fake_kube)
    leader = LeaderElector(api, "ops", identity="a", lease_s=15, grace_s=60, clock=clock)
    assert leader.renew() is None
    api.down = True
    clock.t += 60
    assert leader.renew() is None
    clock.t += 1
    why = leader.renew()
    assert why is not None and "61 s" in why and "connection refused" in why


def test_a_refused_renewal_or_another_holder_ends_leadership_without_grace(fake_kube):
    clock = Clock()
    api = Outage(fake_kube, status=403)  # say, RBAC on leases revoked
    leader = LeaderElector(api, "ops", identity="a", lease_s=15, grace_s=600, clock=clock)
    assert leader.renew() is None
    api.down = True
    clock.t += 10
    assert leader.renew() is None  # within the lease: may still recover
    clock.t += 6
    assert "limit 15 s" in (leader.renew() or "")

    api.down = False
    fresh = LeaderElector(fake_kube, "ops", identity="c", lease_s=15, grace_s=600, clock=clock)
    fake_kube.get("Lease", "ops", "pagoda-operator")["spec"]["holderIdentity"] = "b"  # taken meanwhile
    assert fresh.renew() == "another replica holds the lease"


def test_a_standby_that_lost_sight_of_the_lease_waits_a_whole_duration_again(fake_kube):
    clock = Clock()
    api = Outage(fake_kube)
    LeaderElector(fake_kube, "ops", identity="a", lease_s=15, clock=clock).try_acquire()
    standby = LeaderElector(api, "ops", identity="b", lease_s=15, clock=clock)
    assert standby.try_acquire() is False  # first seen at t
    clock.t += 10
    api.down = True
    with pytest.raises(ConnectionRefusedError):
        standby.try_acquire()
    api.down = False
    clock.t += 10  # 20 s after first seeing the record, but it saw nothing for 10 of them
    assert standby.try_acquire() is False
    clock.t += 16
    assert standby.try_acquire() is True
