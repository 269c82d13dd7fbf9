"""One module per op the SDK submits, mirroring `lockstep/scheduler/ops/`: each declares its
route, whether it takes a place in a model's seq_id order, its request model, the
`SubmitRequest` it builds and the response its future is answered with (`base.GatewayOp`).
`registry.py` lists them and builds their routes; the scheduler's op of the same name holds the
rules that judge what the request carries, and the audit entry it leaves.
"""
