"""/healthz on the operator's metrics port: 200 while kopf's event loop and the periodic pass
keep beating, 503 naming the one that stopped (the chart's liveness probe restarts a leader that
is stuck), 200 on a standby replica that runs neither. Served over real HTTP on loopback."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx

from pagoda_operator import telemetry
from pagoda_operator.handlers import LOOP_BEAT, PASS_BEAT, Ticker, loop_heartbeat
from pagoda_operator.reconcile import Context
from tests.operator.operator_fakes import FakeKube, every_capability


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_healthz_is_503_naming_the_silent_heartbeat_and_metrics_still_answer():
    clock = Clock()
    beats = telemetry.Heartbeats(clock)
    server = telemetry.serve(0, "127.0.0.1", beats)
    url = f"http://127.0.0.1:{server.server_port}"
    try:
        assert httpx.get(url + "/healthz").json() == {"status": "ok"}  # a standby: nothing registered
        beats.expect("kopf event loop", 60)
        beats.expect("periodic pass", 270)
        clock.t += 59
        assert httpx.get(url + "/healthz").status_code == 200
        clock.t += 2
        r = httpx.get(url + "/healthz")
        assert r.status_code == 503 and r.json()["stale"] == ["kopf event loop: no heartbeat for 61 s (allowed 60 s)"]
        beats.beat("kopf event loop")
        assert httpx.get(url + "/healthz").status_code == 200
        clock.t += 300
        assert len(httpx.get(url + "/healthz").json()["stale"]) == 2
        beats.forget("kopf event loop")
        beats.forget("periodic pass")  # leadership lost: the loops stopped on purpose
        assert httpx.get(url + "/healthz").status_code == 200
        assert "pagoda_operator_reconcile_errors_total" in httpx.get(url + "/metrics").text
    finally:
        server.shutdown()
        server.server_close()


def test_the_loop_heartbeat_stops_when_the_loop_stops_running_tasks():
    beats = telemetry.Heartbeats()
    loop = asyncio.new_event_loop()
    task = loop.create_task(loop_heartbeat(beats, every_s=0.01, stuck_after_s=0.3))
    loop.run_until_complete(asyncio.sleep(0.5))  # the loop runs: the task beats
    assert beats.stale() == []
    time.sleep(0.4)  # the loop runs nothing, as when a handler blocks it
    assert beats.stale() and beats.stale()[0].startswith(f"{LOOP_BEAT}: no heartbeat for")
    task.cancel()
    loop.run_until_complete(asyncio.gather(task, return_exceptions=True))
    loop.close()


def test_the_periodic_pass_beats_after_every_pass_and_is_forgotten_when_stopped():
    clock = Clock()
    beats = telemetry.Heartbeats(clock)
    passes = threading.Event()

    class Counting(Ticker):
        def tick(self) -> None:
            passes.set()

    ticker = Counting(Context(kube=FakeKube(), supports=every_capability), interval=0.05, heartbeats=beats)
    ticker.start()
    try:
        assert passes.wait(5)
        clock.t += 10 * 0.05 + 119  # within ten intervals plus two minutes of the last pass
        time.sleep(0.2)  # more passes, each beating at the clock's new time
        assert beats.stale() == []
        ticker.stop_flag.set()
        ticker.thread.join(5)
        clock.t += 10 * 0.05 + 121
        assert beats.stale() and beats.stale()[0].startswith(f"{PASS_BEAT}: no heartbeat")
    finally:
        ticker.stop()
    assert beats.stale() == []
