"""What this build of the engine can do: one list, read by the daemon (which refuses an
unsupported option at start, exit 2) and by the operator (which refuses the InferenceService
that asks for it with an ``InvalidSpec`` condition naming the field, instead of rendering a
pod that would crash-loop).

Standard library only: the operator imports it in an image without torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Capability:
    name: str
    supported: bool
    what: str  # what a user asking for it wants, in the refusal message


CAPABILITIES: dict[str, Capability] = {
    c.name: c
    for c in (
        Capability("tensor_parallel", True, "tensor parallelism (one model sharded over several GPUs)"),
        Capability("expert_parallel", True, "expert parallelism (MoE experts spread over several GPUs)"),
        Capability("data_parallel", True, "data parallelism inside one replica"),
        Capability("data_parallel_experts", True, "MoE experts spread over data-parallel engines "
                   "(data-parallel attention)"),
        Capability("elastic_expert_parallel", True, "elastic expert parallelism"),
        Capability("kv_cache_fp8", False, "an fp8 KV cache"),
        Capability("kv_offload", True, "KV cache offload to host memory or disk"),
        Capability("model_uri", True, "fetching the model from a URI (hf://, s3://)"),
    )
}


def supported(name: str) -> bool:
    return CAPABILITIES[name].supported


def refusal(name: str) -> str:
    """The sentence a refused capability is explained with."""
    return f"{CAPABILITIES[name].what} is not supported by this Pagoda build yet"
