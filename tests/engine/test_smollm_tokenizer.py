"""Our GGUF tokenizer and chat template agree with transformers' loading of the same file."""

from __future__ import annotations

from typing import Any

import pytest

from kvlink.engine.tokenizer import Tokenizer

TEXTS = [
    "Hello, world!",
    "Grüße aus Köln — naïve café, 世界你好, emoji 🌍🚀 and ZWJ 👩‍💻.",
    "def square(x: int) -> int:\n    return x ** 2  # fast\n\tprint(f'{x!r}')\n",
    "  leading   and trailing spaces  \n\n\n",
    "Digits 12345, pi 3.14159, big 1,000,000 and 0x1F.",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another, in français?"},
    ],
]


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(
    smollm2_tokenizer: Tokenizer, hf_tokenizer: Any, text: str
) -> None:
    ids = smollm2_tokenizer.encode(text)
    assert ids == hf_tokenizer.encode(text)
    assert smollm2_tokenizer.decode(ids) == hf_tokenizer.decode(ids) == text
    assert smollm2_tokenizer.decode(ids, skip_special_tokens=True) == hf_tokenizer.decode(
        ids, skip_special_tokens=True
    )


def test_control_tokens_stay_whole(smollm2_tokenizer: Tokenizer) -> None:
    ids = smollm2_tokenizer.encode("<|im_start|>assistant\nok<|im_end|>")
    assert ids[0] == 1
    assert ids[-1] == smollm2_tokenizer.eos_token_id == 2
    assert smollm2_tokenizer.eos_token_ids == frozenset({2})


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    smollm2_tokenizer: Tokenizer,
    hf_tokenizer: Any,
    messages: list[dict[str, str]],
    add_generation_prompt: bool,
) -> None:
    ours = smollm2_tokenizer.apply_chat_template(messages, add_generation_prompt)
    theirs = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours == theirs
    assert smollm2_tokenizer.encode(ours) == hf_tokenizer.encode(theirs)


def test_chat_template_adds_default_system_prompt(smollm2_tokenizer: Tokenizer) -> None:
    prompt = smollm2_tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt.startswith("<|im_start|>system\n")
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_incremental_decode_never_splits_a_character(smollm2_tokenizer: Tokenizer) -> None:
    text = "Snow ☃ at 3°C, 雪 and 🌨️ — done.<|im_end|>"
    ids = smollm2_tokenizer.encode(text)
    decoder = smollm2_tokenizer.incremental_decoder(skip_special_tokens=True)
    pieces = [decoder.push(token_id) for token_id in ids]
    pieces.append(decoder.flush())
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == smollm2_tokenizer.decode(ids, skip_special_tokens=True)
    # Multi-byte characters span several byte-level tokens, so some pushes must hold text back.
    assert "" in pieces[:-1]


def test_chat_template_variables_a_client_sends_render_as_transformers_renders_them(
    smollm2_tokenizer: Tokenizer, hf_tokenizer: Any,
) -> None:
    """`chat_template_kwargs` of a chat request: more variables for the template (SmolLM2's
    ignores ones it does not read, as Jinja does)."""
    messages = [{"role": "user", "content": "hi"}]
    ours = smollm2_tokenizer.apply_chat_template(messages, False, enable_thinking=False, tools=None)
    theirs = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                              enable_thinking=False)
    assert ours == theirs == smollm2_tokenizer.apply_chat_template(messages, False)
