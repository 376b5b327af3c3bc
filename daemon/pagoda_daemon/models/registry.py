"""Which model class serves which `architectures` entry of a config.json."""

from __future__ import annotations

from pagoda_daemon.models.llama import LlamaForCausalLM, Qwen3ForCausalLM
from pagoda_daemon.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def resolve_model_class(config) -> type:
    archs = getattr(config, "architectures", None) or []
    for arch in archs:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise ValueError(
        f"unsupported model architecture {archs or '(none given in config.json)'}; "
        f"Pagoda supports {sorted(MODEL_REGISTRY)}"
    )
