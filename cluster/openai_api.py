"""OpenAI-compatible request models and error bodies."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_STOP = 8


class APIError(Exception):
    """An error the client caused or must see; becomes an OpenAI-style error body."""

    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="Served model name (see GET /v1/models)")
    max_tokens: int | None = Field(None, description="Max tokens to generate (>= 1)")
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=100_000)
    min_tokens: int = Field(0, ge=0, le=100_000)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1, description="Only n=1 is supported")
    user: str | None = Field(None, max_length=256)
    ignore_eos: bool = False
    return_token_ids: bool = Field(False, description="vLLM extension: add generated token_ids to choices")

    @field_validator("max_tokens")
    @classmethod
    def _positive(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError("max_tokens must be >= 1")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str] | None:
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else v
        if len(stops) > MAX_STOP or any(not s or len(s) > 256 for s in stops):
            raise ValueError(f"stop takes at most {MAX_STOP} non-empty strings of <= 256 characters")
        return stops

    def sampling(self, max_tokens: int) -> dict[str, Any]:
        return {
            "max_tokens": max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k or 0,
            "min_tokens": min(self.min_tokens, max_tokens),
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "stop": self.stop,
            "seed": self.seed,
            "ignore_eos": self.ignore_eos,
        }


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] = Field(description="A string, a list of token ids, or [string]")
    echo: Literal[False] = False
    logprobs: None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str
    name: str | None = None


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: Literal[False] | None = None
