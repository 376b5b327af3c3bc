"""Paged attention in plain torch: the reference backend, and the one the CPU runs.

Clear rather than fast: gather each sequence's context from its blocks and call
scaled_dot_product_attention with the causal offset that cached context implies.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagoda_daemon.attention.backend import AttentionBackend, AttentionMetadata


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter this step's K/V into their slots of the paged cache."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    flat[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


def causal_mask(q_len: int, kv_len: int, sliding_window: int | None, device: torch.device) -> torch.Tensor:
    """Query i (at absolute position kv_len - q_len + i) sees keys at positions <= its own."""
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    k_pos = torch.arange(kv_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask


class TorchPagedAttention(AttentionBackend):
    name = "torch"

    def write_kv(self, k, v, kv_cache, slot_mapping) -> None:
        keep = slot_mapping >= 0  # padding rows (-1) write nothing (a host sync: this backend is never captured)
        if not bool(keep.all()):
            k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
        write_kv_cache(k, v, kv_cache, slot_mapping)

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, out: torch.Tensor | None = None) -> torch.Tensor:
        if kv_cache is not None and meta.has_kv_cache and not meta.kv_written:
            write_kv_cache(k, v, kv_cache, meta.slot_mapping)
        out = torch.empty_like(q) if out is None else out
        if not self.causal:
            self.check_bidirectional(meta)
        gqa = self.num_heads != self.num_kv_heads
        starts = meta.query_start_loc_cpu
        for i, kv_len in enumerate(meta.seq_lens_cpu):
            q_start, q_end = starts[i], starts[i + 1]
            q_len = q_end - q_start
            if meta.is_prefill_only or kv_cache is None or not meta.has_kv_cache:
                ks, vs = k[q_start:q_end], v[q_start:q_end]
            else:
                ks, vs = self._gather(kv_cache, meta.block_tables[i], kv_len)
            mask = causal_mask(q_len, kv_len, self.sliding_window, q.device) if self.causal else None
            o = F.scaled_dot_product_attention(
                q[q_start:q_end].transpose(0, 1),
                ks.transpose(0, 1).to(q.dtype),
                vs.transpose(0, 1).to(q.dtype),
                attn_mask=mask,
                scale=self.scale,
                enable_gqa=gqa,
            )
            out[q_start:q_end] = o.transpose(0, 1)
        return out

    @staticmethod
    def _gather(kv_cache: torch.Tensor, block_table: torch.Tensor, kv_len: int):
        block_size = kv_cache.shape[2]
        num_blocks = -(-kv_len // block_size)
        blocks = block_table[:num_blocks]
        k = kv_cache[0, blocks].flatten(0, 1)[:kv_len]
        v = kv_cache[1, blocks].flatten(0, 1)[:kv_len]
        return k, v
