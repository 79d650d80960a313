"""What a request asks for: its prompt (text, chat messages or token ids) and generation
parameters, validated here once for the client that submits and the engine that runs it.

Also what fits a model: a prompt and its max_new_tokens within the model's context
(``check_length``), and a bound that lets a submission skip tokenizing the prompts that
fit whatever their tokenization (``fits_by_size``). No model or tokenizer is imported here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from specq.schema.grammar import Shaped

Role = Literal["system", "developer", "user", "assistant", "tool", "function"]
INT32_MAX = 2**31 - 1  # the largest count anything stores (INTEGER columns)
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1000


class SamplingParams(Shaped):
    """Generation parameters; temperature 0 is greedy; ``response_format`` shapes the output
    (schema/grammar.py).

    Numbers are strict (no bool, no numeric strings, no 2.0 for an int), finite, and within
    what the database and the engine can hold."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    max_new_tokens: int | None = Field(
        256, ge=1, le=INT32_MAX, strict=True,
        description="None: until the model's context ends (OpenAI's default, no cap)")
    temperature: float = Field(0.0, ge=0.0, le=1e6, strict=True)
    top_p: float = Field(1.0, ge=0.0, le=1.0, strict=True,
                         description="0 keeps the likeliest token alone (OpenAI and HF take 0)")
    top_k: int = Field(0, ge=0, le=INT32_MAX, strict=True, description="0 keeps every token")
    stop: list[str] = Field(default_factory=list, max_length=MAX_STOP_STRINGS)
    seed: int | None = Field(None, ge=0, lt=2**63, strict=True)

    @model_validator(mode="after")
    def _stop_strings(self) -> SamplingParams:
        if any(s == "" for s in self.stop):
            raise ValueError("stop: stop strings must not be empty")
        if any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise ValueError(f"stop: a stop string is longer than {MAX_STOP_CHARS} characters")
        if any("\x00" in s for s in self.stop):
            raise ValueError("stop: contains a NUL character (\\u0000)")
        if not all(_is_unicode(s) for s in self.stop):
            raise ValueError("stop: contains a lone surrogate, which is not valid Unicode")
        if self.stop and self.response_format is not None \
                and self.response_format.type != "text":
            raise ValueError("stop: not with a response_format that shapes the output (a "
                             "stop string would cut it short of its grammar's end, where "
                             "it ends by itself)")
        return self


def _is_unicode(text: str) -> bool:
    """False for text with a lone surrogate (it has no UTF-8 encoding)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class Message(BaseModel):
    """A chat message. Its content is text, or OpenAI's list of content parts where every
    part is text (``{"type": "text", "text": ...}``): their texts joined by newlines, as
    vLLM joins them for a text-only model."""

    model_config = ConfigDict(extra="allow")
    role: Role
    content: str

    @model_validator(mode="before")
    @classmethod
    def _no_tool_calls(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("content") is None:
            calls = next((k for k in ("tool_calls", "function_call") if data.get(k)), None)
            if calls:
                raise ValueError(f"a message of {calls} and no content: tool calls are not "
                                 f"served (specq generates text; a message holds text)")
        return data

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, content: Any) -> Any:
        if not isinstance(content, list):
            return content
        texts = []
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind is None:
                raise ValueError(f"part {i} has no type (a text part: "
                                 f"{{'type': 'text', 'text': ...}})")
            if kind != "text":
                raise ValueError(f"part {i} is {str(kind)[:40]!r}: only text parts "
                                 f"({{'type': 'text', 'text': ...}}) are served")
            if not isinstance(part.get("text"), str):
                raise ValueError(f"part {i}: a text part holds its text as a string")
            texts.append(part["text"])
        if not texts:
            raise ValueError("an empty list of content parts")
        return "\n".join(texts)


class Request(SamplingParams):
    """One prompt: text, chat messages (rendered with the chat template) or token ids."""

    id: int | str = 0
    prompt: str | None = None
    messages: list[Message] | None = None
    prompt_token_ids: list[int] | None = None

    @model_validator(mode="after")
    def _one_prompt(self) -> Request:
        given = [x is not None for x in (self.prompt, self.messages, self.prompt_token_ids)]
        if sum(given) != 1:
            raise ValueError("give exactly one of prompt, messages, prompt_token_ids")
        if self.prompt is not None and not self.prompt.strip():
            raise ValueError("prompt: must not be empty")
        if self.messages is not None and not self.messages:
            raise ValueError("messages: must not be empty")
        if self.prompt_token_ids is not None and not self.prompt_token_ids:
            raise ValueError("prompt_token_ids: must not be empty")
        if self.prompt_token_ids is not None and min(self.prompt_token_ids) < 0:
            raise ValueError("prompt_token_ids: token ids are 0 or more")
        return self


def merge(defaults: Mapping[str, Any], overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    """A job's generation parameters with one item's own on top: the one place they meet."""
    return {**defaults, **(overrides or {})}


class RequestError(ValueError):
    """A request the model cannot serve; the message names the field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def check_length(prompt_tokens: int, max_new_tokens: int | None, context: int) -> None:
    """RequestError unless a prompt of this many tokens and its max_new_tokens fit (None:
    the prompt and one new token)."""
    if prompt_tokens >= context:
        raise RequestError("prompt", f"{prompt_tokens} tokens, the model's context is {context}")
    if max_new_tokens is not None and prompt_tokens + max_new_tokens > context:
        raise RequestError(
            "max_new_tokens",
            f"{max_new_tokens} after a {prompt_tokens}-token prompt exceeds the model's "
            f"context of {context} tokens",
        )


def context_length(config: Mapping[str, Any]) -> int:
    """The context of a model from its config.json (the text model's, for a multimodal
    one); 2**31 when it names none."""
    config = config.get("text_config") or config
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        if config.get(name):
            return int(config[name])
    return 2**31


# Upper bound on what a tokenizer adds beyond one token per byte: special tokens, a
# SentencePiece space prefix, and per message the chat template's role markers.
_TOKENS_BEYOND_BYTES = 16
_TOKENS_PER_MESSAGE = 64


def fits_by_size(request: Request, context: int) -> bool:
    """True when the prompt fits whatever its tokenization: every real tokenizer emits at
    most one token per UTF-8 byte, plus a few special ones. Lets a submission skip
    tokenizing the (vast majority of) prompts far below the model's context."""
    if request.prompt_token_ids is not None:
        n = len(request.prompt_token_ids)
    elif request.messages is not None:
        n = sum(len(m.content.encode()) + len(m.role) + _TOKENS_PER_MESSAGE
                for m in request.messages)
    else:
        assert request.prompt is not None  # a Request holds exactly one of the three
        n = len(request.prompt.encode())
    return n + _TOKENS_BEYOND_BYTES + (request.max_new_tokens or 1) <= context


def new_token_limit(request: Request, prompt_tokens: int, context: int | None) -> int:
    """How many tokens the request may generate after its prompt: its max_new_tokens, or
    (None) what is left of the model's ``context`` (ValueError without one)."""
    if request.max_new_tokens is not None:
        return request.max_new_tokens
    if context is None:
        raise ValueError("a request without max_new_tokens needs the model's context")
    return max(context - prompt_tokens, 1)


def text_bytes(request: Request) -> int:
    """UTF-8 bytes of the text a request's prompt is made of (its messages' contents; 0
    for token ids): the part of a prompt that a chat template only adds to."""
    if request.prompt_token_ids is not None:
        return 0
    if request.messages is not None:
        return sum(len(m.content.encode()) for m in request.messages)
    assert request.prompt is not None  # a Request holds exactly one of the three
    return len(request.prompt.encode())


def longest_token(vocab: Mapping[str, int]) -> int:
    """UTF-8 bytes of the longest token string in a vocabulary: at least as many as the
    text any of its tokens covers (a byte-level token's characters stand for a byte each
    and take one or two; a SentencePiece piece's marker stands for one byte and takes
    three)."""
    return max((len(t.encode()) for t in vocab), default=1)


def check_size(request: Request, longest_token: int, context: int) -> None:
    """RequestError when the prompt cannot fit ``context`` whatever its tokenization: no
    token of the model's covers more than ``longest_token`` bytes, so it has at least its
    bytes over that many tokens. Refuses a prompt far too long before a tokenizer spends
    hundreds of bytes on each of its tokens (8 MB of text took 1.8 GB)."""
    size = text_bytes(request)
    least = -(-size // max(longest_token, 1))
    if least >= context:
        raise RequestError("prompt", f"at least {least} tokens, the model's context is "
                           f"{context} ({size} bytes of text; no token of this model's "
                           f"covers more than {longest_token})")
