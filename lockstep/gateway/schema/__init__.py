"""The HTTP API's JSON schema: what the tinker SDK sends and expects, as pydantic models (its
binary form, the SDK's protobuf schema, is `lockstep.wire`).

Kept apart from the gRPC translation (`lockstep.gateway.translate`) on purpose: these mirror
the SDK's types (tinker 0.38, see tinker-protocol.md §3), ignore unknown fields, and know
nothing about the scheduler.
"""
