"""The all-to-all dispatch and combine of data-parallel attention (distributed/token_dispatch.py),
over gloo with three ranks: every token's outputs come back summed from the ranks holding its
experts, each rank receiving only the tokens that have an expert there, a rank without tokens
sending none. The engine-level parity with the one-process engine is in test_data_parallel.py
(``eplb-alltoallv``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.processes import warm_start_method

SIZE, SLOTS_PER_RANK, TOP_K, HIDDEN = 3, 4, 3, 8
ROWS = [7, 0, 12]  # the middle rank lends its experts only


def _inputs(rank: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + rank)
    rows = ROWS[rank]
    x = torch.randn(rows, HIDDEN, generator=g)
    slots = torch.stack([torch.randperm(SIZE * SLOTS_PER_RANK, generator=g)[:TOP_K] for _ in range(rows)]) \
        if rows else torch.empty((0, TOP_K), dtype=torch.int64)
    weights = torch.rand(rows, TOP_K, generator=g)
    return x, weights, slots


def _experts(x: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor, rank: int | None) -> torch.Tensor:
    """Slot s multiplies by s + 1; only ``rank``'s slots count (None: every slot)."""
    mine = torch.ones_like(slots, dtype=torch.bool) if rank is None else slots // SLOTS_PER_RANK == rank
    scale = (weights * (slots + 1) * mine).sum(dim=1, keepdim=True)
    return x * scale


def _rank(rank: int, init: str, seed: int, out: str) -> None:
    import torch.distributed as dist

    from pagoda_daemon.distributed import token_dispatch

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=SIZE)
    x, weights, slots = _inputs(rank, seed)
    padded = torch.cat([x, torch.randn(3, HIDDEN)])  # padding rows after the real ones: never sent
    sent = token_dispatch.dispatch(x, weights, slots, SLOTS_PER_RANK, dist.group.WORLD, SIZE)
    computed = _experts(sent.x, sent.weights, sent.slots, rank)
    combined = token_dispatch.combine(sent, computed, padded.shape[0], dist.group.WORLD)
    dist.destroy_process_group()
    Path(out).write_text(json.dumps({"combined": combined.tolist(), "received": sent.received_counts,
                                     "sent": sent.sent_counts, "received_slots": sent.slots.tolist()}))


def test_each_token_reaches_only_the_ranks_holding_its_experts_and_its_outputs_come_back_summed(tmp_path):
    import torch.multiprocessing as mp

    seed = int(torch.randint(0, 2**31, ()).item())
    ctx = mp.get_context(warm_start_method())
    init = f"file://{tmp_path / 'rdv'}"
    procs = [ctx.Process(target=_rank, args=(r, init, seed, str(tmp_path / f"{r}.json"))) for r in range(SIZE)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0] * SIZE
    results = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(SIZE)]
    for rank, result in enumerate(results):
        x, weights, slots = _inputs(rank, seed)
        combined = torch.tensor(result["combined"]).reshape(-1, HIDDEN)
        torch.testing.assert_close(combined[: ROWS[rank]], _experts(x, weights, slots, None))
        assert not combined[ROWS[rank]:].any(), "padding rows get no output"
        # rows sent to each rank: this rank's tokens with at least one expert there, once each
        ranks = slots // SLOTS_PER_RANK
        assert result["sent"] == [int((ranks == r).any(dim=1).sum()) for r in range(SIZE)]
        assert result["received"] == [results[src]["sent"][rank] for src in range(SIZE)]
        received_slots = torch.tensor(result["received_slots"]).reshape(-1, TOP_K)
        assert ((received_slots // SLOTS_PER_RANK) == rank).any(dim=1).all()
    assert results[1]["sent"] == [0, 0, 0]
