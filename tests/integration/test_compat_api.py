"""The OpenAI- and Anthropic-compatible routes, driven by the official `openai` and `anthropic`
clients against a real `lockstep serve`: the same checkpoint sampled through the tinker SDK and
through the compatible routes gives the same greedy text; streams reassemble to it; chat uses the
model's template; a foreign or missing checkpoint is a clean 404, bad fields a 400."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import anthropic
import numpy as np
import openai
import pytest
import tinker
from tinker import types

from lockstep.demo import quickstart_data

from .conftest import API_KEY, Server

pytestmark = pytest.mark.e2e
OTHER_KEY = "tml-compat-other-tenant"
PROMPT = "English: banana split\nPig Latin:"
MAX_TOKENS = 12
# anthropic 2.x no longer takes sampling parameters as arguments; the API still does.
GREEDY = {"temperature": 0}


@dataclass
class Trained:
    path: str  # tinker://.../sampler_weights/...
    sampler: tinker.SamplingClient
    tokenizer: Any


@pytest.fixture(scope="module")
def trained(service_client: tinker.ServiceClient, base_model: str) -> Trained:
    trainer = service_client.create_lora_training_client(
        base_model=base_model, rank=8, seed=3
    ).result()
    data = quickstart_data(trainer.get_tokenizer())
    for _ in range(3):
        trainer.forward_backward(data, "cross_entropy")
        trainer.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    path = trainer.save_weights_for_sampler("compat").result().path
    sampler = service_client.create_sampling_client(model_path=path).result()
    return Trained(path, sampler, trainer.get_tokenizer())


def _oai(server: Server, key: str = API_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/oai/api/v1", api_key=key, max_retries=0)


def _claude(server: Server, key: str = API_KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=server.base_url + "/anthropic/api", api_key=key, max_retries=0
    )


def _greedy(run: Trained, tokens: list[int], logprobs: bool = False) -> types.SampledSequence:
    out = run.sampler.sample(
        prompt=types.ModelInput.from_ints(tokens),
        num_samples=1,
        sampling_params=types.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
    ).result()
    return out.sequences[0]


def test_completion_greedy_equals_tinker_sample(
    server: Server, trained: Trained, base_model: str
) -> None:
    tokens = trained.tokenizer.encode(PROMPT)
    seq = _greedy(trained, tokens)
    expected = trained.tokenizer.decode(seq.tokens, skip_special_tokens=True)
    assert expected.strip(), "the greedy sample is empty: nothing to compare"
    client = _oai(server)
    for prompt in (PROMPT, tokens):  # text, or token ids
        out = client.completions.create(
            model=trained.path, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=3
        )
        (choice,) = out.choices
        assert choice.text == expected
        assert out.usage is not None and out.usage.prompt_tokens == len(tokens)
        assert out.usage.completion_tokens == len(seq.tokens)
        assert choice.finish_reason == ("stop" if seq.stop_reason == "stop" else "length")
        assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
        np.testing.assert_allclose(choice.logprobs.token_logprobs, seq.logprobs, atol=1e-4)
        assert all(len(top) >= 1 for top in choice.logprobs.top_logprobs or [])

    # The other ways to name the checkpoint, and the base model itself (which differs).
    base = base_model
    same = client.completions.create(
        model=f"{base};{trained.path}", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0
    )
    assert same.choices[0].text == expected
    plain = client.completions.create(
        model=base, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0
    )
    assert plain.choices[0].text != expected, "training did not change the greedy text"

    # max_tokens 0 with echo + logprobs scores the prompt (what eval harnesses send).
    scored = client.completions.create(
        model=trained.path, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1
    )
    (choice,) = scored.choices
    assert choice.text == PROMPT and scored.usage is not None
    assert scored.usage.completion_tokens == 0
    assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
    assert choice.logprobs.token_logprobs[0] is None
    forward = trained.sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
    np.testing.assert_allclose(choice.logprobs.token_logprobs[1:], forward[1:], atol=1e-4)

    # n > 1 at temperature 0: n equal choices; echo prepends the prompt.
    many = client.completions.create(
        model=trained.path, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, n=3, echo=True
    )
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert {c.text for c in many.choices} == {PROMPT + expected}


def test_completion_stream_reassembles(server: Server, trained: Trained) -> None:
    client = _oai(server)
    kwargs: dict[str, Any] = dict(
        model=trained.path, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, n=2
    )
    whole = client.completions.create(**kwargs)
    chunks = list(
        client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    for index in (0, 1):
        text = "".join(
            c.choices[0].text for c in chunks if c.choices and c.choices[0].index == index
        )
        assert text == whole.choices[index].text
        finish = [
            c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].index == index
        ]
        assert finish[-1] == whole.choices[index].finish_reason
    assert chunks[-1].usage is not None and chunks[-1].usage == whole.usage

    # A stop string ends the text before it (OpenAI's rule) and finishes with "stop".
    text = whole.choices[0].text
    stop = text[len(text) // 2 :][:2]
    if stop.strip():
        cut = client.completions.create(**{**kwargs, "n": 1}, stop=[stop])
        assert cut.choices[0].text == text[: text.index(stop)]
        assert cut.choices[0].finish_reason == "stop"


def test_chat_uses_the_template(server: Server, trained: Trained) -> None:
    messages = [{"role": "user", "content": "banana split"}]
    templated = trained.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    tokens = trained.tokenizer.encode(templated, add_special_tokens=False)
    seq = _greedy(trained, tokens)
    expected = trained.tokenizer.decode(seq.tokens, skip_special_tokens=True)
    client = _oai(server)
    out = client.chat.completions.create(
        model=trained.path,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    assert out.usage is not None and out.usage.prompt_tokens == len(tokens)
    assert out.choices[0].message.content == expected
    content = out.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == len(seq.tokens)
    np.testing.assert_allclose([c.logprob for c in content], seq.logprobs, atol=1e-4)
    assert all(len(c.top_logprobs) == 2 for c in content)
    stream = client.chat.completions.create(
        model=trained.path,
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,  # type: ignore[arg-type]
    )
    parts = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(parts) == expected

    # Anthropic Messages: same template (no system prompt), same greedy text.
    claude = _claude(server)
    msg = claude.messages.create(
        model=trained.path,
        max_tokens=MAX_TOKENS,
        messages=messages,  # type: ignore[arg-type]
        extra_body=GREEDY,
    )
    assert msg.content[0].text == expected  # type: ignore[union-attr]
    assert msg.usage.input_tokens == len(tokens) and msg.usage.output_tokens == len(seq.tokens)
    assert msg.stop_reason == ("end_turn" if seq.stop_reason == "stop" else "max_tokens")
    count = claude.messages.count_tokens(model=trained.path, messages=messages)  # type: ignore[arg-type]
    assert count.input_tokens == len(tokens)
    with claude.messages.stream(
        model=trained.path,
        max_tokens=MAX_TOKENS,
        messages=messages,  # type: ignore[arg-type]
        extra_body=GREEDY,
    ) as events:
        kinds = [e.type for e in events]
        final = events.get_final_message()
    assert final.content[0].text == expected  # type: ignore[union-attr]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "message_delta" in kinds

    # A system prompt goes through the template too.
    with_system = claude.messages.count_tokens(
        model=trained.path,
        system="Be brief.",
        messages=messages,  # type: ignore[arg-type]
    )
    system_prompt = [{"role": "system", "content": "Be brief."}, *messages]
    text = trained.tokenizer.apply_chat_template(
        system_prompt, add_generation_prompt=True, tokenize=False
    )
    assert with_system.input_tokens == len(trained.tokenizer.encode(text, add_special_tokens=False))


def test_foreign_missing_and_bad_requests(
    server: Server, trained: Trained, base_model: str
) -> None:
    other, claude_other = _oai(server, OTHER_KEY), _claude(server, OTHER_KEY)
    missing = trained.path.rsplit("/", 1)[0] + "/no-such-checkpoint"
    for model in (trained.path, missing, "no-such-base-model"):
        with pytest.raises(openai.NotFoundError) as oai_err:
            other.completions.create(model=model, prompt=PROMPT, max_tokens=2)
        assert oai_err.value.body["type"] == "not_found_error"  # type: ignore[index]
        with pytest.raises(anthropic.NotFoundError) as claude_err:
            claude_other.messages.create(
                model=model, max_tokens=2, messages=[{"role": "user", "content": "hi"}]
            )
        assert claude_err.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    with pytest.raises(openai.AuthenticationError):
        _oai(server, "not-a-key").models.list()

    client = _oai(server)
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=base_model, prompt=PROMPT, temperature=5)
    assert bad.value.body["param"] == "temperature"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=base_model, prompt=PROMPT, presence_penalty=1.0)
    assert bad.value.body["param"] == "presence_penalty"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError):
        _claude(server).messages.create(
            model=base_model, max_tokens=0, messages=[{"role": "user", "content": "hi"}]
        )

    # Published: every key may sample it.
    ids = [m.id for m in client.models.list()]
    assert base_model in ids and trained.path in ids
    tinker.RestClient(
        base_url=server.base_url, api_key=API_KEY
    ).publish_checkpoint_from_tinker_path(trained.path).result()
    out = other.completions.create(model=trained.path, prompt=PROMPT, max_tokens=2, temperature=0)
    assert len(out.choices) == 1
