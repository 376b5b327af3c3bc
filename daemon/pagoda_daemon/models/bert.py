"""BERT-family encoders (BERT, XLM-RoBERTa): the embedding models most deployments run
(bge, e5, gte, all-MiniLM, multilingual-e5, bge-m3), and with a sequence-classification head the
cross-encoder rerankers (bge-reranker, ms-marco-MiniLM), served for embeddings and scores.

An encoder differs from the decoders in three ways that matter here: every token attends to
the whole sequence (the attention backend is built with ``causal=False``), positions are a
learned table (XLM-RoBERTa's counted from ``pad_token_id + 1``), and each sub-layer is
normed after its residual add (post-LayerNorm, with biases). Its hidden states are those of
Hugging Face's ``BertModel`` / ``XLMRobertaModel`` (``last_hidden_state``), which
sentence-transformers pools. A classifier's text pair carries token types (0 for the first text,
1 for the second: BERT's segments); every other input is token type 0 throughout.

Because attention is bidirectional, a prompt's hidden states depend on all of it: an encoder
engine never splits a prompt across steps nor reuses cached prefixes (engine_core.py turns
both off), so each step attends over its own fresh K/V. The layers keep the decoder's
interface (``before_attention`` / ``after_attention`` around the backend call; ``embed`` and
``finish`` on the body), so the piecewise CUDA graphs and tensor parallelism run them as
they run the decoders. Parameter names follow ours; ``checkpoint_name`` maps Hugging Face's.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from pagoda_daemon.attention.backend import AttentionBackend, AttentionMetadata, KVCacheSpec
from pagoda_daemon.distributed.parallel_state import SINGLE, TensorParallel
from pagoda_daemon.models.layers import (
    MergedLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    attend_step_rows,
)

# transformers' names for the activations an encoder may use, as torch computes them
ACTIVATIONS = {"gelu": lambda x: F.gelu(x), "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
               "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}


def check_encoder_config(config) -> None:
    """ValueError naming what an encoder config asks for that is not served."""
    kind = getattr(config, "position_embedding_type", "absolute") or "absolute"
    if kind != "absolute":
        raise ValueError(f"position_embedding_type {kind!r} is not served: Pagoda's encoders use absolute positions")
    if config.hidden_act not in ACTIVATIONS:
        raise ValueError(f"hidden_act {config.hidden_act!r} is not served by Pagoda's encoders "
                         f"(served: {sorted(ACTIVATIONS)})")
    if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
        raise ValueError("a BERT-family decoder (is_decoder, add_cross_attention) is not served: encoders only")


class EncoderAttention(nn.Module):
    """Bidirectional multi-head attention with biases; heads split over the tensor-parallel ranks."""

    def __init__(self, config, backend: type[AttentionBackend], tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        kernels = backend.uses_kernels
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.num_heads = self.num_kv_heads = tp.split(config.num_attention_heads, "the number of attention heads")
        self.q_size = self.num_heads * self.head_dim
        rows = (tp.rank * self.q_size, self.q_size, config.hidden_size)
        self.qkv_proj = MergedLinear(config.hidden_size, {"query": self.q_size, "key": self.q_size,
                                                          "value": self.q_size}, True, kernels,
                                     checkpoint_rows={"query": rows, "key": rows, "value": rows})
        self.o_proj = RowParallelLinear(config.hidden_size, config.hidden_size, True, kernels, tp)
        self.attn = backend(self.num_heads, self.num_heads, self.head_dim, self.head_dim**-0.5, causal=False)

    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self.qkv_proj(hidden).split([self.q_size] * 3, dim=-1)
        shape = (-1, self.num_heads, self.head_dim)
        return q.view(shape), k.view(shape), v.view(shape)

    def attend(self, q, k, v, kv_cache, meta: AttentionMetadata, out: torch.Tensor | None = None) -> torch.Tensor:
        return attend_step_rows(self.attn, q, k, v, kv_cache, meta, out)


class EncoderLayer(nn.Module):
    """attention -> add & LayerNorm -> intermediate (activation) -> output -> add & LayerNorm."""

    def __init__(self, config, backend: type[AttentionBackend], tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        kernels = backend.uses_kernels
        self.self_attn = EncoderAttention(config, backend, tp)
        self.attention_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        local = tp.split(config.intermediate_size, "the intermediate size")
        self.up_proj = MergedLinear(config.hidden_size, {"intermediate": local}, True, kernels,
                                    checkpoint_rows={"intermediate": (tp.rank * local, local, config.intermediate_size)})
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, True, kernels, tp)
        self.output_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, positions, hidden, residual, kv_cache, meta):
        q, k, v, residual = self.before_attention(positions, hidden, residual)
        return self.after_attention(self.self_attn.attend(q, k, v, kv_cache, meta), residual)

    def before_attention(self, positions, hidden, residual):
        """(q, k, v, residual): the layer's input is its own residual (normed already)."""
        return (*self.self_attn.project(hidden), hidden)

    def after_attention(self, o, residual):
        """(the layer's output, None): post-norm layers hand the next one no separate residual."""
        attended = self.attention_norm(self.self_attn.o_proj(o.reshape(o.shape[0], -1)) + residual)
        out = self.down_proj(self.act(self.up_proj(attended)))
        return self.output_norm(out + attended), None


class EncoderEmbeddings(nn.Module):
    def __init__(self, config, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(max(1, config.type_vocab_size), config.hidden_size)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.position_offset = position_offset(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_types: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.word_embeddings(input_ids) + self.position_embeddings(positions + self.position_offset)
        if token_types is None:
            return self.norm(hidden + self.token_type_embeddings.weight[0])  # one segment: token type 0
        return self.norm(hidden + self.token_type_embeddings(token_types))


class EncoderBody(nn.Module):
    def __init__(self, config, backend: type[AttentionBackend], tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.embeddings = EncoderEmbeddings(config, tp)
        self.layers = nn.ModuleList(EncoderLayer(config, backend, tp) for _ in range(config.num_hidden_layers))
        self.hidden_size = config.hidden_size

    def forward(self, input_ids, positions, kv_caches: list[torch.Tensor | None], meta,
                token_types: torch.Tensor | None = None) -> torch.Tensor:
        hidden, residual = self.embed(input_ids, positions, token_types), None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta)
        return self.finish(hidden, residual)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor,
              token_types: torch.Tensor | None = None) -> torch.Tensor:
        """The first layer's input; ``token_types`` (None: all 0) per token, 0 or 1."""
        return self.embeddings(input_ids, positions, token_types)

    def finish(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        return hidden  # the last layer normed its output already


def position_offset(config) -> int:
    """Where position 0 sits in the position table: XLM-RoBERTa counts from pad_token_id + 1."""
    if config.model_type in ("xlm-roberta", "roberta"):
        return int(config.pad_token_id) + 1
    return 0


# Hugging Face's names (after the prefix a task head adds) -> ours; None: not part of the body
_RENAMES = (
    (re.compile(r"^embeddings\.LayerNorm\."), "embeddings.norm."),
    (re.compile(r"^encoder\.layer\.(\d+)\.attention\.self\.(query|key|value)\."), r"layers.\1.self_attn.\2."),
    (re.compile(r"^encoder\.layer\.(\d+)\.attention\.output\.dense\."), r"layers.\1.self_attn.o_proj."),
    (re.compile(r"^encoder\.layer\.(\d+)\.attention\.output\.LayerNorm\."), r"layers.\1.attention_norm."),
    (re.compile(r"^encoder\.layer\.(\d+)\.intermediate\.dense\."), r"layers.\1.intermediate."),
    (re.compile(r"^encoder\.layer\.(\d+)\.output\.dense\."), r"layers.\1.down_proj."),
    (re.compile(r"^encoder\.layer\.(\d+)\.output\.LayerNorm\."), r"layers.\1.output_norm."),
)
_NOT_THE_BODY = ("pooler.", "cls.", "lm_head.", "classifier.", "qa_outputs.")


class BertModel(nn.Module):
    """A BERT encoder's body, as ``BertModel`` and sentence-transformers checkpoints hold it."""

    causal = False
    # whether the model runner hands the body each token's type: only a classifier's pairs carry a
    # second segment, and only where the model has a second token type (BERT's, not XLM-RoBERTa's)
    takes_token_types = False
    stacked_params = (
        ("qkv_proj", "query"),
        ("qkv_proj", "key"),
        ("qkv_proj", "value"),
        ("up_proj", "intermediate"),
    )

    def __init__(self, config, backend: type[AttentionBackend], max_positions: int,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        check_encoder_config(config)
        self.config = config
        self.tp = tp.dense
        self.model = EncoderBody(config, backend, self.tp)

    @staticmethod
    def checkpoint_name(name: str) -> str | None:
        """Our parameter's name for a checkpoint tensor, or None for one the body does not use
        (a task head, the pooler, the position-id buffers)."""
        for prefix in ("bert.", "roberta.", "model."):
            name = name.removeprefix(prefix)
        if name.startswith(_NOT_THE_BODY) or name.endswith(("position_ids", "token_type_ids")):
            return None
        name = re.sub(r"LayerNorm\.gamma$", "LayerNorm.weight", re.sub(r"LayerNorm\.beta$", "LayerNorm.bias", name))
        for pattern, ours in _RENAMES:
            name, found = pattern.subn(ours, name)
            if found:
                break
        return "model." + name

    def kv_cache_spec(self) -> KVCacheSpec:
        """The cache the engine's block accounting runs on: written, never read back (every step
        attends over its own fresh K/V)."""
        c = self.config
        return KVCacheSpec(c.num_hidden_layers, self.tp.split(c.num_attention_heads, "the number of attention heads"),
                           c.hidden_size // c.num_attention_heads)

    def forward(self, input_ids, positions, kv_caches, meta, token_types: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, meta, token_types)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("an encoder has no language-model head: it serves embeddings (runner pooling)")


class XLMRobertaModel(BertModel):
    """RoBERTa and XLM-RoBERTa (bge-m3, multilingual-e5): BERT's layers, positions counted from
    pad + 1 (``position_offset``)."""


class ClassifierHead(nn.Module):
    """The first token's state -> dense -> tanh -> one score per label: BERT's pooler and
    classifier, and RoBERTa's classification head, are this one shape (dropout is training's).
    Replicated under tensor parallelism: it runs on one row per request."""

    def __init__(self, hidden_size: int, num_labels: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.out_proj = nn.Linear(hidden_size, num_labels)

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(pooled)))


class BertForSequenceClassification(BertModel):
    """A BERT cross-encoder (ms-marco-MiniLM, ...): the body, then ``classify`` on the pooled
    [CLS] row of each request. Hugging Face keeps the head's first layer as the body's pooler."""

    _HEAD = (("pooler.dense.", "classifier.dense."), ("classifier.", "classifier.out_proj."))

    def __init__(self, config, backend: type[AttentionBackend], max_positions: int,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__(config, backend, max_positions, tp)
        self.classifier = ClassifierHead(config.hidden_size, config.num_labels)
        self.takes_token_types = config.type_vocab_size > 1

    @classmethod
    def checkpoint_name(cls, name: str) -> str | None:  # type: ignore[override]
        bare = name.removeprefix("bert.").removeprefix("roberta.")
        for theirs, ours in cls._HEAD:
            if bare.startswith(theirs):
                return ours + bare.removeprefix(theirs)
        return BertModel.checkpoint_name(name)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """Each row's label scores (float32, before any activation) from its pooled float32 state."""
        return self.classifier(pooled.to(self.classifier.dense.weight.dtype)).float()


class XLMRobertaForSequenceClassification(BertForSequenceClassification):
    """An XLM-RoBERTa cross-encoder (bge-reranker-base/large/v2-m3): the head holds both layers."""

    _HEAD = (("classifier.dense.", "classifier.dense."), ("classifier.out_proj.", "classifier.out_proj."))
