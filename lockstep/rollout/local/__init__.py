"""In-process torch sampling backend: `LocalSamplingEngine`."""

from lockstep.rollout.local.engine import LocalSamplingEngine

__all__ = ["LocalSamplingEngine"]
