"""The chat template an engine is told to use (``chat_template``, vLLM's ``--chat-template``), and
how a classifier makes one prompt of a (query, document) pair.

The chat template replaces the tokenizer's for chat requests. For a sequence classifier it is
also the score template, as in vLLM 0.26: a pair is rendered as the two messages
``{"role": "query"}`` and ``{"role": "document"}`` (with a request's ``instruction`` and
``chat_template_kwargs`` as variables) and tokenized as one text. That is how Qwen3-Reranker
reads its pairs: a system prompt, ``<Instruct>``, ``<Query>``, ``<Document>``, then the
assistant's empty thought, where the next token is "yes" or "no"
(``examples/templates/qwen3_reranker.jinja``).

Without a template a pair is the tokenizer's pair (BERT's ``[CLS] a [SEP] b [SEP]``), except for
a classifier made from a language model's tokens (hf_overrides.py), whose two texts are joined as
they are (vLLM's ``use_sep_token`` false; a config key may say otherwise).

No torch here: the API process renders pairs too.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagoda_daemon.config import MAX_TEMPLATE_BYTES, is_template_text
from pagoda_daemon.pooling import is_classifier

# The probe pair rendered at start-up, so that a template that cannot render a pair fails the
# start instead of every request
_PROBE = ("what is the capital of France?", "Paris is the capital of France.")


def read_chat_template(value: str) -> str:
    """The template's text: ``value`` itself where it reads as Jinja (holds ``{{`` or ``{%``),
    else the file it names. (vLLM looks for a file first; Pagoda never reads a file named by a
    template's text, which is what lets the operator render one from an InferenceService.)
    ValueError for neither."""
    if is_template_text(value):
        return value
    path = Path(value)
    try:
        is_file = len(value) < 4096 and "\n" not in value and path.is_file()
    except (OSError, ValueError):
        is_file = False
    if is_file:
        if path.stat().st_size > MAX_TEMPLATE_BYTES:
            raise ValueError(f"chat_template {value!r} is larger than {MAX_TEMPLATE_BYTES} bytes")
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read chat_template {value!r}: {e}") from e
    raise ValueError(f"chat_template {value[:80]!r} is neither a file nor a Jinja template")


@dataclass(frozen=True)
class PairFormat:
    """How a classifier's (query, document) pair becomes one prompt."""

    template: str | None = None  # the score template; None: the pair is joined as below
    separated: bool = True  # the tokenizer's pair template; False: the two texts one after the other

    @property
    def joined(self) -> bool:
        """Whether a pair is one text to tokenize (a template's, or the two texts together),
        not the tokenizer's pair of two segments."""
        return self.template is not None or not self.separated

    def render(self, tokenizer: Any, query: str, document: str, variables: dict[str, Any] | None = None) -> str:
        """The pair as one text (``joined`` formats only)."""
        if self.template is None:
            return query + document
        messages = [{"role": "query", "content": query}, {"role": "document", "content": document}]
        return tokenizer.apply_chat_template(messages, chat_template=self.template, tokenize=False,
                                             **(variables or {}))


def engine_pair_format(config: Any, model_config: Any, tokenizer: Any) -> PairFormat:
    """The pair format of an engine of ``config`` (an EngineConfig) serving ``model_config``
    (the default where it is no classifier); ValueError for a template that cannot render a pair
    (tried on a probe pair)."""
    if not is_classifier(getattr(model_config, "architectures", None)):
        return PairFormat()
    separated = bool(getattr(model_config, "use_sep_token", getattr(model_config, "method", None) is None))
    if not config.chat_template:
        return PairFormat(None, separated)
    found = PairFormat(read_chat_template(config.chat_template), separated)
    try:
        rendered = found.render(tokenizer, *_PROBE)
    except Exception as e:  # Jinja raises many kinds; any one means it cannot serve pairs
        raise ValueError(f"chat_template cannot render a (query, document) pair as the score template: {e}") from e
    if not isinstance(rendered, str) or _PROBE[1] not in rendered:
        raise ValueError("chat_template renders a (query, document) pair without the document: a score template "
                         "reads the messages of roles query and document")
    return found
