"""Read a PEFT LoRA adapter directory and check it against the base model.

An adapter is ``adapter_config.json`` plus ``adapter_model.safetensors``, as PEFT's
``save_pretrained`` writes them (pickled ``.bin`` weights are refused: loading one runs code).
Everything in it is data from whoever trained it: every field and every tensor is checked
(kind, rank bound, known target, shape against the base model, finite values) and a refusal
names what is wrong. The result holds each projection's A and B as the file has them, with B's
scaling (alpha / r, or alpha / sqrt(r) with rsLoRA): the workers copy them to the device as
they are, and cast, scale and slice there.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pagoda_daemon.lora.names import AdapterError
from pagoda_daemon.lora.request import LoRARequest

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20
PEFT_DEFAULT_ALPHA = 8  # LoraConfig's lora_alpha when a config leaves it out
KEY_PREFIX = "base_model.model."
# The projections an adapter may target, by their name inside a decoder layer.
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
# PEFT options that change what the adapter computes beyond W + B·A, refused by name: DoRA's
# magnitudes, biases on B, weights of whole modules, extra token rows, activated LoRA.
UNSUPPORTED = {
    "use_dora": "DoRA adapters",
    "lora_bias": "adapters with a bias on lora_B",
    "modules_to_save": "adapters that replace whole modules (modules_to_save)",
    "trainable_token_indices": "adapters that train token embeddings",
    "alora_invocation_tokens": "activated LoRA (aLoRA)",
    "target_parameters": "adapters on expert parameters (target_parameters)",
    "layer_replication": "adapters that replicate layers",
    "fan_in_fan_out": "fan_in_fan_out adapters (Conv1D base layers)",
}


@dataclass(frozen=True)
class LoRAWeights:
    """One projection's A [rank, in] and B [out, rank] as the file holds them, and B's scaling."""

    raw_a: torch.Tensor
    raw_b: torch.Tensor
    scale: float

    @property
    def a(self) -> torch.Tensor:
        return self.raw_a.to(torch.float32)

    @property
    def b(self) -> torch.Tensor:
        """B in float32 with the scaling applied: what the delta multiplies by."""
        return self.raw_b.to(torch.float32) * self.scale


@dataclass
class LoRAAdapter:
    name: str
    path: str
    digest: str
    rank: int  # the largest rank among its projections
    weights: dict[str, LoRAWeights]  # by the base model's module name, e.g. model.layers.0.self_attn.q_proj

    def request(self) -> LoRARequest:
        return LoRARequest(self.name, self.path, self.digest)


def projection_shapes(config) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each projection an adapter may target in this model's
    decoder layers; the MLP only where a layer's MLP is dense (not a Qwen3-MoE expert layer)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    hidden, q, kv = config.hidden_size, config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    shapes = {"self_attn.q_proj": (hidden, q), "self_attn.k_proj": (hidden, kv), "self_attn.v_proj": (hidden, kv),
              "self_attn.o_proj": (q, hidden)}
    if not _has_experts(config):
        inter = config.intermediate_size
        shapes.update({"mlp.gate_proj": (hidden, inter), "mlp.up_proj": (hidden, inter), "mlp.down_proj": (inter, hidden)})
    return shapes


def max_weights_bytes(config, max_rank: int) -> int:
    """The largest adapter file this model can take: rank ``max_rank`` on every projection of
    every layer in float32, plus room for the safetensors header."""
    per_layer = sum(in_features + out_features for in_features, out_features in projection_shapes(config).values())
    return per_layer * max_rank * config.num_hidden_layers * 4 + MAX_CONFIG_BYTES


def _has_experts(config) -> bool:
    return bool(getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None))


def read_adapter(name: str, path: str | Path, config, max_rank: int, check_values: bool = True) -> LoRAAdapter:
    """The adapter at ``path``, checked against the base model's ``config``; AdapterError names
    what is wrong. ``check_values=False`` leaves out the finite check of every weight (a pass
    over each tensor): for a worker reading files whose digest shows they are the ones checked
    when the adapter was registered."""
    root = Path(path)
    if not root.is_dir():
        raise AdapterError(f"adapter {name!r}: {str(path)!r} is not a directory")
    config_file, weights_file = root / ADAPTER_CONFIG, root / ADAPTER_WEIGHTS
    if not weights_file.is_file():
        pickled = (root / "adapter_model.bin").is_file()
        raise AdapterError(f"adapter {name!r}: no {ADAPTER_WEIGHTS} in {str(path)!r}"
                           + ("; pickled adapter_model.bin is not loaded (it can run code): save with "
                              "safetensors" if pickled else ""))
    raw = _read_config_bytes(name, config_file)
    spec = _parse_config(name, raw)
    limit = max_weights_bytes(config, max_rank)
    if weights_file.stat().st_size > limit:  # before reading it: the file is read whole into memory
        raise AdapterError(f"adapter {name!r}: {ADAPTER_WEIGHTS} has {weights_file.stat().st_size} bytes, more than "
                           f"the {limit} that rank {max_rank} on every projection of this model takes in float32")
    # The file read once: the digest and the tensors come from the same bytes, and the tensors are
    # copies (safetensors' load_file maps the file: a rewrite would change them underneath).
    data = weights_file.read_bytes()
    tensors = _read_tensors(name, data)
    digest = hashlib.sha256(raw + b"\0" + data).hexdigest()
    weights = _pair_weights(name, spec, tensors, config, max_rank, check_values)
    return LoRAAdapter(name, str(path), digest, max(w.a.shape[0] for w in weights.values()), weights)


def _read_config_bytes(name: str, file: Path) -> bytes:
    if not file.is_file():
        raise AdapterError(f"adapter {name!r}: no {ADAPTER_CONFIG}")
    if file.stat().st_size > MAX_CONFIG_BYTES:
        raise AdapterError(f"adapter {name!r}: {ADAPTER_CONFIG} is larger than {MAX_CONFIG_BYTES} bytes")
    return file.read_bytes()


@dataclass(frozen=True)
class _Spec:
    rank: int
    alpha: float
    rslora: bool
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]


def _parse_config(name: str, raw: bytes) -> _Spec:
    try:
        spec = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise AdapterError(f"adapter {name!r}: {ADAPTER_CONFIG} is not valid JSON: {type(e).__name__}") from e
    if not isinstance(spec, dict):
        raise AdapterError(f"adapter {name!r}: {ADAPTER_CONFIG} is not a JSON object")
    if spec.get("peft_type") != "LORA":
        raise AdapterError(f"adapter {name!r}: peft_type is {spec.get('peft_type')!r}; only LORA adapters are served")
    for key, what in UNSUPPORTED.items():
        if spec.get(key):
            raise AdapterError(f"adapter {name!r}: {what} are not supported ({key} is set)")
    if spec.get("bias", "none") != "none":
        raise AdapterError(f"adapter {name!r}: bias {spec.get('bias')!r} is not supported (only 'none')")
    rank: Any = spec.get("r")
    alpha: Any = spec.get("lora_alpha", PEFT_DEFAULT_ALPHA)
    if not _is_int(rank) or rank < 1:
        raise AdapterError(f"adapter {name!r}: r must be a positive integer, got {rank!r}")
    if not _is_number(alpha):
        raise AdapterError(f"adapter {name!r}: lora_alpha must be a finite number, got {alpha!r}")
    rank_pattern = spec.get("rank_pattern") or {}
    alpha_pattern = spec.get("alpha_pattern") or {}
    if not isinstance(rank_pattern, dict) or not all(_is_int(v) and v >= 1 for v in rank_pattern.values()):
        raise AdapterError(f"adapter {name!r}: rank_pattern must map module patterns to positive integers")
    if not isinstance(alpha_pattern, dict) or not all(_is_number(v) for v in alpha_pattern.values()):
        raise AdapterError(f"adapter {name!r}: alpha_pattern must map module patterns to finite numbers")
    for key in (*rank_pattern, *alpha_pattern):
        if not _PLAIN_NAME.fullmatch(key):
            raise AdapterError(f"adapter {name!r}: pattern {key[:100]!r} is a regular expression; only module "
                               "names (or their dotted suffixes) are supported as rank_pattern/alpha_pattern keys")
    return _Spec(rank, float(alpha), bool(spec.get("use_rslora", False)), rank_pattern, alpha_pattern)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _read_tensors(name: str, data: bytes) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        return load(data)
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise AdapterError(f"adapter {name!r}: cannot read {ADAPTER_WEIGHTS}: {e}") from e


_KEY = re.compile(r"(?P<module>.+)\.lora_(?P<half>[AB])\.weight")
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*")
_LAYER_INDEX = re.compile(r"0|[1-9][0-9]{0,8}")  # as the model names its layers: no 01, no other digits


def _pair_weights(name: str, spec: _Spec, tensors: dict[str, torch.Tensor], config,
                  max_rank: int, check_values: bool) -> dict[str, LoRAWeights]:
    shapes = projection_shapes(config)
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.fullmatch(key.removeprefix(KEY_PREFIX)) if key.startswith(KEY_PREFIX) else None
        if match is None:
            raise AdapterError(f"adapter {name!r}: tensor {key!r} is not a LoRA A or B weight "
                               "(embedding, bias and DoRA tensors are not supported)")
        module = match["module"]
        if _projection(module, config.num_hidden_layers, shapes) is None:
            raise AdapterError(f"adapter {name!r}: tensor {key!r} targets {module!r}, which this model cannot "
                               f"take a LoRA on (supported: the {', '.join(sorted(shapes))} of its "
                               f"{config.num_hidden_layers} layers)")
        halves.setdefault(module, {})[match["half"]] = tensor
    if not halves:
        raise AdapterError(f"adapter {name!r}: {ADAPTER_WEIGHTS} holds no LoRA weights")
    weights = {}
    for module, pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"adapter {name!r}: {module} has lora_{'A' if 'A' in pair else 'B'} "
                               f"but no lora_{'B' if 'A' in pair else 'A'}")
        a, b = pair["A"], pair["B"]
        projection = _projection(module, config.num_hidden_layers, shapes)
        assert projection is not None
        in_features, out_features = shapes[projection]
        rank = a.shape[0] if a.dim() == 2 else -1
        if (a.dim() != 2 or b.dim() != 2 or rank < 1 or a.shape[1] != in_features
                or b.shape != (out_features, rank)):
            raise AdapterError(f"adapter {name!r}: {module} has lora_A {tuple(a.shape)} and lora_B "
                               f"{tuple(b.shape)}; this model needs (rank, {in_features}) and "
                               f"({out_features}, rank), rank at least 1")
        if rank > max_rank:
            raise AdapterError(f"adapter {name!r}: {module} has rank {rank}, more than --max-lora-rank {max_rank}")
        if not (a.is_floating_point() and b.is_floating_point()):
            raise AdapterError(f"adapter {name!r}: {module} weights are not floating point")
        pair_weights = LoRAWeights(a.contiguous(), b.contiguous(), _scaling(spec, module, rank))
        # B counted after its scaling, which may overflow
        if check_values and not (torch.isfinite(pair_weights.a).all() and torch.isfinite(pair_weights.b).all()):
            raise AdapterError(f"adapter {name!r}: {module} has non-finite weights (B counted after its scaling)")
        weights[module] = pair_weights
    return weights


def _projection(module: str, num_layers: int, shapes: Iterable[str]) -> str | None:
    """The projection (``self_attn.q_proj``) that a module name of a decoder layer names, or None."""
    head, sep, projection = module.partition(".layers.")
    if head != "model" or not sep:
        return None
    index, _, rest = projection.partition(".")
    if not _LAYER_INDEX.fullmatch(index) or int(index) >= num_layers or rest not in shapes:
        return None
    return rest


def _scaling(spec: _Spec, module: str, rank: int) -> float:
    """PEFT's: lora_alpha (or the alpha_pattern entry for the module) over r, or over sqrt(r). A
    pattern key matches as a literal name or dotted suffix, not as PEFT's regular expression: a
    pattern from an untrusted file must not be able to backtrack for hours."""
    alpha = next((float(v) for k, v in spec.alpha_pattern.items() if module == k or module.endswith("." + k)),
                 spec.alpha)
    return alpha / math.sqrt(rank) if spec.rslora else alpha / rank
