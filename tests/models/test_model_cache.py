"""The node's model cache: entries fetched from a loopback Hub, held by serving daemons (shared
locks, also from another process), listed for the NodeTopology status and evicted LRU-first
without touching what is held, what a fetch is writing, or what an InferenceService still names."""

from __future__ import annotations

import dataclasses
import fcntl
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pagoda_daemon.model_uri import parse
from pagoda_daemon.models.fetch import COMPLETE_MARKER, fetch
from pagoda_daemon.models.model_cache import entries, evict, hold
from tests.models.hub_server import HubServer

TOKEN = "hf_cache_token"


@pytest.fixture(autouse=True)
def _hub_online(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


@pytest.fixture
def hub(tiny_models, tmp_path):
    server = HubServer(token=TOKEN).start()
    server.add_repo("org/tiny", tiny_models["qwen3"])
    (tmp_path / "small").mkdir()
    server.add_repo("org/small", tmp_path / "small", {"config.json": b"{}"})
    yield server
    server.stop()


def get(hub: HubServer, reference: str, cache: Path) -> Path:
    return fetch(parse(reference), cache, env={"HF_ENDPOINT": hub.url, "HF_TOKEN": TOKEN})


def test_entries_name_source_revision_size_and_namespace(hub, tmp_path):
    tiny = get(hub, "hf://org/tiny", tmp_path / "team-a")
    small = get(hub, "hf://org/small", tmp_path / "team-b")
    found = entries(tmp_path, namespaced=True)
    assert {(e.namespace, e.source, e.revision, e.complete) for e in found} == {
        ("team-a", "hf://org/tiny", tiny.name, True), ("team-b", "hf://org/small", small.name, True)}
    by_path = {e.path: e for e in found}
    assert by_path[tiny].bytes == sum(f.stat().st_size for f in tiny.rglob("*") if f.is_file())
    assert not any(e.in_use for e in found)
    assert entries(tmp_path / "team-a") == [dataclasses.replace(by_path[tiny], namespace="")]  # one namespace's cache


def test_a_held_entry_is_in_use_and_never_evicted_until_released(hub, tmp_path):
    tiny, small = get(hub, "hf://org/tiny", tmp_path), get(hub, "hf://org/small", tmp_path)
    os.utime(tiny / COMPLETE_MARKER, (1, 1))  # used longest ago: the first to go
    lease = hold(tiny)
    assert lease is not None
    assert {e.path for e in entries(tmp_path) if e.in_use} == {tiny}
    assert [e.path for e in evict(tmp_path, max_bytes=0)] == [small]  # the held one stays
    assert tiny.exists() and not small.exists()
    lease.close()
    assert [e.path for e in evict(tmp_path, max_bytes=0)] == [tiny]
    assert hold(tiny) is None  # evicted: the daemon must fetch again


def test_a_lock_held_by_another_process_keeps_the_entry(hub, tmp_path):
    tiny = get(hub, "hf://org/tiny", tmp_path)
    code = textwrap.dedent(f"""
        import sys, time
        from pagoda_daemon.models.model_cache import hold
        lease = hold({str(tiny)!r})
        print("held" if lease else "gone", flush=True)
        sys.stdin.readline()
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        assert evict(tmp_path, max_bytes=0) == [] and tiny.exists()
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
    assert [e.path for e in evict(tmp_path, max_bytes=0)] == [tiny]  # its process is gone, so is its lock


def test_keep_spares_the_newest_revision_of_a_named_model_only(hub, tmp_path, tiny_models):
    old = get(hub, "hf://org/tiny", tmp_path / "ns")
    hub.add_repo("org/tiny", tiny_models["llama"])  # the branch moves: a new revision
    new = get(hub, "hf://org/tiny", tmp_path / "ns")
    assert new != old
    os.utime(old / COMPLETE_MARKER, (1, 1))
    gone = evict(tmp_path, max_bytes=0, namespaced=True, keep={("ns", "hf://org/tiny")})
    assert [e.path for e in gone] == [old] and new.exists()
    assert evict(tmp_path, max_bytes=0, namespaced=True, keep={("other-ns", "hf://org/tiny")})[0].path == new


def test_an_abandoned_download_is_evicted_one_being_written_is_not(tmp_path):
    base = tmp_path / "s3" / "bucket%2Fm"
    abandoned, writing = base / "aaaa", base / "bbbb"
    for d in (abandoned, writing):
        d.mkdir(parents=True)
        (d / "model.safetensors.part").write_bytes(os.urandom(4096))
    with open(base / "bbbb.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a fetch in progress
        found = {e.path: e for e in entries(tmp_path)}
        assert not found[abandoned].complete and found[abandoned].source == "s3://bucket/m"
        assert found[writing].in_use and not found[abandoned].in_use
        assert [e.path for e in evict(tmp_path, max_bytes=0)] == [abandoned]
    assert writing.exists()


def test_links_planted_in_a_namespace_are_not_followed(hub, tmp_path):
    other = get(hub, "hf://org/tiny", tmp_path / "victim")
    planted = tmp_path / "tenant" / "hf" / "org%2Ftiny"
    planted.mkdir(parents=True)
    (planted / other.name).symlink_to(other)  # a link to another namespace's entry
    (tmp_path / "tenant" / "s3").symlink_to(tmp_path / "victim" / "hf")
    (planted.parent.parent / "hf" / "x").mkdir()
    found = entries(tmp_path, namespaced=True)
    assert [(e.namespace, e.path) for e in found] == [("victim", other)]
    assert evict(tmp_path, max_bytes=10**12, namespaced=True) == []
    assert other.exists()
