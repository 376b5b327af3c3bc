"""How fast the disk KV tier's block files are written and read on a directory: the daemon's own
``DiskStore.write`` and ``DiskStore.read``, one thread and several (the worker's I/O threads),
and a hard link (prefill/decode on one filesystem). Fresh random blocks of a given shape.

    python -m benchmarks.kv_block_files /dev/shm/kv-bench /tmp/kv-bench [--blocks 128] [--threads 8]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from pagoda_daemon.kv_offload import disk

# Qwen3-0.6B: 28 layers, K and V, 16 tokens, 8 KV heads of 128 (1.84 MB in bfloat16)
SHAPE = (28, 2, 16, 8, 128)


def measure(root: str, blocks: int, threads: int, shape: tuple[int, ...] = SHAPE) -> dict[str, float]:
    folder = Path(tempfile.mkdtemp(dir=root))
    store = disk.DiskStore(str(folder), 0, "bench", shape, torch.bfloat16)
    data = torch.randn(blocks, *shape).to(torch.bfloat16)
    hashes = [os.urandom(32) for _ in range(blocks)]
    out: dict[str, float] = {"blocks": blocks, "block_mb": data[0].numel() * 2 / 1e6}

    def timed(name: str, fn) -> None:
        started = time.perf_counter()
        fn()
        out[f"{name}_ms"] = round((time.perf_counter() - started) * 1e3, 1)

    timed("write_1t", lambda: [store.write(h, b) for h, b in zip(hashes, data, strict=True)])
    timed("read_1t", lambda: [store.read(h) for h in hashes])
    assert all(torch.equal(store.read(h), b) for h, b in zip(hashes[:4], data[:4], strict=True))
    for h in hashes:
        store.drop(h)
    with ThreadPoolExecutor(threads) as pool:
        timed(f"write_{threads}t", lambda: list(pool.map(store.write, hashes, data)))
        timed(f"read_{threads}t", lambda: list(pool.map(store.read, hashes)))
        staging = torch.empty(blocks, *shape, dtype=torch.bfloat16)  # the worker reads into reused slots
        staging.zero_()
        timed(f"read_into_{threads}t", lambda: list(pool.map(store.read, hashes, staging)))
    assert torch.equal(staging, data)
    timed("link_1t", lambda: [os.link(store.dir / disk.file_name(h), folder / f"{i}.link") for i, h in enumerate(hashes)])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dirs", nargs="+", help="directories to measure in (a folder is made in each)")
    p.add_argument("--blocks", type=int, default=128)
    p.add_argument("--threads", type=int, default=8)
    args = p.parse_args()
    for root in args.dirs:
        os.makedirs(root, exist_ok=True)
        print("RESULT", json.dumps({"dir": root, **measure(root, args.blocks, args.threads)}), flush=True)


if __name__ == "__main__":
    main()
