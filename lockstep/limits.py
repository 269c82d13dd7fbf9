"""Request and capacity limits: one frozen dataclass, shared by `lockstep serve`, the gateway and
the scheduler (docs/operations.md, "Limits").

A permanent violation (a body, datum or request too large; a tenant quota used up) is a 4xx that
names the limit; a transient one (a full queue) is a 429, which the SDK backs off on and retries.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

MIB = 1024 * 1024
WEEK_S = 7 * 24 * 3600
# Not a scheduler flag: the body size is the gateway's; --max-lora-rank is the sampler's
# (lockstep/rollout/config.py: the rank a vLLM/SGLang server reserves per adapter).
_NOT_SCHEDULER_FLAGS = ("max_body_bytes", "max_lora_rank")
_OPTIONAL = ("max_tokens_per_datum", "max_tenants", "max_tenants_per_key",
             "max_tokens_per_cycle_per_key")  # 0 = no limit


@dataclass(frozen=True)
class Limits:
    """Every limit in one place; 0 means "no limit" for the optional ones.

    Attributes:
        max_body_bytes: largest request body, after decompression (gateway: 413 above it).
        max_tokens_per_datum: model-input tokens of one forward/forward_backward datum or one
            sample prompt; 0: the model's context length (400 above it).
        max_datums_per_request: datums in one forward/forward_backward request (400 above it).
            The gateway's client config tells the SDK to chunk its batches below it.
        max_tenants: training runs (LoRA adapters) this server holds, over all keys; 0: no limit.
        max_tenants_per_key: training runs one API key may create; 0: no limit.
        max_tokens_per_cycle_per_key: pass tokens all models of one API key may run in one
            clock cycle; the rest waits for the next cycle (never an error); 0: no limit. A
            quota, so it lives here beside the tenant quotas rather than in ClockConfig.
        future_ttl_s: how long a finished request's result stays retrievable.
        max_pending_per_model: queued requests of one model before submissions get 429.
        max_pending_samples: queued sample requests (all tenants) before samples get 429.
        max_samples_per_request: `num_samples` of one sample request.
        max_lora_rank: largest LoRA rank a training run may ask for.
    """

    max_body_bytes: int = 256 * MIB
    max_tokens_per_datum: int = 0
    max_datums_per_request: int = 4096
    max_tenants: int = 0
    max_tenants_per_key: int = 0
    max_tokens_per_cycle_per_key: int = 0
    future_ttl_s: int = WEEK_S
    max_pending_per_model: int = 4096
    max_pending_samples: int = 20000
    max_samples_per_request: int = 256
    max_lora_rank: int = 512

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            optional = f.name in _OPTIONAL
            if value < 0 or (value == 0 and not optional):
                raise ValueError(f"{f.name} must be {'>= 0' if optional else '> 0'}, got {value}")

    def scheduler_argv(self) -> list[str]:
        """The scheduler's command-line flags for these limits (what `lockstep serve` passes)."""
        argv: list[str] = []
        for f in fields(self):
            if f.name not in _NOT_SCHEDULER_FLAGS:
                argv += [f"--{f.name.replace('_', '-')}", str(getattr(self, f.name))]
        return argv


def add_scheduler_arguments(p: argparse.ArgumentParser) -> None:
    """`python -m lockstep.scheduler` flags: one per Limits field the scheduler enforces."""
    d = Limits()
    for f in fields(Limits):
        if f.name not in _NOT_SCHEDULER_FLAGS:
            p.add_argument(f"--{f.name.replace('_', '-')}", type=int, default=getattr(d, f.name))


def from_scheduler_args(a: argparse.Namespace) -> Limits:
    return Limits(**{f.name: getattr(a, f.name) for f in fields(Limits)
                     if f.name not in _NOT_SCHEDULER_FLAGS})


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """The `lockstep serve` flags (the commonly tuned limits)."""
    d = Limits()
    p.add_argument("--max-body-mb", type=float, default=d.max_body_bytes / MIB,
                   help="largest request body in MiB, after decompression (413 above it)")
    p.add_argument("--max-tokens-per-datum", type=int, default=d.max_tokens_per_datum,
                   help="model-input tokens per datum or sample prompt (0: context length)")
    p.add_argument("--max-datums-per-request", type=int, default=d.max_datums_per_request,
                   help="datums per forward/forward_backward request (the SDK chunks below it)")
    p.add_argument("--max-tenants", type=int, default=d.max_tenants,
                   help="training runs this server holds, all keys together (0: no limit)")
    p.add_argument("--max-tenants-per-key", type=int, default=d.max_tenants_per_key,
                   help="training runs one API key may create (0: no limit)")
    p.add_argument("--max-tokens-per-cycle-per-key", type=int,
                   default=d.max_tokens_per_cycle_per_key,
                   help="pass tokens of one API key's models in one clock cycle; the rest "
                   "waits for the next cycle (0: no limit)")
    p.add_argument("--future-ttl", type=int, default=d.future_ttl_s, metavar="SECONDS",
                   help="how long a finished request's result stays retrievable (default a week)")


def from_serve_args(a: argparse.Namespace) -> Limits:
    return Limits(
        max_body_bytes=max(1, int(a.max_body_mb * MIB)),
        max_tokens_per_datum=a.max_tokens_per_datum,
        max_datums_per_request=a.max_datums_per_request, max_tenants=a.max_tenants,
        max_tenants_per_key=a.max_tenants_per_key,
        max_tokens_per_cycle_per_key=a.max_tokens_per_cycle_per_key, future_ttl_s=a.future_ttl)
