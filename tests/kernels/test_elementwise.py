"""RMSNorm (with fused residual add), neox RoPE and SiLU-and-mul against their twins, and
the twins against the engine's own layers (so a kernel that matches its twin matches the
engine)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.interp import assert_close, poisoned, randint, randn

from pagoda_kernels.activation import silu_and_mul  # isort: skip
from pagoda_kernels.reference import rmsnorm_ref, rope_cos_sin_ref, rope_neox_ref, silu_and_mul_ref  # isort: skip
from pagoda_kernels.rmsnorm import rmsnorm  # isort: skip
from pagoda_kernels.rope import rope_neox  # isort: skip

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [96, 1000])
def test_rmsnorm_matches_twin(gen, dtype, hidden):
    rows = randint(gen, 1, 9, 1)[0]
    x = randn(gen, rows, hidden, dtype=dtype, scale=2.0)
    w = (1 + randn(gen, hidden, scale=0.3)).to(dtype)
    out = poisoned(x.shape, dtype)
    rmsnorm(x, w, 1e-6, out=out)
    assert_close(out, rmsnorm_ref(x, w, 1e-6), 1e-5 if dtype == torch.float32 else 5e-3)

    r = randn(gen, rows, hidden, dtype=dtype)
    out, res_out = poisoned(x.shape, dtype), poisoned(x.shape, dtype)
    rmsnorm(x, w, 1e-5, residual=r, out=out, residual_out=res_out)
    ref, ref_res = rmsnorm_ref(x, w, 1e-5, residual=r)
    assert torch.equal(res_out, ref_res)  # the add in the input dtype: exact
    assert_close(out, ref, 1e-5 if dtype == torch.float32 else 5e-3)
    if dtype != torch.float32:  # float32 sums differ in order only; in 16 bits nearly all agree exactly
        assert (out != ref).float().mean() < 0.02


def test_rmsnorm_in_place_and_3d(gen):
    x = randn(gen, 2, 3, 64, dtype=torch.float16)
    r = randn(gen, 2, 3, 64, dtype=torch.float16)
    w = randn(gen, 64, dtype=torch.float16)
    ref, ref_res = rmsnorm_ref(x, w, 1e-6, residual=r)
    out, res = rmsnorm(x, w, 1e-6, residual=r, out=x, residual_out=r)
    assert out is x and res is r and torch.equal(r, ref_res)
    assert_close(x, ref, 5e-3)


def test_rmsnorm_twin_is_the_engine_layer(gen):
    from pagoda_daemon.models.layers import RMSNorm

    for dtype in DTYPES:
        layer = RMSNorm(48, 1e-6).to(dtype)
        with torch.no_grad():
            layer.weight.copy_(randn(gen, 48))
        x, r = randn(gen, 5, 48, dtype=dtype), randn(gen, 5, 48, dtype=dtype)
        assert torch.equal(layer(x), rmsnorm_ref(x, layer.weight, 1e-6))
        assert all(torch.equal(a, b) for a, b in zip(layer(x, r), rmsnorm_ref(x, layer.weight, 1e-6, r)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("head_dim", "heads", "kv_heads"), [(64, 4, 2), (80, 3, 1), (128, 2, 2)])
def test_rope_matches_twin_exactly(gen, dtype, head_dim, heads, kv_heads):
    tokens = randint(gen, 1, 7, 1)[0]
    cos, sin = rope_cos_sin_ref(head_dim, 300, base=10000.0)
    positions = torch.randint(0, 300, (tokens,), generator=gen)
    qkv = randn(gen, tokens, heads + 2 * kv_heads, head_dim, dtype=dtype)
    q, k = qkv[:, :heads], qkv[:, heads:heads + kv_heads]  # strided views, as the model has them
    q_out, k_out = poisoned(q.shape, dtype), poisoned(k.shape, dtype)
    rope_neox(positions, q, k, cos, sin, q_out, k_out)
    q_ref, k_ref = rope_neox_ref(positions, q, k, cos, sin)
    if dtype == torch.float32:  # same products and sums; tolerance only for the interpreter's numpy
        torch.testing.assert_close(q_out, q_ref, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(k_out, k_ref, atol=1e-6, rtol=1e-6)
    else:
        assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)
    # in place on the views
    rope_neox(positions, q, k, cos, sin, q, k)
    torch.testing.assert_close(q, q_ref, atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("head_dim", "heads", "kv_heads"), [(64, 4, 2), (80, 3, 1), (128, 16, 8)])
def test_rope_with_qk_norm_matches_twin(gen, dtype, head_dim, heads, kv_heads):
    """Qwen3's per-head q/k RMSNorm fused before the rotation, in place on strided views."""
    tokens = randint(gen, 1, 6, 1)[0]
    cos, sin = rope_cos_sin_ref(head_dim, 300, base=1e6)
    positions = torch.randint(0, 300, (tokens,), generator=gen)
    qkv = randn(gen, tokens, heads + 2 * kv_heads, head_dim, dtype=dtype, scale=3.0)
    q, k = qkv[:, :heads], qkv[:, heads:heads + kv_heads]
    qw, kw = (1 + randn(gen, head_dim, scale=0.3)).to(dtype), (1 + randn(gen, head_dim, scale=0.3)).to(dtype)
    q_ref, k_ref = rope_neox_ref(positions, q, k, cos, sin, qw, kw, 1e-6)
    q_out, k_out = poisoned(q.shape, dtype), poisoned(k.shape, dtype)
    rope_neox(positions, q, k, cos, sin, q_out, k_out, qw, kw, 1e-6)
    v_before = qkv[:, heads + kv_heads:].clone()
    rope_neox(positions, q, k, cos, sin, q, k, qw, kw, 1e-6)  # in place, as the engine calls it
    assert torch.equal(q, q_out) and torch.equal(k, k_out)
    assert torch.equal(qkv[:, heads + kv_heads:], v_before)  # v untouched
    for out, ref in ((q_out, q_ref), (k_out, k_ref)):
        assert_close(out, ref, 1e-5 if dtype == torch.float32 else 8e-3)
        if dtype != torch.float32:  # the norm's float32 sum differs in order only: nearly all identical
            assert (out != ref).float().mean() < 0.03


def test_rope_with_qk_norm_is_the_engine_path(gen):
    """The engine's rotary layer with Qwen3's norms: fused kernel == norms then rotation in torch."""
    from pagoda_daemon.models.layers import RMSNorm, RotaryEmbedding

    params = {"rope_theta": 1e6, "rope_type": "default"}
    fused, plain = RotaryEmbedding(64, 128, params, kernels=True), RotaryEmbedding(64, 128, params)
    q_norm, k_norm = RMSNorm(64, 1e-6).to(torch.float16), RMSNorm(64, 1e-6).to(torch.float16)
    with torch.no_grad():
        q_norm.weight.copy_(1 + randn(gen, 64, scale=0.2))
        k_norm.weight.copy_(1 + randn(gen, 64, scale=0.2))
    positions = torch.randint(0, 128, (5,), generator=gen)
    qkv = randn(gen, 5, 8, 64, dtype=torch.float16)
    q, k = qkv[:, :4], qkv[:, 4:6]
    with torch.no_grad():
        want_q, want_k = plain(positions, q.clone(), k.clone(), q_norm, k_norm)
        got_q, got_k = fused(positions, q, k, q_norm, k_norm)
    assert got_q.data_ptr() == q.data_ptr()  # in place
    assert_close(got_q, want_q, 8e-3)
    assert_close(got_k, want_k, 8e-3)


def test_rope_twin_is_the_engine_layer(gen):
    """Including llama3 scaling, which lives in the table the engine builds."""
    from pagoda_daemon.models.layers import RotaryEmbedding

    params = {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    rope = RotaryEmbedding(64, 256, params)
    positions = torch.randint(0, 256, (6,), generator=gen)
    for dtype in DTYPES:
        q, k = randn(gen, 6, 4, 64, dtype=dtype), randn(gen, 6, 2, 64, dtype=dtype)
        a, b = rope(positions, q, k)
        a2, b2 = rope_neox_ref(positions, q, k, rope.cos, rope.sin)
        assert torch.equal(a, a2) and torch.equal(b, b2)
        if dtype != torch.float32:
            a3, b3 = rope_neox(positions, q, k, rope.cos, rope.sin)
            assert torch.equal(a3, a) and torch.equal(b3, b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_twin(gen, dtype):
    from pagoda_daemon.models.layers import SiluAndMul

    x = randn(gen, randint(gen, 1, 6, 1)[0], 2 * 1500, dtype=dtype, scale=3.0)
    out = poisoned((x.shape[0], 1500), dtype)
    silu_and_mul(x, out=out)
    ref = silu_and_mul_ref(x)
    assert torch.equal(ref, SiluAndMul()(x))
    assert_close(out, ref, 1e-6 if dtype == torch.float32 else 5e-3)


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_silu_and_mul_of_a_ranks_own_expert_rows_only(gen, ids_dtype):
    """Under expert parallelism only the rows routed to this rank's experts are computed; the
    others' stay as they were (poisoned here), ids of -1 included."""
    rows, first, count = 40, 4, 3
    x = randn(gen, rows, 2 * 96, scale=3.0)
    ids = torch.tensor(randint(gen, -1, 10, rows), dtype=ids_dtype)
    out = poisoned((rows, 96), torch.float32)
    silu_and_mul(x, out=out, expert_ids=ids, first_expert=first, num_experts=count)
    mine = (ids >= first) & (ids < first + count)
    assert mine.any() and (~mine).any()
    assert_close(out[mine], silu_and_mul_ref(x[mine]), 1e-6)
    assert out[~mine].isnan().all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ranks", [2, 3])
def test_peer_sum_adds_every_buffer_in_rank_order_after_the_barrier(gen, dtype, ranks):
    """One rank's launch, the others' flags already raised in its pad: it takes them down,
    raises its own in theirs (one per program and rank), and sums. Two ranks really waiting on
    each other: tests/kernels/test_peer_all_reduce_slots.py."""
    from pagoda_kernels.peer_sum import peer_sum

    n = randint(gen, 1, 5000, 1)[0]
    rank, max_programs, block = ranks - 1, 3, 1024
    programs = min(-(-n // block), max_programs)
    buffers = [randn(gen, n + 64, dtype=dtype, scale=3.0) for _ in range(ranks)]  # longer than the span
    table = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
    pads = [torch.zeros(max_programs * ranks, dtype=torch.int32) for _ in range(ranks)]
    flags = pads[rank].view(max_programs, ranks)
    flags[:programs] = 1
    flags[:, rank] = 0  # no rank signals itself
    out = poisoned((n,), dtype)
    peer_sum(table, torch.tensor([p.data_ptr() for p in pads]), rank, out, max_programs, block=block)
    expected = sum(b[:n].float() for b in buffers).to(dtype)  # float32, in rank order, rounded once
    assert torch.equal(out, expected)
    assert not pads[rank].any()  # every flag of the others taken down
    for other in range(ranks - 1):  # this rank's raised in each of theirs, once per program
        raised = pads[other].view(max_programs, ranks)
        assert raised[:programs, rank].eq(1).all() and not raised[programs:].any() and not raised[:, :rank].any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [96, 1000])
def test_peer_sum_add_norm_is_the_sum_then_the_fused_norm(gen, dtype, hidden):
    """The sum, the residual add and RMSNorm in one launch equal peer_sum then rmsnorm with the
    residual (two launches) bit for bit, with more rows than programs (each program takes
    several), after the same barrier; and the result is the engine's norm of the sum."""
    from pagoda_kernels.peer_sum import peer_sum, peer_sum_add_norm

    ranks, rank, max_programs = 3, 1, 3
    rows = randint(gen, max_programs + 1, 12, 1)[0]
    buffers = [randn(gen, rows * hidden + 64, dtype=dtype, scale=3.0) for _ in range(ranks)]
    table = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
    residual = randn(gen, rows, hidden, dtype=dtype, scale=2.0)
    weight = (1 + randn(gen, hidden, scale=0.3)).to(dtype)

    def raised_pads() -> tuple[list[torch.Tensor], torch.Tensor]:
        pads = [torch.zeros(max_programs * ranks, dtype=torch.int32) for _ in range(ranks)]
        for r in range(ranks):
            if r != rank:
                pads[rank].view(max_programs, ranks)[:, r] = 1  # every other rank already here
        return pads, torch.tensor([p.data_ptr() for p in pads])

    pads, pad_table = raised_pads()
    out, res_out = poisoned((rows, hidden), dtype), poisoned((rows, hidden), dtype)
    peer_sum_add_norm(table, pad_table, rank, residual, weight, 1e-6, out, res_out, max_programs)
    assert not pads[rank].any()  # the barrier ran: every flag taken down
    assert all(p.view(max_programs, ranks)[:, rank].eq(1).all() for r, p in enumerate(pads) if r != rank)

    pads, pad_table = raised_pads()
    total = poisoned((rows, hidden), dtype)
    peer_sum(table, pad_table, rank, total.view(-1), max_programs)
    expected, expected_res = rmsnorm(total, weight, 1e-6, residual=residual)
    assert torch.equal(res_out, expected_res) and torch.equal(out, expected)
    ref, ref_res = rmsnorm_ref(sum(b[: rows * hidden].float() for b in buffers).to(dtype).view(rows, hidden),
                               weight, 1e-6, residual=residual)
    assert torch.equal(res_out, ref_res)
    assert_close(out, ref, 1e-5 if dtype == torch.float32 else 5e-3)
