"""The scheduler's gRPC edge: `SchedulerService` (thin methods over admission, the catalog and
the futures board), `TenancyService` (unload, usage, audit, session search, copy_weights) and
`Tenancy`, the session-lifecycle logic those calls and the expiry loop share. Nothing else in
the scheduler imports this package: only `server` wires it.
"""
