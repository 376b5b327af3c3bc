"""Small helpers shared by the kernel wrappers (host side only)."""

from __future__ import annotations

import functools
import math

import torch

FP8_DTYPES = tuple(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz")
    if hasattr(torch, name)
)


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def fp8_params(dtype: torch.dtype) -> tuple[float, float, int]:
    """(largest finite, smallest normal, mantissa bits) of an fp8 format.

    Works for the OCP formats NVIDIA and MI350 use (e4m3fn) and the fnuz ones MI300 uses.
    """
    info = torch.finfo(dtype)
    return float(info.max), float(info.tiny), round(-math.log2(info.eps))


def scale_tensor(scale: float | torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """A per-tensor scale as a 1-element float32 tensor (kernels read it through a pointer,
    so a CUDA graph can keep a captured launch while the value changes)."""
    if scale is None:
        scale = 1.0
    if isinstance(scale, torch.Tensor):
        return scale.reshape(1).to(device=device, dtype=torch.float32)
    return torch.full((1,), float(scale), dtype=torch.float32, device=device)


@functools.lru_cache(maxsize=16)  # asked every step (decode plan, sampler); the driver call is not free
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors (compute units on ROCm) of a device; a nominal 8 on CPU."""
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8


def is_hip() -> bool:
    return torch.version.hip is not None


def aligned_buffers(sizes: list[int], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Flat tensors of these lengths carved from one allocation, each starting 16-byte aligned.

    Triton specialises a kernel on each pointer argument's 16-byte alignment: views at
    offsets that follow the batch size would compile new variants while serving.
    """
    per = 16 // torch.empty((), dtype=dtype).element_size()
    starts, total = [], 0
    for n in sizes:
        starts.append(total)
        total += cdiv(n, per) * per
    buf = torch.empty(total, dtype=dtype, device=device)
    return [buf[s : s + n] for s, n in zip(starts, sizes)]
