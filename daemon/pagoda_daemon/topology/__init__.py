"""Node topology: discover CPUs/NUMA/GPUs/NICs, plan and apply CPU pinning, report to Kubernetes.

Nothing here imports torch or creates a CUDA context; NVML, amdsmi and the
kubernetes client are optional and imported only when used.
"""

from pagoda_daemon.topology.discover import discover
from pagoda_daemon.topology.model import Gpu, GpuLink, Nic, NodeTopology, NumaNode
from pagoda_daemon.topology.pinning import (
    PinningPlan,
    PinningPolicy,
    WorkerPin,
    apply_pinning,
    parse_policy,
    pin_this_process,
    plan_pinning,
)

__all__ = [
    "Gpu",
    "GpuLink",
    "Nic",
    "NodeTopology",
    "NumaNode",
    "PinningPlan",
    "PinningPolicy",
    "WorkerPin",
    "apply_pinning",
    "discover",
    "parse_policy",
    "pin_this_process",
    "plan_pinning",
]
