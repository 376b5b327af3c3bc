"""Embeddings and classifiers: what a pooling request asks for, and how a model directory says
it pools.

An engine runs as a generator or as a pooler (``runner``, vLLM's ``--runner``): a pooling engine
computes each prompt once and returns one vector made from its final hidden states (after the
model's last norm) instead of sampling tokens: the last token's (``last``, for causal embedding
models such as Qwen3-Embedding), the first token's (``cls``) or their mean (``mean``). The
vector is then cut to ``dimensions`` (Matryoshka models) and scaled to unit length when
``normalize``, in that order, as sentence-transformers and vLLM do.

A sequence classifier (``BertForSequenceClassification``, ...: cross-encoder rerankers such as
bge-reranker and ms-marco-MiniLM) pools the same way and runs its head on the vector: the reply is
one score per label, through the activation its config names (``classifier_activation``). A text
pair (query, document) is one prompt whose second text has token type 1 from ``token_type_start``.

A model directory says how it pools as sentence-transformers writes it: ``modules.json`` lists
its modules, the Pooling module's ``config.json`` its mode and a Normalize module that the
vectors are unit length. No torch here: the API process reads this too.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from pagoda_daemon.config import POOLING_TYPES
from pagoda_daemon.sampling_params import SamplingParams

# Architectures that are a model's body without a language-model head (AutoModel's classes):
# served for embeddings only. Each maps to the class that serves its body (models/registry.py).
BODY_ARCHITECTURES = {"LlamaModel": "LlamaForCausalLM", "Qwen3Model": "Qwen3ForCausalLM",
                      "Qwen3MoeModel": "Qwen3MoeForCausalLM"}
# Encoders (bidirectional attention, models/bert.py): served for embeddings, whether the checkpoint
# is the body alone or carries a masked-LM head (which is not read); with a sequence-classification
# head, for classification and scoring.
ENCODER_ARCHITECTURES = {"BertModel": "BertModel", "BertForMaskedLM": "BertModel",
                         "RobertaModel": "XLMRobertaModel", "RobertaForMaskedLM": "XLMRobertaModel",
                         "XLMRobertaModel": "XLMRobertaModel", "XLMRobertaForMaskedLM": "XLMRobertaModel",
                         "BertForSequenceClassification": "BertForSequenceClassification",
                         "RobertaForSequenceClassification": "XLMRobertaForSequenceClassification",
                         "XLMRobertaForSequenceClassification": "XLMRobertaForSequenceClassification"}
# Sequence classifiers: served for classification and scoring, never for embeddings. The encoders
# (cross-encoders) pool their first token, the decoders (Qwen3-Reranker's conversions, reward
# models) their last.
DECODER_CLASSIFIERS = frozenset({"LlamaForSequenceClassification", "Qwen3ForSequenceClassification"})
CLASSIFIER_ARCHITECTURES = DECODER_CLASSIFIERS | {a for a in ENCODER_ARCHITECTURES
                                                  if a.endswith("ForSequenceClassification")}
# The activations a classifier's scores may go through, by the torch.nn module a config names
# (sentence-transformers' CrossEncoder ``activation_fn``): applied on the host, per request.
ACTIVATIONS = ("none", "sigmoid", "softmax", "tanh")
_TORCH_ACTIVATIONS = {"torch.nn.modules.linear.Identity": "none", "torch.nn.modules.activation.Sigmoid": "sigmoid",
                      "torch.nn.modules.activation.Softmax": "softmax", "torch.nn.modules.activation.Tanh": "tanh"}
# sentence-transformers' Pooling config keys, in the order they are read, and the types they mean
_ST_MODES = (("pooling_mode_lasttoken", "last"), ("pooling_mode_mean_tokens", "mean"),
             ("pooling_mode_cls_token", "cls"))
_ST_UNSERVED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")
MAX_CONFIG_BYTES = 1 << 20  # a modules.json or Pooling config.json larger than this is not one
# What a pooling request carries where the engine expects sampling parameters: nothing is sampled.
NOTHING_SAMPLED = SamplingParams(temperature=0.0, max_tokens=1)


class PoolingParams(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One pooling request: how its vector is made (``type``: the engine's, stamped by the
    frontend), whether it is scaled to unit length, and the leading dimensions kept (None: all).
    A classifier's request: the activation its label scores go through, and for a text pair the
    prompt position where the second text starts (token type 1 from there on)."""

    type: str = "last"
    normalize: bool = True
    dimensions: int | None = None
    activation: str = "none"
    token_type_start: int | None = None

    def check(self, hidden_size: int) -> None:
        """ValueError naming the field when this cannot be served by a model of ``hidden_size``."""
        if self.type not in POOLING_TYPES[1:]:
            raise ValueError(f"pooling type must be one of {POOLING_TYPES[1:]}, got {self.type!r}")
        if not isinstance(self.normalize, bool):
            raise ValueError("normalize must be true or false")
        d = self.dimensions
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or not 1 <= d <= hidden_size):
            raise ValueError(f"dimensions must be an integer from 1 to the model's {hidden_size}, got {d!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        start = self.token_type_start
        if start is not None and (isinstance(start, bool) or not isinstance(start, int) or start < 1):
            raise ValueError(f"token_type_start must be a positive prompt position, got {start!r}")

    @property
    def every_position(self) -> bool:
        """Whether every prompt position's hidden state is needed (not only the last token's):
        such a request computes its whole prompt, without the prefix cache."""
        return self.type != "last"


@dataclass(frozen=True)
class ModelPooling:
    """How a model directory pools when nothing overrides it."""

    type: str = "last"
    normalize: bool = True
    matryoshka: bool = False  # config.json says the leading dimensions are an embedding on their own


def _read_json(path: Path) -> dict | list | None:
    try:
        if not path.is_file() or path.stat().st_size > MAX_CONFIG_BYTES:
            return None
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def is_encoder(architectures: list[str] | None) -> bool:
    return any(a in ENCODER_ARCHITECTURES for a in architectures or [])


def is_classifier(architectures: list[str] | None) -> bool:
    return any(a in CLASSIFIER_ARCHITECTURES for a in architectures or [])


def classifier_activation(hf_config: Any) -> str:
    """The activation a classifier's scores go through unless a request turns it off, as
    transformers' loss for its ``problem_type`` implies, else as sentence-transformers' CrossEncoder
    config names it, else sigmoid for one label and softmax over several (vLLM 0.26's order).
    ValueError for a torch module that is not one of the activations served."""
    num_labels = int(getattr(hf_config, "num_labels", 1) or 1)
    problem = getattr(hf_config, "problem_type", None)
    if problem == "regression":
        return "none"
    if problem == "multi_label_classification":
        return "sigmoid"
    if problem != "single_label_classification":
        st = getattr(hf_config, "sentence_transformers", None)
        named = st.get("activation_fn") if isinstance(st, dict) else None
        named = named or getattr(hf_config, "sbert_ce_default_activation_function", None)
        if named is not None:
            if named not in _TORCH_ACTIVATIONS:
                raise ValueError(f"the classifier's activation {named!r} (config.json) is not served; Pagoda serves "
                                 f"{sorted(_TORCH_ACTIVATIONS)}")
            return _TORCH_ACTIVATIONS[named]
    return "sigmoid" if num_labels < 2 else "softmax"


def classifier_labels(hf_config: Any) -> tuple[str, ...]:
    """Each label's name, in score order (config.json's id2label; LABEL_i where it has none)."""
    num_labels = int(getattr(hf_config, "num_labels", 1) or 1)
    names = getattr(hf_config, "id2label", None) or {}
    return tuple(str(names.get(i, names.get(str(i), f"LABEL_{i}"))) for i in range(num_labels))


def model_pooling(model_dir: str | Path, hf_config: object = None) -> ModelPooling:
    """The pooling the directory's sentence-transformers files describe; where they say nothing,
    unit length and the last token for a causal model, the first ([CLS]) for an encoder (vLLM's
    defaults). ValueError for a pooling mode Pagoda does not serve."""
    root = Path(model_dir)
    modules = _read_json(root / "modules.json")
    pooling_type = "cls" if is_encoder(getattr(hf_config, "architectures", None)) else "last"
    normalize = True
    if isinstance(modules, list):
        kinds = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
        normalize = "Normalize" in kinds
        pooling = kinds.get("Pooling")
        if pooling is not None:
            cfg = _read_json(root / str(pooling.get("path", "")) / "config.json")
            if isinstance(cfg, dict):
                unserved = [k for k in _ST_UNSERVED if cfg.get(k)]
                if unserved:
                    raise ValueError(f"the model pools by {unserved[0]} (sentence-transformers); Pagoda pools by "
                                     "the last token, the mean or the first token (--pooling-type)")
                pooling_type = next((t for key, t in _ST_MODES if cfg.get(key)), pooling_type)
    matryoshka = bool(getattr(hf_config, "is_matryoshka", False) or getattr(hf_config, "matryoshka_dimensions", None))
    return ModelPooling(pooling_type, normalize, matryoshka)


def resolve_runner(runner: str, model_dir: str | Path, architectures: list[str] | None) -> str:
    """``generate`` or ``pooling``: as asked, or (auto) pooling for a model body without a head
    (``Qwen3Model``, ...), an encoder (``BertModel``, ...) and a sentence-transformers directory,
    else generate. ValueError for an encoder asked to generate."""
    if architectures and (is_encoder(architectures) or is_classifier(architectures)):
        if runner == "generate":
            what = "an encoder" if is_encoder(architectures) else "a sequence classifier"
            serves = "classification and scoring" if is_classifier(architectures) else "embeddings"
            raise ValueError(f"{architectures[0]} is {what}: it serves {serves} (runner pooling), not generation")
        return "pooling"
    if runner != "auto":
        return runner
    if any(a in BODY_ARCHITECTURES for a in architectures or []):
        return "pooling"
    return "pooling" if (Path(model_dir) / "modules.json").is_file() else "generate"


@dataclass(frozen=True)
class EnginePooling:
    """A pooling engine's settings, from its options over what the model directory says."""

    type: str
    normalize: bool  # a request that does not say
    hidden_size: int
    matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] = ()  # the cuts the model was trained for (empty: any)
    # "embed": one vector per prompt; "classify": the scores of a classifier's labels
    task: str = "embed"
    labels: tuple[str, ...] = ()  # a classifier's label names, in score order
    activation: str = "none"  # a classifier's scores go through this unless a request turns it off

    @property
    def classifies(self) -> bool:
        return self.task == "classify"

    def classify_params(self, use_activation: bool | None = None,
                        token_type_start: int | None = None) -> PoolingParams:
        """A classifier request's PoolingParams (``token_type_start``: a text pair's second text)."""
        assert self.classifies, "classify_params of an embedding engine"
        activation = self.activation if use_activation is not False else "none"
        params = PoolingParams(self.type, False, None, activation, token_type_start)
        params.check(self.hidden_size)
        return params

    def params(self, normalize: bool | None = None, dimensions: int | None = None) -> PoolingParams:
        """A request's PoolingParams; ValueError naming the field when it cannot be served."""
        if dimensions is not None:
            if not self.matryoshka:
                raise ValueError("dimensions: this model does not support Matryoshka embeddings (its config.json "
                                 "sets neither is_matryoshka nor matryoshka_dimensions): its vectors cannot be cut")
            if self.matryoshka_dimensions and dimensions not in self.matryoshka_dimensions:
                raise ValueError(f"dimensions: this model's vectors are cut to one of {list(self.matryoshka_dimensions)}, "
                                 f"got {dimensions}")
        params = PoolingParams(self.type, self.normalize if normalize is None else normalize, dimensions)
        params.check(self.hidden_size)
        return params


def engine_pooling(config: Any, model_config: Any) -> EnginePooling | None:
    """The pooling an engine of ``config`` (an EngineConfig) serves for the model of
    ``model_config`` (its config.json), or None when it generates. ValueError for what a
    pooling engine cannot do (the API server and the engine core both ask)."""
    runner = resolve_runner(config.runner, config.model, getattr(model_config, "architectures", None))
    if runner == "generate":
        return None
    if config.kv_offload_disk_source or config.kv_transfer_port:
        raise ValueError("prefill/decode disaggregation (kv_offload_disk_source, kv_transfer_port) serves "
                         "generation, and this model is served for embeddings (runner pooling)")
    if config.enable_lora:
        raise ValueError("LoRA adapters are served for generation: enable_lora does not combine with embeddings "
                         "(runner pooling) yet")
    if is_encoder(getattr(model_config, "architectures", None)) and (config.kv_offload_cpu_gib
                                                                    or config.kv_offload_disk_path):
        raise ValueError("KV offload (kv_offload_cpu_gib, kv_offload_disk_path) keeps prefixes to reuse, and an "
                         "encoder's prompts share none (each token sees the whole prompt)")
    architectures = getattr(model_config, "architectures", None)
    if is_classifier(architectures):
        pooled = "cls" if is_encoder(architectures) else "last"
        if config.pooling_type not in ("auto", pooled) or config.pooling_normalize:
            which = "first token ([CLS])" if pooled == "cls" else "last token"
            raise ValueError(f"a sequence classifier pools its {which} as its head was trained: "
                             "pooling_type and pooling_normalize do not apply")
        return EnginePooling(pooled, False, int(model_config.hidden_size), task="classify",
                             labels=classifier_labels(model_config), activation=classifier_activation(model_config))
    found = model_pooling(config.model, model_config)
    cuts = getattr(model_config, "matryoshka_dimensions", None) or ()
    return EnginePooling(found.type if config.pooling_type == "auto" else config.pooling_type,
                         found.normalize if config.pooling_normalize is None else config.pooling_normalize,
                         int(model_config.hidden_size), found.matryoshka,
                         tuple(d for d in cuts if isinstance(d, int) and not isinstance(d, bool)))


def as_texts(side: str | Sequence[str]) -> list[str]:
    """One side of a scoring request (a text, or several) as a list of texts."""
    return [side] if isinstance(side, str) else list(side)


def pair_up(firsts: list, seconds: list) -> list[tuple[int, int]]:
    """The (first, second) index pairs a scoring request asks for: one first text against each
    second (1:N), or the texts side by side (N:N). ValueError otherwise."""
    if not firsts or not seconds:
        raise ValueError("scoring needs at least one text on each side")
    if len(firsts) == 1:
        return [(0, j) for j in range(len(seconds))]
    if len(firsts) != len(seconds):
        raise ValueError(f"the two sides must be 1:N or N:N, got {len(firsts)}:{len(seconds)}")
    return [(i, i) for i in range(len(firsts))]


def cosine(a: bytes, b: bytes) -> float:
    """The cosine similarity of two vectors as the engine sends them (float32 little-endian):
    an embedding model's score of a pair (vLLM's bi-encoder scoring). 0 for a zero vector."""
    import numpy as np

    x, y = np.frombuffer(a, dtype="<f4").astype(np.float64), np.frombuffer(b, dtype="<f4").astype(np.float64)
    norm = float(np.linalg.norm(x) * np.linalg.norm(y))
    return float(x @ y) / norm if norm > 0.0 else 0.0


def check_one_label(pooling: EnginePooling) -> None:
    """ValueError unless the classifier scores with one label: a pair's score is one number."""
    if len(pooling.labels) != 1:
        raise ValueError(f"scoring pairs needs a cross-encoder with one label; this classifier has "
                         f"{len(pooling.labels)} ({', '.join(pooling.labels[:8])}): use classify")
