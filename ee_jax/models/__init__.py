"""Models: configuration, pure-function Llama-family layers, loaders and tokenizers."""

from ee_jax.models.config import ConfigError, ModelConfig, RopeScaling
from ee_jax.models.loading import LoadedModel, load_model

__all__ = ["ConfigError", "LoadedModel", "ModelConfig", "RopeScaling", "load_model"]
