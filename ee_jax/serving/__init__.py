"""Serving: paged KV cache, block manager, scheduler, sampler, engine and the LLM API."""

from ee_jax.serving.engine import EngineConfig, LLMEngine
from ee_jax.serving.llm import LLM
from ee_jax.serving.params import InvalidRequestError, RequestOutput, SamplingParams

__all__ = ["LLM", "EngineConfig", "InvalidRequestError", "LLMEngine", "RequestOutput",
           "SamplingParams"]
