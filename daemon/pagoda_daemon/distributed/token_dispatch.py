"""Data-parallel attention's other dispatch and combine: each token sent only to the ranks that
hold one of its experts, by all-to-all with per-rank row counts (``--all2all-backend alltoallv``).

With the experts spread over data-parallel engines (parallel_state.TensorParallel.spread_tokens),
every MoE layer must bring each engine's tokens to the experts they were routed to and their
outputs back. The default, ``allgather_reducescatter`` (vLLM's default too), gathers every
engine's rows, padding included, to every rank, and reduce-scatters the outputs: a fixed shape,
so decode steps can be captured in CUDA graphs. This module's form routes each engine's real
rows where they are (the router is replicated), sends a rank only the tokens that have an
expert there, with their top-k weights and expert slots, and sends each rank's partial outputs
back to the token's engine, which sums them. It skips padding rows (an idle engine's whole step,
a short step's share of a long one's) and, with more than two ranks, the tokens a rank's experts
do not see; in exchange, every layer waits once on the host for the row counts, so it runs in
passes that every engine runs eagerly (``ModelRunner._moe_dispatch``): where one engine replays
a CUDA graph, which holds the gather, the others gather too, as the collectives must match.

Both run on NCCL (GPUs) and gloo (CPU, where CI proves that the answers are the same).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class StepRows:
    """The real token rows of this engine's step, shared by its MoE layers: set by the model
    runner around a forward pass that every engine runs eagerly (0 for an engine that only lends
    its experts); None otherwise (CUDA graphs, their capture, warm-up): the layers gather."""

    rows: int | None = None


@dataclass
class Dispatched:
    """What a rank received to run its experts on, and how to send the outputs back."""

    x: torch.Tensor  # [received rows, hidden]: tokens of every engine that have an expert here
    weights: torch.Tensor  # [received rows, top_k] float32
    slots: torch.Tensor  # [received rows, top_k] int64: the expert slots of the replica (others' too)
    token_of_sent_row: torch.Tensor  # [sent rows]: which of this engine's rows each sent row was
    sent_counts: list[int]  # rows sent to each rank
    received_counts: list[int]  # rows received from each rank


def dispatch(x: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor, slots_per_rank: int,
             group, size: int) -> Dispatched:
    """Send each of ``x``'s rows, once, to every rank holding one of its ``slots`` (rank r holds
    slots ``r·slots_per_rank ..``), with its top-k weights and slots (collective: every rank of
    ``group`` calls it at the same layer)."""
    rows, hidden = x.shape
    ranks = torch.div(slots, slots_per_rank, rounding_mode="floor").long()
    needs = torch.zeros((size, rows), dtype=torch.bool, device=x.device)
    if rows:
        needs[ranks.t().reshape(-1), torch.arange(rows, device=x.device).repeat(slots.shape[1])] = True
    token_of_sent_row = needs.nonzero()[:, 1]  # grouped by rank, in token order within each
    counts = needs.sum(dim=1)
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)
    sent_counts, received_counts = torch.stack([counts, received]).tolist()  # the one wait on the host
    meta = torch.cat([weights.float(), slots.float()], dim=1)  # slots are exact in float32 below 2**24
    x_in = x.new_empty((sum(received_counts), hidden))
    meta_in = meta.new_empty((sum(received_counts), meta.shape[1]))
    dist.all_to_all_single(x_in, x[token_of_sent_row].contiguous(), received_counts, sent_counts, group=group)
    dist.all_to_all_single(meta_in, meta[token_of_sent_row].contiguous(), received_counts, sent_counts, group=group)
    top_k = slots.shape[1]
    return Dispatched(x_in, meta_in[:, :top_k].contiguous(), meta_in[:, top_k:].long(), token_of_sent_row,
                      sent_counts, received_counts)


def combine(sent: Dispatched, outputs: torch.Tensor, rows: int, group) -> torch.Tensor:
    """``outputs`` (this rank's experts on the rows it received) back to their engines, each
    engine's rows summed over the ranks that computed them: ``[rows, hidden]`` (collective)."""
    back = outputs.new_empty((len(sent.token_of_sent_row), outputs.shape[1]))
    dist.all_to_all_single(back, outputs.contiguous(), sent.sent_counts, sent.received_counts, group=group)
    out = torch.zeros((rows, outputs.shape[1]), dtype=outputs.dtype, device=outputs.device)
    return out.index_add_(0, sent.token_of_sent_row, back)
