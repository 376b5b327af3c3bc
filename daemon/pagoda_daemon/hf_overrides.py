"""What a served model's config.json is told on top of what it says (vLLM's ``--hf-overrides``),
and the classifiers made from a language model's head that such overrides ask for.

Qwen3-Reranker ships as ``Qwen3ForCausalLM``: it judges a (query, document) prompt by the next
token's logits for "yes" and "no". vLLM serves it as a one-label classifier with

    --hf-overrides '{"architectures": ["Qwen3ForSequenceClassification"],
                     "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true}'

and Pagoda takes the same flag: the head becomes one row, the language-model head's "yes" row
minus its "no" row, so sigmoid(score) is the softmax probability of "yes" over the two
(``from_2_way_softmax``, vLLM's name). With ``method: "no_post_processing"`` each token named is
a label whose row is the language-model head's row of that token (bge-reranker-v2-gemma's
"Yes"). The rows are read from the checkpoint by models/loader.py.

No torch here: the API process and the option checks read this too.
"""

from __future__ import annotations

import json
from typing import Any

MAX_OVERRIDES_BYTES = 64 * 1024  # a config.json's worth of keys; anything larger is not an override
TWO_WAY = "from_2_way_softmax"
TOKEN_ROWS = "no_post_processing"
METHODS = (TWO_WAY, TOKEN_ROWS)
MAX_CLASSIFIER_TOKENS = 64


def parse_hf_overrides(text: str) -> dict[str, Any]:
    """The overrides as a dict; ValueError saying why when ``text`` is not a JSON object of them."""
    if len(text.encode("utf-8", "surrogatepass")) > MAX_OVERRIDES_BYTES:
        raise ValueError(f"hf_overrides is longer than {MAX_OVERRIDES_BYTES} bytes")
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except ValueError as e:
        raise ValueError(f"hf_overrides must be a JSON object: {e}") from e
    if not isinstance(value, dict) or not value:
        raise ValueError("hf_overrides must be a JSON object with at least one key, such as "
                         '{"architectures": ["Qwen3ForSequenceClassification"]}')
    architectures = value.get("architectures")
    if architectures is not None and (not isinstance(architectures, list) or not architectures
                                      or not all(isinstance(a, str) for a in architectures)):
        raise ValueError("hf_overrides: architectures must be a non-empty list of names")
    return value


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number a config may hold")


def apply_hf_overrides(config: Any, overrides: dict[str, Any]) -> None:
    """Set each key on the config (a transformers PretrainedConfig), merging a JSON object into
    a nested config (``text_config``) key by key, as vLLM does."""
    _merge(config, overrides)


def _merge(config: Any, overrides: dict[str, Any]) -> None:
    for key, value in overrides.items():
        current = getattr(config, key, None)
        if isinstance(value, dict) and current is not None and hasattr(current, "to_dict"):
            _merge(current, value)
        elif isinstance(value, dict) and isinstance(current, dict):
            setattr(config, key, {**current, **value})
        else:
            setattr(config, key, value)


def classifier_from_tokens(config: Any) -> tuple[str, list[str]] | None:
    """(method, token strings) of a classifier made from the language-model head's rows, or None
    when the config asks for none; sets ``method`` and ``num_labels`` as the method implies.
    ValueError for a request that cannot be one."""
    tokens = getattr(config, "classifier_from_token", None)
    method = getattr(config, "method", None)
    if getattr(config, "is_original_qwen3_reranker", False):
        method = TWO_WAY
    if tokens is None and method is None:
        return None
    if method is None:
        method = TOKEN_ROWS
    if method not in METHODS:
        raise ValueError(f"hf_overrides: method must be one of {METHODS}, got {method!r}")
    if (not isinstance(tokens, list) or not tokens or len(tokens) > MAX_CLASSIFIER_TOKENS
            or not all(isinstance(t, str) and t for t in tokens)):
        raise ValueError(f"hf_overrides: classifier_from_token must be a list of 1 to {MAX_CLASSIFIER_TOKENS} "
                         f"token strings, got {tokens!r}")
    if method == TWO_WAY and len(tokens) != 2:
        raise ValueError(f"hf_overrides: {TWO_WAY} (is_original_qwen3_reranker) reads two tokens, the negative "
                         f'then the positive answer (["no", "yes"]), got {tokens!r}')
    if not any(a.endswith("ForSequenceClassification") for a in getattr(config, "architectures", None) or []):
        raise ValueError("hf_overrides: classifier_from_token makes a sequence classifier: architectures must name "
                         'one too, such as ["Qwen3ForSequenceClassification"]')
    config.method = method
    config.num_labels = 1 if method == TWO_WAY else len(tokens)
    return method, tokens


def classifier_token_ids(config: Any, tokens: list[str], tokenizer: Any) -> list[int]:
    """The vocabulary rows a classifier made from ``tokens`` reads, each token looked up as the
    tokenizer spells it; ValueError for one it does not hold."""
    ids = []
    for token in tokens:
        index = tokenizer.convert_tokens_to_ids(token)
        if not isinstance(index, int) or index == getattr(tokenizer, "unk_token_id", None) or index < 0 \
                or index >= int(config.vocab_size):
            raise ValueError(f"hf_overrides: classifier_from_token {token!r} is not a token of the model's tokenizer")
        ids.append(index)
    return ids
