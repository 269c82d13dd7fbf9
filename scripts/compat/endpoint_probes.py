"""The OpenAI- and Anthropic-compatible endpoints, probed with the official clients."""

from typing import Any

from compat.context import API_KEY, OTHER_KEY, Ctx, expect
from compat.feature_probes import feature

PROMPT = "English: banana split\nPig Latin:"
CHAT = [{"role": "user", "content": "banana split"}]


def _oai(c: Ctx, key: str = API_KEY) -> Any:
    import openai

    return openai.OpenAI(base_url=c.base_url + "/oai/api/v1", api_key=key, max_retries=0)


def _claude(c: Ctx, key: str = API_KEY) -> Any:
    import anthropic

    return anthropic.Anthropic(base_url=c.base_url + "/anthropic/api", api_key=key, max_retries=0)


def _greedy_text(c: Ctx, tokens: list[int]) -> str:
    from tinker import types

    sampler = c.service.create_sampling_client(model_path=c.sampler_path).result()
    params = types.SamplingParams(max_tokens=8, temperature=0.0)
    seq = sampler.sample(types.ModelInput.from_ints(tokens), 1, params).result().sequences[0]
    return str(c.tokenizer.decode(seq.tokens, skip_special_tokens=True))


@feature("endpoints", "OpenAI POST /oai/api/v1/completions")
def _(c: Ctx) -> str | None:
    client = _oai(c)
    for prompt in (PROMPT, c.tokenizer.encode(PROMPT)):
        out = client.completions.create(
            model=c.sampler_path, prompt=prompt, max_tokens=8, temperature=0, logprobs=2
        )
        expect(out.choices[0].text == _greedy_text(c, c.tokenizer.encode(PROMPT)), "greedy text")
    many = client.completions.create(
        model=c.base_model, prompt=[PROMPT, PROMPT], max_tokens=2, n=2, seed=1, echo=True
    )
    expect(len(many.choices) == 4 and many.choices[0].text.startswith(PROMPT), "n x prompts")
    return (
        "text, token-id or batched prompts; max_tokens (0 with echo + logprobs scores the "
        "prompt), temperature, top_p, top_k, stop, n, seed, logprobs, echo, usage; "
        "greedy text = the SDK's greedy sample"
    )


@feature("endpoints", "OpenAI POST /oai/api/v1/completions, stream")
def _(c: Ctx) -> str | None:
    client = _oai(c)
    kw: dict[str, Any] = dict(model=c.sampler_path, prompt=PROMPT, max_tokens=8, temperature=0)
    whole = client.completions.create(**kw).choices[0].text
    chunks = client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    expect("".join(ch.choices[0].text for ch in chunks if ch.choices) == whole, "reassembly")
    return "server-sent events, one per token, sent when the sample completes; `[DONE]`"


@feature("endpoints", "OpenAI POST /oai/api/v1/chat/completions (+ stream)")
def _(c: Ctx) -> str | None:
    client = _oai(c)
    text = c.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    tokens = c.tokenizer.encode(text, add_special_tokens=False)
    out = client.chat.completions.create(
        model=c.sampler_path,
        messages=CHAT,
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    expect(out.choices[0].message.content == _greedy_text(c, tokens), "templated greedy text")
    expect(out.usage.prompt_tokens == len(tokens), "prompt tokens")
    stream = client.chat.completions.create(
        model=c.sampler_path, messages=CHAT, max_tokens=8, temperature=0, stream=True
    )
    parts = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    expect(parts == out.choices[0].message.content, "stream reassembly")
    return "the model's chat template (from its tokenizer); logprobs / top_logprobs; stream"


@feature("endpoints", "OpenAI GET /oai/api/v1/models")
def _(c: Ctx) -> str | None:
    ids = [m.id for m in _oai(c).models.list()]
    expect(c.base_model in ids and c.sampler_path in ids, "listing")
    return "served base models and the caller's sampler checkpoints"


@feature("endpoints", "model: base name, tinker://… path, <base>;<path>")
def _(c: Ctx) -> str | None:
    client = _oai(c)
    texts = {
        client.completions.create(model=m, prompt=PROMPT, max_tokens=4, temperature=0)
        .choices[0]
        .text
        for m in (c.sampler_path, f"{c.base_model};{c.sampler_path}")
    }
    expect(len(texts) == 1, "same checkpoint")
    return "the same sampling lane, engines, keys and ownership rules as Tinker samples"


@feature("endpoints", "foreign or missing checkpoint, unknown model, bad field")
def _(c: Ctx) -> str | None:
    import anthropic
    import openai

    missing = c.sampler_path.rsplit("/", 1)[0] + "/missing"
    for model in (c.sampler_path, missing, "no-such-model"):
        try:
            _oai(c, OTHER_KEY).completions.create(model=model, prompt=PROMPT, max_tokens=1)
            raise AssertionError("served")
        except openai.NotFoundError:
            pass
        try:
            _claude(c, OTHER_KEY).messages.create(model=model, max_tokens=1, messages=CHAT)
            raise AssertionError("served")
        except anthropic.NotFoundError:
            pass
    try:
        _oai(c).completions.create(model=c.base_model, prompt=PROMPT, temperature=9)
        raise AssertionError("accepted")
    except openai.BadRequestError:
        pass
    return "404 / 400 in each API's error shape (a published checkpoint is readable by all)"


@feature("endpoints", "Anthropic POST /anthropic/api/v1/messages (+ stream)")
def _(c: Ctx) -> str | None:
    claude = _claude(c)
    greedy = {"temperature": 0}
    msg = claude.messages.create(
        model=c.sampler_path, max_tokens=8, system="Be brief.", messages=CHAT, extra_body=greedy
    )
    with claude.messages.stream(
        model=c.sampler_path, max_tokens=8, system="Be brief.", messages=CHAT, extra_body=greedy
    ) as events:
        kinds = [e.type for e in events]
        final = events.get_final_message()
    expect(final.content[0].text == msg.content[0].text, "stream reassembly")
    expect(kinds[0] == "message_start" and kinds[-1] == "message_stop", "events")
    return (
        "system, messages (an assistant turn last is continued), max_tokens, temperature, "
        "top_p, top_k, stop_sequences; SSE message_start … message_stop; x-api-key"
    )


@feature("endpoints", "Anthropic POST /anthropic/api/v1/messages/count_tokens")
def _(c: Ctx) -> str | None:
    count = _claude(c).messages.count_tokens(model=c.base_model, messages=CHAT)
    text = c.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    expect(count.input_tokens == len(c.tokenizer.encode(text, add_special_tokens=False)), "n")
    return None
