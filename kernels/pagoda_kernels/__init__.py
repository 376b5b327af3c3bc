"""Pagoda's Triton kernels, each family in its own module with a pure-torch reference twin.

| module | kernels |
|---|---|
| `cache_write` | K/V of a step into their paged-cache slots (slot mapping), fp8 quantisation |
| `kv_copy` | KV blocks from pinned host slots straight into the paged cache (the host tier's loads) |
| `decode_attention` | paged decode attention: a per-step work plan, balanced chunks (flash-decoding), combined by the last chunk of each sequence to finish |
| `prefill_attention` | paged prefill/extend attention (varlen, causal, cached prefix) and varlen on fresh K/V |
| `rmsnorm` | RMSNorm with optional fused residual add |
| `rope` | neox-style rotary embedding from a cos/sin table |
| `activation` | SiLU-and-mul |
| `fused_moe` | softmax top-k routing, moe_align block padding, grouped expert GEMMs, the fused MoE |
| `sampling` | temperature sampling and greedy decoding in one read of the logits (Gumbel-max) |
| `reference` | the pure-torch twins of all of the above (no Triton needed) |
| `bench` | the GPU benchmark script (prints JSON) |

Importing this package does not import Triton; the kernel modules do. Set
`TRITON_INTERPRET=1` before importing a kernel module to run it on CPU tensors.
"""

from __future__ import annotations

import importlib.util

HAS_TRITON = importlib.util.find_spec("triton") is not None

__all__ = ["HAS_TRITON"]
