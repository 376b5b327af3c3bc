"""A CPU-weighted sampling profiler for any Python process, loaded by putting this directory
first on the process's PYTHONPATH (Python imports ``sitecustomize`` at start) and naming an
output file in ``CPU_SAMPLER_OUT``:

    python -m benchmarks.operator_scale --objects 200 \\
        --operator-env PYTHONPATH=$PWD/benchmarks/cpu_sampler:$PWD/operator \\
        --operator-env CPU_SAMPLER_OUT=/tmp/operator-cpu.txt

Every 2 ms a thread reads every other thread's Python stack and the CPU time that thread used
since the last look (its own CPU clock), and charges that time to the stack: to the innermost
line (self) and once to every function on the stack (inclusive). Every 10 s the totals are
written to the file, replacing it. Threads that wait use no CPU and are not charged, which a
plain stack sampler cannot tell apart. The charge is to where a thread is when it is sampled:
CPU used just before a blocking call (a request's encryption before its read) shows up in that
call, so blocking frames' self time reads high; inclusive figures of the callers are the ones to
trust. tracemalloc and cProfile slowed the operator so much at 1,000 objects that the picture
changed (docs/benchmarks/2026-11-27-operator-watch-cache-compressed.md); this costs about one
core's 1-2%.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time

INTERVAL_S, WRITE_EVERY_S = 0.002, 10.0


def _key(code) -> str:  # type: ignore[no-untyped-def]
    return f"{os.path.basename(os.path.dirname(code.co_filename))}/{os.path.basename(code.co_filename)}:{code.co_name}"


def _write(out: str, total: float, inclusive: collections.Counter, own: collections.Counter) -> None:
    with open(out + ".tmp", "w") as f:
        f.write(f"CPU seconds sampled: {total:.1f}\n== inclusive (seconds, share, function)\n")
        for key, s in inclusive.most_common(90):
            f.write(f"{s:8.2f} {100 * s / total:5.1f}% {key}\n")
        f.write("== self (seconds, share, line)\n")
        for key, s in own.most_common(60):
            f.write(f"{s:8.2f} {100 * s / total:5.1f}% {key}\n")
    os.replace(out + ".tmp", out)


def _sample(out: str) -> None:
    me = threading.get_ident()
    last_cpu: dict[int, float] = {}
    inclusive: collections.Counter = collections.Counter()
    own: collections.Counter = collections.Counter()
    total, written = 0.0, time.monotonic()
    while True:
        time.sleep(INTERVAL_S)
        for tid, frame in sys._current_frames().items():
            if tid == me:
                continue
            try:
                cpu = time.clock_gettime(time.pthread_getcpuclockid(tid))
            except OSError:  # the thread ended
                continue
            used = cpu - last_cpu.get(tid, cpu)
            last_cpu[tid] = cpu
            if used <= 0:
                continue
            total += used
            own[f"{_key(frame.f_code)}:{frame.f_lineno}"] += used
            seen = set()
            f = frame
            while f is not None:
                key = _key(f.f_code)
                if key not in seen:
                    inclusive[key] += used
                    seen.add(key)
                f = f.f_back
        if time.monotonic() - written > WRITE_EVERY_S and total > 0:
            written = time.monotonic()
            _write(out, total, inclusive, own)


if os.environ.get("CPU_SAMPLER_OUT"):
    threading.Thread(target=_sample, args=(os.environ["CPU_SAMPLER_OUT"],), name="cpu-sampler", daemon=True).start()
