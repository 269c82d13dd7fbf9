"""In-process torch sampling backend: `LocalSamplingEngine`."""

from lockstep.rollout.local.sampler import LocalSamplingEngine

__all__ = ["LocalSamplingEngine"]
