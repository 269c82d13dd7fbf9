"""What the scheduler holds: Redis (every key in `keys`, every record in `records`, the
connection in `redis_conn`, `store` with its one-script claims and commits, the futures boards,
the owner-scoped `catalog`, stored custom losses), what an executed op produced (`outcome`, the
unit a commit records), checkpoint directories on disk (`storage`, `encryption`) and which runs
the training engine holds (`residency`). The bottom layer: it imports no other role, so `ops/`
and every role above may use it.
"""
