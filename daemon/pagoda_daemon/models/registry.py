"""Which model class serves which `architectures` entry of a config.json."""

from __future__ import annotations

from pagoda_daemon.models.llama import LlamaForCausalLM, Qwen3ForCausalLM
from pagoda_daemon.models.qwen3_moe import Qwen3MoeForCausalLM
from pagoda_daemon.pooling import BODY_ARCHITECTURES

MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def resolve_model_class(config) -> type:
    archs = getattr(config, "architectures", None) or []
    for arch in archs:
        arch = BODY_ARCHITECTURES.get(arch, arch)  # a body without its head (embedding models): the same layers
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise ValueError(
        f"unsupported model architecture {archs or '(none given in config.json)'}; "
        f"Pagoda supports {sorted([*MODEL_REGISTRY, *BODY_ARCHITECTURES])}"
    )


def is_model_body(config) -> bool:
    """Whether config.json names a model body without its language-model head (``Qwen3Model``):
    its checkpoint names the body's tensors without the ``model.`` prefix and holds no head."""
    return any(a in BODY_ARCHITECTURES for a in getattr(config, "architectures", None) or [])
