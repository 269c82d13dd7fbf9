"""SGLang sampling engine: Lockstep's SamplingEngine over SGLang's native HTTP API."""

from lockstep.rollout.sglang.sampler import SglangLaunchConfig, SglangSamplingEngine

__all__ = ["SglangLaunchConfig", "SglangSamplingEngine"]
