"""Data-parallel engines whose MoE layers run together: each step they first agree on what runs.

With ``--data-parallel-experts`` the experts of a MoE model are spread over the data-parallel
engines, each engine holding its own requests, attention and dense layers (data-parallel
attention, vLLM's ``--data-parallel-size`` with ``--enable-expert-parallel``). Every MoE layer
gathers the tokens of all engines, so every engine must run each forward pass, with the same
number of token rows, whether it has requests or not. Before each step the engine cores agree,
in one all-reduce of four integers over a gloo group, on:

- whether any engine has work (if none, none steps, and the idle loops wait for input);
- the most tokens any engine's step has: every engine pads its step to that many rows (an idle
  engine runs the MoE layers alone, on padding rows, for the others' tokens);
- whether every engine's step is decode-only (then all may replay the same CUDA graph size);
- whether every engine was asked to shut down (they leave together, so that none waits in a
  collective for one already gone).

Each agreement is one collective, matched in order across the engines: an engine may call it
from its warm-up, an idle loop or a busy one, and the pairs still line up.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from pagoda_daemon.engine.scheduler_output import SchedulerOutput, StepAgreement


class Lockstep:
    """One engine's side of the per-step agreement (the gloo group of the engines' processes)."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.stopping = False  # this engine was asked to shut down; it steps on until all are
        self.last = StepAgreement(0, True, False)

    def agree(self, sched: SchedulerOutput, busy: bool) -> StepAgreement:
        """This engine's step against every other's (collective)."""
        mine = torch.tensor([sched.num_scheduled_tokens, int(not sched.decode_only), int(busy),
                             int(not self.stopping)], dtype=torch.int64)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=self.group)
        tokens, not_decode, busy_anywhere, running_anywhere = mine.tolist()
        self.last = StepAgreement(int(tokens), not not_decode, bool(busy_anywhere), not running_anywhere)
        return self.last

    @property
    def others_may_be_busy(self) -> bool:
        """Whether the last agreement found work somewhere: an idle engine must not wait for its
        own input then, or every busy engine would wait for it."""
        return self.last.anyone_busy
