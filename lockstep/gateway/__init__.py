"""The HTTP gateway: the Tinker API (/api/v1) in front of the scheduler's gRPC service.

Thin on purpose: authenticate, decode, validate shapes, make one gRPC call, translate the
reply back. No model code, no scheduling. The app is `lockstep.gateway.app` (this package
imports none of its modules, so none of them imports the package back in a circle).
"""
