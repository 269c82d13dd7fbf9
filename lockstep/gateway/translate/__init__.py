"""Translation between wire types (`lockstep.gateway.schema`) and the scheduler's gRPC messages.

One module per resource; every function is pure (no I/O), so routes stay a few lines each:
authenticate, translate, one gRPC call, translate back.
"""
