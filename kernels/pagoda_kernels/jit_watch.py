"""Which Triton kernels compile while a piece of code runs, and how long each compile takes.

A Triton kernel compiles once per specialisation: its constexprs, and for each integer
argument whether it is 1 or divisible by 16. The engine compiles every kernel it needs in
its warm-up; a specialisation first met while serving stalls that step for the length of
a compile (about a second cold, tens of milliseconds from Triton's disk cache). The
throughput benchmark watches its timed run with this, so such stalls show up as numbers
rather than as an unexplained spread between two identical runs.

It hooks Triton's JIT through `triton.knobs.runtime` (Triton 3.4 and later); elsewhere it
watches nothing and says so (`supported` is False).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class CompileRecord:
    kernel: str  # the JIT function's name
    signature: str  # Triton's cache key: argument types, alignment / value classes, constexprs, options
    seconds: float


@dataclass
class CompileWatch:
    supported: bool
    records: list[CompileRecord] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return sum(r.seconds for r in self.records)

    def summary(self) -> dict:
        """Count, total time and specialisations per kernel, for a benchmark's JSON line."""
        kernels: dict[str, dict] = {}
        for r in self.records:
            k = kernels.setdefault(r.kernel, {"compiles": 0, "seconds": 0.0, "signatures": []})
            k["compiles"] += 1
            k["seconds"] = round(k["seconds"] + r.seconds, 3)
            k["signatures"].append(r.signature)
        return {"supported": self.supported, "compiles": len(self.records), "seconds": round(self.seconds, 3),
                "kernels": kernels}


def _runtime_knobs():
    try:
        from triton import knobs
    except ImportError:
        return None
    runtime = getattr(knobs, "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_cache_hook") or not hasattr(runtime, "jit_post_compile_hook"):
        return None
    return runtime


@contextmanager
def watch_compiles() -> Iterator[CompileWatch]:
    """Record every Triton JIT compile (in-memory cache miss) made inside the block.

    Hooks already installed keep running (this one wraps them) and come back on exit.
    """
    runtime = _runtime_knobs()
    watch = CompileWatch(supported=runtime is not None)
    if runtime is None:
        yield watch
        return
    before_hook, after_hook = runtime.jit_cache_hook, runtime.jit_post_compile_hook
    started: dict[int, float] = {}

    def before(*args, **kwargs):
        started[id(kwargs.get("key"))] = time.perf_counter()
        return before_hook(*args, **kwargs) if before_hook else None  # a truthy answer skips the compile

    def after(*args, **kwargs):
        t0 = started.pop(id(kwargs.get("key")), None)
        fn = kwargs.get("fn")
        name = getattr(fn, "name", None) or str(kwargs.get("repr", "?")).split("[", 1)[0]
        # the key holds the specialisation (argument types, alignment and value classes, constexprs)
        watch.records.append(CompileRecord(name, str(kwargs.get("key", kwargs.get("repr", ""))),
                                           time.perf_counter() - t0 if t0 is not None else 0.0))
        return after_hook(*args, **kwargs) if after_hook else None

    runtime.jit_cache_hook, runtime.jit_post_compile_hook = before, after
    try:
        yield watch
    finally:
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = before_hook, after_hook
