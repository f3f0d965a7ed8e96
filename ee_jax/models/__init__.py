"""Models: configuration, pure-function Llama-family layers, loaders and tokenizers.

The names below import when first used (`ee_jax.lazy`): `ee_jax.models.config` or
`exit_config` alone (what the CLI's parser needs) loads no JAX.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ee_jax.lazy import lazy_exports

if TYPE_CHECKING:
    from ee_jax.models.config import ConfigError, ModelConfig, RopeScaling
    from ee_jax.models.loading import LoadedModel, load_model

_EXPORTS = {
    "ConfigError": "ee_jax.models.config",
    "LoadedModel": "ee_jax.models.loading",
    "ModelConfig": "ee_jax.models.config",
    "RopeScaling": "ee_jax.models.config",
    "load_model": "ee_jax.models.loading",
}
# _EXPORTS's names, spelt out: linters read a literal __all__
__all__ = ["ConfigError", "LoadedModel", "ModelConfig", "RopeScaling", "load_model"]
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
