"""Text <-> tokens for the compatible routes, with the served model's own tokenizer.

Why here and not in the scheduler: the scheduler's contract is token ids (what the tinker SDK
sends after tokenizing on the client side with the same directory, `get_tokenizer()`), and it
stays that way; the compatible routes speak text, so the gateway plays the SDK's part, as vLLM's
API server does in front of its engine. Chat templating belongs with tokenization: the template
ships in the tokenizer files (`tokenizer_config.json` / `chat_template.jinja`).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import Request

from lockstep.engine.families import ModelConfig
from lockstep.engine.images import RUN_AGAIN, VisionSpec, read_image
from lockstep.errors import UserInputError
from lockstep.gateway.errors import ApiError, bad_request
from lockstep.gateway.inference.images import ChatImage


@dataclass(frozen=True)
class Finished:
    """A completion as text: `text` stops before a matched stop string (OpenAI's rule)."""

    text: str
    stop_string: str | None


class TextCodec:
    def __init__(self, directory: Path) -> None:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        from transformers import AutoTokenizer  # a few seconds: loaded on the first request

        self._tok: Any = AutoTokenizer.from_pretrained(str(directory))
        eos = {self._tok.eos_token_id} if self._tok.eos_token_id is not None else set()
        generation = Path(directory) / "generation_config.json"
        if generation.is_file():  # chat models end a turn with their own token (e.g. <|im_end|>)
            value = json.loads(generation.read_text()).get("eos_token_id")
            eos |= set(value if isinstance(value, list) else [value] if value is not None else [])
        self.eos_ids: tuple[int, ...] = tuple(sorted(int(t) for t in eos))
        # A vision-language model's image processing: its placeholder id, and image token
        # counts for usage (the scheduler judges the images themselves).
        has_config = (Path(directory) / "config.json").is_file()
        self.vision = VisionSpec.of(ModelConfig.read(directory)) if has_config else None

    @property
    def placeholder(self) -> int | None:
        """The id the chat template renders an image as (None: the model takes no images)."""
        return None if self.vision is None else self.vision.image_token_id

    def image_tokens(self, images: Sequence[ChatImage]) -> int:
        """Tokens the images add beyond their placeholders (from their headers)."""
        if self.vision is None:
            return 0
        total = 0
        for i, image in enumerate(images):
            try:
                size = read_image(image.data, image.format, f"images[{i}]", RUN_AGAIN, False)
            except UserInputError as exc:
                raise bad_request(exc.field, exc.detail) from exc
            total += self.vision.tokens(self.vision.grid(*size)) - 1
        return total

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text))

    def encode_chat(
        self, messages: list[dict[str, Any]], continue_final: bool = False
    ) -> list[int]:
        """The prompt of a chat: the model's chat template, ending where the reply starts."""
        if not self._tok.chat_template:
            raise bad_request("messages", "the served model has no chat template")
        try:
            text = self._tok.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=not continue_final,
                continue_final_message=continue_final,
            )
        except Exception as exc:  # a template may refuse a conversation (roles, order)
            raise bad_request("messages", f"the chat template refused them: {exc}") from exc
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, tokens: Sequence[int]) -> str:
        return str(self._tok.decode(list(tokens), skip_special_tokens=True))

    def piece(self, token: int) -> str:
        """One token's text as logprob listings show it (special tokens kept)."""
        return str(self._tok.decode([token], skip_special_tokens=False))

    def finish(self, tokens: Sequence[int], stops: Sequence[str]) -> Finished:
        text = self.decode(tokens)
        hits = [(text.find(s), s) for s in stops if s and s in text]
        if not hits:
            return Finished(text, None)
        at, stop = min(hits)
        return Finished(text[:at], stop)

    def deltas(self, tokens: Sequence[int], text: str) -> list[str]:
        """`text` cut into one piece per token (for streaming): piece i is what token i adds,
        held back while it would end inside a multi-byte character; they join to `text`."""
        out: list[str] = []
        sent = 0
        for i in range(len(tokens)):
            prefix = self.decode(tokens[: i + 1])
            stable = len(os.path.commonprefix([prefix, text]))
            if prefix.endswith("\ufffd"):
                stable = min(stable, len(prefix) - 1)
            out.append(text[sent:stable] if stable > sent else "")
            sent = max(sent, stable)
        if out and sent < len(text):
            out[-1] += text[sent:]
        return out


async def get_codec(request: Request) -> TextCodec:
    """The app's codec (loaded once, off the event loop)."""
    state = request.app.state
    codec: TextCodec | None = state.text_codec
    if codec is not None:
        return codec
    directory = state.settings.tokenizer_dir
    if directory is None:
        raise ApiError(404, "model: this gateway serves no text models (no --tokenizer-dir)")
    lock: asyncio.Lock = state.text_codec_lock
    async with lock:
        codec = state.text_codec
        if codec is None:
            codec = await asyncio.to_thread(TextCodec, Path(directory))
            state.text_codec = codec
    return codec
