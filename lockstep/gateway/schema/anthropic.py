"""Request bodies of the Anthropic-compatible routes (`/anthropic/api/v1`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from lockstep.gateway.schema.requests import SchemaModel


class TextBlock(BaseModel):
    type: Literal["text"]
    text: str


class ImageSource(BaseModel):
    type: Literal["base64", "url"]
    media_type: str | None = None
    data: str | None = None
    url: str | None = None  # refused: nothing is fetched


class ImageBlock(BaseModel):
    type: Literal["image"]
    source: ImageSource


ContentBlock = Annotated[TextBlock | ImageBlock, Field(discriminator="type")]


class Message(BaseModel):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(b.text for b in self.content if isinstance(b, TextBlock))
        return self.content


class Conversation(SchemaModel):
    model: str = Field(min_length=1, max_length=2048)
    messages: Annotated[list[Message], Field(min_length=1, max_length=4096)]
    system: str | list[TextBlock] | None = None
    tools: list[Any] | None = None

    def chat(self) -> list[dict[str, str]]:
        """The conversation as chat-template messages (the system prompt first)."""
        out = []
        if self.system:
            system = self.system
            text = system if isinstance(system, str) else "".join(b.text for b in system)
            out.append({"role": "system", "content": text})
        return out + [{"role": m.role, "content": m.text()} for m in self.messages]


class MessagesRequest(Conversation):
    max_tokens: int = Field(ge=1, le=2**31 - 1)
    temperature: float = Field(1.0, ge=0, le=2, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    top_k: int = Field(-1, ge=-1, le=2**31 - 1)
    stop_sequences: Annotated[list[str], Field(max_length=16)] | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None


class CountTokensRequest(Conversation):
    pass
