"""Paged attention on Pagoda's Triton kernels (`pagoda_kernels`): the GPU backend.

Same constructor and contract as `TorchPagedAttention`: write the step's K/V into the
cache, then attend over each sequence's context. Dispatch on the host-side metadata (no
device sync):

- no cache, or a prefill-only step: varlen attention over the fresh K/V of the step
  (exactly what the torch backend does; the cache write still happens when there is one);
- a decode-only step: the split-KV decode kernel;
- anything else (chunked prefill, prefix-cache hits, decodes mixed with prefills): the
  decodes at the head of the batch on the decode kernel, the rest on the paged
  prefill/extend kernel (which would take one-token rows too, but walks each one's whole
  context per query head with a mostly empty query tile: on the H100, 2026-11-26, a
  prefill-heavy run spent 5.3 s of 14.2 s of GPU time in it, most of it on decode rows).
  Only when those decodes read little context does the whole step go to the extend kernel:
  the split costs another launch a layer (the decode kernel; its combine ran as a third
  kernel until 2026-11-28), and an eager
  step is paced by the host (a 562-token prompt joining 4 decodes on an H100, 2026-11-27:
  25.8 ms of host time in the forward passes until its first token, 46 µs of Python per
  Triton launch; docs/benchmarks/2026-11-27-serving-ttft-h100.md).

fp8 caches: set `k_scale` / `v_scale` (floats or 1-element tensors) on the instance;
they default to 1.0. The decode kernel's work plan (how each context is cut into chunks)
is made on the device by the first layer of a step and kept in `meta.backend_state` for
the others; its launch shapes depend on the number of sequences only (CUDA graphs).
"""

from __future__ import annotations

import torch

from pagoda_daemon.attention.backend import AttentionBackend, AttentionMetadata


class TritonPagedAttention(AttentionBackend):
    name = "triton"
    uses_kernels = True
    # A mixed step gives its leading decodes their own kernel from this much context on (their
    # context tokens summed). Below it the extend kernel's extra reads for them (about 2x the
    # decode kernel's per token, the 2026-11-26 profile above) cost less than the two launches
    # a layer the split added when this was set (the decode kernel and its combine, since
    # folded into it): 32k tokens of 4 KiB a layer (Qwen3-0.6B, Llama-3-8B at 8 KV
    # heads) are 128 MiB, ~45 us at 3 TB/s, against ~100 us of host time for the launches.
    split_decodes_from_context = 32_768

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, causal: bool = True) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale, sliding_window, causal)
        # Imported here so that importing the daemon never imports Triton.
        from pagoda_kernels import cache_write, decode_attention, prefill_attention

        self._write = cache_write.write_kv_cache
        self._decode = decode_attention.paged_decode_attention
        self._plan_decode = decode_attention.plan_decode
        self._decode_block_n = decode_attention.decode_block_n
        self._extend = prefill_attention.paged_prefill_attention
        self._varlen = prefill_attention.varlen_attention
        self.k_scale: float | torch.Tensor = 1.0
        self.v_scale: float | torch.Tensor = 1.0

    def write_kv(self, k, v, kv_cache, slot_mapping) -> None:
        if kv_cache.element_size() == 1 and not isinstance(self.k_scale, torch.Tensor):
            # fp8 cache: keep the scales on the device once, not a new tensor every call
            self.k_scale = torch.tensor([float(self.k_scale)], dtype=torch.float32, device=k.device)
            self.v_scale = torch.tensor([float(self.v_scale)], dtype=torch.float32, device=k.device)
        self._write(k, v, kv_cache, slot_mapping, self.k_scale, self.v_scale)  # the kernel skips slot -1

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, out: torch.Tensor | None = None) -> torch.Tensor:
        has_cache = kv_cache is not None and meta.has_kv_cache
        if has_cache and not meta.kv_written:
            self.write_kv(k, v, kv_cache, meta.slot_mapping)
        out = torch.empty_like(q) if out is None else out
        if meta.num_seqs == 0:
            return out
        if not self.causal:
            self.check_bidirectional(meta)
        if not has_cache or meta.is_prefill_only:
            return self._varlen(q, k, v, meta.query_start_loc, self.scale, self.sliding_window,
                                max_query_len=meta.max_query_len, out=out, causal=self.causal)
        if meta.is_decode_only:
            return self._decode_rows(q, kv_cache, meta.block_tables, meta.seq_lens, meta, out)
        decodes = meta.num_leading_decodes
        if decodes == 0 or meta.leading_decode_context < self.split_decodes_from_context:
            return self._extend(q, kv_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, self.scale,
                                self.sliding_window, self.k_scale, self.v_scale,
                                max_query_len=meta.max_query_len, out=out)
        self._decode_rows(q[:decodes], kv_cache, meta.block_tables[:decodes], meta.seq_lens[:decodes], meta,
                          out[:decodes])
        rest = meta.backend_state.get("rest")  # once per step, for every layer
        if rest is None:
            # The decodes bring one token each: the rest's tokens start at `decodes`. Its tables
            # are copies, not views: a view starting `decodes` int32 entries in may lose the
            # 16-byte alignment Triton specialises pointers on, and a step would then compile a
            # variant the warm-up did not (1 s inside a timed round, 2 x H100, 2026-11-26). The
            # copies keep the views' strides: the block table's row stride is the engine's table
            # width, one value the warm-up compiled for, where a packed copy's would be this
            # step's widest row (a compile mid-run on an H100, 2026-11-26).
            rest = meta.backend_state["rest"] = (meta.query_start_loc[decodes:] - decodes,
                                                 _aligned_copy(meta.block_tables[decodes:]),
                                                 _aligned_copy(meta.seq_lens[decodes:]))
        query_start_loc, block_tables, seq_lens = rest
        self._extend(q[decodes:], kv_cache, block_tables, query_start_loc, seq_lens, self.scale,
                     self.sliding_window, self.k_scale, self.v_scale, max_query_len=meta.max_query_len,
                     out=out[decodes:])
        return out

    def _decode_rows(self, q, kv_cache, block_tables, seq_lens, meta: AttentionMetadata, out) -> torch.Tensor:
        """One-token rows on the split-KV decode kernel; its work plan made by the step's first
        layer and kept for the others."""
        block_n = self._decode_block_n(self.head_dim, q.dtype)
        plan = meta.backend_state.get("decode_plan")
        if plan is None:
            plan = meta.backend_state["decode_plan"] = self._plan_decode(seq_lens, self.num_kv_heads, block_n)
        return self._decode(q, kv_cache, block_tables, seq_lens, self.scale, self.sliding_window,
                            self.k_scale, self.v_scale, plan=plan, out=out, block_n=block_n)


def _aligned_copy(view: torch.Tensor) -> torch.Tensor:
    """A copy of ``view`` in memory of its own (aligned as every fresh allocation is), with the
    view's strides."""
    return torch.empty_strided(view.shape, view.stride(), dtype=view.dtype, device=view.device).copy_(view)
