"""Which physical GPUs CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES leave this process.

Pinning needs the physical GPU behind each device ordinal, and reading it from
the environment (rather than asking CUDA) keeps the topology code free of any
CUDA context. The rules follow the runtimes: entries are indices or UUID
prefixes, and parsing stops at the first entry that names no device.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from pagoda_daemon.topology.model import Gpu, Visibility


def resolve_visibility(
    gpus: Sequence[Gpu], env: Mapping[str, str] | None = None
) -> tuple[Visibility, list[str]]:
    """The visible GPUs (physical indices in ordinal order, None = all) and warnings about them."""
    env = os.environ if env is None else env
    cuda, hip = env.get("CUDA_VISIBLE_DEVICES"), env.get("HIP_VISIBLE_DEVICES")
    warnings: list[str] = []
    vendor = "amd" if gpus and all(g.vendor == "amd" for g in gpus) else "nvidia"
    mine = [g for g in gpus if g.vendor == vendor]

    visible: tuple[int, ...] | None = None
    from_cuda = _parse(cuda, mine, "CUDA_VISIBLE_DEVICES", warnings) if cuda is not None else None
    from_hip = _parse(hip, mine, "HIP_VISIBLE_DEVICES", warnings) if hip is not None else None
    if vendor == "amd" and from_hip is not None:
        visible = from_hip  # HIP reads HIP_VISIBLE_DEVICES first, CUDA_VISIBLE_DEVICES only without it
    else:
        visible = from_cuda if from_cuda is not None else from_hip
    if from_cuda is not None and from_hip is not None and from_cuda != from_hip:
        used = "HIP_VISIBLE_DEVICES" if vendor == "amd" else "CUDA_VISIBLE_DEVICES"
        warnings.append(
            f"CUDA_VISIBLE_DEVICES={cuda!r} and HIP_VISIBLE_DEVICES={hip!r} disagree "
            f"({list(from_cuda)} vs {list(from_hip)}); the {vendor} runtime uses {used}"
        )

    numeric = any(part.strip().isdigit() for part in (cuda or "").split(","))
    if (
        vendor == "nvidia"
        and numeric
        and env.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID"
        and len({g.model for g in mine}) > 1
    ):
        warnings.append(
            "CUDA_VISIBLE_DEVICES uses indices on a node with mixed GPU models and CUDA_DEVICE_ORDER "
            "is not PCI_BUS_ID: CUDA numbers the fastest GPU first, so indices may name other GPUs"
        )
    return Visibility(cuda, hip, visible), warnings


def _parse(text: str, gpus: Sequence[Gpu], name: str, warnings: list[str]) -> tuple[int, ...]:
    chosen: list[int] = []
    for raw in text.split(","):
        entry = raw.strip()
        gpu = _lookup(entry, gpus)
        if gpu is None:
            if entry.startswith("MIG-"):
                warnings.append(f"{name}={text!r}: MIG instances are not mapped to GPUs; not pinning by GPU")
            elif entry and entry != "-1":  # "-1" is the usual way to hide every GPU
                warnings.append(f"{name}={text!r}: {entry!r} names no GPU here; later entries are ignored")
            break
        if gpu.index in chosen:
            warnings.append(f"{name}={text!r}: GPU {entry!r} is listed twice; later entries are ignored")
            break
        chosen.append(gpu.index)
    return tuple(chosen)


def _lookup(entry: str, gpus: Sequence[Gpu]) -> Gpu | None:
    if entry.isdigit():
        ordinal = int(entry)
        return gpus[ordinal] if ordinal < len(gpus) else None
    if not entry:
        return None
    matches = [g for g in gpus if g.uuid and g.uuid.lower().startswith(entry.lower())]
    return matches[0] if len(matches) == 1 else None
