"""The pure parts of the pinning benchmark (the GPU part runs on a CUDA machine)."""

from __future__ import annotations

import ctypes
import mmap

import pytest

from pagoda_daemon.topology.bench_pinning import gbps, pages_by_node, parse_maps, parse_numa_maps

MAPS = """\
7f0000000000-7f0000200000 rw-s 00000000 00:05 123  /dev/nvidiactl
7f0000400000-7f0000600000 rw-p 00000000 00:00 0
"""
NUMA_MAPS = """\
7f0000000000 default file=/dev/nvidiactl mapped=512 N1=512 kernelpagesize_kB=4
7f0000400000 default anon=512 dirty=512 N0=500 N1=12 kernelpagesize_kB=4
"""


def test_parses_maps_and_numa_maps():
    assert parse_maps(MAPS) == [(0x7F0000000000, 0x7F0000200000), (0x7F0000400000, 0x7F0000600000)]
    assert parse_numa_maps(NUMA_MAPS) == {0x7F0000000000: {1: 512}, 0x7F0000400000: {0: 500, 1: 12}}


def test_bandwidth_is_bytes_per_second_in_gb():
    assert gbps(2 * 10**9, 100.0) == pytest.approx(20.0)


def test_pages_by_node_finds_this_process_memory():
    buf = mmap.mmap(-1, 1 << 20)
    buf.write(b"x" * (1 << 20))  # touch the pages so they have a node
    placement = pages_by_node(ctypes.addressof(ctypes.c_char.from_buffer(buf)))
    assert sum(placement.values()) >= 256  # 1 MiB of 4 KiB pages, on some node
    assert pages_by_node(0) == {}
