"""Serving: paged KV cache, block manager, scheduler, sampler, engine and the LLM API.

The names below import when first used (`ee_jax.lazy`): a submodule imported alone does not
load the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ee_jax.lazy import lazy_exports

if TYPE_CHECKING:
    from ee_jax.serving.engine import LLMEngine
    from ee_jax.serving.llm import LLM
    from ee_jax.serving.params import InvalidRequestError, RequestOutput, SamplingParams
    from ee_jax.serving.plan import EngineConfig

_EXPORTS = {
    "LLM": "ee_jax.serving.llm",
    "EngineConfig": "ee_jax.serving.plan",
    "InvalidRequestError": "ee_jax.serving.params",
    "LLMEngine": "ee_jax.serving.engine",
    "RequestOutput": "ee_jax.serving.params",
    "SamplingParams": "ee_jax.serving.params",
}
# _EXPORTS's names, spelt out: linters read a literal __all__
__all__ = ["LLM", "EngineConfig", "InvalidRequestError", "LLMEngine", "RequestOutput",
           "SamplingParams"]
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
