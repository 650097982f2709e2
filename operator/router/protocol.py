"""OpenAI request bodies (plus vLLM's extra sampling fields), checked to the proto's ranges.

Pydantic checks types and the documented ranges at the boundary, so no value can overflow a
proto field; what needs the tokenizer or the context length (token ids, top_k, min_tokens) is
checked in `requests.py`, and the worker checks again (it is the authority).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

MAX_LOGPROBS = 20
MAX_N = 128  # OpenAI's documented bound on n
_INT64 = 2**63
_UINT32 = 2**32 - 1
_INT32 = 2**31 - 1
_FLOAT32 = 3.4e38  # beyond this a proto float becomes inf

TokenId = Annotated[int, Field(ge=0, le=_UINT32)]


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(BaseModel):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` object: exactly one constraint."""

    model_config = ConfigDict(extra="forbid")

    json_: str | dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class SamplingFields(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False, populate_by_name=True)

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=_FLOAT32)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=-_INT64, lt=_INT64)
    stop: str | list[str] | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extra sampling parameters.
    top_k: int | None = Field(None, ge=-1, le=_INT32)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=_FLOAT32)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=_UINT32)
    stop_token_ids: list[TokenId] | None = None
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    request_id: str | None = Field(None, min_length=1, max_length=256)
    # vLLM's structured outputs: the object, and the older guided_* fields.
    structured_outputs: StructuredOutputs | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None

    # Field validators, not a model validator: the error's location names the field.
    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(
        cls, v: StreamOptions | None, info: ValidationInfo
    ) -> StreamOptions | None:
        if v is not None and not info.data.get("stream"):
            raise ValueError("stream_options can only be set with stream=true (as vLLM)")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, v: str | list[str] | None) -> str | list[str] | None:
        if v is not None and any(not text for text in ([v] if isinstance(v, str) else v)):
            raise ValueError("stop strings must be non-empty")
        return v

    @field_validator("bad_words")
    @classmethod
    def _bad_words_not_empty(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and any(not word.strip() for word in v):
            raise ValueError("bad_words entries must be non-empty")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of_covers_n(cls, v: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n", 1)
        if v is not None and v < n:
            raise ValueError(f"best_of ({v}) must be >= n ({n})")
        if v is not None and v > n and info.data.get("stream"):
            raise ValueError("best_of > n cannot be streamed (the best are known only at the end)")
        return v

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM: with include_usage, every chunk carries the usage so far."""
        return self.include_usage and bool(
            self.stream_options and self.stream_options.continuous_usage_stats
        )

    @property
    def num_sequences(self) -> int:
        """How many sequences run: best_of when set (the best n are kept), else n."""
        return self.best_of or self.n


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: int | None = Field(16, ge=1, le=_UINT32)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    # vLLM: add the tokenizer's special tokens (e.g. BOS) to a text prompt; default on.
    add_special_tokens: bool = True


ToolChoice = Literal["none", "auto", "required"] | dict[str, Any]


class ChatCompletionRequest(SamplingFields):
    messages: list[dict[str, Any]]
    max_tokens: int | None = Field(None, ge=1, le=_UINT32)
    max_completion_tokens: int | None = Field(None, ge=1, le=_UINT32)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM: off for chat, since the chat template writes BOS itself; on adds them once more.
    add_special_tokens: bool = False

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs=true")
        return v

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(BaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[TokenId]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """The error body of every 4xx/5xx (the OpenAPI schema names it for each status)."""

    error: ErrorDetail
