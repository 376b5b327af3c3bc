"""A step's inputs on their way from host to device, through preallocated buffers.

Every per-step input has a host buffer (pinned on a GPU) with a numpy view, written by the
runner's numpy code, and a device twin the model reads (the CUDA graphs read them in
place, so their addresses never change). On a CPU the host buffer is the device buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagoda_daemon.attention.backend import AttentionMetadata


class CpuGpuBuffer:
    """One input: ``host``/``np`` (this step's host half), ``device``, and on a GPU a ``spare``
    host half. On a GPU the host side is double-buffered (``flip()`` swaps the halves each
    step): with a step still running, its host-to-device copies may not have run yet, so the
    next step must not overwrite the memory they read. Two steps back is safe: the engine has
    waited for it."""

    __slots__ = ("device", "host", "np", "spare", "spare_np")

    def __init__(self, shape: int | tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        on_gpu, pin = device.type != "cpu", device.type == "cuda"
        self.host = torch.zeros(shape, dtype=dtype, pin_memory=pin)
        self.np: np.ndarray = self.host.numpy()
        self.device = torch.zeros(shape, dtype=dtype, device=device) if on_gpu else self.host
        self.spare: torch.Tensor | None = torch.zeros(shape, dtype=dtype, pin_memory=pin) if on_gpu else None
        self.spare_np: np.ndarray | None = self.spare.numpy() if self.spare is not None else None

    def flip(self) -> None:
        if self.spare is not None and self.spare_np is not None:
            self.host, self.np, self.spare, self.spare_np = self.spare, self.spare_np, self.host, self.np

    def to_device(self, n: int) -> torch.Tensor:
        """The first n entries on the device (one async copy; none on a CPU)."""
        if self.device is self.host:
            return self.host[:n]
        self.device[:n].copy_(self.host[:n], non_blocking=True)
        return self.device[:n]

    def fill(self, values) -> torch.Tensor:
        self.np[: len(values)] = values
        return self.to_device(len(values))


@dataclass
class StepInputs:
    """What ``prepare_inputs`` made for one step. On the CUDA-graph path the graph reads its
    inputs from the buffers in place, so ``input_ids``, ``positions`` and ``meta`` are None."""

    logits_indices: torch.Tensor  # rows of the hidden states whose logits are sampled
    sample_rows: list[int]  # indices into the scheduled requests that sample this step
    input_ids: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    meta: AttentionMetadata | None = None
    # eager steps: the rows the LM head runs on, logits_indices padded (step_shapes.py)
    lm_head_indices: torch.Tensor | None = None
    token_types: torch.Tensor | None = None  # for a model that takes them (BERT classifiers), per token row


class StagingBuffers:
    """The step's inputs, sized for the largest step."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, device: torch.device) -> None:
        self.device = device
        self._all: list[CpuGpuBuffer] = []
        self._max_seqs = max_seqs
        make = self._make
        self.input_ids = make(max_tokens, torch.int64)
        self.positions = make(max_tokens, torch.int64)
        self.slot_mapping = make(max_tokens, torch.int64)
        self.query_start_loc = make(max_seqs + 1, torch.int32)
        self.seq_lens = make(max_seqs, torch.int32)
        self.block_tables = make((max_seqs, max_blocks), torch.int32)
        self.logits_indices = make(max_seqs, torch.int64)
        # per-row sampling parameters
        self.temperature = make(max_seqs, torch.float32)
        self.top_k = make(max_seqs, torch.int64)
        self.top_p = make(max_seqs, torch.float32)
        self.min_p = make(max_seqs, torch.float32)
        self.presence_penalty = make(max_seqs, torch.float32)
        self.frequency_penalty = make(max_seqs, torch.float32)
        self.repetition_penalty = make(max_seqs, torch.float32)
        # LoRA: each token row's adapter slot (-1: the base model); lora/layers.py
        self.lora_slots = make(max_tokens, torch.int64)
        # a BERT classifier's token types (a text pair's second text: 1); models/bert.py
        self.token_types = make(max_tokens, torch.int64)
        # decode rows whose input token is the previous step's sample, still on the device
        self.pending_dst = make(max_seqs, torch.int64)
        self.pending_src = make(max_seqs, torch.int64)
        self.penalty_tokens: dict[str, CpuGpuBuffer] = {}  # prompt/output token matrices, made on first use

    def _make(self, shape: int | tuple[int, ...], dtype: torch.dtype) -> CpuGpuBuffer:
        buf = CpuGpuBuffer(shape, dtype, self.device)
        self._all.append(buf)
        return buf

    def token_matrix(self, name: str, rows: list[list[int]], pad: int, max_len: int) -> torch.Tensor:
        """Rows of token ids padded with `pad`, through a reusable buffer of max_len columns."""
        if name not in self.penalty_tokens:
            self.penalty_tokens[name] = self._make((self._max_seqs, max_len), torch.int64)
        buf = self.penalty_tokens[name]
        width = max(1, max(len(r) for r in rows))
        buf.np[: len(rows), :width] = pad
        for i, r in enumerate(rows):
            buf.np[i, : len(r)] = r
        if buf.device is buf.host:
            return buf.host[: len(rows), :width]
        buf.device[: len(rows), :width].copy_(buf.host[: len(rows), :width], non_blocking=True)
        return buf.device[: len(rows), :width]

    def flip(self) -> None:
        """Switch every host buffer to its other half (a no-op on CPU; see CpuGpuBuffer)."""
        for buf in self._all:
            buf.flip()
