"""Pure-torch reference twins of every kernel in this package.

Each twin states the semantics its kernel must meet; the tests compare kernel and twin on
random inputs. They are written for clarity (loops over sequences and experts), and they
follow the engine's order of operations and casts (`pagoda_daemon.models.layers`), so a
kernel that matches its twin can replace the engine's torch code.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

# ---- KV cache --------------------------------------------------------------------------


def quantize_fp8_ref(x: torch.Tensor, scale: float | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x / scale in float32, saturated to the format's range, rounded to nearest even."""
    fmax = torch.finfo(dtype).max
    return (x.float() / torch.as_tensor(scale, dtype=torch.float32)).clamp(-fmax, fmax).to(dtype)


def dequantize_ref(cache: torch.Tensor, scale: float | torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """A cache slice in the query dtype: fp8 is scaled up in float32 first, then cast."""
    if cache.dtype.itemsize == 1:
        s = torch.as_tensor(1.0 if scale is None else scale, dtype=torch.float32)
        return (cache.to(torch.float32) * s).to(dtype)
    return cache.to(dtype)


def write_kv_cache_ref(k, v, kv_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """Scatter K/V [T, KVH, D] into kv_cache [2, blocks, block_size, KVH, D] at slot_mapping
    (negative slots are skipped: padding). fp8 caches store round(x / scale)."""
    _, num_blocks, block_size, kvh, d = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, kvh, d)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    for i, (x, scale) in enumerate(((k, k_scale), (v, v_scale))):
        x = x[keep]
        if kv_cache.dtype.itemsize == 1:  # index_copy_ has no fp8 kernels: copy the bytes
            x = quantize_fp8_ref(x, 1.0 if scale is None else scale, kv_cache.dtype)
            flat[i].view(torch.uint8).index_copy_(0, slots, x.view(torch.uint8))
        else:
            flat[i].index_copy_(0, slots, x.to(kv_cache.dtype))


def load_blocks_ref(host: torch.Tensor, slots, kv_cache: torch.Tensor, gpu_blocks) -> None:
    """``kv_cache[:, :, gpu_blocks[i]] = host[slots[i]]``: host ``[slots, layers, 2, ...]``,
    kv_cache ``[layers, 2, blocks, ...]`` (bytes, so fp8 caches copy as they are)."""
    slots = torch.as_tensor(slots, dtype=torch.long)
    blocks = torch.as_tensor(gpu_blocks, dtype=torch.long, device=kv_cache.device)
    rows = host.view(torch.uint8)[slots].to(kv_cache.device)  # [n, layers, 2, ..., bytes]
    kv_cache.view(torch.uint8).movedim(2, 0)[blocks] = rows


# ---- attention -------------------------------------------------------------------------


def _attend(q, k, v, q_pos, k_pos, scale, sliding_window, causal=True):
    """q [M, H, D], k/v [N, KVH, D] -> [M, H, D]; softmax in float32 (or the input dtype
    when that is wider), masked causally by absolute positions (unless not ``causal``)."""
    h, kvh = q.shape[1], k.shape[1]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    qf, kf, vf = (t.to(acc).transpose(0, 1) for t in (q, k, v))
    kf = kf.repeat_interleave(h // kvh, dim=0)
    vf = vf.repeat_interleave(h // kvh, dim=0)
    s = (qf @ kf.transpose(1, 2)) * scale
    mask = k_pos[None, :] <= q_pos[:, None]
    if not causal:
        mask.fill_(True)
    if sliding_window:
        mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1)
    return (p @ vf).transpose(0, 1).to(q.dtype)


def gather_kv_ref(kv_cache, block_table, seq_len, q_dtype, k_scale=None, v_scale=None):
    """One sequence's K and V [seq_len, KVH, D] from its blocks, dequantised to q's dtype."""
    block_size = kv_cache.shape[2]
    blocks = block_table[: -(-seq_len // block_size)].long()
    k = kv_cache[0, blocks].flatten(0, 1)[:seq_len]
    v = kv_cache[1, blocks].flatten(0, 1)[:seq_len]
    return dequantize_ref(k, k_scale, q_dtype), dequantize_ref(v, v_scale, q_dtype)


def paged_attention_ref(q, kv_cache, block_tables, query_start_loc, seq_lens, scale,
                        sliding_window=None, k_scale=None, v_scale=None) -> torch.Tensor:
    """Varlen attention over a paged cache: q [T, H, D] holds the new tokens of each sequence,
    which are the last q_len of its seq_lens[i] positions (decode is q_len == 1)."""
    out = torch.empty_like(q)
    starts = [int(x) for x in query_start_loc.tolist()]
    for i, seq_len in enumerate(int(x) for x in seq_lens.tolist()):
        q_start, q_end = starts[i], starts[i + 1]
        if q_end == q_start:
            continue
        k, v = gather_kv_ref(kv_cache, block_tables[i], seq_len, q.dtype, k_scale, v_scale)
        q_pos = torch.arange(seq_len - (q_end - q_start), seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        out[q_start:q_end] = _attend(q[q_start:q_end], k, v, q_pos, k_pos, scale, sliding_window)
    return out


def varlen_attention_ref(q, k, v, query_start_loc, scale, sliding_window=None, causal=True) -> torch.Tensor:
    """Causal (or, not ``causal``, bidirectional) attention within each sequence of a flattened
    batch of fresh tokens (no cache)."""
    out = torch.empty_like(q)
    starts = [int(x) for x in query_start_loc.tolist()]
    for a, b in itertools.pairwise(starts):
        if b == a:
            continue
        pos = torch.arange(b - a, device=q.device)
        out[a:b] = _attend(q[a:b], k[a:b], v[a:b], pos, pos, scale, sliding_window, causal)
    return out


# ---- elementwise and norms ---------------------------------------------------------------


def rmsnorm_ref(x, weight, eps, residual=None):
    """The engine's RMSNorm: the residual add in the input dtype, the norm in float32, then
    weight * normed.to(dtype). Returns out, or (out, x + residual)."""
    if residual is not None:
        x = residual + x
        residual = x
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(dtype)
    return out if residual is None else (out, residual)


def rope_neox_ref(positions, q, k, cos, sin, q_norm_weight=None, k_norm_weight=None, eps=1e-6):
    """Neox rotary embedding with the engine's casts: the float32 cos/sin table rows cast to
    the input dtype, then x * cos + rotate_half(x) * sin in that dtype. With norm weights,
    each head goes through the engine's RMSNorm first."""
    if q_norm_weight is not None:
        q, k = rmsnorm_ref(q, q_norm_weight, eps), rmsnorm_ref(k, k_norm_weight, eps)

    def apply(x):
        c = cos[positions].unsqueeze(1).to(x.dtype)
        s = sin[positions].unsqueeze(1).to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return x * c + torch.cat((-x2, x1), dim=-1) * s

    return apply(q), apply(k)


def rope_cos_sin_ref(head_dim: int, max_positions: int, base: float = 10000.0):
    """A default-rope cos/sin table [max_positions, head_dim] as the engine builds it."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
             silu_mul: bool = False) -> torch.Tensor:
    """The skinny matmul: float32 products and sums, one rounding to x's dtype; with silu_mul
    the activation first, as the engine's SiluAndMul rounds it."""
    a = silu_and_mul_ref(x) if silu_mul else x
    y = F.linear(a.float(), weight.float(), None if bias is None else bias.float())
    return y.to(x.dtype)


# ---- mixture of experts -------------------------------------------------------------------


def route_topk_ref(router_logits, top_k: int, renormalize: bool):
    """Softmax in float32, top-k, optional renormalisation (Qwen3's norm_topk_prob)."""
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def local_expert_ids(ids: torch.Tensor, first: int, count: int) -> torch.Tensor:
    """Global expert ids -> this rank's (expert parallelism: it holds experts first..first+count-1);
    -1 for an expert another rank holds."""
    local = ids - first
    return torch.where((local >= 0) & (local < count), local, torch.full_like(local, -1))


def moe_ref(x, w13, w2, weights, ids) -> torch.Tensor:
    """Expert by expert: x [T, H]; w13 [E, 2I, H] (gate rows then up rows); w2 [E, H, I];
    weights/ids [T, k]. Sums the k expert outputs of each token; an id of -1 (an expert another
    expert-parallel rank holds) adds nothing."""
    out = torch.zeros_like(x)
    weights = weights.to(x.dtype)
    inter = w2.shape[2]
    for e in torch.unique(ids).tolist():
        if e < 0:
            continue
        token_idx, slot = torch.where(ids == e)
        gate_up = F.linear(x[token_idx], w13[e])
        h = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = F.linear(h, w2[e]) * weights[token_idx, slot, None]
        out.index_add_(0, token_idx, y.to(x.dtype))
    return out


def grouped_gemm_ref(a, b, topk_ids, top_k: int, topk_weights=None) -> torch.Tensor:
    """Row r of the result (r = token * top_k + slot, or r = token when a has one row per
    (token, slot) already and top_k == 1) is a[r // top_k] @ b[topk_ids.flatten()[r]].T,
    times topk_weights.flatten()[r] when given."""
    flat_ids = topk_ids.flatten().long()
    rows = torch.arange(flat_ids.numel(), device=a.device)
    acc = torch.float64 if a.dtype == torch.float64 else torch.float32
    out = torch.einsum("rk,rnk->rn", a[rows // top_k].to(acc), b[flat_ids].to(acc))
    if topk_weights is not None:
        out = out * topk_weights.flatten()[:, None].to(acc)
    return out.to(a.dtype)


# ---- sampling ---------------------------------------------------------------------------


def sample_tokens_ref(logits: torch.Tensor, temperature: torch.Tensor,
                      generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row: a draw from softmax(logits / T) in float32 where T > 0 (the
    exponential race, argmax p / q with q ~ Exp(1), as the engine's torch sampler draws it),
    argmax(logits) where T == 0 (ties to the lowest index). The kernel draws its own Philox
    numbers, so the two agree in distribution (and exactly on greedy rows), not token for
    token."""
    logits = logits.to(torch.float32)
    greedy = logits.argmax(dim=-1)
    temp = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    probs = (logits / temp.unsqueeze(1)).softmax(dim=-1)
    q = torch.empty_like(probs).exponential_(generator=generator)
    return torch.where(temperature > 0, probs.div(q).argmax(dim=-1), greedy)
