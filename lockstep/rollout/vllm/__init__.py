"""vLLM sampling engine: Lockstep's SamplingEngine over vLLM's OpenAI-compatible server."""

from lockstep.rollout.vllm.sampler import VllmLaunchConfig, VllmSamplingEngine

__all__ = ["VllmLaunchConfig", "VllmSamplingEngine"]
