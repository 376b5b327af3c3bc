"""The threads that run reconcile passes (operator/pagoda_operator/pass_pool.py): a pass asked for
while one of the same InferenceService waits is not queued twice, one asked for while one runs
is, asking never blocks, and a failing pass leaves the pool serving."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from pagoda_operator.pass_pool import PassPool


def wait_for(check, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_pass_waiting_to_start_takes_later_requests_and_a_running_one_does_not():
    pool = PassPool(workers=1)
    ran: list[str] = []
    release = threading.Event()
    try:
        def blocking() -> None:
            ran.append("a")
            assert release.wait(10)

        assert pool.request(("ns", "a"), blocking)
        wait_for(lambda: ran == ["a"])  # running: the pool's one thread is busy
        assert pool.request(("ns", "b"), lambda: ran.append("b"))
        assert not pool.request(("ns", "b"), lambda: ran.append("b twice"))  # b waits: taken by it
        assert pool.request(("ns", "a"), lambda: ran.append("a again"))  # a runs: another pass after it
        assert pool.waiting() == 2
        release.set()
        wait_for(lambda: len(ran) == 3)
        assert ran == ["a", "b", "a again"] and pool.waiting() == 0
    finally:
        release.set()
        pool.shutdown()


def test_a_failing_pass_leaves_the_pool_serving_and_run_returns_results_and_errors():
    pool = PassPool(workers=2)
    done = threading.Event()
    try:
        def boom() -> None:
            raise RuntimeError("API server gone")

        assert pool.request(("ns", "a"), boom)
        assert pool.request(("ns", "b"), done.set)
        assert done.wait(10)

        async def both() -> tuple[int, str]:
            value = await pool.run(lambda x: x * 2, 21)
            try:
                await pool.run(boom)
            except RuntimeError as e:
                return value, str(e)
            return value, ""

        assert asyncio.run(both()) == (42, "API server gone")
    finally:
        pool.shutdown()


def test_after_shutdown_requests_are_refused_and_waiting_passes_dropped():
    pool = PassPool(workers=1)
    release, ran = threading.Event(), []
    pool.request(("ns", "a"), lambda: release.wait(10))
    pool.request(("ns", "b"), lambda: ran.append("b"))
    stopper = threading.Thread(target=pool.shutdown)
    stopper.start()
    time.sleep(0.1)
    release.set()
    stopper.join(10)
    assert ran == [] and pool.request(("ns", "c"), lambda: ran.append("c")) is False
    with pytest.raises(RuntimeError):
        asyncio.run(pool.run(lambda: None))
