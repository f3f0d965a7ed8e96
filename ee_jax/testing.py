"""Tiny configurations and random models shared by tests, examples and benchmarks.

Part of the package (not tests/) so that bench/ and notebooks can build the same tiny models
without importing from the test tree.
"""

from __future__ import annotations

import os

import jax
import numpy as np

from ee_jax.models import backfill_maps as bm
from ee_jax.models.config import ModelConfig, RopeScaling
from ee_jax.models.llama import init_params


def tiny_config(**overrides) -> ModelConfig:
    """GQA (4 query / 2 kv heads), head_dim != d_model / heads, untied head, Llama-3 RoPE."""
    base = dict(
        vocab_size=128, d_model=48, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16,
        ffn_dim=96, rms_eps=1e-5, rope_theta=10000.0,
        rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=64),
        tie_embeddings=False, max_position=1024, bos_token_id=1, eos_token_ids=(2,),
        name="tiny",
    )
    base.update(overrides)
    return ModelConfig(**base)


def tiny_model(seed: int = 0, **overrides):
    """`tiny_config(**overrides)` and its random parameters (normal, scale 0.1)."""
    cfg = tiny_config(**overrides)
    return cfg, init_params(cfg, jax.random.PRNGKey(seed), scale=0.1)


def random_backfill_maps(cfg: ModelConfig, exit_layers: tuple[int, ...], rank: int = 3,
                         seed: int = 0, scale: float = 0.3) -> dict:
    """Random learned back-fill maps (f32, normal times `scale`), zero where the format holds
    zero (layers at or below each exit): what a fit could produce, without fitting."""
    k = jax.random.PRNGKey(seed)
    shapes = bm.map_shapes(cfg, exit_layers, rank)
    live = np.zeros((*shapes["a"].shape[:2], 1, 1), np.float32)
    for s, j in bm.used(exit_layers, cfg.n_layers):
        live[s, j - exit_layers[0]] = 1
    return {n: scale * jax.random.normal(jax.random.fold_in(k, i), s.shape) * live
            for i, (n, s) in enumerate(shapes.items())}


def subprocess_env(devices: int | None = None) -> dict[str, str]:
    """This process's environment for a child process, with XLA_FLAGS' simulated CPU device
    count replaced (`devices`) or dropped (None: one device); the other flags, such as the
    test suite's compile settings, are kept."""
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    if devices is not None:
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    env["XLA_FLAGS"] = " ".join(flags)
    return env
