"""The model runner's half of pooling requests (pooling.py): one vector per prompt from the
final hidden states of the steps that computed it.

A prompt may be computed over several steps (chunked prefill): the mean and the first token's
state are kept between them, per request, as float32 rows on the device. A step hands back, for
each request whose prompt it finished, the raw pooled vector (a classifier's: its label scores,
model_runner.py runs the head); cutting it to its dimensions, the classifier's activation and
scaling to unit length happen on the host once the step's outputs are there (``finish``).
Every row kept is a copy: the hidden states may sit in a piecewise CUDA graph's output buffer,
which the next step overwrites.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pagoda_daemon.engine.scheduler_output import SchedulerOutput
from pagoda_daemon.pooling import PoolingParams


@dataclass
class PooledRows:
    """A step's pooled vectors on their way to the host: row j of ``vectors`` is request_ids[j]'s."""

    request_ids: list[str] = field(default_factory=list)
    params: list[PoolingParams] = field(default_factory=list)
    vectors: torch.Tensor | None = None  # [len(request_ids), hidden] float32

    def finish(self) -> dict[str, bytes]:
        """Each request's vector, cut, activated and scaled as it asked, as float32 little-endian
        bytes (the layout of OpenAI's base64 embeddings). Reads ``vectors`` on the host: call it
        after the step's event."""
        if self.vectors is None:
            return {}
        rows = self.vectors.numpy()
        out = {}
        for rid, params, row in zip(self.request_ids, self.params, rows, strict=True):
            vector = row[: params.dimensions] if params.dimensions else row
            if params.activation != "none":
                vector = activate(vector, params.activation)
            if params.normalize:
                norm = float(np.linalg.norm(vector))
                vector = vector / norm if norm > 0.0 else vector
            out[rid] = np.ascontiguousarray(vector, dtype="<f4").tobytes()
        return out


def activate(scores: np.ndarray, activation: str) -> np.ndarray:
    """A classifier's label scores through ``activation`` (pooling.ACTIVATIONS), in float32."""
    x = scores.astype(np.float32)
    if activation == "sigmoid":
        return np.exp(-np.logaddexp(np.float32(0.0), -x))  # 1 / (1 + e^-x), without overflow
    if activation == "softmax":
        e = np.exp(x - x.max())
        return e / e.sum()
    if activation == "tanh":
        return np.tanh(x)
    return x


class Pooler:
    """Pooling state between steps, per request."""

    def __init__(self) -> None:
        # mean: the sum of the rows computed so far; cls: the first token's row
        self._partial: dict[str, torch.Tensor] = {}

    def forget(self, request_id: str) -> None:
        self._partial.pop(request_id, None)

    def pool(self, sched: SchedulerOutput, hidden: torch.Tensor, query_starts: list[int]) -> PooledRows | None:
        """The vectors of the requests whose prompt this step finished, from the step's hidden
        states (row range query_starts[i]..query_starts[i + 1] is scheduled entry i's); None
        when the step finished none."""
        pooled = PooledRows()
        last_rows: list[int] = []
        others: list[tuple[int, torch.Tensor]] = []  # (index among the pooled, vector)
        for i, s in enumerate(sched.scheduled):
            params = s.request.pooling
            if params is None:
                continue
            rid = s.request.request_id
            lo, hi = query_starts[i], query_starts[i + 1]
            if params.type == "mean":
                part = hidden[lo:hi].sum(dim=0, dtype=torch.float32)
                self._partial[rid] = part if s.start == 0 else self._partial[rid] + part
            elif params.type == "cls" and s.start == 0:  # a copy: hidden may be a graph's buffer, reused next step
                self._partial[rid] = hidden[lo].to(torch.float32, copy=True)
            if not s.pools:
                continue
            pooled.request_ids.append(rid)
            pooled.params.append(params)
            if params.type == "last":
                last_rows.append(hi - 1)
                continue
            vector = self._partial.pop(rid)
            if params.type == "mean":
                vector = vector / s.request.num_tokens
            others.append((len(pooled.request_ids) - 1, vector))
        if not pooled.request_ids:
            return None
        vectors = torch.empty((len(pooled.request_ids), hidden.shape[1]), dtype=torch.float32, device=hidden.device)
        if last_rows:
            where = [j for j, p in enumerate(pooled.params) if p.type == "last"]
            index = torch.tensor(last_rows, device=hidden.device)
            vectors[torch.tensor(where, device=hidden.device)] = hidden.index_select(0, index).float()
        for j, vector in others:
            vectors[j] = vector
        pooled.vectors = vectors
        return pooled
