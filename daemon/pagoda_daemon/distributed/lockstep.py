"""Data-parallel engines whose MoE layers run together: each step they first agree on what runs.

With ``--data-parallel-experts`` the experts of a MoE model are spread over the data-parallel
engines, each engine holding its own requests, attention and dense layers (data-parallel
attention, vLLM's ``--data-parallel-size`` with ``--enable-expert-parallel``). Every MoE layer
gathers the tokens of all engines, so every engine must run each forward pass, with the same
number of token rows, whether it has requests or not. Before each step the engine cores agree,
in one all-reduce of five integers over a gloo group, on:

- whether any engine has work (if none, none steps, and the idle loops wait for input);
- the most tokens any engine's step has: every engine pads its step to that many rows (an idle
  engine runs the MoE layers alone, on padding rows, for the others' tokens);
- whether every engine's step is decode-only (then all may replay the same CUDA graph size);
- whether every engine was asked to shut down (they leave together, so that none waits in a
  collective for one already gone);
- with EPLB moving experts in the background, how many MoE layers of the move every engine
  holds (each switches those at this step, none waiting for its transfer thread).

Each agreement is one collective, matched in order across the engines: an engine may call it
from its warm-up, an idle loop or a busy one, and the pairs still line up.
"""

from __future__ import annotations

from collections.abc import Callable
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
        # EPLB in the background (the worker sets it): the layers of the move under way this
        # engine's transfer thread holds
        self.eplb_layers_held: Callable[[], int] | None = None

    def agree(self, sched: SchedulerOutput, busy: bool) -> StepAgreement:
        """This engine's step against every other's (collective)."""
        held = self.eplb_layers_held() if self.eplb_layers_held is not None else 0
        # one MAX for all: negated, the fewest layers held
        mine = torch.tensor([sched.num_scheduled_tokens, int(not sched.decode_only), int(busy),
                             int(not self.stopping), -held], dtype=torch.int64)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=self.group)
        tokens, not_decode, busy_anywhere, running_anywhere, fewest_held = mine.tolist()
        self.last = StepAgreement(int(tokens), not not_decode, bool(busy_anywhere), not running_anywhere,
                                  -int(fewest_held) if self.eplb_layers_held is not None else None)
        return self.last

    @property
    def others_may_be_busy(self) -> bool:
        """Whether the last agreement found work somewhere: an idle engine must not wait for its
        own input then, or every busy engine would wait for it."""
        return self.last.anyone_busy
