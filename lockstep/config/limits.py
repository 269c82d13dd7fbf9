"""Request and capacity limits: one frozen dataclass (docs/operations.md, "Limits").

A permanent violation (a body, datum or request too large; a tenant quota used up) is a 4xx that
names the limit; a transient one (a full queue) is a 429, which the SDK backs off on and retries.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from lockstep.config.flags import EVERYWHERE, GATEWAY, SCHEDULER, SCHEDULER_ONLY, flag

MIB = 1024 * 1024
DAY_S = 24 * 3600
# A finished request's result (and its seq_id claim) stays retrievable this long: what Redis
# holds in steady state is about results per second x their size x this (docs/operations.md).
DEFAULT_FUTURE_TTL_S = DAY_S
_OPTIONAL = (
    "max_tokens_per_datum",
    "max_tenants",
    "max_tenants_per_key",
    "max_tokens_per_cycle_per_key",
)  # 0 = no limit


@dataclass(frozen=True)
class Limits:
    """Every limit in one place; 0 means "no limit" for the optional ones.

    `max_tokens_per_cycle_per_key` is a quota, so it lives here beside the tenant quotas rather
    than in ClockConfig. `max_lora_rank` has no flag: with a vLLM/SGLang sampler the scheduler
    lowers it to the rank that server reserves (SamplerConfig.max_lora_rank).
    """

    max_body_bytes: int = field(
        default=256 * MIB,
        metadata=flag(
            "--max-body-bytes",
            help="largest request body, after decompression (413 above it)",
            on=GATEWAY,
            scaled=(("--max-body-mb", MIB, "the same limit in MiB"),),
        ),
    )
    max_tokens_per_datum: int = field(
        default=0,
        metadata=flag(
            "--max-tokens-per-datum",
            help="model-input tokens per datum or sample prompt (0: context length)",
            on=SCHEDULER,
        ),
    )
    max_datums_per_request: int = field(
        default=4096,
        metadata=flag(
            "--max-datums-per-request",
            help="datums per forward/forward_backward request (the SDK is told to chunk below it)",
            on=EVERYWHERE,
        ),
    )
    max_tenants: int = field(
        default=0,
        metadata=flag(
            "--max-tenants",
            help="training runs this server holds, all keys together (0: no limit)",
            on=SCHEDULER,
        ),
    )
    max_tenants_per_key: int = field(
        default=0,
        metadata=flag(
            "--max-tenants-per-key",
            help="training runs one API key may create (0: no limit)",
            on=SCHEDULER,
        ),
    )
    max_tokens_per_cycle_per_key: int = field(
        default=0,
        metadata=flag(
            "--max-tokens-per-cycle-per-key",
            help="pass tokens of one API key's models in one clock cycle; the rest waits for "
            "the next cycle (0: no limit)",
            on=SCHEDULER,
        ),
    )
    future_ttl_s: int = field(
        default=DEFAULT_FUTURE_TTL_S,
        metadata=flag(
            "--future-ttl",
            help="seconds a finished request's result (and its seq_id, for an exactly-once "
            "retry) stays retrievable (default a day)",
            on=SCHEDULER,
            metavar="SECONDS",
            deprecated=("--future-ttl-s",),
        ),
    )
    max_pending_per_model: int = field(
        default=4096,
        metadata=flag(
            "--max-pending-per-model",
            help="queued requests of one model before its submissions get 429",
            on=SCHEDULER_ONLY,
        ),
    )
    max_pending_samples: int = field(
        default=20000,
        metadata=flag(
            "--max-pending-samples",
            help="queued sample requests (all tenants) before samples get 429",
            on=SCHEDULER_ONLY,
        ),
    )
    max_samples_per_request: int = field(
        default=256,
        metadata=flag(
            "--max-samples-per-request",
            help="num_samples of one sample request",
            on=SCHEDULER_ONLY,
        ),
    )
    max_image_bytes: int = field(
        default=16 * MIB,
        metadata=flag(
            "--max-image-bytes",
            help="largest encoded image (PNG or JPEG) in a model input",
            on=SCHEDULER,
        ),
    )
    max_image_pixels: int = field(
        default=40_000_000,
        metadata=flag(
            "--max-image-pixels",
            help="largest image in pixels (width x height), checked from its header before it "
            "is decoded",
            on=SCHEDULER,
        ),
    )
    max_lora_rank: int = 512  # largest LoRA rank a training run may ask for

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            optional = f.name in _OPTIONAL
            if value < 0 or (value == 0 and not optional):
                raise ValueError(f"{f.name} must be {'>= 0' if optional else '> 0'}, got {value}")
