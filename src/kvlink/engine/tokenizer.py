"""Byte-level BPE tokenizer and chat template, both built from a GGUF file."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from kvlink.engine.model.gguf_loader import GGUFVocab, load_vocab

CONTROL_TOKEN_TYPE = 3
USER_DEFINED_TOKEN_TYPE = 4
REPLACEMENT_CHAR = "\ufffd"


def _raise_template_error(message: str) -> None:
    raise jinja2.TemplateError(message)


def _merge_pair(merge: str) -> tuple[str, str]:
    left, right = merge.split(" ", 1)
    return left, right


@functools.lru_cache(maxsize=4)
def _compile_template(source: str) -> jinja2.Template:
    # trim/lstrip match how Hugging Face renders chat templates, so prompts agree byte for byte.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_template_error
    return env.from_string(source)


class Tokenizer:
    """Text ↔ token ids for a GGUF 'gpt2' vocabulary.

    The GPT-2 byte-level split is used, without a prefix space, as the
    Hugging Face GGUF loader does for this vocabulary; control tokens such as
    `<|im_end|>` are matched whole in the text.
    """

    def __init__(self, vocab: GGUFVocab) -> None:
        if vocab.model != "gpt2":
            raise ValueError(
                f"expected a GGUF with tokenizer.ggml.model 'gpt2' (byte-level BPE), "
                f"got {vocab.model!r}"
            )
        token_to_id = {token: index for index, token in enumerate(vocab.tokens)}
        merges = [_merge_pair(merge) for merge in vocab.merges]
        backend = BackendTokenizer(models.BPE(vocab=token_to_id, merges=merges, fuse_unk=False))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        typed = list(zip(vocab.tokens, vocab.token_types, strict=True))
        backend.add_special_tokens(
            [
                AddedToken(token, normalized=False, special=True)
                for token, kind in typed
                if kind == CONTROL_TOKEN_TYPE
            ]
        )
        backend.add_tokens(
            [
                AddedToken(token, normalized=False, special=False)
                for token, kind in typed
                if kind == USER_DEFINED_TOKEN_TYPE
            ]
        )
        self._backend = backend
        self._vocab = vocab
        self.bos_token_id = vocab.bos_token_id
        self.eos_token_id = vocab.eos_token_id
        self.eos_token_ids: frozenset[int] = frozenset({vocab.eos_token_id})
        self.special_token_ids: frozenset[int] = frozenset(
            index for index, kind in enumerate(vocab.token_types) if kind == CONTROL_TOKEN_TYPE
        )
        # No token stands for more characters of text than this (no normaliser runs): a
        # byte-level token of n vocabulary characters is n bytes, so at most n characters, and
        # an added token is matched as written. A text of c characters is >= c / this tokens.
        self.max_token_chars = max(len(token) for token in vocab.tokens)

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        return cls(load_vocab(path))

    @property
    def vocab_size(self) -> int:
        return len(self._vocab.tokens)

    def token(self, token_id: int) -> str:
        return self._vocab.tokens[token_id]

    def encode(self, text: str) -> list[int]:
        return list(self._backend.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return str(self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """Render `messages` with the template stored in the GGUF file; `template_kwargs` are
        more variables the template may read (a client's `chat_template_kwargs`)."""
        if self._vocab.chat_template is None:
            raise ValueError("this GGUF file carries no tokenizer.chat_template")
        template = _compile_template(self._vocab.chat_template)
        return template.render(
            {**template_kwargs,
             "messages": [dict(message) for message in messages],
             "add_generation_prompt": add_generation_prompt,
             "bos_token": self.token(self.bos_token_id),
             "eos_token": self.token(self.eos_token_id)},
        )

    def incremental_decoder(self, skip_special_tokens: bool = True) -> IncrementalDecoder:
        return IncrementalDecoder(self, skip_special_tokens)


class IncrementalDecoder:
    """Turns a stream of token ids into a stream of text pieces.

    A multi-byte character can be split across tokens, so text is held back
    while it ends in an incomplete UTF-8 sequence; the pieces concatenate to
    `tokenizer.decode(all_ids)`. Only a short window of trailing ids is
    re-decoded per token, so the cost does not grow with the output length.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = []
        self._window_start = 0  # ids before this are already emitted and final

    def push(self, token_id: int) -> str:
        """Add one token; return the text that became final because of it."""
        self._ids.append(token_id)
        text = self._tokenizer.decode(self._ids[self._window_start :], self._skip_special)
        if text.endswith(REPLACEMENT_CHAR):
            return ""
        self._window_start = len(self._ids)
        return text

    def flush(self) -> str:
        """Whatever is still held back, e.g. a truncated character at the end of output."""
        text = self._tokenizer.decode(self._ids[self._window_start :], self._skip_special)
        self._window_start = len(self._ids)
        return text
