"""Validate and tokenize what callers send, before anything reaches the engine core."""

from __future__ import annotations

from pagoda_daemon.sampling_params import SamplingParams

PromptType = str | list[int]


def resolve_eos_token_id(tokenizer, model_config) -> int | None:
    """The tokenizer's EOS, else the model config's (the first one where it lists several)."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        eos = getattr(model_config, "eos_token_id", None)
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return eos


def cache_salt_keys(cache_salt: str | None) -> tuple:
    """Extra block-hash keys: requests with different salts never share cached blocks."""
    return (("salt", cache_salt),) if cache_salt else ()


class InputProcessor:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len

    def process(self, prompt: PromptType, params: SamplingParams) -> tuple[str | None, list[int]]:
        """Return (prompt text or None, prompt token ids); raise ValueError on bad input."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=True)
            text: str | None = prompt
        elif isinstance(prompt, (list, tuple)):
            token_ids = list(prompt)
            text = None
            if any(not isinstance(t, int) or isinstance(t, bool) for t in token_ids):
                raise ValueError("prompt token ids must be integers")
            bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        else:
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not token_ids:
            raise ValueError("prompt must not be empty")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt is {len(token_ids)} tokens long, which leaves no room to generate within "
                f"the model's context of {self.max_model_len} tokens"
            )
        if params.max_tokens is not None and len(token_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"this model's context is {self.max_model_len} tokens, but the prompt ({len(token_ids)} tokens) "
                f"plus max_tokens ({params.max_tokens}) asks for {len(token_ids) + params.max_tokens}"
            )
        if any(not 0 <= t < self.vocab_size for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be in [0, {self.vocab_size})")
        return text, token_ids
