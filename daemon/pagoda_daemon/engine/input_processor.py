"""Validate and tokenize what callers send, before anything reaches the engine core."""

from __future__ import annotations

from pagoda_daemon.sampling_params import SamplingParams

PromptType = str | list[int]


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
        if any(not 0 <= t < self.vocab_size for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be in [0, {self.vocab_size})")
        return text, token_ids
