"""The compile watch: records what Triton's JIT reports, keeps hooks that were already there,
and puts them back. (Real compiles need a GPU: tests/gpu/test_warm_up.py watches those.)"""

from __future__ import annotations

import pytest

from pagoda_kernels.jit_watch import _runtime_knobs, watch_compiles

runtime = _runtime_knobs()
pytestmark = pytest.mark.skipif(runtime is None, reason="this Triton has no knobs.runtime JIT hooks")


class _Fn:  # what Triton passes as `fn` (a JitFunctionInfo)
    name = "_some_kernel"


def _compile_event(key):
    """What Triton's JIT does around one compile: the cache hook, the compile, the post hook."""
    kwargs = dict(key=key, repr="_some_kernel[num_warps=4](x: *bf16, n: i32)", fn=_Fn(), compile={},
                  is_manual_warmup=False, already_compiled=False)
    skip = runtime.jit_cache_hook(**kwargs) if runtime.jit_cache_hook else None
    runtime.jit_post_compile_hook(**kwargs)
    return skip


def test_records_each_compile_and_restores_the_hooks():
    seen = []
    old_before, old_after = runtime.jit_cache_hook, runtime.jit_post_compile_hook
    runtime.jit_cache_hook = lambda **kw: seen.append(("before", kw["key"]))
    runtime.jit_post_compile_hook = lambda **kw: seen.append(("after", kw["key"]))
    try:
        mine_before, mine_after = runtime.jit_cache_hook, runtime.jit_post_compile_hook
        with watch_compiles() as watch:
            assert not _compile_event(("a",))  # never asks Triton to skip the compile
            _compile_event(("b",))
        assert (runtime.jit_cache_hook, runtime.jit_post_compile_hook) == (mine_before, mine_after)
        _compile_event(("c",))  # after the block: not recorded
    finally:
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = old_before, old_after
    assert watch.supported
    assert [r.kernel for r in watch.records] == ["_some_kernel", "_some_kernel"]
    assert all(r.seconds >= 0 for r in watch.records)
    assert [k for _, k in seen] == [("a",), ("a",), ("b",), ("b",), ("c",), ("c",)]  # chained
    summary = watch.summary()
    assert summary["compiles"] == 2 and summary["kernels"]["_some_kernel"]["compiles"] == 2
    assert summary["kernels"]["_some_kernel"]["signatures"][0] == "('a',)"  # Triton's cache key
