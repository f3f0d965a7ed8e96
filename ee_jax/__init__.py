"""ee-jax: serve early-exit LLMs fast with JAX.

The public names below import when first used (`ee_jax.lazy`): `import ee_jax.cli`, and so
`ee-jax --help`, loads no JAX.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ee_jax.lazy import lazy_exports

if TYPE_CHECKING:  # what the names are, for type checkers and readers
    from ee_jax.errors import EEJaxError, ModelLoadError, UnsupportedModelError
    from ee_jax.models.config import ModelConfig, RopeScaling
    from ee_jax.models.exits.config import ExitConfig
    from ee_jax.models.exits.heads import ExitHeads
    from ee_jax.models.loading import LoadedModel, load_model
    from ee_jax.models.params import Params
    from ee_jax.serving.engine import LLMEngine
    from ee_jax.serving.llm import LLM
    from ee_jax.serving.params import InvalidRequestError, RequestOutput, SamplingParams
    from ee_jax.serving.plan import EngineConfig

_EXPORTS = {
    "LLM": "ee_jax.serving.llm",
    "EEJaxError": "ee_jax.errors",
    "EngineConfig": "ee_jax.serving.plan",
    "ExitConfig": "ee_jax.models.exits.config",
    "ExitHeads": "ee_jax.models.exits.heads",
    "InvalidRequestError": "ee_jax.serving.params",
    "LLMEngine": "ee_jax.serving.engine",
    "LoadedModel": "ee_jax.models.loading",
    "ModelConfig": "ee_jax.models.config",
    "ModelLoadError": "ee_jax.errors",
    "Params": "ee_jax.models.params",
    "RequestOutput": "ee_jax.serving.params",
    "RopeScaling": "ee_jax.models.config",
    "SamplingParams": "ee_jax.serving.params",
    "UnsupportedModelError": "ee_jax.errors",
    "load_model": "ee_jax.models.loading",
}
# _EXPORTS's names, spelt out: linters read a literal __all__
__all__ = ["LLM", "EEJaxError", "EngineConfig", "ExitConfig", "ExitHeads", "InvalidRequestError",
           "LLMEngine", "LoadedModel", "ModelConfig", "ModelLoadError", "Params",
           "RequestOutput", "RopeScaling", "SamplingParams", "UnsupportedModelError",
           "load_model"]
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__version__ = "0.1.0"
