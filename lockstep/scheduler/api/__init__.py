"""The scheduler's gRPC edge: one servicer (`servicer.py`: the one error mapping) composed of
role objects — `future_rpcs.FutureRpcs` (submissions and their futures),
`catalog_rpcs.CatalogRpcs` (sessions, runs, checkpoints, samplers, capabilities) and
`tenancy_rpcs.TenancyRpcs` (session lifecycle, usage, audit, unload, copy) — over
`tenancy.Tenancy`, the session-lifecycle logic those calls and the expiry loop share, and
`audit.AuditTrail`. Nothing else in the scheduler imports this package: only `server` wires it.
"""
