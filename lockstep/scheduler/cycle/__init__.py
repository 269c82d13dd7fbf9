"""The running loops that feed the engines: the clock (plan -> dispatch -> collect -> publish,
one lock-step cycle at a time), `dispatch` (one plan on the training engine: one fused pass,
one batched optimizer step), the sampling lane beside it, and their policies: how many tokens
a cycle packs (`pace`), when a run is snapshotted (`cadence`), which request kills an engine
(`poison`). The plan itself is `scheduler.planner`, one level up, because observers read it too.
"""
