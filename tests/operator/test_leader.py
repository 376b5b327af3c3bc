"""Leader election on a Lease: one leader at a time, takeover after expiry, fast hand-over on release."""

from __future__ import annotations

import pytest

from pagoda_operator.leader import LeaderElector, decide


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
