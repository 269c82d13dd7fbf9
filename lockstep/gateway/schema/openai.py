"""Request bodies of the OpenAI-compatible routes (`/oai/api/v1`).

Unknown fields are ignored, as OpenAI-compatible servers do; fields whose non-default value this
server cannot honour (penalties, logit_bias, tools, ...) are refused with a 400 that names them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
)

from lockstep.gateway.schema.requests import Int64, SchemaModel

Temperature = Annotated[float, Field(ge=0, le=2, allow_inf_nan=False)]
TopP = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
MaxTokens = Annotated[int, Field(ge=0, le=2**31 - 1)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
N = Annotated[int, Field(ge=1, le=128)]
Penalty = Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)]
# A prompt: text, token ids, or a batch of either (at most 64 prompts per request).
Prompt = str | list[str] | list[TokenId] | list[TokenIds]
_PROMPT_SHAPES = "a string, a list of strings, a list of token ids or a list of such lists"
MAX_PROMPTS = 64


def _check_prompt(value: Prompt) -> Prompt:
    """One message for every malformed prompt (the union's own errors name its members)."""
    if isinstance(value, list):
        if not value:
            raise ValueError("must not be empty")
        if isinstance(value[0], str | list) and len(value) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request")
        if any(isinstance(p, list) and not p for p in value):
            raise ValueError("a token-id prompt must not be empty")
    return value


Stop = str | Annotated[list[str], Field(max_length=16)] | None


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(SchemaModel):
    model: str = Field(min_length=1, max_length=2048)
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: int = Field(-1, ge=-1, le=2**31 - 1)  # vLLM's extension; -1 = no limit
    n: N = 1
    stop: Stop = None
    seed: Int64 | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    def unsupported(self) -> list[str]:
        """Fields set to something this server cannot do."""
        bad = [f for f in ("presence_penalty", "frequency_penalty") if getattr(self, f) != 0.0]
        return bad + (["logit_bias"] if self.logit_bias else [])

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(_Sampling):
    prompt: Prompt
    max_tokens: MaxTokens | None = 16
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=128)
    suffix: str | None = None

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _prompt(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Prompt:
        try:
            checked = handler(value)
        except ValidationError:
            raise ValueError(f"must be {_PROMPT_SHAPES}") from None
        return _check_prompt(checked)

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        if self.best_of is not None and self.best_of != self.n:
            bad.append("best_of")
        return bad + (["suffix"] if self.suffix else [])

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]
        return list(p)  # type: ignore[arg-type]


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ImageUrl(BaseModel):
    url: str  # a data: URI (remote URLs are refused: nothing is fetched)
    detail: str | None = None


class ImageUrlPart(BaseModel):
    type: Literal["image_url"]
    image_url: ImageUrl


ChatPart = Annotated[TextPart | ImageUrlPart, Field(discriminator="type")]


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ChatPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content if isinstance(part, TextPart))
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=4096)]
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        if self.tools:
            bad.append("tools")
        kind = (self.response_format or {}).get("type", "text")
        return bad + (["response_format"] if kind != "text" else [])
