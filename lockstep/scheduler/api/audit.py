"""The audit trail the gRPC edge and the session lifecycle record into.

An entry is written after its action took effect (a job queued, a checkpoint deleted, a session
ended). A failed write cannot undo the action, and failing the call would have the client
retry an action that already happened, so it is logged and counted
(`lockstep_errors_total{category="audit"}`) and the action stands.
"""

from __future__ import annotations

import logging
from typing import Any

from lockstep.observability import metrics
from lockstep.scheduler.observers.accounting import Accounting
from lockstep.scheduler.state import redis_conn
from lockstep.vocab import AuditEvent

log = logging.getLogger(__name__)


class AuditTrail:
    def __init__(self, accounting: Accounting) -> None:
        self.accounting = accounting

    async def record(self, owner: str, event: AuditEvent, **details: Any) -> None:
        try:
            await self.accounting.audit(owner, event, **details)
        except redis_conn.ERRORS as exc:
            metrics.scheduler_error("audit")
            log.error("audit entry %s for %s not written (%s): %s", event, owner, details, exc)
