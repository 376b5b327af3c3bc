"""A chat conversation through the model's chat template: one place for the chat endpoint and
/tokenize, with vLLM's request options (``add_generation_prompt``, ``continue_final_message``,
``chat_template_kwargs``, ``documents``, ``tools``, ``reasoning_effort``)."""

from __future__ import annotations

from pagoda_daemon.server.errors import bad_request
from pagoda_daemon.server.protocol import ChatTemplateFields


def render_chat(tokenizer, req: ChatTemplateFields) -> str:
    """The conversation through the model's chat template, as text (400 when the template refuses)."""
    conversation = [m.for_template() for m in req.messages]
    extra = dict(req.chat_template_kwargs or {})
    if req.documents is not None:
        extra["documents"] = req.documents
    tools = req.template_tools()
    if tools is not None:
        extra["tools"] = tools
    if req.reasoning_effort is not None:  # vLLM's mapping: templates without these variables ignore them
        extra["reasoning_effort"] = req.reasoning_effort
        extra.setdefault("enable_thinking", req.reasoning_effort != "none")
    try:
        return tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message, **extra)
    except Exception as e:  # a template that rejects the conversation is the caller's problem
        raise bad_request(f"the chat template rejected the messages: {e}", param="messages") from e
