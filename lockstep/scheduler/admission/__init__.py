"""Admission: a request is validated against the scheduler's state and queued exactly once
(`submissions`), or refused with a 400 naming its field before it reaches an engine. A
forward_backward decoded here is kept (`decoded`) so dispatch runs that same object. What each
op checks is its own rule in `scheduler/ops/`; the claims and the quotas are `state.claims`.
"""
