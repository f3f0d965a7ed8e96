"""ee-jax: serve early-exit LLMs fast with JAX."""

from ee_jax.errors import EEJaxError, ModelLoadError, UnsupportedModelError
from ee_jax.models.config import ModelConfig, RopeScaling
from ee_jax.models.exit_config import ExitConfig
from ee_jax.models.loading import LoadedModel, load_model
from ee_jax.serving.engine import EngineConfig, LLMEngine
from ee_jax.serving.llm import LLM
from ee_jax.serving.params import InvalidRequestError, RequestOutput, SamplingParams

__all__ = [
    "LLM",
    "EEJaxError",
    "EngineConfig",
    "ExitConfig",
    "InvalidRequestError",
    "LLMEngine",
    "LoadedModel",
    "ModelConfig",
    "ModelLoadError",
    "RequestOutput",
    "RopeScaling",
    "SamplingParams",
    "UnsupportedModelError",
    "load_model",
]

__version__ = "0.1.0"
