"""target_stack's serving engine: engine (requests in, tokens out), scheduler (continuous batching,
preemption by swapping), cache (paged KV, state-slot pool), runner (the model over the caches),
sampler."""

from target_stack.engine.engine import LLMEngine
from target_stack.engine.sequence import RequestError, RequestOutput, SamplingParams

__all__ = ["LLMEngine", "RequestError", "RequestOutput", "SamplingParams"]
