"""Which model class serves which `architectures` entry of a config.json."""

from __future__ import annotations

from pagoda_daemon.models.bert import (
    BertForSequenceClassification,
    BertModel,
    XLMRobertaForSequenceClassification,
    XLMRobertaModel,
    position_offset,
)
from pagoda_daemon.models.llama import (
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    Qwen3ForCausalLM,
    Qwen3ForSequenceClassification,
)
from pagoda_daemon.models.qwen3_moe import Qwen3MoeForCausalLM
from pagoda_daemon.pooling import BODY_ARCHITECTURES, ENCODER_ARCHITECTURES, is_encoder

MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "BertModel": BertModel,
    "XLMRobertaModel": XLMRobertaModel,
    "BertForSequenceClassification": BertForSequenceClassification,
    "XLMRobertaForSequenceClassification": XLMRobertaForSequenceClassification,
    "LlamaForSequenceClassification": LlamaForSequenceClassification,
    "Qwen3ForSequenceClassification": Qwen3ForSequenceClassification,
}


def resolve_model_class(config) -> type:
    archs = getattr(config, "architectures", None) or []
    for arch in archs:
        # a body without its head (embedding models): the same layers; an encoder with or without its head
        arch = BODY_ARCHITECTURES.get(arch, ENCODER_ARCHITECTURES.get(arch, arch))
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise ValueError(
        f"unsupported model architecture {archs or '(none given in config.json)'}; "
        f"Pagoda supports {sorted({*MODEL_REGISTRY, *BODY_ARCHITECTURES, *ENCODER_ARCHITECTURES})}"
    )


def is_model_body(config) -> bool:
    """Whether config.json names a model body without its language-model head (``Qwen3Model``):
    its checkpoint names the body's tensors without the ``model.`` prefix and holds no head."""
    return any(a in BODY_ARCHITECTURES for a in getattr(config, "architectures", None) or [])


def max_positions(config) -> int | None:
    """The longest sequence the model's position table holds (config.json's
    max_position_embeddings, less XLM-RoBERTa's offset), None when the config does not say."""
    limit = getattr(config, "max_position_embeddings", None)
    if limit is None:
        return None
    if is_encoder(getattr(config, "architectures", None)):
        limit -= position_offset(config)
    return int(limit)
