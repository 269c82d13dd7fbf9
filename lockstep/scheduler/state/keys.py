"""Every Redis key the scheduler uses, in one place (like arq's constants module).

All keys share the `ls:` prefix so one Redis can be shared with other services and the whole
Lockstep state can be listed with `SCAN MATCH ls:*`.
"""

PREFIX = "ls:"

# String (JSON): the state's format stamp, {"format": N, "written_by": version} (format.py).
FORMAT = PREFIX + "format"

# Pool-wide clock counter: INCR once per cycle that ran work. Only ever increases.
CLOCK = PREFIX + "clock"
# Models that have queued training work (the clock scans only these).
ACTIVE_MODELS = PREFIX + "active_models"
# Every training run ever created here (a set; the --max-tenants count).
ALL_MODELS = PREFIX + "all_models"
# Sample jobs waiting for the sampling lane (a list of request ids, FIFO).
SAMPLE_QUEUE = PREFIX + "sample_queue"
# Every owner (API key) that has created a session (a set; read by admin keys' usage).
OWNERS = PREFIX + "owners"
# Sorted set: sampling session id -> when it was last used (created, a sample submitted, a
# client joined). Sampling sessions unused for --sampler-expiry are removed (tenancy).
SAMPLER_USES = PREFIX + "sampler_uses"


def job(request_id: str) -> str:
    """Hash: kind, owner, model_id, seq_id, digest, payload, status, result, error, created."""
    return f"{PREFIX}job:{request_id}"


def seq_claim(model_id: str, seq_id: int) -> str:
    """String: request id that owns (model, seq_id). Makes a retried request exactly-once. It
    expires with its request's result (--future-ttl after the request left the replay log); a
    seq_id below the model's next_seq without a claim is refused as expired (claims.py)."""
    return f"{seq_claim_prefix(model_id)}{seq_id}"


def seq_claim_prefix(model_id: str) -> str:
    return f"{PREFIX}seq:{model_id}:"


def sample_claim(sampling_session_id: str, seq_id: int) -> str:
    """String: request id that owns (sampling session, seq_id)."""
    return f"{PREFIX}sseq:{sampling_session_id}:{seq_id}"


def sample_done(sampling_session_id: str, clone: int) -> str:
    """Sorted set: cursor -> "<cursor>|<state>|<request id>|<payload bytes>", the completions of
    one (sampling session, clone) not yet acknowledged by its retrieve_futures poller."""
    return f"{PREFIX}sdone:{sampling_session_id}:{clone}"


def sample_done_cursor(sampling_session_id: str, clone: int) -> str:
    """String: the last cursor handed out in `sample_done` (INCR; never moves back)."""
    return f"{PREFIX}sdone_cursor:{sampling_session_id}:{clone}"


def sampler_clients(sampling_session_id: str) -> str:
    """String: the last clone id handed to a client joining the sampling session (INCR)."""
    return f"{PREFIX}sclients:{sampling_session_id}"


def pending(model_id: str) -> str:
    """Sorted set: seq_id -> request id of the model's queued training requests."""
    return f"{PREFIX}pending:{model_id}"


def progress(model_id: str) -> str:
    """Hash: next_seq (the seq_id the clock runs next), snapshot_seq (the seq_id whose state
    is the model's durable snapshot), last_request_time, steps (optim_steps committed) and
    tokens (forward_backward tokens committed). Written with the job outcomes, in the same
    transaction, so a crash never leaves a finished request without its model advancing."""
    return f"{PREFIX}progress:{model_id}"


def history(model_id: str) -> str:
    """List of the model's committed forward, forward_backward and optim_step results' metrics
    (`records.HistoryEntry`, oldest first), appended by the commit script with the op's result
    and trimmed to the newest `commit.HISTORY_KEPT`; the run's metrics per step are read here."""
    return f"{PREFIX}history:{model_id}"


def replay(model_id: str) -> str:
    """Sorted set: seq_id -> request id of forward_backward passes run since the model's last
    snapshot. A restarted engine restores the snapshot and re-runs these to rebuild gradients."""
    return f"{PREFIX}replay:{model_id}"


def model(model_id: str) -> str:
    """String (JSON ModelRecord)."""
    return f"{PREFIX}model:{model_id}"


def session(session_id: str) -> str:
    """String (JSON SessionRecord)."""
    return f"{PREFIX}session:{session_id}"


def session_models(session_id: str) -> str:
    """Set of model ids created in a session."""
    return f"{PREFIX}session:{session_id}:models"


def session_samplers(session_id: str) -> str:
    """Set of sampling session ids created in a session."""
    return f"{PREFIX}session:{session_id}:samplers"


def custom_loss(loss_id: str) -> str:
    """String (JSON CustomLossRecord); the id is "<session_id>:loss:<custom_loss_seq_id>"."""
    return f"{PREFIX}custom_loss:{loss_id}"


def session_losses(session_id: str) -> str:
    """Set of custom loss ids created in a session (bounds how many it may store)."""
    return f"{PREFIX}session:{session_id}:losses"


def sampler(sampler_id: str) -> str:
    """String (JSON SamplerRecord)."""
    return f"{PREFIX}sampler:{sampler_id}"


def inflight_target(model_id: str) -> str:
    """String (JSON InflightTarget): the model's shared inflight weights target."""
    return f"{PREFIX}inflight:{model_id}"


def checkpoints(model_id: str) -> str:
    """Hash: checkpoint_id ("weights/name") -> JSON CheckpointRecord."""
    return f"{PREFIX}checkpoints:{model_id}"


def owner_sessions(owner: str) -> str:
    """Sorted set: session id scored by creation time."""
    return f"{PREFIX}owner:{owner}:sessions"


def owner_runs(owner: str) -> str:
    """Sorted set: model (training run) id scored by creation time."""
    return f"{PREFIX}owner:{owner}:runs"


# ---------------------------------------------------------------- tenancy (scheduler/accounting)
# Sorted set: session id -> time of its last heartbeat (or creation); the silence expiry scans it.
SESSION_BEATS = PREFIX + "session_beats"


def usage(owner: str, hour: int) -> str:
    """Hash: "<session_id>|<base_model>|<counter>" -> amount, for one owner and UTC hour
    (`hour` = unix seconds // 3600). Expires after the audit retention."""
    return f"{PREFIX}usage:{owner}:{hour}"


def audit(owner: str) -> str:
    """Stream: the owner's audit log, append-only, trimmed to the retention by MINID."""
    return f"{PREFIX}audit:{owner}"


def session_trace(session_id: str) -> str:
    """Stream of the session's trace events (field `e`: JSON), trimmed to the trace retention
    by age and to a most recent count; it expires the retention after its last event."""
    return f"{PREFIX}trace:{session_id}"
