"""Tiny random-weight checkpoints, written in Hugging Face format and loaded like real ones.

Used by the tests, the README's demo and the GPU benchmarks: nothing is downloaded.
The tokenizer is a byte-level BPE trained here on a small embedded text, so any
string (including multi-byte UTF-8) round-trips.
"""

from __future__ import annotations

from pathlib import Path

ARCHITECTURES = ("llama", "qwen3", "qwen3_moe")
BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"

_CORPUS = """
Pagoda serves large language models on Kubernetes. A user writes one InferenceService and
runs kubectl apply; an operator turns it into pods, and each pod runs a paged-attention engine.
The capital of France is Paris. The quick brown fox jumps over the lazy dog. Paged attention
stores the key and value cache in fixed-size blocks, so memory is never fragmented and
prefixes can be shared between requests. Continuous batching lets new requests join a running
batch at every step. Chunked prefill splits long prompts so that decodes keep flowing.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 1024 4096. Punctuation: , . ; : ! ? ( ) [ ] { } " ' -
Accents and scripts: café, naïve, Straße, déjà vu, 東京, 日本語, Москва, Ελλάδα, 🚀 🐍 ✨.
def main():\n    return "hello, world"\n
"""

_CHAT_TEMPLATE = (
    # tools as Qwen3's template offers them and its model calls them (<tool_call> JSON blocks)
    "{% if tools %}<|system|>\n# Tools\n<tools>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "</tools>\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call>\n{% endif %}"
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% for call in message['tool_calls'] or [] %}<tool_call>\n{\"name\": \"{{ call['function']['name'] }}\", "
    "\"arguments\": {{ call['function']['arguments'] | tojson }}}\n</tool_call>\n{% endfor %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    # as Qwen3's template: chat_template_kwargs {"enable_thinking": false} opens and closes the thought
    "{% if add_generation_prompt and enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n"
    "{% endif %}"
)


def build_tokenizer(vocab_size: int = 512):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([line for line in _CORPUS.splitlines() if line] * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD)
    fast.chat_template = _CHAT_TEMPLATE
    return fast


def tiny_config(arch: str, vocab_size: int, **overrides):
    """A small config of each supported family, exercising what makes each family differ."""
    from transformers import LlamaConfig, Qwen3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    if arch == "llama":
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        cfg = dict(common, tie_word_embeddings=False, rope_parameters=rope)
        cfg.update(overrides)
        return LlamaConfig(**cfg)
    if arch == "qwen3":
        cfg = dict(common, tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
        cfg.update(overrides)
        return Qwen3Config(**cfg)
    if arch == "qwen3_moe":
        cfg = dict(
            common,
            tie_word_embeddings=False,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        )
        cfg.update(overrides)
        return Qwen3MoeConfig(**cfg)
    raise ValueError(f"unknown tiny architecture {arch!r}; choose from {ARCHITECTURES}")


def build_tiny_model(
    arch: str,
    out_dir: str | Path,
    seed: int = 0,
    dtype: str = "float32",
    max_shard_size: str | None = None,
    weight_std: float = 0.08,
    num_labels: int = 0,
    **config_overrides,
) -> Path:
    """Write config.json, *.safetensors and the tokenizer for a random `arch` model to out_dir.

    Weights are drawn wider than the usual 0.02 so that next-token logits are well
    separated and greedy decoding is a sharp test of numerical parity. With ``num_labels``: a
    sequence classifier (``...ForSequenceClassification``, a ``score`` head) instead.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    if num_labels:
        config_overrides["num_labels"] = num_labels
    config = tiny_config(arch, len(tokenizer), **config_overrides)
    torch.manual_seed(seed)
    auto = AutoModelForSequenceClassification if num_labels else AutoModelForCausalLM
    model = auto.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, weight_std)
            elif "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, weight_std)
    model = model.to(getattr(torch, dtype))
    model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=1, pad_token_id=2)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(out), **kwargs)
    tokenizer.save_pretrained(str(out))
    return out


def build_tiny_embedding_model(
    arch: str,
    out_dir: str | Path,
    seed: int = 0,
    pooling: str = "last",
    normalize: bool = True,
    body: bool = True,
    **config_overrides,
) -> Path:
    """A random ``arch`` model laid out as a sentence-transformers embedding model: with ``body``,
    the model without its language-model head, as AutoModel saves it (``Qwen3Model``: tensors
    without the ``model.`` prefix, as Qwen3-Embedding ships), else the whole causal model; a
    ``modules.json`` with a Pooling module of mode ``pooling`` (last, mean, cls) and, with
    ``normalize``, a Normalize module. The same weights as ``build_tiny_model(arch, seed=seed)``."""
    import json

    import torch
    from transformers import AutoModel

    out = Path(build_tiny_model(arch, out_dir, seed=seed, **config_overrides))
    if body:
        full = AutoModel.from_pretrained(str(out), dtype=torch.float32)  # the body of what was just written
        for f in out.glob("*.safetensors"):
            f.unlink()
        full.save_pretrained(str(out))
    write_sentence_transformers_files(out, json.loads((out / "config.json").read_text())["hidden_size"], pooling,
                                      normalize)
    return out


def write_sentence_transformers_files(out: Path, hidden_size: int, pooling: str, normalize: bool) -> None:
    """The modules.json and Pooling config of a sentence-transformers model pooling by ``pooling``
    (last, mean, cls), with a Normalize module when ``normalize``."""
    import json

    modes = {"last": "pooling_mode_lasttoken", "mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token"}
    (out / "1_Pooling").mkdir(exist_ok=True)
    (out / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": hidden_size, **{key: key == modes[pooling] for key in modes.values()}}))
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (out / "modules.json").write_text(json.dumps(modules))


# The encoders' special tokens, ids from 0 in this order, and the template a single text takes
_ENCODER_SPECIALS = {"bert": (("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"), "[CLS]", "[SEP]"),
                     "xlm-roberta": (("<s>", "<pad>", "</s>", "<unk>", "<mask>"), "<s>", "</s>")}
ENCODERS = tuple(_ENCODER_SPECIALS)


def build_encoder_tokenizer(arch: str, vocab_size: int = 512):
    """A byte-level BPE with the encoder's special tokens, wrapping each text as BERT's ([CLS]
    text [SEP]) or XLM-RoBERTa's (<s> text </s>) tokenizer does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials, first, last = _ENCODER_SPECIALS[arch]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([line for line in _CORPUS.splitlines() if line] * 4, trainer)
    # pairs as each family's tokenizer makes them: BERT's second segment is token type 1,
    # XLM-RoBERTa's pair is <s> a </s></s> b </s> in one segment
    pair = f"{first} $A {last} $B:1 {last}:1" if arch == "bert" else f"{first} $A {last} {last} $B {last}"
    tok.post_processor = processors.TemplateProcessing(
        single=f"{first} $A {last}", pair=pair,
        special_tokens=[(first, specials.index(first)), (last, specials.index(last))])
    names = dict(zip(("pad_token", "unk_token", "cls_token", "sep_token", "mask_token"), specials, strict=True))
    if arch == "xlm-roberta":
        names = {"bos_token": "<s>", "pad_token": "<pad>", "eos_token": "</s>", "unk_token": "<unk>",
                 "mask_token": "<mask>", "cls_token": "<s>", "sep_token": "</s>"}
    return PreTrainedTokenizerFast(tokenizer_object=tok, **names)


def build_tiny_encoder(arch: str, out_dir: str | Path, seed: int = 0, pooling: str = "cls", normalize: bool = True,
                       sentence_transformers: bool = True, weight_std: float = 0.08, num_labels: int = 0,
                       **config_overrides) -> Path:
    """A random BERT (saved as ``BertModel`` saves its body) or XLM-RoBERTa (saved with its
    masked-LM head, the ``roberta.`` prefix and a position table offset by pad + 1) with its
    tokenizer; with ``sentence_transformers``, the modules.json and Pooling config of an
    embedding model pooling by ``pooling``. With ``num_labels``: a cross-encoder instead
    (``...ForSequenceClassification`` with that many labels, no sentence-transformers files)."""
    import torch
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        BertModel,
        XLMRobertaConfig,
        XLMRobertaForMaskedLM,
        XLMRobertaForSequenceClassification,
    )

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_encoder_tokenizer(arch)
    common = dict(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=128, hidden_act="gelu", layer_norm_eps=1e-12)
    torch.manual_seed(seed)
    if num_labels:
        common["num_labels"] = num_labels
    config: BertConfig | XLMRobertaConfig
    model: torch.nn.Module
    if arch == "bert":
        config = BertConfig(**common, max_position_embeddings=256, type_vocab_size=2, pad_token_id=0,
                            **config_overrides)
        model = BertForSequenceClassification(config) if num_labels else BertModel(config, add_pooling_layer=True)
    else:
        config = XLMRobertaConfig(**common, max_position_embeddings=258, type_vocab_size=1, pad_token_id=1,
                                  bos_token_id=0, eos_token_id=2, **config_overrides)
        model = XLMRobertaForSequenceClassification(config) if num_labels else XLMRobertaForMaskedLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm.weight" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, weight_std)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    if sentence_transformers and not num_labels:
        write_sentence_transformers_files(out, config.hidden_size, pooling, normalize)
    return out
