"""Tenancy settings: runs that come and go (paging, session and sampler expiry, audit
retention)."""

from __future__ import annotations

from dataclasses import dataclass, field

from lockstep.config.flags import SCHEDULER, flag

DAY_S = 24 * 3600


@dataclass(frozen=True)
class TenancyConfig:
    """Tenants that come and go: paging, session expiry, audit retention."""

    max_resident_models: int = field(
        default=0,
        metadata=flag(
            "--max-resident-models",
            help="training runs the trainer holds at once; others are paged out LRU and "
            "restored before their next cycle (0: no limit)",
            on=SCHEDULER,
        ),
    )
    session_expiry_s: float = field(
        default=600.0,
        metadata=flag(
            "--session-expiry",
            help="seconds without a heartbeat after which a session has ended and its models' "
            "engine state is freed (0: never)",
            on=SCHEDULER,
        ),
    )
    sampler_expiry_s: float = field(
        default=DAY_S,
        metadata=flag(
            "--sampler-expiry",
            help="seconds a sampling session may go unused (no sample, no client joining) "
            "before it is removed, with the sampler weights save_weights_and_get_sampling_client "
            "wrote for it (0: never; a long-lived RL run makes one per step)",
            on=SCHEDULER,
        ),
    )
    audit_retention_s: float = field(
        default=90 * DAY_S,
        metadata=flag(
            "--audit-retention",
            help="seconds the audit log and the usage counters are kept",
            on=SCHEDULER,
        ),
    )

    def __post_init__(self) -> None:
        if self.max_resident_models < 0:
            raise ValueError("--max-resident-models must be >= 0")
        if self.sampler_expiry_s < 0:
            raise ValueError("--sampler-expiry must be >= 0")
