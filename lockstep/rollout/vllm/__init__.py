"""vLLM sampling engine: Lockstep's SamplingEngine over vLLM's OpenAI-compatible server."""

from lockstep.rollout.vllm.engine import VllmLaunchConfig, VllmSamplingEngine

__all__ = ["VllmLaunchConfig", "VllmSamplingEngine"]
