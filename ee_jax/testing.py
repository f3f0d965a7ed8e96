"""Tiny configurations and random models shared by tests, examples and benchmarks.

Part of the package (not tests/) so that bench/ and notebooks can build the same tiny models
without importing from the test tree.
"""

from __future__ import annotations

import os

import jax
import numpy as np

from ee_jax.models.config import ModelConfig, RopeScaling
from ee_jax.models.exits import backfill_maps as bm
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
                         seed: int = 0, scale: float = 0.3) -> bm.Maps:
    """Random learned back-fill maps (f32, normal times `scale`), zero where the format holds
    zero (layers at or below each exit): what a fit could produce, without fitting."""
    k = jax.random.PRNGKey(seed)
    shapes = bm.map_shapes(cfg, exit_layers, rank)
    live = np.zeros((*shapes.a.shape[:2], 1, 1), np.float32)
    for s, j in bm.used(exit_layers, cfg.n_layers):
        live[s, j - exit_layers[0]] = 1
    return bm.Maps(**{n: scale * jax.random.normal(jax.random.fold_in(k, i),
                                                   getattr(shapes, n).shape) * live
                      for i, n in enumerate(bm.LEAVES)})


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


def write_megatron(folder, hf_config: dict, state: dict[str, np.ndarray], *, tp: int = 1,
                   pp: int = 1, exit_layer_nums: tuple[int, ...] = (), pre_exit: bool = False,
                   use_exit_norm: bool = True, use_exit_mlp: bool = False,
                   untie_exit_output_weights: bool = True,
                   exit_layer_temperature: tuple[float, ...] | None = None,
                   seed: int = 0, exit_scale: float = 0.05, extra_args: dict | None = None,
                   ) -> dict[str, np.ndarray]:
    """Write a Llama (Hugging Face names and [out, in] weights in `state`, its config.json
    as `hf_config`) as an EE-LLM / EE-Tuning Megatron checkpoint in `folder`, split as
    Megatron splits it over `tp` tensor and `pp` pipeline ranks (EE-LLM's `loader_llama2_hf`
    + `saver_megatron`, then EE-Tuning's `checkpoint_converter --conversion-type add-exit`):
    backbone fp16, exit parts fp32 (random normal times `exit_scale`, exit norms around 1).
    A tied model (no lm_head.weight) keeps its exits on the tied embedding unless
    `untie_exit_output_weights`. Returns the exit parts written, by Megatron layer number:
    {"exit_norm.{n}", "branch.{gate,up,down}.{n}", "exit_output.{n}"} (HF orientation,
    full, f32): what a test computes its own exits from.

    For tests and benchmarks; needs torch. Megatron's `ModelType` is pickled from a
    stand-in module named as Megatron's, so the file names the class Megatron's names."""
    import argparse
    import enum
    import random
    import sys
    import types
    from collections import OrderedDict
    from pathlib import Path

    import torch

    rng = np.random.default_rng(seed)
    folder = Path(folder)
    c = hf_config
    L, D, H = c["num_hidden_layers"], c["hidden_size"], c["num_attention_heads"]
    G = c.get("num_key_value_heads", H)
    hd, F, V = D // H, c["intermediate_size"], c["vocab_size"]
    tied = "lm_head.weight" not in state
    if L % pp or G % tp or F % tp or V % tp:
        raise ValueError(f"layers {L} / pp {pp}, kv heads {G}, ffn {F}, vocab {V} / tp {tp} "
                         f"must divide")
    nums = tuple(sorted(exit_layer_nums))
    f16 = lambda a: torch.from_numpy(np.ascontiguousarray(a, np.float16))  # noqa: E731
    f32 = lambda a: torch.from_numpy(np.ascontiguousarray(a, np.float32))  # noqa: E731
    parts: dict[str, np.ndarray] = {}
    for n in nums:
        if use_exit_norm:
            parts[f"exit_norm.{n}"] = (1 + exit_scale * rng.standard_normal(D)).astype(np.float32)
        if use_exit_mlp:
            for k, shape in (("gate", (F, D)), ("up", (F, D)), ("down", (D, F))):
                parts[f"branch.{k}.{n}"] = (exit_scale * 4 * rng.standard_normal(shape)
                                            ).astype(np.float32)
        if untie_exit_output_weights:
            parts[f"exit_output.{n}"] = (exit_scale * 4 * rng.standard_normal((V, D))
                                         ).astype(np.float32)

    megatron = types.ModuleType("megatron")
    core = types.ModuleType("megatron.core")
    enums = types.ModuleType("megatron.core.enums")

    class ModelType(enum.Enum):
        encoder_or_decoder = 1
        encoder_and_decoder = 2

    ModelType.__module__, ModelType.__qualname__ = "megatron.core.enums", "ModelType"
    enums.ModelType, megatron.core, core.enums = ModelType, core, enums
    args = argparse.Namespace(
        num_layers=L, hidden_size=D, ffn_hidden_size=F, num_attention_heads=H,
        group_query_attention=G != H, num_query_groups=G, kv_channels=hd,
        padded_vocab_size=V, vocab_size=V, norm_epsilon=c.get("rms_norm_eps", 1e-5),
        seq_length=4096, max_position_embeddings=4096, position_embedding_type="rope",
        use_rotary_position_embeddings=True, normalization="RMSNorm", swiglu=True,
        add_bias_linear=False, apply_residual_connection_post_layernorm=False,
        untie_embeddings_and_output_weights=not tied, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=None,
        exit_layer_nums=list(nums), pre_exit=pre_exit, use_exit_norm=use_exit_norm,
        use_exit_mlp=use_exit_mlp, use_exit_block=False,
        untie_exit_output_weights=untie_exit_output_weights,
        exit_layer_temperature=list(exit_layer_temperature or [1.0] * len(nums)),
        exit_layer_weight=[1.0] * len(nums), params_dtype=torch.float16, fp16=True,
        model_type=ModelType.encoder_or_decoder, iteration=1, rotary_percent=1.0,
        transformer_impl="local", num_experts=None)
    for k, v in (extra_args or {}).items():  # settings a test wants other than Llama's
        setattr(args, k, v)

    def chunk(a, axis=0):
        return np.split(a, tp, axis=axis)

    per = L // pp
    it = folder / "iter_0000001"
    saved = {k: sys.modules.get(k) for k in ("megatron", "megatron.core", "megatron.core.enums")}
    sys.modules.update({"megatron": megatron, "megatron.core": core,
                        "megatron.core.enums": enums})
    try:
        for s in range(pp):
            stage_exits = [n for n in nums if s * per < n <= (s + 1) * per]
            for r in range(tp):
                enc: OrderedDict = OrderedDict()
                for i in range(per):
                    g, p = s * per + i, f"layers.{i}."
                    hf = f"model.layers.{s * per + i}."
                    q = state[hf + "self_attn.q_proj.weight"].reshape(G, H // G * hd, D)
                    k = state[hf + "self_attn.k_proj.weight"].reshape(G, hd, D)
                    v = state[hf + "self_attn.v_proj.weight"].reshape(G, hd, D)
                    qkv = np.concatenate([q, k, v], axis=1).reshape(-1, D)
                    enc[p + "input_norm.weight"] = f16(state[hf + "input_layernorm.weight"])
                    enc[p + "self_attention.query_key_value.weight"] = f16(chunk(qkv)[r])
                    enc[p + "self_attention.dense.weight"] = f16(
                        chunk(state[hf + "self_attn.o_proj.weight"], 1)[r])
                    enc[p + "post_attention_norm.weight"] = f16(
                        state[hf + "post_attention_layernorm.weight"])
                    n = g + 1
                    mlp = p + ("mlp.trunk." if use_exit_mlp and n in nums else "mlp.")
                    enc[mlp + "dense_h_to_4h.weight"] = f16(np.concatenate(
                        [chunk(state[hf + "mlp.gate_proj.weight"])[r],
                         chunk(state[hf + "mlp.up_proj.weight"])[r]]))
                    enc[mlp + "dense_4h_to_h.weight"] = f16(
                        chunk(state[hf + "mlp.down_proj.weight"], 1)[r])
                    if n in nums and use_exit_mlp:
                        b = p + "mlp.branch."
                        enc[b + "dense_h_to_4h.weight"] = f32(np.concatenate(
                            [chunk(parts[f"branch.gate.{n}"])[r],
                             chunk(parts[f"branch.up.{n}"])[r]]))
                        enc[b + "dense_4h_to_h.weight"] = f32(
                            chunk(parts[f"branch.down.{n}"], 1)[r])
                    if n in nums and use_exit_norm:
                        enc[p + "exit_norm.weight"] = f32(parts[f"exit_norm.{n}"])
                lm: dict = {}
                if s == 0:
                    lm["embedding"] = {"word_embeddings": {
                        "weight": f16(chunk(state["model.embed_tokens.weight"])[r])}}
                if stage_exits and untie_exit_output_weights:
                    lm["exit_output_layer"] = OrderedDict(
                        (f"{j}.weight", f32(chunk(parts[f"exit_output.{n}"])[r]))
                        for j, n in enumerate(stage_exits))
                if s == pp - 1:
                    enc["final_norm.weight"] = f16(state["model.norm.weight"])
                    if not tied:
                        lm["output_layer"] = {"weight": f16(chunk(state["lm_head.weight"])[r])}
                lm["encoder"] = enc
                model = {"language_model": lm}
                if tied and pp > 1 and s == pp - 1:
                    model["word_embeddings_for_head"] = {
                        "weight": f16(chunk(state["model.embed_tokens.weight"])[r])}
                name = f"mp_rank_{r:02d}" + (f"_{s:03d}" if pp > 1 else "")
                (it / name).mkdir(parents=True, exist_ok=True)
                torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 1,
                            "model": model,
                            "rng_state": [{"random_rng_state": random.Random(seed).getstate(),
                                           "np_rng_state": np.random.RandomState(seed).get_state(),
                                           "torch_rng_state": torch.get_rng_state()}]},
                           it / name / "model_optim_rng.pt")
    finally:
        for k, mod in saved.items():
            if mod is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = mod
    (folder / "latest_checkpointed_iteration.txt").write_text("1")
    return parts
