"""Embeddings: what a pooling request asks for, and how a model directory says it pools.

An engine runs as a generator or as a pooler (``runner``, vLLM's ``--runner``): a pooling engine
computes each prompt once and returns one vector made from its final hidden states (after the
model's last norm) instead of sampling tokens: the last token's (``last``, for causal embedding
models such as Qwen3-Embedding), the first token's (``cls``) or their mean (``mean``). The
vector is then cut to ``dimensions`` (Matryoshka models) and scaled to unit length when
``normalize``, in that order, as sentence-transformers and vLLM do.

A model directory says how it pools as sentence-transformers writes it: ``modules.json`` lists
its modules, the Pooling module's ``config.json`` its mode and a Normalize module that the
vectors are unit length. No torch here: the API process reads this too.
"""

from __future__ import annotations

import json
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
# Encoders (bidirectional attention, models/bert.py): served for embeddings only, whether the
# checkpoint is the body alone or carries a masked-LM head (which is not read).
ENCODER_ARCHITECTURES = {"BertModel": "BertModel", "BertForMaskedLM": "BertModel",
                         "RobertaModel": "XLMRobertaModel", "RobertaForMaskedLM": "XLMRobertaModel",
                         "XLMRobertaModel": "XLMRobertaModel", "XLMRobertaForMaskedLM": "XLMRobertaModel"}
# sentence-transformers' Pooling config keys, in the order they are read, and the types they mean
_ST_MODES = (("pooling_mode_lasttoken", "last"), ("pooling_mode_mean_tokens", "mean"),
             ("pooling_mode_cls_token", "cls"))
_ST_UNSERVED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")
MAX_CONFIG_BYTES = 1 << 20  # a modules.json or Pooling config.json larger than this is not one
# What a pooling request carries where the engine expects sampling parameters: nothing is sampled.
NOTHING_SAMPLED = SamplingParams(temperature=0.0, max_tokens=1)


class PoolingParams(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One pooling request: how its vector is made (``type``: the engine's, stamped by the
    frontend), whether it is scaled to unit length, and the leading dimensions kept (None: all)."""

    type: str = "last"
    normalize: bool = True
    dimensions: int | None = None

    def check(self, hidden_size: int) -> None:
        """ValueError naming the field when this cannot be served by a model of ``hidden_size``."""
        if self.type not in POOLING_TYPES[1:]:
            raise ValueError(f"pooling type must be one of {POOLING_TYPES[1:]}, got {self.type!r}")
        if not isinstance(self.normalize, bool):
            raise ValueError("normalize must be true or false")
        d = self.dimensions
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or not 1 <= d <= hidden_size):
            raise ValueError(f"dimensions must be an integer from 1 to the model's {hidden_size}, got {d!r}")

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
    if architectures and is_encoder(architectures):
        if runner == "generate":
            raise ValueError(f"{architectures[0]} is an encoder: it serves embeddings (runner pooling), "
                             "not generation")
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
    found = model_pooling(config.model, model_config)
    cuts = getattr(model_config, "matryoshka_dimensions", None) or ()
    return EnginePooling(found.type if config.pooling_type == "auto" else config.pooling_type,
                         found.normalize if config.pooling_normalize is None else config.pooling_normalize,
                         int(model_config.hidden_size), found.matryoshka,
                         tuple(d for d in cuts if isinstance(d, int) and not isinstance(d, bool)))
