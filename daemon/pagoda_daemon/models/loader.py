"""Load a Hugging Face-format model directory: config.json, *.safetensors, tokenizer.

Every parameter is created uninitialised and must be filled from the checkpoint; a
missing, unexpected or mis-shaped tensor is an error that names it.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from safetensors import safe_open

from pagoda_daemon.distributed.parallel_state import SINGLE, TensorParallel
from pagoda_daemon.hf_overrides import (
    TWO_WAY,
    apply_hf_overrides,
    classifier_from_tokens,
    classifier_token_ids,
    parse_hf_overrides,
)
from pagoda_daemon.models.layers import MergedLinear
from pagoda_daemon.models.registry import is_model_body, resolve_model_class
from pagoda_daemon.templates import PairFormat, engine_pair_format, read_chat_template

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class WeightLoadError(ValueError):
    pass


def check_model_dir(path: str | Path) -> Path:
    p = Path(path)
    if not p.is_dir():
        raise ValueError(f"model path {str(path)!r} does not exist or is not a directory")
    if not (p / "config.json").is_file():
        raise ValueError(f"model path {str(path)!r} has no config.json")
    return p


def load_config(path: str | Path, hf_overrides: str | None = None, tokenizer: Callable[[], Any] | None = None):
    """The model's config.json with ``hf_overrides`` (a JSON object, hf_overrides.py) set on it;
    a classifier made from tokens gets the vocabulary rows it reads (``classifier_token_ids``)
    from ``tokenizer()`` (default: the model's tokenizer), called for such a classifier only."""
    from transformers import AutoConfig

    p = check_model_dir(path)
    try:
        config = AutoConfig.from_pretrained(str(p), trust_remote_code=False)
    except (ValueError, KeyError, OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read the model config in {str(p)!r}: {e}") from e
    if hf_overrides:
        apply_hf_overrides(config, parse_hf_overrides(hf_overrides))
    resolve_model_class(config)  # fail early on unsupported architectures
    from_tokens = classifier_from_tokens(config)
    if from_tokens is not None:
        tokenizer_now = tokenizer() if tokenizer is not None else load_tokenizer(p)
        config.classifier_token_ids = classifier_token_ids(config, from_tokens[1], tokenizer_now)
    return config


def engine_model_config(config):
    """The model config an engine of ``config`` (an EngineConfig) serves (the tokenizer loaded only
    for a classifier made of tokens: load_engine_model where the tokenizer is wanted too)."""
    return load_config(config.model, config.hf_overrides, functools.partial(load_tokenizer, config.tokenizer or config.model))


@dataclass(frozen=True)
class EngineModel:
    """What an engine's front end reads of its model, each read once: the config (with its
    overrides), the tokenizer (with the chat template) and how a text pair becomes a prompt."""

    config: Any
    tokenizer: Any
    pair_format: PairFormat


def load_engine_model(config) -> EngineModel:
    """The EngineModel of an engine of ``config``; ValueError for a model, override, tokenizer or
    template it cannot serve."""
    tokenizer = functools.cache(lambda: engine_tokenizer(config))
    model_config = load_config(config.model, config.hf_overrides, tokenizer)  # the model's own faults named first
    return EngineModel(model_config, tokenizer(), engine_pair_format(config, model_config, tokenizer()))


def checkpoint_dtype(config) -> torch.dtype:
    name = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32"
    if isinstance(name, torch.dtype):
        return name
    return DTYPES.get(str(name).removeprefix("torch."), torch.float32)


def shard_path(index_name: str, entry: object) -> PurePosixPath:
    """A weight file named by the index, refused unless it is a plain relative path inside the
    model directory: an index is data from whoever published the model, and ``../../etc/passwd``
    or ``/dev/zero`` must not become a file the daemon opens. Checked by name, not by resolving
    symlinks, so Hugging Face cache snapshots (symlinks into ``../../blobs``) still load."""
    path = PurePosixPath(entry) if isinstance(entry, str) else None
    if path is None or not entry or path.is_absolute() or ".." in path.parts:
        raise WeightLoadError(
            f"{index_name} names weight file {entry!r} outside the model directory; "
            "shards must be relative paths inside it"
        )
    return path


def safetensors_files(path: str | Path) -> list[Path]:
    """The weight files, sorted, from the index when there is one."""
    p = Path(path)
    index = p / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({p / shard_path(index.name, f) for f in weight_map.values()})
        missing = [str(f.name) for f in files if not f.is_file()]
        if missing:
            raise WeightLoadError(f"{index.name} lists weight files that do not exist: {missing}")
        return files
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"no .safetensors files in {str(p)!r}")
    return files


class CheckpointTensor:
    """One tensor of a checkpoint, read lazily: a tensor-parallel rank reads only the rows or
    columns it holds (safetensors slices read just those bytes)."""

    def __init__(self, source) -> None:
        self._source = source  # a safetensors slice, or a tensor

    @classmethod
    def of(cls, tensor: torch.Tensor) -> CheckpointTensor:
        return cls(tensor)

    @property
    def shape(self) -> tuple[int, ...]:
        if isinstance(self._source, torch.Tensor):
            return tuple(self._source.shape)
        return tuple(self._source.get_shape())

    def read(self, dim: int | None = None, start: int = 0, size: int | None = None) -> torch.Tensor:
        """The whole tensor, or [start, start + size) along dim (0 or 1)."""
        if dim is None:
            return self._source[:] if not isinstance(self._source, torch.Tensor) else self._source
        stop = start + (self.shape[dim] - start if size is None else size)
        return self._source[start:stop] if dim == 0 else self._source[:, start:stop]


def iterate_weights(path: str | Path) -> Iterator[tuple[str, CheckpointTensor]]:
    for f in safetensors_files(path):
        with safe_open(str(f), framework="pt", device="cpu") as st:
            for name in st.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, CheckpointTensor(st.get_slice(name))


def load_weights(model: torch.nn.Module, weights: Iterator[tuple[str, CheckpointTensor]]) -> None:
    """Copy checkpoint tensors into the model, merging stacked and expert tensors; under tensor
    parallelism each parameter takes its rank's slice (the layer's checkpoint_rows/cols)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    pending = _expected_pieces(model, params)
    stacked = getattr(model, "stacked_params", ())
    expert_param = getattr(model, "expert_param", None)
    body = is_model_body(model.config)  # AutoModel's checkpoint (embedding models): no head, no prefix
    if body:
        pending.pop("lm_head.weight", None)
    rename = getattr(model, "checkpoint_name", None)  # a model whose names differ from Hugging Face's (bert.py)
    token_ids = getattr(model.config, "classifier_token_ids", None)  # a head made of the vocabulary's rows
    vocabulary = "model.embed_tokens.weight" if tied else "lm_head.weight"
    rows = None

    for name, tensor in weights:
        if rename is not None and (name := rename(name)) is None:
            continue  # not a tensor of the model served (a task head)
        if body and not name.startswith("model."):
            name = "model." + name
        if token_ids and name == vocabulary:
            rows = torch.cat([tensor.read(0, i, 1) for i in token_ids]).float()
        if name == "lm_head.weight" and (tied or token_ids):
            # tied checkpoints may still carry a copy of the embedding; a classifier made from
            # tokens read its rows above and has no language-model head
            continue
        if "rotary_emb.inv_freq" in name:
            continue
        located = _locate(model, params, name, stacked, expert_param)
        if located is None:
            continue
        target, piece, dest, (dim, start, size, full) = located
        expected = list(dest.shape)
        if dim is not None:
            expected[dim] = full
        if list(tensor.shape) != expected:
            raise WeightLoadError(
                f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                f"the model expects {tuple(expected)} for {target!r}"
            )
        with torch.no_grad():
            part = tensor.read(dim, start, size)
            if dim is not None and part.shape[dim] < dest.shape[dim]:  # a padded vocabulary shard
                dest.zero_()
                dest = dest.narrow(dim, 0, part.shape[dim])
            dest.copy_(part)
        pending[target].discard(piece)

    if rows is not None and pending.get("score.weight"):
        _fill_score_from_rows(params["score.weight"], rows, two_way=getattr(model.config, "method", None) == TWO_WAY)
        pending["score.weight"].discard(None)
    missing = sorted(f"{t}{'' if p is None else f'[{p}]'}" for t, pieces in pending.items() for p in pieces)
    if missing:
        shown = ", ".join(missing[:10]) + (f" and {len(missing) - 10} more" if len(missing) > 10 else "")
        raise WeightLoadError(f"the checkpoint is missing {len(missing)} weight(s): {shown}")


@torch.no_grad()
def _fill_score_from_rows(score: torch.Tensor, rows: torch.Tensor, two_way: bool) -> None:
    """A classifier made from the vocabulary (hf_overrides.py): its one row the positive token's
    minus the negative's (the two-way softmax as one logit), or each token's row as a label;
    the difference taken in float32, as vLLM takes it."""
    head = rows[1:2] - rows[0:1] if two_way else rows
    if tuple(head.shape) != tuple(score.shape):
        raise WeightLoadError(f"the classifier made from tokens has shape {tuple(head.shape)}, the model's score "
                              f"head {tuple(score.shape)}")
    score.copy_(head)


def _expected_pieces(model, params) -> dict[str, set]:
    """Per parameter, the checkpoint pieces that must fill it."""
    pending: dict[str, set] = {}
    modules = dict(model.named_modules())
    for name, p in params.items():
        owner = modules[name.rsplit(".", 1)[0]]
        if isinstance(owner, MergedLinear):
            pending[name] = set(owner.shard_offsets)
        elif name.endswith(".w13"):
            pending[name] = {(e, proj) for e in range(p.shape[0]) for proj in ("gate_proj", "up_proj")}
        elif name.endswith(".w2"):
            pending[name] = {(e, "down_proj") for e in range(p.shape[0])}
        else:
            pending[name] = {None}
    if getattr(model.config, "tie_word_embeddings", False):
        pending.pop("lm_head.weight", None)
    return pending


# Which part of a checkpoint tensor a parameter takes: (dim, start, size, the checkpoint's size
# along dim), or all of it.
WHOLE = (None, 0, None, None)


def _slice_of(module, param_name: str, dest: torch.Tensor):
    """The checkpoint slice a (non-merged) parameter takes, from its module's TP layout."""
    leaf = param_name.rsplit(".", 1)[-1]
    rows = getattr(module, "checkpoint_rows", None)
    if isinstance(rows, tuple) and leaf == "weight":  # vocabulary-split embedding or LM head
        return 0, rows[0], rows[1], getattr(module, "vocab_size", rows[1])
    cols = getattr(module, "checkpoint_cols", None)
    if cols is not None and leaf == "weight":  # row-parallel: input columns
        return 1, cols[0], cols[1], cols[1] * module.tp.size
    return WHOLE


def _locate(model, params, name, stacked, expert_param):
    """Map a checkpoint tensor name to (parameter name, piece key, destination view, slice)."""
    if expert_param is not None and (hit := expert_param(name)) is not None:
        target, expert, proj = hit
        if target not in params:
            raise WeightLoadError(f"checkpoint tensor {name!r} does not match any model parameter")
        p = params[target]
        moe = model.get_submodule(target.rsplit(".", 1)[0])
        if not 0 <= expert < getattr(moe, "num_experts", p.shape[0]):
            raise WeightLoadError(f"checkpoint tensor {name!r} does not match any model parameter")
        slots = moe.local_slots(expert)
        if not slots:
            return None  # another expert-parallel rank's expert: not read
        (local,) = slots  # check_layout keeps two copies of one expert off one rank
        start, inter, full = moe.checkpoint_inter
        if proj == "down_proj":
            return target, (local, proj), p.data[local], (1, start, inter, full)
        rows = slice(0, inter) if proj == "gate_proj" else slice(inter, 2 * inter)
        return target, (local, proj), p.data[local, rows], (0, start, inter, full)
    for merged, shard in stacked:
        if f".{shard}." in name:
            target = name.replace(f".{shard}.", f".{merged}.")
            if target not in params:
                break
            module = model.get_submodule(target.rsplit(".", 1)[0])
            offset, size = module.shard_offsets[shard]
            start, count, full = module.checkpoint_rows[shard]
            return target, shard, params[target].data[offset : offset + size], (0, start, count, full)
    if name not in params:
        raise WeightLoadError(f"checkpoint tensor {name!r} does not match any model parameter")
    module = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
    return name, None, params[name].data, _slice_of(module, name, params[name].data)


def load_model(path: str | Path, config, dtype: torch.dtype, device: torch.device, backend, max_positions: int,
               load_format: str = "auto", tp: TensorParallel = SINGLE):
    """Build the model on `device` (this rank's shard under tensor parallelism) and fill it
    from the checkpoint's safetensors, or with random weights when load_format is "dummy"
    (config.json alone is enough)."""
    model_cls = resolve_model_class(config)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_cls(config, backend, max_positions, tp)
    finally:
        torch.set_default_dtype(previous)
    if load_format == "dummy":
        fill_dummy_weights(model)
    else:
        load_weights(model, iterate_weights(path))
    log.info("loaded %s from %s (%s on %s, %s weights)", model_cls.__name__, path, dtype, device, load_format)
    return model.eval()


@torch.no_grad()
def fill_dummy_weights(model: torch.nn.Module) -> None:
    """Small uniform noise everywhere, norm weights one: finite activations at any depth."""
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            param.uniform_(-1e-3, 1e-3)


def engine_tokenizer(config):
    """The tokenizer an engine of ``config`` (an EngineConfig) serves with: its chat template
    the one ``chat_template`` gives, where it gives one."""
    tokenizer = load_tokenizer(config.tokenizer or config.model)
    if config.chat_template:
        tokenizer.chat_template = read_chat_template(config.chat_template)
    return tokenizer


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load a tokenizer from {str(path)!r}: {e}") from e
