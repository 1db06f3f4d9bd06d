"""Request bodies of `/v1/completions` and `/v1/chat/completions`, as the OpenAI API spells them.

Only the fields kvlink acts on are declared; unknown fields are ignored (clients
send many), but features we cannot honour (`n > 1`, `logprobs`, `echo`, and the sampling
knobs in `UNHONOURED` set to anything but their neutral value) are refused with a 400
rather than silently dropped. Of vLLM's extensions, `ignore_eos`, `stop_token_ids`,
`min_tokens`, `include_stop_str_in_output` and `skip_special_tokens` are honoured, and for
chat `add_generation_prompt` and `chat_template_kwargs` (`continue_final_message` and a
`chat_template` of the client's are refused).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    StrictInt,
    field_validator,
    model_validator,
)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_STOP_TOKEN_IDS = 1024


class StreamOptions(BaseModel):
    include_usage: bool = False


# Sampling knobs of the OpenAI API (and vLLM's extensions) the engine does not implement, with
# the values that mean "off": a client may send those, any other value is refused.
UNHONOURED: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "repetition_penalty": (None, 1),
    "top_k": (None, 0, -1), "min_p": (None, 0), "best_of": (None, 1), "logit_bias": (None, {}),
    "prompt_logprobs": (None,), "truncate_prompt_tokens": (None,), "bad_words": (None, []),
    "allowed_token_ids": (None,), "guided_json": (None,), "guided_regex": (None,),
    "guided_choice": (None,), "guided_grammar": (None,), "structured_outputs": (None,),
    # constrained or tool-calling output: plain text only
    "response_format": (None, {"type": "text"}), "tools": (None, []), "functions": (None, []),
    "tool_choice": (None, "none", "auto"),
}


_NULL_IS_DEFAULT = ("ignore_eos", "min_tokens", "include_stop_str_in_output", "skip_special_tokens")


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _unhonoured(cls, data: Any) -> Any:
        if isinstance(data, dict):
            # vLLM's extensions sent as null mean their default
            data = {k: v for k, v in data.items() if v is not None or k not in _NULL_IS_DEFAULT}
            for name, neutral in UNHONOURED.items():
                value = data.get(name)
                # bool is an int: `true` is not the neutral 1; NaN equals nothing, so it is refused.
                if isinstance(value, bool):
                    neutral_value = any(value is n for n in neutral)
                else:
                    neutral_value = any(value == n for n in neutral if not isinstance(n, bool))
                if not neutral_value:
                    raise ValueError(f"{name}={value!r} is not supported (kvlink samples with temperature, "
                                     f"top_p and seed, and stops at stop, stop_token_ids or max_tokens); "
                                     f"leave it out")
        return data

    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)  # what a torch generator takes
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    n: int = 1
    kv_transfer_params: dict[str, Any] | None = None
    ignore_eos: bool = False  # vLLM's extension: generate past the end-of-sequence token
    # vLLM's extension: more tokens that end the answer (each generated token is looked up in them)
    stop_token_ids: list[NonNegativeInt] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    # vLLM's extension: no stop token or stop string ends the answer before this many tokens
    min_tokens: int = Field(0, ge=0)
    # vLLM's extensions: the stop string or stop token's text stays in the answer; special tokens' text too
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError(f"only n=1 is supported, got n={n}")
        return n

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop: str | list[str] | None) -> str | list[str] | None:
        strings = [stop] if isinstance(stop, str) else (stop or [])
        if any(not s for s in strings):
            raise ValueError("stop strings must be non-empty")
        if len(strings) > 4:
            raise ValueError(f"at most 4 stop strings are allowed, got {len(strings)}")
        return stop

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingFields):
    """`prompt` is one text or one list of token ids (batched prompts are not supported)."""

    prompt: str | list[StrictInt]  # ["1", "2"] is not read as token ids (vLLM would batch it)
    max_tokens: int | None = Field(DEFAULT_COMPLETION_MAX_TOKENS, ge=1)
    echo: bool = False
    logprobs: int | None = None

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, prompt: str | list[int]) -> str | list[int]:
        if len(prompt) == 0:
            raise ValueError("prompt must not be empty")
        return prompt

    @model_validator(mode="after")
    def _unsupported(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo=true is not supported")
        if self.logprobs is not None:
            raise ValueError("logprobs are not supported")
        return self


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    echo: bool = False
    # vLLM's chat extensions: the first two are honoured, the others refused when set
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: bool = False
    chat_template: str | None = None

    @model_validator(mode="after")
    def _unsupported(self) -> ChatCompletionRequest:
        if self.logprobs:
            raise ValueError("logprobs are not supported")
        if self.echo:
            raise ValueError("echo=true is not supported")
        if self.continue_final_message:
            raise ValueError("continue_final_message=true is not supported (the template's generation "
                             "prompt, or none with add_generation_prompt=false, is)")
        if self.chat_template is not None:
            raise ValueError("chat_template is not supported: the model's own template (from its GGUF "
                             "file) is used")
        reserved = {"messages", "add_generation_prompt", "bos_token", "eos_token"} & set(self.chat_template_kwargs or {})
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {sorted(reserved)}")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def template_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]
