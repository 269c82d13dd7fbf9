"""Images through the real SDK and the compatible APIs against one real `lockstep serve` of a
tiny Qwen3.5 vision-language model in its published layout (lockstep/modeling/vision/zoo.py).

- two tenants with images and a text tenant train in shared clock cycles; the loss falls; a
  server-side custom loss takes the same image datums;
- a wrong `expected_tokens` and each bad image are a 400 naming the chunk, and the tenant keeps
  training right after;
- a sampler answers an image prompt; compute_logprobs with the image equals the trainer's
  forward;
- OpenAI `image_url` data URIs and Anthropic base64 `image` blocks are answered; remote URLs are
  refused;
- the console's playground uploads an image and shows what the OpenAI route answers for it
  (headless Chromium; skipped with the other console tests where it is missing);
- tinker-cookbook's own renderer and image processing build the datums (tests/cookbook, in its
  venv; skipped with the cookbook tests).

The numbers per family (HF oracle, packed == alone, the sampler): tests/unit/test_vision_models.py.
"""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from lockstep.devserver import Server, start_server, stop_server
from lockstep.modeling.vision import zoo as vision_zoo

from .browser import WAIT_MS, chromium, sign_in_by_keyboard, unlabelled
from .packing import assert_packed

pytestmark = pytest.mark.e2e
API_KEY = "tml-vision-test"
FAMILY = "qwen3_5_vl"
COLOURS = {"red": (220, 30, 30), "blue": (30, 30, 220)}


def png(colour: tuple[int, int, int], size: tuple[int, int] = (64, 64), **save: Any) -> bytes:
    image = Image.new("RGB", size, colour)
    image.putpixel((1, 2), (255, 255, 255))
    out = io.BytesIO()
    image.save(out, format="PNG", **save)
    return out.getvalue()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, Server]]:
    os.environ["HF_HUB_OFFLINE"] = "1"
    root = tmp_path_factory.mktemp("vision")
    directory = vision_zoo.ensure_family(FAMILY, root / "models")
    # Served under its directory too: the cookbook's tokenizer lookup by model name finds it.
    # A longer gather, so the three tenants' pipelined passes usually share a cycle (the check
    # of their packing, `assert_packed`, holds however they land).
    server = start_server(root / "data", "--model", str(directory), "--clock-gather", "0.2")
    yield str(directory), directory, server
    code = stop_server(server)
    assert code == 0, f"lockstep serve did not stop cleanly ({code}):\n{server.log()[-5000:]}"


def _image_datum(
    tokenizer: Any, colour: str, expected: int | None = 4, data: bytes | None = None
) -> Any:
    """'<|vision_start|>' image '<|vision_end|>' 'colour:' -> the colour's name."""
    from tinker import types

    start = tokenizer.encode("<|im_start|>user\n<|vision_start|>")
    end = tokenizer.encode("<|vision_end|>colour?<|im_end|>\n<|im_start|>assistant\n")
    answer = tokenizer.encode(f"{colour}<|im_end|>")
    image = types.ImageChunk(
        data=png(COLOURS[colour]) if data is None else data, format="png", expected_tokens=expected
    )
    chunks = [
        types.EncodedTextChunk(tokens=start),
        image,
        types.EncodedTextChunk(tokens=end + answer[:-1]),
    ]
    n = len(start) + (expected or 4) + len(end) + len(answer) - 1
    targets = [0] * (n - len(answer)) + answer
    weights = [0.0] * (n - len(answer)) + [1.0] * len(answer)
    return types.Datum(
        model_input=types.ModelInput(chunks=chunks),
        loss_fn_inputs={"target_tokens": targets, "weights": weights},
    )


def test_images_train_packed_refuse_bad_input_and_sample(served: tuple[str, Path, Server]) -> None:
    import tinker
    from tinker import types

    name, _, server = served
    service = tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)
    images = [
        service.create_lora_training_client(base_model=name, rank=8, seed=i).result()
        for i in (1, 2)
    ]
    text = service.create_lora_training_client(base_model=name, rank=4, seed=3).result()
    tok = images[0].get_tokenizer()
    batch = [_image_datum(tok, c) for c in COLOURS]
    ids = tok.encode("The quick brown fox jumps over the lazy dog. " * 3)
    prose = types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
    )
    losses: list[list[float]] = []
    rounds: list[list[int]] = []
    for _ in range(5):  # pipelined: every tenant's step submitted before any result is read
        passes = [t.forward_backward(batch, "cross_entropy") for t in images]
        passes.append(text.forward_backward([prose], "cross_entropy"))
        steps = [t.optim_step(types.AdamParams(learning_rate=5e-3)) for t in [*images, text]]
        results = [p.result() for p in passes]
        for s in steps:
            s.result()
        rounds.append([int(r.metrics["clock_cycle:unique"]) for r in results])
        losses.append([r.metrics["loss:sum"] for r in results])
    assert_packed(server.base_url, API_KEY, service.holder.get_session_id(), rounds)
    for tenant in range(3):
        assert losses[-1][tenant] < 0.7 * losses[0][tenant], losses

    # A server-side custom loss takes the same image datums (the custom loss path).
    trainer = images[0]
    handle = service.create_custom_loss(weighted_nll, {"logprobs": 1, "weights": 1}).result()
    assert handle.loss_id is not None  # uploaded: it runs on the server
    plain = trainer.forward(batch, "cross_entropy").result().metrics["loss:sum"]
    custom = trainer.forward_backward_custom(batch, handle).result().metrics["loss:sum"]
    assert custom == pytest.approx(plain, abs=1e-4)

    # Each bad image is a 400 naming its chunk; the tenant trains on right after each.
    bad = {
        "expected_tokens: is 5 but this image is 4 tokens": _image_datum(tok, "red", expected=5),
        "data: is a truncated or corrupt png": _image_datum(tok, "red", data=png((1, 2, 3))[:-30]),
        "data: is not a PNG or JPEG image": _image_datum(tok, "red", data=b"GIF89a" + bytes(64)),
        "animated image (2 frames)": _image_datum(
            tok,
            "red",
            data=png((9, 9, 9), save_all=True, append_images=[Image.new("RGB", (64, 64))]),
        ),
        "= 144000000 pixels": _image_datum(tok, "red", data=_bomb()),
    }
    for message, datum in bad.items():
        with pytest.raises(tinker.BadRequestError) as err:
            trainer.forward_backward([datum], "cross_entropy").result()
        assert "data[0].model_input.chunks[1]" in str(err.value) and message in str(err.value)
        trainer.forward_backward(batch, "cross_entropy").result()
    trainer.optim_step(types.AdamParams(learning_rate=5e-3)).result()

    # The sampler answers an image prompt; compute_logprobs with it equals the trainer's forward.
    sampler = trainer.save_weights_and_get_sampling_client().result()
    chunks = batch[0].model_input.chunks
    out = sampler.sample(
        types.ModelInput(chunks=chunks), 1, types.SamplingParams(max_tokens=3, temperature=0.0)
    ).result()
    assert len(out.sequences[0].tokens) == 3
    scored = sampler.compute_logprobs(types.ModelInput(chunks=chunks)).result()
    # The same sequence scored by the trainer: each position's next token (placeholders too).
    expanded = [*chunks[0].tokens, *[tok.convert_tokens_to_ids("<|image_pad|>")] * 4]
    expanded += chunks[2].tokens
    scoring = types.Datum(
        model_input=types.ModelInput(chunks=chunks),
        loss_fn_inputs={
            "target_tokens": expanded[1:] + [0],
            "weights": [1.0] * len(expanded),
        },
    )
    forward = trainer.forward([scoring], "cross_entropy").result().loss_fn_outputs[0]
    theirs = np.asarray(forward["logprobs"].tolist()[:-1])
    assert len(scored) == len(expanded) and scored[0] is None
    assert np.abs(np.asarray(scored[1:]) - theirs).max() <= 1e-4


def weighted_nll(logprobs, weights):  # type: ignore[no-untyped-def]
    return -(logprobs * weights).sum(), {}


def _bomb() -> bytes:
    """A 12000 x 12000 PNG of a few KB: refused from its header, before it is decoded."""
    out = io.BytesIO()
    Image.new("1", (12000, 12000)).save(out, format="PNG")
    return out.getvalue()


QUESTION = "colour?"


def _chat_prompt(tok: Any, data: bytes) -> Any:
    """What the chat template renders for one user turn [image, text], as SDK chunks."""
    from tinker import types

    return types.ModelInput(
        chunks=[
            types.EncodedTextChunk(tokens=tok.encode("<|im_start|>user\n<|vision_start|>")),
            types.ImageChunk(data=data, format="png", expected_tokens=4),
            types.EncodedTextChunk(
                tokens=tok.encode(f"<|vision_end|>{QUESTION}<|im_end|>\n<|im_start|>assistant\n")
            ),
        ]
    )


def test_compatible_apis_take_images_as_the_sdk_does(served: tuple[str, Path, Server]) -> None:
    """OpenAI `image_url` (data: URI) and Anthropic `image` (base64) parts, rendered with the
    model's chat template, sample exactly what the SDK samples for the same prompt; a different
    image changes the answer's logprobs; remote URLs are refused."""
    import anthropic
    import openai
    import tinker
    from tinker import types

    name, _, server = served
    oai = openai.OpenAI(base_url=server.base_url + "/oai/api/v1", api_key=API_KEY, max_retries=0)
    claude = anthropic.Anthropic(
        base_url=server.base_url + "/anthropic/api", api_key=API_KEY, max_retries=0
    )
    service = tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)
    base = service.create_sampling_client(base_model=name).result()
    tok = base.get_tokenizer()
    greedy = types.SamplingParams(max_tokens=4, temperature=0.0)
    answers = {}
    for colour, rgb in COLOURS.items():
        data = png(rgb)
        prompt = _chat_prompt(tok, data)
        sdk = base.sample(prompt, 1, greedy).result().sequences[0]
        b64 = base64.b64encode(data).decode()
        chat = oai.chat.completions.create(
            model=name,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64}"}},
                        {"type": "text", "text": QUESTION},
                    ],
                }
            ],
            max_tokens=4,
            temperature=0,
            logprobs=True,
        )
        assert chat.usage is not None and chat.usage.prompt_tokens == prompt.length
        content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
        assert np.allclose([c.logprob for c in content], sdk.logprobs, atol=1e-4)
        msg = claude.messages.create(
            model=name,
            max_tokens=4,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": b64},
                        },
                        {"type": "text", "text": QUESTION},
                    ],
                }
            ],
            extra_body={"temperature": 0},
        )
        assert msg.content[0].text == chat.choices[0].message.content  # type: ignore[union-attr]
        answers[colour] = sdk.logprobs
    assert not np.allclose(answers["red"], answers["blue"], atol=1e-3)

    remote = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(
            model=name, messages=[{"role": "user", "content": [remote]}], max_tokens=2
        )
    assert "remote image URLs are not fetched" in str(err.value)
    source = {"type": "url", "url": "https://example.com/cat.png"}
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(
            model=name,
            max_tokens=2,
            messages=[{"role": "user", "content": [{"type": "image", "source": source}]}],
        )


def test_console_playground_samples_an_uploaded_image(
    served: tuple[str, Path, Server], tmp_path: Path
) -> None:
    """The playground offers an image field for a vision model; the uploaded file's bytes reach
    the model (a data: URI in the page's request), and the page shows the logprobs the OpenAI
    client gets for that very request; another image, another answer."""
    import openai

    name, _, server = served
    oai = openai.OpenAI(base_url=server.base_url + "/oai/api/v1", api_key=API_KEY, max_retries=0)
    sent: list[dict[str, Any]] = []
    shown: dict[str, list[float]] = {}
    with chromium() as context:
        page = context.new_page()
        chat_url = server.base_url + "/oai/api/v1/chat/completions"
        page.on("request", lambda r: sent.append(r.post_data_json) if r.url == chat_url else None)
        sign_in_by_keyboard(page, server.base_url, API_KEY)
        page.goto(server.base_url + "/console/playground")
        page.wait_for_selector("#playground", timeout=WAIT_MS)
        assert unlabelled(page) == []
        for colour, rgb in COLOURS.items():
            upload = tmp_path / f"{colour}.png"
            upload.write_bytes(png(rgb))
            sent.clear()
            page.get_by_label("Model", exact=True).select_option(name)
            page.get_by_label("Prompt").fill(QUESTION)
            page.get_by_label("Image (PNG or JPEG)").set_input_files(upload)
            page.get_by_label("Samples").fill("1")
            page.get_by_label("Max tokens").fill("4")
            page.get_by_label("Temperature").fill("0")
            page.evaluate("document.querySelector('#samples').replaceChildren()")
            page.get_by_role("button", name="Sample").click()
            page.wait_for_selector("#samples .column .sample", timeout=WAIT_MS)
            cells = page.locator("#samples .sample tbody tr td:nth-of-type(2)").all_text_contents()
            shown[colour] = [float(c) for c in cells]

            (body,) = sent
            (image,) = [p for p in body["messages"][0]["content"] if p["type"] == "image_url"]
            head, data = image["image_url"]["url"].split(",", 1)
            assert head == "data:image/png;base64" and base64.b64decode(data) == upload.read_bytes()
            asked = {k: body[k] for k in ("model", "messages", "max_tokens", "temperature")}
            chat = oai.chat.completions.create(**asked, logprobs=True)
            content = chat.choices[0].logprobs.content
            assert shown[colour] and np.allclose(
                shown[colour], [c.logprob for c in content], atol=1e-4
            )  # the page shows 4 decimals
        page.screenshot(path=tmp_path / "playground-image.png", full_page=True)
    assert not np.allclose(shown["red"], shown["blue"], atol=1e-3)


def test_cookbook_renderers_train_sample_and_merge(
    served: tuple[str, Path, Server], tmp_path: Path
) -> None:
    """tinker-cookbook's own `qwen3_5` renderer and image processing build the datums; they
    train, sample and score through the SDK; the saved adapter merged by the cookbook's
    `weights.build_hf_model` gives the trainer's logprobs with the image; vlm_classifier's
    dataset over a local image folder trains in the cookbook's supervised loop
    (tests/cookbook/drivers/vision.py, in the cookbook venv)."""
    if os.environ.get("LOCKSTEP_SKIP_COOKBOOK"):
        pytest.skip("LOCKSTEP_SKIP_COOKBOOK is set")
    from tests.cookbook.conftest import DRIVERS, ensure_cookbook_venv, offline_env, read_jsonl

    name, _, server = served
    images = tmp_path / "images"
    rng = np.random.default_rng(0)
    for colour, rgb in {**COLOURS, "green": (30, 200, 30), "yellow": (230, 220, 30)}.items():
        (images / colour).mkdir(parents=True)
        for k in range(4):
            noise = rng.integers(-20, 20, (64, 64, 3))
            pixels = np.clip(np.asarray(rgb) + noise, 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(images / colour / f"{k}.png")
    home = tmp_path / "home"
    home.mkdir()
    out = tmp_path / "results.json"
    config = {
        "model": name,
        "images": str(images),
        "data_dir": str(server.data_dir),
        "log_dir": str(tmp_path / "run"),
        "out": str(out),
    }
    env = {**offline_env(home, server.base_url), "TINKER_API_KEY": API_KEY}
    proc = subprocess.run(
        [str(ensure_cookbook_venv()), str(DRIVERS / "vision.py"), json.dumps(config)],
        capture_output=True,
        text=True,
        env=env,
        cwd=home,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    got = json.loads(out.read_text())
    assert got["expected_tokens"] == [4]  # the cookbook's own count for a 64x64 image
    assert got["losses"][-1] < 0.5 * got["losses"][0], got["losses"]
    assert got["answer_tokens"]
    forward = np.asarray(got["forward_logprobs"])
    scored = np.asarray(got["compute_logprobs"])[got["same_target"]]
    assert len(got["same_target"]) > 10
    assert np.abs(scored - forward[got["same_target"]]).max() <= 1e-4
    assert np.abs(np.asarray(got["merged_logprobs"]) - forward).max() <= 1e-4
    nll = [row["train_mean_nll"] for row in read_jsonl(tmp_path / "run" / "metrics.jsonl")]
    assert len(nll) >= 3 and nll[-1] < 0.7 * nll[0], nll
