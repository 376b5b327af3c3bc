"""LoRA on the GPU: every adapted projection holds ``max_loras`` adapter slots, and each token
of a step picks one (or none) through a one-hot mask shared by every layer.

For a projection of k merged parts (q/k/v: 3, gate/up: 2, else 1), S slots of rank R:

    shrink = x @ A^T                       [T, k·S·R]   A: every slot's A of every part, stacked
    shrink *= mask (per token, its slot)   [T, k, S, R] zero outside the token's own slot
    out[:, part j] += shrink[:, j] @ B_j   [T, S·R] @ [S·R, out_j]

Dense and of fixed shape, so CUDA graphs (decode and piecewise) capture it once and replay it
for any mix of adapters: the mask and the slots' weights are buffers updated in place. The
price is computing every slot for every token, about 2·S·R/in of a projection's arithmetic,
plus the small GEMMs' own cost. On one H200 (Qwen3-0.6B shape, 4 slots of rank 16), 0.74 of
the throughput without LoRA, adapters used or not. In the same call vLLM 0.26.0's LoRA kept
0.76 of its own, and served 20,391 output tokens/s under adapters to Pagoda's 23,096
(docs/benchmarks/2026-12-01-lora-beside-vllm-h200.md). A token without an adapter has an
all-zero mask row and gets exactly the base output.

Under tensor parallelism each rank holds the slice of A and B that matches its slice of the
base weight: a column-parallel projection's B rows (A whole), a row-parallel projection's A
columns (B whole); the row-parallel delta is a partial product summed with the base's.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pagoda_daemon.lora.adapter import LoRAAdapter, read_adapter
from pagoda_daemon.lora.request import LoRARequest
from pagoda_daemon.models.layers import Linear, MergedLinear, RowParallelLinear

log = logging.getLogger(__name__)

# The projections of a decoder layer that take adapters, by the model's module name, and the
# checkpoint projections each holds.
ADAPTED = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"), "self_attn.o_proj": ("o_proj",),
           "mlp.gate_up_proj": ("gate_proj", "up_proj"), "mlp.down_proj": ("down_proj",)}


@dataclass(frozen=True)
class _Part:
    projection: str  # the checkpoint's name inside the layer: q_proj, down_proj, ...
    out_offset: int  # where its rows sit in the projection's output
    rows: tuple[int, int]  # (first row, count) of the checkpoint's output rows this rank holds


class LoRASlots:
    """The adapter slots of one projection (see the module docstring). Not a module: its
    tensors are no parameters of the model, which loads, shards and moves without them."""

    def __init__(self, linear: Linear, module_prefix: str, parts: tuple[str, ...], num_slots: int, max_rank: int,
                 mask: torch.Tensor) -> None:
        weight = linear.weight
        out_features, in_features = weight.shape
        self.prefix = module_prefix  # model.layers.3.self_attn.
        self.num_slots, self.max_rank = num_slots, max_rank
        self.parts = self._parts(linear, parts, out_features)
        # a row-parallel projection's input columns: (first, count) of the checkpoint's
        self.cols = getattr(linear, "checkpoint_cols", None) if isinstance(linear, RowParallelLinear) else None
        k = len(self.parts)
        dtype, device = weight.dtype, weight.device
        self.a = torch.zeros(k * num_slots * max_rank, in_features, dtype=dtype, device=device)
        self.b = [torch.zeros(num_slots * max_rank, out_features if k == 1 else rows[1], dtype=dtype, device=device)
                  for rows in (p.rows for p in self.parts)]
        self.mask = mask  # [max tokens, slots], shared by every projection of the model

    @staticmethod
    def _parts(linear: Linear, parts: tuple[str, ...], out_features: int) -> tuple[_Part, ...]:
        if isinstance(linear, MergedLinear):
            return tuple(_Part(p, linear.shard_offsets[p][0], linear.checkpoint_rows[p][:2]) for p in parts)
        (only,) = parts
        return (_Part(only, 0, (0, out_features)),)

    def add_delta(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """out += the adapters' product of x, each token's own slot's; out [T, out], x [T, in]."""
        t, k, s, r = x.shape[0], len(self.parts), self.num_slots, self.max_rank
        shrink = F.linear(x, self.a).view(t, k, s, r) * self.mask[:t].view(t, 1, s, 1)
        shrink = shrink.view(t, k, s * r)
        if k == 1:
            return out.addmm_(shrink[:, 0], self.b[0])
        for j, part in enumerate(self.parts):
            size = self.b[j].shape[1]
            out[:, part.out_offset : part.out_offset + size].addmm_(shrink[:, j], self.b[j])
        return out

    @torch.no_grad()
    def load(self, slot: int, weights_by_module: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Fill ``slot`` with this projection's share of an adapter's weights (A and scaled B of
        each module, on this device; zeros where it has none)."""
        s, r = self.num_slots, self.max_rank
        for j, part in enumerate(self.parts):
            a_rows = self.a[(j * s + slot) * r : (j * s + slot + 1) * r]
            b_rows = self.b[j][slot * r : (slot + 1) * r]
            a_rows.zero_()
            b_rows.zero_()
            weights = weights_by_module.get(self.prefix + part.projection)
            if weights is None:
                continue
            a, b = weights  # [rank, in], [out, rank]
            if self.cols is not None:
                a = a[:, self.cols[0] : self.cols[0] + self.cols[1]]
            start, count = part.rows
            rank = a.shape[0]
            a_rows[:rank].copy_(a)
            b_rows[:rank].copy_(b[start : start + count].t())


class LoRAModelManager:
    """The adapters of one worker's model: the slots of every adapted projection, the mask that
    picks a slot per token, and which adapter each slot holds. The scheduler decides which
    adapter goes in which slot (lora/slots.py); every rank loads what it is told."""

    def __init__(self, model: nn.Module, model_config, max_loras: int, max_rank: int, max_tokens: int,
                 device: torch.device) -> None:
        self.model_config = model_config
        self.max_loras, self.max_rank = max_loras, max_rank
        # adapters read from disk, kept on the host while slots come and go (each is a file read)
        self._host: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self._host_limit = 2 * max_loras
        dtype = next(model.parameters()).dtype
        self.mask = torch.zeros(max_tokens, max_loras, dtype=dtype, device=device)
        self._slot_ids = torch.arange(max_loras, device=device)
        self.slots: list[LoRASlots] = []
        for name, module in model.named_modules():
            head, _, tail = name.rpartition(".layers.")
            index, _, projection = tail.partition(".")
            if not head or not index.isdigit() or projection not in ADAPTED or not isinstance(module, Linear):
                continue
            prefix = f"{head}.layers.{index}.{projection.rsplit('.', 1)[0]}."
            slots = LoRASlots(module, prefix, ADAPTED[projection], max_loras, max_rank, self.mask)
            module.lora = slots
            self.slots.append(slots)
        self.held: list[str | None] = [None] * max_loras  # the digest in each slot

    def load(self, slot: int, lora: LoRARequest) -> None:
        """Put the adapter in ``slot`` (a copy into the slot after the steps already launched,
        on the same stream: they read what the slot held when they ran)."""
        adapter = self._read(lora)
        on_device = _to_device(adapter, self.mask.device)
        for slots in self.slots:
            slots.load(slot, on_device)
        self.held[slot] = adapter.digest

    def _read(self, lora: LoRARequest) -> LoRAAdapter:
        adapter = self._host.get(lora.digest)
        if adapter is None:
            # (values unchecked: a digest that matches means the files checked at registration)
            adapter = read_adapter(lora.name, lora.path, self.model_config, self.max_rank, check_values=False)
            if adapter.digest != lora.digest:  # registered, then changed on disk: serve nothing wrong
                raise RuntimeError(f"adapter {lora.name!r} at {lora.path} changed on disk after it was registered "
                                   "(its files no longer match their digest); register it again under a new name")
            log.info("LoRA adapter %r (rank %d) read from %s", lora.name, adapter.rank, lora.path)
            self._host[lora.digest] = adapter
            while len(self._host) > self._host_limit:
                self._host.popitem(last=False)
        self._host.move_to_end(lora.digest)
        return adapter

    def set_token_slots(self, token_slots: torch.Tensor) -> None:
        """The step's token rows' slots (-1: none), on the device: their rows of the mask."""
        self.mask[: token_slots.shape[0]].copy_(token_slots.unsqueeze(1) == self._slot_ids)


# Tensor bytes start at multiples of this in the packed buffer, so that each can be viewed in its dtype.
_ALIGN = 16


def _to_device(adapter: LoRAAdapter, device: torch.device) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Every A and scaled B of the adapter on ``device``, float32: their bytes packed (by numpy)
    into one host buffer and copied in one transfer, then cast and scaled there. Torch's host
    kernels are what an engine process must avoid: on an H200 host, inside a serving engine,
    each took milliseconds (a finite check of an adapter's 392 tensors 3.9 s, padding them into
    one buffer with torch 3.2 s, where a fresh process did the check in 0.1 s; 2026-12-01,
    Qwen3-0.6B shape, rank 16)."""
    layout: list[tuple[str, int, torch.Tensor, float]] = []
    offset = 0
    for module, w in adapter.weights.items():
        for tensor, scale in ((w.raw_a, 1.0), (w.raw_b, w.scale)):
            layout.append((module, offset, tensor, scale))
            offset += -(-tensor.numel() * tensor.element_size() // _ALIGN) * _ALIGN
    packed = np.empty(offset, dtype=np.uint8)
    for _, start, tensor, _ in layout:
        raw = tensor.contiguous().view(-1).view(torch.uint8).numpy()
        packed[start : start + raw.size] = raw
    on_device = torch.from_numpy(packed).to(device)
    out: dict[str, list[torch.Tensor]] = {}
    for module, start, tensor, scale in layout:
        size = tensor.numel() * tensor.element_size()
        value = on_device[start : start + size].view(tensor.dtype).view(tensor.shape).to(torch.float32)
        out.setdefault(module, []).append(value * scale if scale != 1.0 else value)
    return {module: (a, b) for module, (a, b) in out.items()}
