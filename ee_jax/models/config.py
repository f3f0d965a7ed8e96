"""Static model configuration: frozen, hashable, safe to pass to `jax.jit` as static."""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax.numpy as jnp

from ee_jax.errors import EEJaxError

DType = Literal["float32", "bfloat16", "float16"]


class ConfigError(EEJaxError, ValueError):
    """A configuration that cannot describe a valid model."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency-dependent RoPE scaling ("rope_type": "llama3")."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.factor <= 0:
            raise ConfigError(f"RopeScaling.factor must be > 0, got {self.factor}")
        if self.high_freq_factor <= self.low_freq_factor:
            raise ConfigError(
                "RopeScaling.high_freq_factor must exceed low_freq_factor, got "
                f"{self.high_freq_factor} <= {self.low_freq_factor}"
            )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A Llama-family decoder (Llama 2/3, SmolLM2, Mistral-style GQA)."""

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_embeddings: bool = False
    max_position: int = 8192
    dtype: DType = "float32"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = "llama"

    def __post_init__(self):
        for field in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads",
                      "head_dim", "ffn_dim", "max_position"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"ModelConfig.{field} must be a positive int, got {value!r}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"ModelConfig.n_heads ({self.n_heads}) must be a multiple of n_kv_heads "
                f"({self.n_kv_heads}) for grouped-query attention"
            )
        if self.head_dim % 2:
            raise ConfigError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(
                f"ModelConfig.dtype must be float32/bfloat16/float16, got {self.dtype!r}")
        if not isinstance(self.eos_token_ids, tuple):
            object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))

    @property
    def q_per_kv(self) -> int:
        return self.n_heads // self.n_kv_heads

    @property
    def jnp_dtype(self):
        return jnp.dtype(self.dtype)

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)
