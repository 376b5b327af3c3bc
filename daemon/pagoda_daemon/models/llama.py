"""Llama-family decoder (Llama 2/3, and Qwen3 which adds per-head q/k RMSNorm).

Parameter names follow the Hugging Face checkpoints, except that q/k/v and gate/up
are merged into one matmul each; `stacked_params` tells the loader how to fill them.
"""

from __future__ import annotations

import torch
from torch import nn

from pagoda_daemon.attention.backend import AttentionBackend, AttentionMetadata, KVCacheSpec
from pagoda_daemon.distributed.parallel_state import (
    SINGLE,
    TensorParallel,
    Unsummed,
    kv_heads_per_rank,
    summed,
)
from pagoda_daemon.models.layers import (
    MergedLinear,
    ParallelLMHead,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    SiluAndMul,
    VocabParallelEmbedding,
    attend_step_rows,
    rope_parameters,
)


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class Attention(nn.Module):
    """Under tensor parallelism each rank holds num_heads / size query heads and its share of
    the KV heads (replicated when there are more ranks than KV heads); o_proj sums the ranks."""

    def __init__(self, config, backend: type[AttentionBackend], rotary: RotaryEmbedding, qk_norm: bool,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        kernels = backend.uses_kernels
        self.head_dim = head_dim_of(config)
        self.num_heads = tp.split(config.num_attention_heads, "the number of attention heads")
        self.num_kv_heads, first_kv_head = kv_heads_per_rank(config.num_key_value_heads, tp)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = getattr(config, "attention_bias", False)
        kv_rows = (first_kv_head * self.head_dim, self.kv_size, config.num_key_value_heads * self.head_dim)
        q_rows = (tp.rank * self.q_size, self.q_size, config.num_attention_heads * self.head_dim)
        self.qkv_proj = MergedLinear(
            config.hidden_size, {"q_proj": self.q_size, "k_proj": self.kv_size, "v_proj": self.kv_size}, bias, kernels,
            checkpoint_rows={"q_proj": q_rows, "k_proj": kv_rows, "v_proj": kv_rows},
        )
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, bias, kernels,
                                        tp)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, kernels) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, kernels) if qk_norm else None
        self.rotary = rotary  # one cos/sin table shared by every layer
        window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", False) else None
        self.attn = backend(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5, window)

    def forward(self, positions, hidden, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.project(positions, hidden)
        return summed(self.output(self.attend(q, k, v, kv_cache, meta)))

    def project(self, positions, hidden) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, H, D], k and v [T, KVH, D]: views of one projection, q and k rotated in place."""
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k, self.q_norm, self.k_norm)  # Qwen3's q/k norm first
        return q, k, v

    def attend(self, q, k, v, kv_cache, meta: AttentionMetadata, out: torch.Tensor | None = None) -> torch.Tensor:
        return attend_step_rows(self.attn, q, k, v, kv_cache, meta, out)

    def output(self, o: torch.Tensor) -> torch.Tensor | Unsummed:
        """The output projection of ``o``, its sum over the ranks left to the norm after it."""
        return self.o_proj.partial(o.reshape(-1, self.q_size))


class MLP(nn.Module):
    """gate/up column-parallel, down row-parallel: one sum over the ranks per MLP."""

    def __init__(self, hidden_size: int, intermediate_size: int, kernels: bool = False,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        local = tp.split(intermediate_size, "the MLP's intermediate size")
        rows = (tp.rank * local, local, intermediate_size)
        self.gate_up_proj = MergedLinear(hidden_size, {"gate_proj": local, "up_proj": local}, kernels=kernels,
                                         checkpoint_rows={"gate_proj": rows, "up_proj": rows})
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, kernels=kernels, tp=tp)
        self.act = SiluAndMul(kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor | Unsummed:
        """Its sum over the ranks left to the norm after it."""
        gate_up = self.gate_up_proj(x)
        if self.down_proj.skinny(gate_up):  # batch-1 decode: the activation inside the down projection
            return self.down_proj.partial_silu_mul(gate_up)
        return self.down_proj.partial(self.act(gate_up))


class DecoderLayer(nn.Module):
    def __init__(self, config, backend, rotary: RotaryEmbedding, qk_norm: bool, mlp: nn.Module,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.self_attn = Attention(config, backend, rotary, qk_norm, tp)
        self.mlp = mlp
        kernels = backend.uses_kernels
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)

    def forward(self, positions, hidden, residual, kv_cache, meta):
        q, k, v, residual = self.before_attention(positions, hidden, residual)
        return self.after_attention(self.self_attn.attend(q, k, v, kv_cache, meta), residual)

    # The layer in two halves around its attention, which needs the step's sequences: piecewise
    # CUDA graphs (worker/piecewise_graphs.py) capture everything but the attention.
    def before_attention(self, positions, hidden, residual):
        """(q, k, v, residual): the norm (adding the residual stream) and the projections."""
        if residual is None:  # the first layer: the embedding, summed
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        return (*self.self_attn.project(positions, hidden), residual)

    def after_attention(self, o, residual):
        """(hidden, residual) from the attention's output: its projection, the norm, the MLP.
        Under tensor parallelism the projections' sums are left to the norms after them (the
        next layer's, or the model's last, sums the MLP's), which can do both in one kernel."""
        hidden, residual = self.post_attention_layernorm(self.self_attn.output(o), residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    def __init__(self, config, layers: list[DecoderLayer], kernels: bool = False,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)

    def forward(self, input_ids, positions, kv_caches: list[torch.Tensor | None], meta) -> torch.Tensor:
        hidden = self.embed(input_ids, positions)
        residual = None
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if meta.wait_for_kv_layer is not None:  # this layer's offloaded KV may still be crossing
                meta.wait_for_kv_layer(index)
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta)
        return self.finish(hidden, residual)

    # What the piecewise graphs (worker/piecewise_graphs.py) run before the first layer and after
    # the last; an encoder body (models/bert.py) has the same three.
    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def finish(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """The final hidden states: the last layer's output, its residual added, normed."""
        return self.norm(hidden, residual)[0]

    @property
    def hidden_size(self) -> int:
        return self.norm.weight.shape[0]


class LlamaForCausalLM(nn.Module):
    qk_norm = False
    stacked_params = (
        ("qkv_proj", "q_proj"),
        ("qkv_proj", "k_proj"),
        ("qkv_proj", "v_proj"),
        ("gate_up_proj", "gate_proj"),
        ("gate_up_proj", "up_proj"),
    )

    def __init__(self, config, backend: type[AttentionBackend], max_positions: int,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        rotary = RotaryEmbedding(head_dim_of(config), max_positions, rope_parameters(config), backend.uses_kernels)
        layers = [self.make_layer(config, backend, rotary, i) for i in range(config.num_hidden_layers)]
        self.model = DecoderModel(config, layers, backend.uses_kernels, tp.dense)
        self.make_head(config, backend, tp)

    def make_head(self, config, backend: type[AttentionBackend], tp: TensorParallel) -> None:
        """The language-model head (the embedding itself where the config ties them)."""
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, backend.uses_kernels, tp.dense)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def make_layer(self, config, backend, rotary: RotaryEmbedding, index: int) -> DecoderLayer:
        mlp = MLP(config.hidden_size, config.intermediate_size, backend.uses_kernels, self.tp.dense)
        return DecoderLayer(config, backend, rotary, self.qk_norm, mlp, self.tp.dense)

    def kv_cache_spec(self) -> KVCacheSpec:
        """This rank's KV cache: its share of the KV heads."""
        c = self.config
        return KVCacheSpec(c.num_hidden_layers, kv_heads_per_rank(c.num_key_value_heads, self.tp.dense)[0], head_dim_of(c))

    def forward(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True


class ScoreHead:
    """A decoder whose head scores instead of predicting the next token (``...ForSequenceClassification``:
    Qwen3-Reranker's sequence-classification conversions, reward models): the last token's final
    state through Hugging Face's ``score`` (a linear layer without bias, one output per label),
    replicated under tensor parallelism, run by the model runner on each pooled row."""

    config: object
    score: nn.Linear

    def make_head(self, config, backend: type[AttentionBackend], tp: TensorParallel) -> None:
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """Each row's label scores (float32, before any activation) from its pooled float32 state."""
        return self.score(pooled.to(self.score.weight.dtype)).float()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a sequence classifier has no language-model head: it serves scores (runner pooling)")


class LlamaForSequenceClassification(ScoreHead, LlamaForCausalLM):
    pass


class Qwen3ForSequenceClassification(ScoreHead, Qwen3ForCausalLM):
    pass
