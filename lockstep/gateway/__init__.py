"""The HTTP gateway: the Tinker API (/api/v1) in front of the scheduler's gRPC service.

Thin on purpose: authenticate, decode, validate shapes, make one gRPC call, translate the
reply back. No model code, no scheduling.
"""

from lockstep.gateway.app import create_app, run_gateway
from lockstep.gateway.settings import GatewaySettings

__all__ = ["GatewaySettings", "create_app", "run_gateway"]
