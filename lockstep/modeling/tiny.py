"""The default served model: a tiny random-init Qwen3 plus a byte-level BPE tokenizer.

Nothing can be downloaded at run time, so the default model is *built* locally, deterministically:
the same bytes in every directory, on every machine with the same library versions. Weights are
drawn with our own per-parameter generators (not transformers' init code), so they do not change
when transformers changes its initialisers.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import zlib
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from tokenizers import Tokenizer

DEFAULT_MODEL_NAME = "Lockstep/tiny-qwen3"
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TOKENIZER_VOCAB_SIZE = 1024
_SEED = 20251122
# Bump when the recipe changes so an old cache directory is never reused for a new recipe.
_RECIPE_VERSION = "v1"

# ChatML, the format Qwen models use; `apply_chat_template` works offline with it.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def tokenizer_corpus() -> str:
    """The fixed corpus shipped with the package."""
    return (resources.files("lockstep") / "assets" / "tokenizer_corpus.txt").read_text("utf-8")


def recipe_digest() -> str:
    """Recipe version + corpus digest: a cache directory name changes when either does."""
    digest = hashlib.sha256(tokenizer_corpus().encode()).hexdigest()[:8]
    return f"{_RECIPE_VERSION}-{digest}"


def ensure_default_model(cache_dir: Path) -> Path:
    """Build (once, atomically) and return the default model directory under `cache_dir`.

    The directory is a normal HF model dir (config.json, model.safetensors, tokenizer files) that
    `AutoModelForCausalLM` / `AutoTokenizer.from_pretrained` load offline.
    """
    cache_dir = Path(cache_dir)
    final = cache_dir / f"tiny-qwen3-{recipe_digest()}"
    if (final / "config.json").is_file():
        return final
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=cache_dir))
    try:
        build_tiny_model(tmp, tokenizer_corpus())
        try:
            os.rename(tmp, final)  # atomic: readers see nothing or a complete directory
        except OSError:
            if not (final / "config.json").is_file():  # not a lost race: a real failure
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def write_tokenizer(
    directory: Path,
    corpus: str | None = None,
    extra_specials: tuple[str, ...] = (),
    chat_template: str = CHAT_TEMPLATE,
) -> tuple[int, int]:
    """Train and save the built-in tokenizer into `directory`; returns (eos id, vocab size).
    `extra_specials` (e.g. a vision model's image tokens) get ids after the trained vocabulary."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer(tokenizer_corpus() if corpus is None else corpus),
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>", *extra_specials],
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(str(directory))
    _portable_tokenizer_config(directory / "tokenizer_config.json")
    eos_id = int(tokenizer.convert_tokens_to_ids("<|endoftext|>"))  # type: ignore[arg-type]
    return eos_id, len(tokenizer)


def build_tiny_model(directory: Path, corpus: str) -> None:
    """Write the tokenizer and the random-init model into an existing empty `directory`."""
    import torch  # here, not at the top: `lockstep serve` finds a built model without it
    from transformers import Qwen3Config, Qwen3ForCausalLM

    eos_id, vocab = write_tokenizer(directory, corpus)
    config = Qwen3Config(
        vocab_size=vocab,  # exactly the tokenizer: every sampled id decodes
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,  # vllm refuses smaller head dims
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        dtype="float32",
    )
    with torch.device("cpu"):
        model = Qwen3ForCausalLM(config)
    init_weights(model, std=0.02)
    model.generation_config.do_sample = True
    model.save_pretrained(str(directory), safe_serialization=True)
    finish_directory(directory)


def finish_directory(directory: Path) -> None:
    """Stamp the recipe and make a freshly built model directory readable by every process."""
    (directory / "lockstep_build.json").write_text(
        json.dumps({"recipe": _RECIPE_VERSION, "seed": _SEED}, sort_keys=True) + "\n"
    )
    # mkdtemp makes the directory 0700; the served model must be readable by other processes.
    directory.chmod(0o755)
    for path in directory.iterdir():
        path.chmod(0o644)


def _portable_tokenizer_config(path: Path) -> None:
    """Name the class and the specials the way transformers 4.x and 5.x (and vLLM) both read.

    transformers 5 writes `TokenizersBackend` and a list-valued `extra_special_tokens`, which 4.x
    does not understand; the specials are in tokenizer.json either way.
    """
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    extra = config.pop("extra_special_tokens", None)
    if isinstance(extra, list):
        config["additional_special_tokens"] = extra
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def init_weights(model: torch.nn.Module, std: float) -> None:
    """Norms = 1, everything else N(0, std) from a generator seeded by the parameter's name."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            gen = torch.Generator().manual_seed(_SEED ^ zlib.crc32(name.encode()))
            param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float32) * std)


def _train_tokenizer(corpus: str) -> Tokenizer:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Special tokens inside the corpus must not be split into merges: strip them out first.
    lines = [line for line in corpus.splitlines() if line.strip()]
    for special in SPECIAL_TOKENS:
        lines = [line.replace(special, " ") for line in lines]
    tok.train_from_iterator(lines, trainer=trainer)
    return tok
