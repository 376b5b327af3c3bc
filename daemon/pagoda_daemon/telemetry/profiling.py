"""Phase labels for torch-profiler traces that cost nothing while no profiler runs.

`torch.profiler.record_function` costs microseconds per use even with profiling off;
the engine labels a handful of phases per step, so it asks the profiler first.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
from torch.profiler import record_function


def phase(name: str) -> AbstractContextManager:
    """`with phase("pagoda.schedule"): ...` shows up as a named range in a profile."""
    return record_function(name) if torch._C._autograd._profiler_enabled() else nullcontext()
