"""Fused MoE: routing, moe_align, grouped GEMM and the whole MoE against their twins, and
the twins against the engine's Qwen3-MoE code. GEMMs in float16/float32 on CPU (the
interpreter's bfloat16 dot is wrong; the GPU suite covers bfloat16)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.interp import assert_close, poisoned, randint, randn

from pagoda_kernels.fused_moe import fused_moe, grouped_gemm, moe, moe_align, route_topk  # isort: skip
from pagoda_kernels.reference import grouped_gemm_ref, moe_ref, route_topk_ref  # isort: skip

SMALL = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 2, "num_warps": 4, "num_stages": 1}


@pytest.mark.parametrize(("experts", "top_k", "renormalize"), [(8, 2, True), (12, 3, False), (64, 8, True), (5, 1, True)])
def test_route_topk_matches_twin(gen, experts, top_k, renormalize):
    logits = randn(gen, randint(gen, 1, 20, 1)[0], experts, scale=2.0)
    weights, ids = route_topk(logits, top_k, renormalize)
    ref_w, ref_ids = route_topk_ref(logits, top_k, renormalize)
    assert torch.equal(ids.long(), ref_ids)
    torch.testing.assert_close(weights, ref_w, atol=1e-6, rtol=1e-5)


def test_the_engine_routes_and_runs_experts_with_the_twins():
    """One implementation: the model's MoE path is the kernels' reference twin itself."""
    from pagoda_daemon.models import qwen3_moe

    assert qwen3_moe.route_topk is route_topk_ref
    assert qwen3_moe.moe_reference is moe_ref


@pytest.mark.parametrize("block_m", [4, 16])
def test_moe_align_pads_and_sorts(gen, block_m):
    tokens, experts, top_k = randint(gen, 1, 30, 1)[0], 10, 3
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    sorted_ids, expert_ids, num_padded = moe_align(ids, experts, block_m)
    n = tokens * top_k
    total = int(num_padded)
    assert total % block_m == 0 and total <= sorted_ids.numel() and sorted_ids.numel() % block_m == 0
    assert expert_ids.numel() == sorted_ids.numel() // block_m
    real = sorted_ids[:total]
    assert sorted(real[real < n].tolist()) == list(range(n))  # every row exactly once
    assert (sorted_ids[total:] == n).all()
    flat = ids.flatten()
    for tile in range(total // block_m):
        rows = real[tile * block_m:(tile + 1) * block_m]
        rows = rows[rows < n].long()
        assert rows.numel() > 0 and (flat[rows] == expert_ids[tile]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_grouped_gemm_writes_every_row(gen, dtype):
    tokens, experts, top_k, n, k = randint(gen, 3, 25, 1)[0], 6, 2, 40, 72
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    a = randn(gen, tokens, k, dtype=dtype)
    b = randn(gen, experts, n, k, dtype=dtype, scale=0.2)
    weights = torch.rand(tokens, top_k, generator=gen) + 0.1
    sorted_ids, expert_ids, num_padded = moe_align(ids, experts, SMALL["BLOCK_M"])
    out = poisoned((tokens * top_k, n), dtype)
    grouped_gemm(a, b, out, sorted_ids, expert_ids, num_padded, top_k, SMALL["BLOCK_M"],
                 topk_weights=weights.flatten(), config=SMALL)
    ref = grouped_gemm_ref(a, b, ids, top_k, weights)
    assert_close(out, ref, 1e-5 if dtype == torch.float32 else 2e-3)


@pytest.mark.parametrize(("dtype", "experts", "top_k", "hidden", "inter"),
                         [(torch.float32, 8, 2, 64, 48), (torch.float16, 16, 4, 96, 40)])
def test_fused_moe_matches_twin(gen, dtype, experts, top_k, hidden, inter):
    tokens = randint(gen, 1, 24, 1)[0]
    x = randn(gen, tokens, hidden, dtype=dtype)
    w13 = randn(gen, experts, 2 * inter, hidden, dtype=dtype, scale=hidden**-0.5)
    w2 = randn(gen, experts, hidden, inter, dtype=dtype, scale=inter**-0.5)
    logits = randn(gen, tokens, experts)
    out = moe(x, logits, w13, w2, top_k, True, config=SMALL)
    w, ids = route_topk_ref(logits, top_k, True)
    assert_close(out, moe_ref(x, w13, w2, w, ids), 1e-5 if dtype == torch.float32 else 3e-3)
    # the default (decode-sized) config too
    out = fused_moe(x, w13, w2, w, ids)
    assert_close(out, moe_ref(x, w13, w2, w, ids), 1e-5 if dtype == torch.float32 else 3e-3)
    # into a given buffer (the all-reduce's slot under tensor parallelism): every element
    # written there, nothing past it
    buffer = poisoned((tokens * hidden + 7,), dtype)
    into = buffer[:tokens * hidden].view(tokens, hidden)
    assert fused_moe(x, w13, w2, w, ids, SMALL, out=into) is into
    assert_close(into, moe_ref(x, w13, w2, w, ids), 1e-5 if dtype == torch.float32 else 3e-3)
    assert buffer[tokens * hidden:].isnan().all()


def test_prompt_sized_steps_take_the_large_tiles_and_match_the_twin(gen):
    """From LARGE_TILE_ROWS_PER_EXPERT rows an expert (counted over every rank's experts) 16-bit
    GEMMs take 128 x 256 tiles; float32 (FMAs, the correctness path) and fewer rows keep theirs."""
    from pagoda_kernels.fused_moe import LARGE_TILE_ROWS_PER_EXPERT, _gemm_config

    large = LARGE_TILE_ROWS_PER_EXPERT
    assert _gemm_config(large * 128, 1536, 2048, 128, torch.bfloat16)["BLOCK_M"] == 128
    assert _gemm_config(large * 128 - 8, 1536, 2048, 128, torch.bfloat16)["BLOCK_M"] == 64
    assert _gemm_config(large * 128, 1536, 2048, 128, torch.float32)["BLOCK_M"] == 64
    tokens, experts, top_k, hidden, inter = 2 * large + 3, 2, 1, 64, 48  # a ragged last tile
    assert _gemm_config(tokens * top_k, 2 * inter, hidden, experts, torch.float16)["BLOCK_N"] == 256
    x = randn(gen, tokens, hidden, dtype=torch.float16)
    w13 = randn(gen, experts, 2 * inter, hidden, dtype=torch.float16, scale=hidden**-0.5)
    w2 = randn(gen, experts, hidden, inter, dtype=torch.float16, scale=inter**-0.5)
    logits = randn(gen, tokens, experts)
    w, ids = route_topk_ref(logits, top_k, True)
    assert_close(moe(x, logits, w13, w2, top_k, True), moe_ref(x, w13, w2, w, ids), 3e-3)


@pytest.mark.parametrize(("dtype", "groups"), [(torch.float32, 2), (torch.float16, 4)])
def test_expert_parallel_shards_sum_to_the_whole_moe(gen, dtype, groups):
    """Each expert-parallel rank runs only its experts (tokens routed elsewhere add nothing);
    the ranks' outputs summed (the all-reduce) are the whole MoE, kernel and twin alike."""
    from pagoda_kernels.reference import local_expert_ids

    experts, top_k, hidden, inter = 8, 2, 64, 48
    tokens = randint(gen, 1, 24, 1)[0]
    x = randn(gen, tokens, hidden, dtype=dtype)
    w13 = randn(gen, experts, 2 * inter, hidden, dtype=dtype, scale=hidden**-0.5)
    w2 = randn(gen, experts, hidden, inter, dtype=dtype, scale=inter**-0.5)
    logits = randn(gen, tokens, experts)
    w, ids = route_topk_ref(logits, top_k, True)
    whole = moe_ref(x, w13, w2, w, ids)
    per = experts // groups
    kernel_sum = torch.zeros_like(whole)
    twin_sum = torch.zeros_like(whole)
    for g in range(groups):
        mine = slice(g * per, (g + 1) * per)
        kernel_sum += moe(x, logits, w13[mine].contiguous(), w2[mine].contiguous(), top_k, True,
                          first_expert=g * per, config=SMALL)
        twin_sum += moe_ref(x, w13[mine], w2[mine], w, local_expert_ids(ids, g * per, per))
    tol = 1e-5 if dtype == torch.float32 else 3e-3
    assert_close(kernel_sum, whole, tol)
    assert_close(twin_sum, whole, tol)
    # int64 global ids, as EPLB's slot tables give them, straight to fused_moe
    slot_sum = sum(fused_moe(x, w13[g * per:(g + 1) * per].contiguous(), w2[g * per:(g + 1) * per].contiguous(),
                             w, ids.long(), SMALL, first_expert=g * per).float() for g in range(groups))
    assert_close(slot_sum.to(dtype), whole, tol)


@pytest.mark.parametrize("first", [0, 3])
def test_moe_align_leaves_out_the_experts_of_other_ranks(gen, first):
    """This rank holds experts first .. first + 3: rows routed to any other expert (or -1) are
    in no tile; the tiles name local experts."""
    tokens, experts, top_k, block_m = 13, 4, 2, 4
    ids = torch.stack([torch.randperm(10, generator=gen)[:top_k] for _ in range(tokens)]) - 1
    sorted_ids, expert_ids, num_padded = moe_align(ids, experts, block_m, first_expert=first)
    n = tokens * top_k
    real = sorted_ids[: int(num_padded)]
    local = ids.flatten() - first
    mine = (local >= 0) & (local < experts)
    assert sorted(real[real < n].tolist()) == [r for r in range(n) if mine[r]]
    assert (sorted_ids[int(num_padded):] == n).all()
    for tile in range(int(num_padded) // block_m):
        rows = real[tile * block_m:(tile + 1) * block_m]
        rows = rows[rows < n].long()
        assert rows.numel() > 0 and (local[rows] == expert_ids[tile]).all()


@pytest.mark.parametrize("tokens", [400, 700])  # 3,200 rows: one launch; 5,600: the three kernels
@pytest.mark.parametrize("first", [0, 160])  # the first or the second of two expert-parallel ranks
def test_moe_align_many_rows_and_experts(gen, tokens, first):
    """Several blocks of rows and 160 experts on this rank of 320: each expert's run holds exactly
    its rows (in any order) and then padding, the padded total is the sum of the padded runs, and
    no row routed to the other rank's experts is anywhere."""
    from pagoda_kernels.fused_moe import SMALL_MAX_ROWS

    experts, top_k, block_m = 160, 8, 16
    assert (tokens * top_k <= SMALL_MAX_ROWS) == (tokens == 400)
    ids = torch.stack([torch.randperm(2 * experts, generator=gen)[:top_k] for _ in range(tokens)]).int()
    sorted_ids, expert_ids, num_padded = moe_align(ids, experts, block_m, first_expert=first)
    local = ids.flatten().long() - first
    mine = (local >= 0) & (local < experts)
    counts = torch.bincount(local[mine], minlength=experts)
    assert int(num_padded) == int(((counts + block_m - 1) // block_m * block_m).sum())
    ends = ((counts + block_m - 1) // block_m * block_m).cumsum(0)
    real = sorted_ids[: int(num_padded)]
    assert torch.equal(real[real < local.numel()].long().sort().values, mine.nonzero().flatten())
    assert (sorted_ids[int(num_padded):] == local.numel()).all()
    for e in torch.randint(0, experts, (12,), generator=gen).tolist():
        begin = int(ends[e - 1]) if e else 0
        run = sorted_ids[begin:int(ends[e])]
        want = (local == e).nonzero().flatten()
        got = run[: want.numel()].long()
        assert torch.equal(got if tokens == 400 else got.sort().values, want)  # one launch keeps row order
        assert (run[want.numel():] == local.numel()).all()
        assert (expert_ids[begin // block_m:int(ends[e]) // block_m] == e).all()


def test_moe_align_of_no_rows():
    sorted_ids, expert_ids, num_padded = moe_align(torch.empty((0, 2), dtype=torch.int32), 4, 16)
    assert sorted_ids.numel() == 0 and expert_ids.numel() == 0 and int(num_padded) == 0


def test_the_models_moe_layer_on_the_kernels_matches_its_torch_path(gen, tiny_models):
    """The path the engine runs on a GPU (`SparseMoE(kernels=True)`: the routing kernel, then
    `fused_moe` sized by every rank's experts) against the layer's own torch path."""
    from pagoda_daemon.models.loader import load_config
    from pagoda_daemon.models.qwen3_moe import SparseMoE

    config = load_config(tiny_models["qwen3_moe"])
    torch_path, kernel_path = SparseMoE(config), SparseMoE(config, kernels=True)
    for p in torch_path.parameters():
        p.data = randn(gen, *p.shape, scale=p.shape[-1] ** -0.5)
    kernel_path.load_state_dict(torch_path.state_dict())
    x = randn(gen, randint(gen, 1, 40, 1)[0], config.hidden_size)
    with torch.inference_mode():
        assert_close(kernel_path(x), torch_path(x), 1e-5)
