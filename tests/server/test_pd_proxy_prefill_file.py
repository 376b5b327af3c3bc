"""pd-proxy's ``--prefill-file``: the prefill instances a file lists (the operator's ConfigMap,
mounted into the proxy's pod), followed while serving. The kubelet swaps the mounted file
atomically: new requests go to what the file lists now, within a few seconds and without a
restart; a file that is not valid leaves the last list in place, with a warning; an empty one
leaves the decode instance computing prompts and the proxy not ready. Real HTTP servers on
loopback stand for the instances, and the proxy serves on loopback too."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from pagoda_daemon.server import pd_proxy
from pagoda_daemon.server.pd_proxy import build_app

ASK = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 4}
READY = {"status": "ready", "startup": []}
SETTLE_S = 5.0  # how long a change of the file may take to be followed (it is read again every second)


class Fake:
    """An instance: a real HTTP server on loopback that is ready and answers completions, and
    counts those it was asked."""

    def __init__(self) -> None:
        self.asked: list[dict] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def answer(self, body: bytes, content_type: str) -> None:
                self.send_response(200)
                self.send_header("content-type", content_type)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                if self.path == "/metrics":
                    self.answer(b"fake_metric 1.0\n", "text/plain; version=0.0.4")
                else:
                    self.answer(json.dumps(READY).encode(), "application/json")

            def do_POST(self) -> None:
                fake.asked.append(json.loads(self.rfile.read(int(self.headers["content-length"]))))
                self.answer(json.dumps({"choices": [{"text": fake.url}]}).encode(), "application/json")

            def log_message(self, *_: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fakes() -> Iterator[Callable[[], Fake]]:
    started: list[Fake] = []

    def start() -> Fake:
        started.append(Fake())
        return started[-1]

    yield start
    for fake in started:
        fake.close()


@contextlib.contextmanager
def serving(prefill_file: Path, decode: Fake, prefills: tuple[str, ...] = ()) -> Iterator[httpx.Client]:
    """The proxy, served by uvicorn on loopback in a thread; yields a client of it."""
    import uvicorn

    app = build_app(list(prefills), [decode.url], prefill_file=str(prefill_file))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the proxy did not start"
        time.sleep(0.02)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}", timeout=10) as client:
            yield client
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def write(path: Path, text: str) -> None:
    """Replaces the file at once, as the kubelet does: never half written."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def kubelet_volume(root: Path, text: str) -> Path:
    """A ConfigMap volume as the kubelet lays it out: ``prefill`` -> ``..data/prefill``, with
    ``..data`` a symlink to a timestamped folder. Returns the mounted file's path."""
    root.mkdir()
    swap_volume(root, text)
    (root / "prefill").symlink_to("..data/prefill")
    return root / "prefill"


def swap_volume(root: Path, text: str) -> None:
    """The kubelet's update: a new folder, and ``..data`` pointed at it by renaming a new symlink."""
    folder = root / f"..{time.monotonic_ns()}"
    folder.mkdir()
    (folder / "prefill").write_text(text)
    (root / "..data_tmp").symlink_to(folder.name)
    os.replace(root / "..data_tmp", root / "..data")


def prefilled(client: httpx.Client, fakes_by_url: dict[str, Fake], n: int = 1) -> list[str]:
    """Sends n completions; returns, for each, the instance whose prefill request it was."""
    before = {url: len(f.asked) for url, f in fakes_by_url.items()}
    out = []
    for _ in range(n):
        assert client.post("/v1/completions", json=ASK).status_code == 200
        now = {url: len(f.asked) for url, f in fakes_by_url.items()}
        out += [url for url in now if now[url] > before[url]]
        before = now
    return out


def until(check: Callable[[], bool], seconds: float = SETTLE_S) -> float:
    """Waits for check() to be true; returns how long it took."""
    start = time.monotonic()
    while not check():
        assert time.monotonic() - start < seconds, "the proxy did not follow the file"
        time.sleep(0.1)
    return time.monotonic() - start


@pytest.mark.serial  # a wall-clock bound: runs alone, after the parallel pass
@pytest.mark.parametrize("swap", ["os.replace", "kubelet symlink"])
def test_new_requests_go_to_the_instances_the_rewritten_file_lists(swap, fakes, tmp_path):
    a, b, decode = fakes(), fakes(), fakes()
    if swap == "os.replace":
        path = tmp_path / "prefill"
        path.write_text(f"# prefill instances\n\n  {a.url}  \n")
    else:
        path = kubelet_volume(tmp_path / "volume", f"{a.url}\n")

    def rewrite(text: str) -> None:
        write(path, text) if swap == "os.replace" else swap_volume(tmp_path / "volume", text)

    with serving(path, decode) as client:
        assert prefilled(client, {a.url: a, b.url: b}, n=3) == [a.url] * 3
        rewrite(f"{b.url}\n")
        took = until(lambda: prefilled(client, {a.url: a, b.url: b}) == [b.url])
        assert took < 3.0
        asked_a = len(a.asked)
        assert prefilled(client, {a.url: a, b.url: b}, n=3) == [b.url] * 3
        assert len(a.asked) == asked_a
    # every prefill request had one token to generate; the decode instance answered each request
    assert {r["max_tokens"] for r in a.asked + b.asked} == {1}
    assert len(decode.asked) == len(a.asked) + len(b.asked)


def test_a_file_rewritten_with_a_bad_line_leaves_the_last_list_and_a_warning(fakes, tmp_path, caplog):
    a, b, decode = fakes(), fakes(), fakes()
    path = tmp_path / "prefill"
    path.write_text(f"{a.url}\n")
    caplog.set_level(logging.WARNING, logger="pagoda_daemon.server.pd_proxy")
    with serving(path, decode) as client:
        assert prefilled(client, {a.url: a, b.url: b}) == [a.url]
        write(path, f"{b.url}\nftp://x\n")
        # the file is looked at when a request or probe needs the list: one a tenth of a second here
        until(lambda: prefilled(client, {a.url: a, b.url: b}) == [a.url]
              and any("ftp://x" in r.getMessage() for r in caplog.records))
        time.sleep(pd_proxy.RELOAD_S + 0.2)  # read again: the same bad content is not warned twice
        assert prefilled(client, {a.url: a, b.url: b}, n=3) == [a.url] * 3
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING and str(path) in r.getMessage()]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]
        assert "line 2 must be an http(s) URL, not 'ftp://x'" in warnings[0].getMessage()
        assert warnings[0].name == "pagoda_daemon.server.pd_proxy"
        path.unlink()  # a file that cannot be read: the last list too
        until(lambda: client.get("/ready").status_code == 200
              and any("cannot be read" in r.getMessage() for r in caplog.records))
        assert prefilled(client, {a.url: a, b.url: b}, n=2) == [a.url] * 2
        write(path, f"{b.url}\n")  # valid again: followed
        until(lambda: prefilled(client, {a.url: a, b.url: b}) == [b.url])


def test_an_empty_file_leaves_prompts_to_the_decode_instance_until_an_instance_is_listed(fakes, tmp_path):
    a, decode = fakes(), fakes()
    path = tmp_path / "prefill"
    path.write_text("# none yet\n")
    with serving(path, decode) as client:
        r = client.get("/ready")
        assert r.status_code == 503
        assert r.json()["reason"] == f"no prefill instance is listed in {path}"
        assert client.get("/health").status_code == 503
        r = client.post("/v1/completions", json=ASK)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == decode.url
        assert decode.asked == [ASK] and a.asked == []
        metrics = client.get("/metrics").text
        assert metrics.startswith("fake_metric 1.0\n")
        assert "pagoda_pd_proxy_prefill_skipped_total 1.0" in metrics
        assert 'pagoda_pd_proxy_instances{role="prefill"} 0.0' in metrics
        write(path, f"{a.url}\n")
        assert until(lambda: client.get("/ready").status_code == 200) < 3.0
        assert client.get("/health").status_code == 200
        assert prefilled(client, {a.url: a}) == [a.url]
        assert "pagoda_pd_proxy_prefill_skipped_total 1.0" in client.get("/metrics").text


def test_a_dropped_instance_leaves_the_in_flight_gauge_and_the_instances_gauge_counts(fakes, tmp_path):
    a, b, c, decode = fakes(), fakes(), fakes(), fakes()
    path = tmp_path / "prefill"
    path.write_text(f"{a.url}\n{b.url}\n{b.url}/\n")  # listed twice: one instance
    with serving(path, decode, prefills=(c.url,)) as client:  # --prefill too: both's instances
        metrics = client.get("/metrics").text
        assert 'pagoda_pd_proxy_instances{role="prefill"} 3.0' in metrics
        assert 'pagoda_pd_proxy_instances{role="decode"} 1.0' in metrics
        series = set(re.findall(r'^pagoda_pd_proxy_in_flight\{instance="([^"]+)",role="prefill"\}', metrics, re.M))
        assert series == {a.url, b.url, c.url}
        assert sorted(prefilled(client, {u.url: u for u in (a, b, c)}, n=3)) == sorted([a.url, b.url, c.url])
        write(path, f"{b.url}\n")
        until(lambda: 'pagoda_pd_proxy_instances{role="prefill"} 2.0' in client.get("/metrics").text)
        metrics = client.get("/metrics").text
        series = set(re.findall(r'^pagoda_pd_proxy_in_flight\{instance="([^"]+)",role="prefill"\}', metrics, re.M))
        assert series == {b.url, c.url}
        assert f'instance="{a.url}"' not in "\n".join(
            line for line in metrics.splitlines() if line.startswith("pagoda_pd_proxy_in_flight"))
        assert sorted(prefilled(client, {u.url: u for u in (a, b, c)}, n=4)) == sorted([b.url, c.url] * 2)


def test_an_instance_still_listed_keeps_its_requests_in_flight():
    pool = pd_proxy.Instances("prefill", ["http://10.0.0.1:80", "http://10.0.0.2:80"])
    kept = pool.all[1]
    kept.in_flight = 2
    added, dropped = pool.replace(["http://10.0.0.2:80/", "http://10.0.0.3:80"])
    assert pool.all[0] is kept and kept.in_flight == 2
    assert [i.url for i in added] == ["http://10.0.0.3:80"] and [i.url for i in dropped] == ["http://10.0.0.1:80"]
    assert [i.url for i in pool.by_load()] == ["http://10.0.0.3:80", "http://10.0.0.2:80"]  # least busy first
    pool.replace([])
    assert pool.by_load() == []


def test_prefill_and_file_instances_combine_each_once(tmp_path):
    path = tmp_path / "prefill"
    path.write_text("http://10.0.0.2:80\n# a comment\n\nhttp://10.0.0.1:80\n  http://10.0.0.2:80  \n")
    assert pd_proxy.InstanceFile(str(path), ["http://10.0.0.1:80"]).urls == ["http://10.0.0.1:80", "http://10.0.0.2:80"]


def parsed(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    pd_proxy.add_args(p)
    return p.parse_args(argv)


@pytest.mark.parametrize("case, message", [
    ("neither", "--prefill or --prefill-file"),
    ("missing", "cannot be read: FileNotFoundError"),
    ("not http", "line 2 must be an http(s) URL, not 'ftp://x'"),
    ("65 instances", "it lists 65 instances, at most 64"),
    ("65 with --prefill", "with --prefill it makes 65 instances, at most 64"),
    ("not text", "can't decode"),
])
def test_a_bad_prefill_file_is_refused_at_start_in_one_line(case, message, tmp_path, capsys):
    path = tmp_path / "prefill"
    argv = ["--decode", "http://127.0.0.1:8200"]
    if case != "neither":
        argv += ["--prefill-file", str(path)]
    if case == "not http":
        path.write_text("http://10.0.0.1:80\nftp://x\n")
    elif case == "65 instances":
        path.write_text("".join(f"http://10.0.0.1:{8000 + i}\n" for i in range(65)))
    elif case == "65 with --prefill":
        path.write_text("".join(f"http://10.0.0.1:{8000 + i}\n" for i in range(64)))
        argv += ["--prefill", "http://10.0.0.2:80"]
    elif case == "not text":
        path.write_bytes(b"\xff\xfe\n")
    assert pd_proxy.run(parsed(argv)) == 2
    out = capsys.readouterr().out
    assert message in out and out.count("\n") == 1, out


def test_an_empty_prefill_file_is_valid_at_start(tmp_path):
    path = tmp_path / "prefill"
    path.write_text("\n# the operator has not started a prefill pod yet\n")
    assert pd_proxy.InstanceFile(str(path), []).urls == []
    assert parsed(["--decode", "http://127.0.0.1:8200", "--prefill-file", str(path)]).prefill == []
