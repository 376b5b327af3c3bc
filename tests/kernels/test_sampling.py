"""The fused sampling kernel: greedy rows equal torch.argmax exactly (ties, ragged chunks,
strided rows, every logits dtype), sampled rows follow softmax(logits / T) (checked
statistically, and shown to fail for a temperature ignored or inverted), seeds and offsets
select the draws; the twin is the engine's torch sampler; `Sampler` on its fused path."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.interp import randint, randn

from pagoda_kernels import sampling  # isort: skip
from pagoda_kernels.reference import sample_tokens_ref  # isort: skip
from pagoda_kernels.sampling import sample_tokens  # isort: skip

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def seed_of(gen: torch.Generator) -> int:
    return int(torch.randint(0, 2**62, (1,), generator=gen))


def strided_rows(gen, rows, vocab, dtype, scale=1.0):
    """Logits [rows, vocab] as a view into a wider, row-strided buffer (as hidden[idx] @ W.T
    sliced to the real vocabulary would be)."""
    wide = randn(gen, 2 * rows, vocab + 37, dtype=dtype, scale=scale)
    view = wide[::2, :vocab]
    assert not view.is_contiguous()
    return view


@pytest.mark.parametrize("dtype", DTYPES)
def test_greedy_rows_are_argmax_exactly(gen, dtype):
    vocab = 2 * sampling.MIN_CHUNK + randint(gen, 1, sampling.MIN_CHUNK, 1)[0]  # 3 chunks, the last ragged
    logits = strided_rows(gen, 5, vocab, dtype, scale=3.0)
    q = sampling.BLOCK // 4  # lanes: index i is lane i % q
    top = logits.float().max().item() + 1
    ties = [
        (100, 2 * sampling.MIN_CHUNK + 7),  # in different chunks
        (q + 5, 3 * q + 5),  # in one lane
        (300, q + 188),  # the later index in the lower lane
        (vocab - 1, vocab - 2),  # at the ragged end
    ]
    for row, (a, b) in enumerate(ties):
        logits[row, a] = logits[row, b] = top
    logits[4, : vocab // 2] = float("-inf")  # masked tokens
    assert sampling.chunk_size(5, vocab, 8) == sampling.MIN_CHUNK
    out = sample_tokens(logits, torch.zeros(5), seed_of(gen))
    assert out.dtype == torch.int64
    assert out.tolist() == logits.argmax(dim=-1).tolist() == logits.float().argmax(dim=-1).tolist()
    assert out[:4].tolist() == [min(t) for t in ties]


def test_mixed_batch_greedy_rows_exact(gen):
    vocab = randint(gen, 500, 3000, 1)[0]
    logits = strided_rows(gen, 6, vocab, torch.bfloat16, scale=2.0)
    temp = torch.tensor([0.0, 0.7, 0.0, 1.3, 0.0, 0.05])
    top = randint(gen, 0, vocab, 1)[0]
    logits[5, top] = logits[5].max() + 1  # 20 ahead at T = 0.05: the noise never beats that
    out = sample_tokens(logits, temp, seed_of(gen))
    greedy = temp == 0
    assert out[greedy].tolist() == logits[greedy].argmax(dim=-1).tolist()
    assert ((out >= 0) & (out < vocab)).all()
    assert out[5] == top


def test_same_logits_in_every_dtype_give_the_same_tokens(gen):
    """Sampled rows too: the kernel computes in float32, so equal values mean equal draws."""
    vocab = randint(gen, 300, 2500, 1)[0]
    logits = randn(gen, 4, vocab, dtype=torch.bfloat16, scale=0.5)
    logits = torch.where(logits.abs() < 2**-12, 2**-12, logits)  # no values below fp16's normal range
    assert all(torch.equal(logits.to(dtype).float(), logits.float()) for dtype in DTYPES)
    temp = torch.tensor([1.0, 0.0, 0.8, 2.0])
    seed = seed_of(gen)
    tokens = [sample_tokens(logits.to(dtype), temp, seed).tolist() for dtype in DTYPES]
    assert tokens[0] == tokens[1] == tokens[2]


def test_seed_and_offset_select_the_draws(gen):
    vocab = 2 * sampling.MIN_CHUNK + 100
    logits = randn(gen, 4, vocab, scale=0.1)  # near uniform: two draws rarely agree
    temp = torch.ones(4)
    seed = seed_of(gen)
    first = sample_tokens(logits, temp, seed, offset=3)
    assert torch.equal(first, sample_tokens(logits, temp, seed, offset=3))
    assert not torch.equal(first, sample_tokens(logits, temp, seed + 1, offset=3))
    assert not torch.equal(first, sample_tokens(logits, temp, seed, offset=4))
    assert not torch.equal(first, sample_tokens(logits, temp, seed ^ (1 << 40), offset=3))  # the high word counts


def g_statistic(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """The G-test statistic of observed counts against probabilities: about chi-square with
    len(probs) - 1 degrees of freedom when the counts follow probs, large when they do not."""
    observed, expected = counts.double(), counts.sum() * probs.double()
    ratio = torch.where(observed > 0, observed / expected, torch.ones_like(observed))
    return float(2 * (observed * ratio.log()).sum())


# P(chi-square with 5 degrees of freedom > 40) ~ 1.5e-7: a correct sampler fails about once
# in 10^6 runs. Simulated (20k runs each), the G of the draws below stays under 27 against
# the right distribution and exceeds 65 against softmax(logits) (temperature ignored) and
# softmax(logits * T) (inverted).
G_LIMIT = 40.0


def test_sampled_rows_follow_softmax_over_temperature(gen):
    vocab = 6
    base = torch.linspace(-1.25, 1.25, vocab)[torch.randperm(vocab, generator=gen)]
    base = base + randn(gen, vocab, scale=0.05)
    groups = [(0.5, 448), (2.0, 192)]  # (temperature, draws)
    temp = torch.cat([torch.full((n,), t) for t, n in groups])
    logits = base.expand(len(temp), vocab)
    out = sample_tokens(logits, temp, seed_of(gen))
    ref = sample_tokens_ref(logits, temp, gen)  # the twin draws the same distribution
    start = 0
    for t, n in groups:
        counts = torch.bincount(out[start:start + n], minlength=vocab)
        right = torch.softmax(base.double() / t, 0)
        assert g_statistic(counts, right) < G_LIMIT
        assert g_statistic(counts, torch.softmax(base.double() * t, 0)) > G_LIMIT  # inverted
        if t == 0.5:  # (at T = 2, 192 draws cannot tell it from T = 1)
            assert g_statistic(counts, torch.softmax(base.double(), 0)) > G_LIMIT  # ignored
        assert g_statistic(torch.bincount(ref[start:start + n], minlength=vocab), right) < G_LIMIT
        start += n


def test_twin_is_the_engine_torch_sampler(gen):
    from pagoda_daemon.worker.sampler import Sampler, SamplingBatch

    logits = randn(gen, 5, 40, dtype=torch.bfloat16, scale=2.0)
    temp = torch.tensor([0.0, 0.9, 1.0, 0.0, 0.4])
    seed = seed_of(gen)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        engine = Sampler(fused=False)(logits, SamplingBatch(temperature=temp, all_greedy=False)).sampled
    ref = sample_tokens_ref(logits, temp, torch.Generator().manual_seed(seed))
    assert torch.equal(engine, ref)


def test_sampler_fused_path(gen, monkeypatch):
    from pagoda_daemon.worker.sampler import Sampler, SamplingBatch

    calls = []
    real = sampling.sample_tokens
    monkeypatch.setattr(sampling, "sample_tokens", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    vocab = randint(gen, 100, 1500, 1)[0]
    logits = randn(gen, 4, vocab, dtype=torch.bfloat16, scale=2.0)
    temp = torch.tensor([0.0, 0.8, 0.0, 1.2])
    batch = SamplingBatch(temperature=temp, all_greedy=False, max_num_logprobs=3)
    fused, plain = Sampler(seed=7, fused=True), Sampler(fused=False)
    out, ref = fused(logits, batch), plain(logits, batch)
    assert len(calls) == 1
    assert out.sampled[[0, 2]].tolist() == ref.sampled[[0, 2]].tolist() == logits[[0, 2]].argmax(-1).tolist()
    lp = logits.float().log_softmax(-1)  # logprobs of the raw float32 logits, as the torch path gives them
    assert torch.equal(out.sampled_logprob, lp.gather(1, out.sampled[:, None]).squeeze(1))
    assert torch.equal(out.top_logprobs, ref.top_logprobs) and torch.equal(out.top_ids, ref.top_ids)
    # reproducible from the sampler's seed, fresh draws every step
    assert torch.equal(Sampler(seed=7, fused=True)(logits, batch).sampled, out.sampled)
    fused(logits, batch)
    assert calls[1] == calls[0] != calls[2]
    # all greedy
    greedy = SamplingBatch(temperature=torch.zeros(4), all_greedy=True)
    assert fused(logits, greedy).sampled.tolist() == logits.argmax(-1).tolist()
    # anything beyond temperature takes the torch path
    n = len(calls)
    for extra in ({"top_k": torch.tensor([0, 5, 0, 0])}, {"top_p": torch.full((4,), 0.9)},
                  {"min_p": torch.full((4,), 0.1)}, {"generators": {1: torch.Generator().manual_seed(1)}}):
        fused(logits, SamplingBatch(temperature=temp, all_greedy=False, **extra))
    assert len(calls) == n
    # and so does everything when turned off, or on CPU by default
    Sampler()(logits, batch)
    assert len(calls) == n
