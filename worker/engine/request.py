"""What a caller asks the engine for, and what it gets back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from worker.engine.counters import Counters

FinishReason = Literal["stop", "length"]
Role = Literal["system", "developer", "user", "assistant", "tool", "function"]
INT32_MAX = 2**31 - 1  # the largest count anything stores (INTEGER columns)
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1000


class SamplingParams(BaseModel):
    """Generation parameters; temperature 0 is greedy.

    Numbers are strict (no bool, no numeric strings, no 2.0 for an int), finite, and within
    what the database and the engine can hold."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    max_new_tokens: int = Field(256, ge=1, le=INT32_MAX, strict=True)
    temperature: float = Field(0.0, ge=0.0, le=1e6, strict=True)
    top_p: float = Field(1.0, gt=0.0, le=1.0, strict=True)
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
        return self


def _is_unicode(text: str) -> bool:
    """False for text with a lone surrogate (it has no UTF-8 encoding)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Role
    content: str


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
        return self

    @property
    def params(self) -> SamplingParams:
        return SamplingParams(**self.model_dump(include=set(SamplingParams.model_fields)))


@dataclass
class Result:
    """The outcome of one request: its tokens and text, or the error that stopped it."""

    id: int | str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    counters: Counters = field(default_factory=Counters)
    error: str | None = None
