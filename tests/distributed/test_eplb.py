"""The EPLB placement algorithm and move plans (the weights moving between real ranks is
tests/distributed/test_tensor_parallel.py's EPLB test)."""

from __future__ import annotations

import random

import pytest

from pagoda_daemon.distributed.eplb import initial_placement, move_plan, rank_loads, rebalance, replica_table
from pagoda_daemon.distributed.layout import check_layout
from pagoda_daemon.models.loader import load_config


@pytest.mark.parametrize(("experts", "ranks", "redundant"), [(8, 2, 0), (8, 2, 2), (16, 4, 4), (128, 8, 32)])
def test_rebalance_places_every_expert_evenly(experts, ranks, redundant):
    rng = random.Random(experts * 31 + ranks + redundant)
    load = [rng.paretovariate(1.2) for _ in range(experts)]  # a few hot experts, as routers make them
    slots = (experts + redundant) // ranks
    old = initial_placement(experts, ranks, slots)
    new = rebalance(load, old, ranks, slots)
    assert sorted(set(new)) == list(range(experts)) and len(new) == ranks * slots
    for r in range(ranks):  # no rank holds two copies of one expert
        mine = new[r * slots:(r + 1) * slots]
        assert len(set(mine)) == len(mine)
    hottest = max(range(experts), key=load.__getitem__)
    if redundant:
        assert new.count(hottest) > 1  # the hottest expert got a copy
    before, after = rank_loads(old, load, ranks, slots), rank_loads(new, load, ranks, slots)
    assert max(after) - min(after) <= max(before) - min(before)
    biggest_share = max(load[e] / new.count(e) for e in range(experts))
    assert max(after) - min(after) <= biggest_share + 1e-9  # greedy packing: within one item


def test_a_balanced_placement_is_left_where_it_is():
    load = [1.0] * 8
    old = initial_placement(8, 2, 4)
    assert rebalance(load, old, 2, 4) == old and move_plan(old, old, 4) == []


@pytest.mark.parametrize("seed", range(5))
def test_move_plan_turns_the_old_placement_into_the_new(seed):
    rng = random.Random(seed)
    experts, ranks, slots = 12, 3, 5
    old = initial_placement(experts, ranks, slots)
    new = rebalance([rng.random() * 10 for _ in range(experts)], old, ranks, slots)
    moved = list(old)
    for dest, src in move_plan(old, new, slots):
        assert old[src] == new[dest]  # each slot filled from a slot that held the expert before
        moved[dest] = old[src]
    assert moved == new


def test_replica_table_has_a_fixed_width_and_refuses_a_missing_expert():
    table, counts = replica_table([0, 1, 2, 0], 3, width=3)
    assert table.tolist() == [[0, 3, 0], [1, 1, 1], [2, 2, 2]] and counts.tolist() == [2, 1, 1]
    with pytest.raises(ValueError, match="every expert"):
        replica_table([0, 0, 1, 1], 3, width=2)


@pytest.mark.parametrize(("arch", "expert", "eplb", "redundant", "message"), [
    ("qwen3_moe", 1, True, 0, "enable_eplb needs a mixture-of-experts model and expert_parallel_size of 2"),
    ("llama", 2, True, 0, "enable_eplb needs"),
    ("qwen3_moe", 2, False, 2, "num_redundant_experts needs enable_eplb"),
    ("qwen3_moe", 2, True, 1, r"experts \(8\) plus num_redundant_experts \(1\) is not divisible"),
    ("qwen3_moe", 2, True, 10, r"num_redundant_experts \(10\) is more than experts × \(expert_parallel_size - 1\) = 8"),
])
def test_eplb_settings_the_model_cannot_take_are_refused(tiny_models, arch, expert, eplb, redundant, message):
    with pytest.raises(ValueError, match=message):
        check_layout(load_config(tiny_models[arch]), 1, expert, eplb, redundant)


@pytest.mark.parametrize(("engines", "redundant", "message"), [
    (2, 1, r"experts \(8\) plus num_redundant_experts \(1\) is not divisible by data_parallel_size 2"),
    (2, 9, r"num_redundant_experts \(9\) is more than experts × \(data_parallel_size - 1\) = 8"),
    (3, 0, r"experts \(8\) is not divisible by data_parallel_size 3"),
])
def test_eplb_over_data_parallel_engines_takes_their_number_for_the_ranks(tiny_models, engines, redundant, message):
    """With the experts spread over the engines (data_experts) the balancer's ranks are the engines."""
    config = load_config(tiny_models["qwen3_moe"])
    check_layout(config, 1, 1, True, 2, data_experts=2)  # the CPU test's layout
    with pytest.raises(ValueError, match=message):
        check_layout(config, 1, 1, True, redundant, data_experts=engines)


@pytest.mark.parametrize("spread", [False, True])
def test_a_moe_layer_counts_the_load_of_its_real_rows_only(tiny_models, spread):
    """Padding rows (CUDA-graph sizes, the token grid, an idle data-parallel engine's rows) route
    too; only the step's own tokens count toward the next placement, and with data-parallel
    attention only this engine's share of the gathered rows, so the sum over engines counts
    each token once."""
    import torch

    from pagoda_daemon.distributed.parallel_state import TensorParallel
    from pagoda_daemon.models.qwen3_moe import SparseMoE

    tp = TensorParallel(1, 2, None, expert_groups=2, eplb=True, redundant_experts=2, replicated_dense=spread,
                        spread_tokens=spread)
    layer = SparseMoE(load_config(tiny_models["qwen3_moe"]), tp=tp)
    rows_per_engine, real = 6, 4
    rows = 2 * rows_per_engine if spread else rows_per_engine
    ids = torch.randint(0, layer.num_experts, (rows, layer.top_k))
    layer._slot_ids(ids)  # no counted_rows: every row counts (a layer built outside a balancer)
    assert layer.expert_load.tolist() == torch.bincount(ids.flatten(), minlength=layer.num_experts).tolist()
    layer.expert_load.zero_()
    layer.counted_rows = torch.tensor(real)
    layer._slot_ids(ids)
    first = rows_per_engine if spread else 0  # engine 1's rows come second in the gathered rows
    want = torch.bincount(ids[first:first + real].flatten(), minlength=layer.num_experts)
    assert layer.expert_load.tolist() == want.tolist() and int(want.sum()) == real * layer.top_k


@pytest.mark.parametrize("value", [-1, 10**6 + 1])
def test_eplb_async_steps_out_of_bounds_or_without_eplb_is_refused(tiny_models, value):
    from pagoda_daemon.config import EngineConfig

    with pytest.raises(ValueError, match="eplb_async_steps"):
        EngineConfig(model=tiny_models["qwen3_moe"], enable_eplb=True, eplb_async_steps=value)
    with pytest.raises(ValueError, match="eplb_async_steps needs enable_eplb"):
        EngineConfig(model=tiny_models["qwen3_moe"], eplb_async_steps=2)
    EngineConfig(model=tiny_models["qwen3_moe"], enable_eplb=True, eplb_async_steps=10**6)  # the largest: accepted
