"""Static model configuration: frozen, hashable, safe to pass to `jax.jit` as static."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from ee_jax.errors import EEJaxError

DType = Literal["float32", "bfloat16", "float16"]
Activation = Literal["silu", "gelu_tanh"]
LayerType = Literal["full_attention", "sliding_attention"]
LAYER_TYPES = ("full_attention", "sliding_attention")
ACTIVATIONS = ("silu", "gelu_tanh")


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
    """A decoder of the Llama family and its relatives, as static switches.

    Llama 2/3, SmolLM2 and Mistral are the defaults plus a sliding window; Qwen2/2.5 set
    `qkv_bias`; Qwen3 sets `qk_norm`; Gemma 2 sets `norm_offset=1`, `embed_scale`,
    `post_norms`, `activation="gelu_tanh"`, both soft-caps, `query_pre_attn_scalar` and
    alternating `layer_types`. Every switch is read by one function in `ee_jax.models.llama`.

    sliding_window: keys further back than this many positions are masked (a key at
        q_pos - k_pos < window is seen, as in transformers), on the layers that `layer_types`
        marks "sliding_attention" (every layer when `layer_types` is None). It is not a cap on
        the context.
    norm_offset: RMSNorm multiplies by (norm_offset + weight) in f32 (Gemma: 1); with 0 it is
        Llama's `weight * x_normed` in the input dtype.
    """

    vocab_size: int  # token ids, the embedding's and the LM head's rows
    d_model: int  # width of the residual stream
    n_layers: int  # decoder layers
    n_heads: int  # query heads per layer
    n_kv_heads: int  # key/value heads per layer (grouped-query attention: divides n_heads)
    head_dim: int  # width of one attention head
    ffn_dim: int  # hidden width of the gated MLP
    rms_eps: float = 1e-5  # RMSNorm's epsilon under the square root
    rope_theta: float = 10000.0  # RoPE's base frequency
    rope_scaling: RopeScaling | None = None  # Llama 3's long-context RoPE scaling; None: none
    tie_embeddings: bool = False  # the LM head is the embedding's transpose
    max_position: int = 8192  # the context length the model was trained for, tokens
    dtype: DType = "float32"  # of the weights and activations
    bos_token_id: int | None = None  # the tokenizer's begin-of-sequence id, if it has one
    eos_token_ids: tuple[int, ...] = ()  # ids that end a generation
    name: str = "llama"  # what the model is called in logs and reports
    # --- family switches (defaults: Llama)
    qkv_bias: bool = False  # Qwen2: biases on q, k and v projections
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k, before RoPE
    norm_offset: float = 0.0  # Gemma: norms scale by (1 + w)
    embed_scale: bool = False  # Gemma: embeddings times sqrt(d_model)
    post_norms: bool = False  # Gemma 2: norms on the attention and MLP outputs as well
    activation: Activation = "silu"  # gated MLP activation (Gemma: tanh-approximated GELU)
    sliding_window: int | None = None
    layer_types: tuple[LayerType, ...] | None = None  # per layer; None: all alike
    attn_logit_softcap: float | None = None  # scores -> tanh(s / c) * c before the mask
    final_logit_softcap: float | None = None  # logits of every head -> tanh(l / c) * c
    query_pre_attn_scalar: float | None = None  # Gemma: scores scaled by this ** -0.5

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
        if self.activation not in ACTIVATIONS:
            raise ConfigError(f"ModelConfig.activation must be one of {ACTIVATIONS}, got "
                              f"{self.activation!r}")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int)
                                                or self.sliding_window <= 0):
            raise ConfigError(f"ModelConfig.sliding_window must be a positive int or None, "
                              f"got {self.sliding_window!r}")
        if self.layer_types is not None:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
            if len(self.layer_types) != self.n_layers:
                raise ConfigError(f"ModelConfig.layer_types has {len(self.layer_types)} "
                                  f"entries for {self.n_layers} layers")
            bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if bad:
                raise ConfigError(f"ModelConfig.layer_types holds {bad}; each entry must be "
                                  f"one of {LAYER_TYPES}")
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise ConfigError("ModelConfig.layer_types marks sliding_attention layers but "
                                  "sliding_window is None")
        for field in ("attn_logit_softcap", "final_logit_softcap", "query_pre_attn_scalar"):
            value = getattr(self, field)
            if value is not None and not value > 0:
                raise ConfigError(f"ModelConfig.{field} must be > 0 or None, got {value!r}")

    @property
    def q_per_kv(self) -> int:
        return self.n_heads // self.n_kv_heads

    @property
    def jnp_dtype(self) -> Any:
        """The parameters' dtype. JAX is imported here, not at the top: the CLI's parser reads
        this module (through `exit_config`), and `ee-jax --help` should not wait ~0.4 s for
        JAX (or for ml_dtypes, which bfloat16 needs); whoever asks has JAX loaded already."""
        import jax.numpy as jnp

        return jnp.dtype(self.dtype)

    @property
    def attn_scale(self) -> float:
        """What attention scores q.k are multiplied by: 1/sqrt(head_dim), or Gemma's
        query_pre_attn_scalar ** -0.5."""
        return float((self.query_pre_attn_scalar or self.head_dim) ** -0.5)

    @property
    def layer_windows(self) -> tuple[int, ...] | None:
        """Per layer: its window, or 0 for a global layer; None when no layer has a window."""
        if self.sliding_window is None:
            return None
        types = self.layer_types or ("sliding_attention",) * self.n_layers
        windows = tuple(self.sliding_window if t == "sliding_attention" else 0 for t in types)
        return windows if any(windows) else None

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)
