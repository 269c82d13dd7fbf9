#!/usr/bin/env python3
"""Probe every public method of the tinker SDK's clients against a Lockstep server and write the
compatibility matrix (docs/compatibility.md).

    python scripts/compat_matrix.py                       # starts its own `lockstep serve`
    python scripts/compat_matrix.py --base-url http://127.0.0.1:8000
    python scripts/compat_matrix.py --check               # exit 1 if the doc is out of date

Every public method of ServiceClient, TrainingClient, SamplingClient and RestClient is called
for real (the deprecated `*_async` variants through their own entry points, awaited) and its
result checked; a method the server refuses is listed as unsupported with the server's reason.
Methods that never reach the server are marked client-side. Loss functions, sampling options
and datum features get tables of their own. The output holds no ids or times, so a rerun on an
unchanged server reproduces it byte for byte (the test suite checks that the doc is current).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import inspect
import os
import re
import shutil
import sys
import tempfile
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import compat.endpoint_probes  # noqa: E402,F401  (registers the endpoint probes)
import compat.method_probes  # noqa: E402,F401  (registers the method probes)
from compat.context import API_KEY, DEFAULT_OUTPUT, PROBES, REPO, Caller, ClientSide, Ctx, Outcome  # noqa: E402
from compat.feature_probes import FEATURES  # noqa: E402
from compat.model_families import family_table  # noqa: E402
from compat.vision_families import vision_table  # noqa: E402

# ------------------------------------------------------------------------------ running

_ID = re.compile(
    r"(sess|req|samp|run)-[0-9a-f]{6,}(:[a-z]+:\d+)?|tinker://[^\s'\"]+|"
    r"\b[0-9a-f]{16,}\b|\d{4}-\d\d-\d\dT?[\d:. +]*"
)


def _reason(exc: BaseException) -> str:
    body = getattr(exc, "body", None)
    detail = body.get("detail") if isinstance(body, dict) else None
    text = str(detail or body or exc)
    text = _ID.sub("…", text).replace("\n", " ").strip()
    status = getattr(exc, "status_code", None)
    prefix = f"HTTP {status}: " if status else f"{type(exc).__name__}: "
    return (prefix + text)[:400]


# Hosted-service features with no counterpart in a self-hosted server (see the end of the doc).
HOSTED_ONLY = {
    "copy_weights",
    "assign_session_project",
    "whoami",
}


def run_one(fn: Callable[[], str | None]) -> Outcome:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            note = fn()
        except ClientSide as cs:
            return Outcome("client-side", str(cs))
        except Exception as exc:  # noqa: BLE001 - every failure is a row of the matrix
            if os.environ.get("COMPAT_DEBUG"):
                traceback.print_exc()
            return Outcome("unsupported", _reason(exc))
    return Outcome("supported", note or "")


def public_methods(cls: type) -> list[str]:
    return sorted(n for n, v in inspect.getmembers(cls) if not n.startswith("_") and callable(v))


def probe_all(
    base_url: str, base_model: str, only: set[str] | None = None
) -> tuple[dict[str, dict[str, Outcome]], dict[str, dict[str, Outcome]]]:
    import tinker

    ctx = Ctx(base_url, base_model)
    loop = asyncio.new_event_loop()
    classes = [
        tinker.ServiceClient,
        tinker.TrainingClient,
        tinker.SamplingClient,
        tinker.RestClient,
    ]
    methods: dict[str, dict[str, Outcome]] = {}
    for cls in classes:
        rows: dict[str, Outcome] = {}
        for name in public_methods(cls):
            key = f"{cls.__name__}.{name}"
            use_async = name.endswith("_async") and f"{cls.__name__}.{name[:-6]}" in PROBES
            base_key = f"{cls.__name__}.{name[:-6]}" if use_async else key
            if only is not None and base_key not in only:
                continue
            fn = PROBES.get(base_key)
            if fn is None:
                rows[name] = Outcome("unsupported", "no probe for this method (new in the SDK?)")
                continue
            caller = Caller(cls.__name__, use_async, loop)
            rows[name] = run_one(functools.partial(fn, ctx, caller))
            if rows[name].status == "unsupported" and base_key.split(".")[1] in HOSTED_ONLY:
                rows[name].note = f"hosted-service feature ({rows[name].note})"
            print(f"{key}: {rows[name].status} {rows[name].note}", file=sys.stderr)
        methods[cls.__name__] = rows
    features: dict[str, dict[str, Outcome]] = {}
    if only is None:
        for table, probes in FEATURES.items():
            features[table] = {}
            for name, feat in probes.items():
                features[table][name] = run_one(functools.partial(feat, ctx))
                print(f"{table}/{name}: {features[table][name].status}", file=sys.stderr)
    loop.close()
    return methods, features


# ------------------------------------------------------------------------------ output

_MARK = {
    "supported": "✅ supported",
    "unsupported": "❌ unsupported",
    "client-side": "➖ client-side",
}


def _table(rows: dict[str, Outcome], first: str) -> list[str]:
    out = [f"| {first} | status | notes |", "|---|---|---|"]
    for name, o in rows.items():
        note = o.note.replace("|", "\\|")
        out.append(f"| `{name}` | {_MARK[o.status]} | {note} |")
    return out


def render(
    methods: dict[str, dict[str, Outcome]],
    features: dict[str, dict[str, Outcome]],
    sdk_version: str,
    cookbook_pin: str,
) -> str:
    counts = {
        s: sum(o.status == s for rows in methods.values() for o in rows.values()) for s in _MARK
    }
    lines = [
        "# Compatibility with the tinker SDK",
        "",
        "<!-- Generated by scripts/compat_matrix.py; do not edit by hand. Regenerate with",
        "     `python scripts/compat_matrix.py` (tests/integration/test_compat_matrix.py checks",
        "     that this file is current). -->",
        "",
        f"Probed against `lockstep serve` (built-in tiny Qwen3) with **tinker {sdk_version}**;"
        f" the cookbook tests pin **{cookbook_pin}** (tests/cookbook/requirements.txt).",
        "Every public method of the four clients is called for real and its result checked;"
        " `*_async` rows call the SDK's async entry point (most are deprecated wrappers).",
        "",
        f"Methods: {counts['supported']} supported, {counts['unsupported']} unsupported, "
        f"{counts['client-side']} client-side (never reach the server).",
        "",
    ]
    for cls, rows in methods.items():
        lines += [f"## {cls}", "", *_table(rows, "method"), ""]
    titles = {
        "loss": "Loss functions (`forward_backward` / `forward`)",
        "sampling": "Sampling options",
        "datum": "Datum features",
        "endpoints": "OpenAI- and Anthropic-compatible endpoints (official `openai` / `anthropic`"
        " clients)",
    }
    for table, rows in features.items():
        lines += [f"## {titles[table]}", "", *_table(rows, "feature"), ""]
    lines += family_table()
    lines += vision_table()
    lines += [
        "## Sampled logprobs",
        "",
        "A sampled token's logprob (and its `topk_sample_logprobs`) is the log-probability under",
        "the distribution the token was drawn from, as hosted Tinker returns it: at temperature T",
        "that is log p_T = log_softmax(logits / T), so pairwise differences are those of T = 1",
        "divided by T (tinker-cookbook's `validate_temperature_logprobs`). With top-k / top-p the",
        "distribution is truncated and renormalised: a kept token's logprob rises by",
        "-log(kept mass), truncated tokens have probability 0 (logprob -inf in top-k lists; the",
        "compatible endpoints leave them out). At temperature 0 (greedy) the logprobs are the",
        "model's own (T = 1). Prompt logprobs are always the model's own (T = 1), equal to the",
        "trainer's `forward`. Every engine does the same: the local sampler, vLLM",
        "(`--logprobs-mode processed_logprobs`), SGLang (`SGLANG_RETURN_ORIGINAL_LOGPROB=0`).",
        "",
        "## Why the unsupported ones are unsupported",
        "",
        "- **stable_reinforce**: Tinker documents what a client sends (sampling with",
        "  `record_stability_info=True`, datums carrying provenance spans that name the sampled",
        "  `sequence_id`s) but not the objective itself nor the stability information the sampler",
        "  records, so it cannot be reproduced faithfully. The server refuses it with a 400 that",
        "  says so; `record_stability_info` and provenance spans are accepted (and ignored) so",
        "  recipes that always send them keep working with the other losses.",
        "- **hosted-console features** (projects, `whoami`, weight copies into a project): no",
        "  counterpart in a self-hosted server. `assign_session_project` answers 404; the SDK's",
        "  `copy_weights` sends the project form and gets a 400 naming the form that is served",
        "  (`session_id` + `model_seq_id` of a run of the caller's); `whoami` needs JWT auth.",
        "  Billing usage, the audit log, storage usage and session search are served per key",
        "  (also `lockstep admin usage|audit|keys`).",
        "- **image chunks on a text-only model** (the probe above runs on the built-in text",
        '  model): refused by name; the vision-language families in "Image input" take them.',
        "- **audio (`dmel` chunks)** and alternative-token prompt scoring: no served model takes",
        "  audio, and the samplers return no alternative-token scores.",
        "",
    ]
    return "\n".join(lines)


# ------------------------------------------------------------------------------ server


@contextlib.contextmanager
def serve() -> Iterator[str]:
    """A throwaway `lockstep serve` on a free port (its own data dir, removed afterwards)."""
    from lockstep.devserver import start_server, stop_server

    data = Path(tempfile.mkdtemp(prefix="lockstep-compat-"))
    server = start_server(data / "data")
    try:
        yield server.base_url
    finally:
        stop_server(server)
        shutil.rmtree(data, ignore_errors=True)


def cookbook_pin() -> str:
    req = REPO / "tests" / "cookbook" / "requirements.txt"
    for line in req.read_text().splitlines() if req.exists() else []:
        if line.startswith("tinker-cookbook"):
            return line.strip()
    return "tinker-cookbook (unpinned)"


def generate(base_url: str, base_model: str) -> str:
    import tinker

    os.environ.setdefault("TINKER_API_KEY", API_KEY)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    methods, features = probe_all(base_url, base_model)
    return render(methods, features, tinker.__version__, cookbook_pin())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", help="a running server (default: start one)")
    p.add_argument("--base-model", default="Lockstep/tiny-qwen3")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    p.add_argument(
        "--check",
        action="store_true",
        help="do not write; exit 1 if --output differs from the generated matrix",
    )
    a = p.parse_args(argv)
    with contextlib.ExitStack() as stack:
        url = a.base_url or stack.enter_context(serve())
        text = generate(url, a.base_model)
    if a.check:
        current = a.output.read_text() if a.output.exists() else ""
        if current != text:
            print(f"{a.output} is out of date; run scripts/compat_matrix.py", file=sys.stderr)
            return 1
        return 0
    a.output.write_text(text)
    print(f"wrote {a.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
