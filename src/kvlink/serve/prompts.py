"""From a validated request to what the engine takes: prompt token ids and a token budget."""

from __future__ import annotations

from typing import Any

from kvlink.serve.errors import APIError
from kvlink.serve.protocol import ChatCompletionRequest, CompletionRequest


def encode_text(tokenizer: Any, text: str, what: str, max_model_len: int | None = None) -> list[int]:
    """Token ids of `text`; 400 for text that is not Unicode a tokenizer takes (a lone
    surrogate, which JSON's \\u escapes can carry), and, without tokenizing it, for text too
    long to fit `max_model_len` whatever its tokens (a tokenizer with `max_token_chars`)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise APIError(400, f"the {what} is not valid Unicode text: a lone surrogate "
                            f"{text[error.start]!r} at character {error.start}", "invalid_value") from None
    longest = getattr(tokenizer, "max_token_chars", None)
    if max_model_len is not None and isinstance(longest, int) and longest > 0 \
            and len(text) >= longest * max_model_len:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens, but the {what} has "
            f"{len(text):,} characters, at least {-(-len(text) // longest):,} tokens (no token "
            f"stands for more than {longest} characters); shorten it.",
            "context_length_exceeded",
        )
    return list(tokenizer.encode(text))


def completion_prompt_ids(request: CompletionRequest, tokenizer: Any, max_model_len: int | None = None) -> list[int]:
    if isinstance(request.prompt, str):
        return encode_text(tokenizer, request.prompt, "prompt", max_model_len)
    vocab_size = int(tokenizer.vocab_size)
    bad = [token for token in request.prompt if not 0 <= token < vocab_size]
    if bad:
        raise APIError(
            400, f"prompt token ids must be in [0, {vocab_size}); got {bad[:5]}", "invalid_value"
        )
    return list(request.prompt)


def chat_prompt_ids(request: ChatCompletionRequest, tokenizer: Any, max_model_len: int | None = None) -> list[int]:
    try:
        text = tokenizer.apply_chat_template(request.template_messages(),
                                             add_generation_prompt=request.add_generation_prompt,
                                             **(request.chat_template_kwargs or {}))
    except Exception as error:  # template errors are about the messages the client sent
        raise APIError(400, f"cannot apply the chat template: {error}", "invalid_value") from error
    return encode_text(tokenizer, text, "messages' text", max_model_len)


def token_budget(prompt_tokens: int, requested: int | None, max_model_len: int) -> int:
    """max_tokens to give the engine; 400 when prompt plus completion cannot fit the context."""
    if prompt_tokens >= max_model_len:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens, but the prompt "
            f"has {prompt_tokens} tokens; shorten the prompt to at most {max_model_len - 1} tokens.",
            "context_length_exceeded",
        )
    room = max_model_len - prompt_tokens
    if requested is None:
        return room
    if requested > room:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_tokens + requested} tokens ({prompt_tokens} in the prompt, "
            f"{requested} for the completion); reduce max_tokens to at most {room}.",
            "context_length_exceeded",
        )
    return requested
