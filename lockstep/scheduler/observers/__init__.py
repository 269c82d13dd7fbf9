"""What watches the scheduler without changing it: the clock's `CycleObserver`s (`observers`),
the Prometheus span of each cycle (`span`), session traces (`tracing`) and usage and audit per
API key (`accounting`). The cycle, admission and the API call into these; they read the plan
(`scheduler.planner`), the outcomes and the state, never the loops that produce them.
"""
