"""The Llama-family decoder as pure functions over a layer-stacked parameter pytree.

Parameters are a `Params` (`ee_jax.models.params`: a registered dataclass, a field per weight,
None where the config has none). Every per-layer tensor carries a leading layer axis so a
traced layer index can select a layer inside `lax.scan` / `lax.while_loop`:

    embed       [V, D]
    layers.     attn_norm [L, D]      wq [L, D, H*hd]   wk, wv [L, D, K*hd]   wo [L, H*hd, D]
                mlp_norm  [L, D]      w_gate, w_up [L, D, F]                 w_down [L, F, D]
                bq [L, H*hd], bk, bv [L, K*hd]          (cfg.qkv_bias: Qwen2)
                q_norm, k_norm [L, hd]                  (cfg.qk_norm: Qwen3)
                post_attn_norm, post_mlp_norm [L, D]    (cfg.post_norms: Gemma 2)
    final_norm  [D]
    lm_head     [D, V]      (absent when the head is tied to `embed`)

Weights are stored input-major (`x @ w`) and applied by `linear`, the one matmul rule: a
layer weight may be a GGUF file's own blocks (`quant.BlockQ`, the default for a GGUF, exact),
or an int8 `quant.QArray` (per-output-channel scales, see `ee_jax.models.quant`). Norm weights
are stored as the checkpoint holds them; `norm` applies the family's rule (Gemma's 1 + w)
in one place, for the layers, the final head and the exit heads alike. Nothing here knows
about caches or batching: attention is injected into `decoder_layer` as a function, so the
serving code wraps these functions instead of re-implementing them. The families differ only
by `ModelConfig` switches, each read here by one function (see `ModelConfig`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ee_jax.models import weights
from ee_jax.models.config import ModelConfig
from ee_jax.models.params import LayerParams, Params, ParamsMismatchError, as_params
from ee_jax.models.quant import (
    BlockQ,
    QArray,
    is_packed,
    linear,
    table_matmul,
    take_rows,
)

# attend(q [..., T, H, hd], k [..., T, K, hd], v [..., T, K, hd]) -> (out [..., T, H, hd], aux)
AttendFn = Callable[[jax.Array, jax.Array, jax.Array], tuple[jax.Array, Any]]



# --------------------------------------------------------------------------- parameters


def param_shapes(cfg: ModelConfig) -> Params:
    """The abstract parameter tree: every loader fills exactly this, nothing more or less
    (`weights.WEIGHTS`, each weight's one declaration)."""
    shapes = {w.key: jax.ShapeDtypeStruct(weights.shape(w, cfg), cfg.jnp_dtype)
              for w in weights.WEIGHTS if weights.present(w, cfg)}
    return Params(layers=LayerParams(**{k: v for k, v in shapes.items()
                                        if weights.BY_KEY[k].layer}),
                  **{k: v for k, v in shapes.items() if not weights.BY_KEY[k].layer})


def weight_name(path) -> str:
    """A params leaf's name from its tree path: "embed", "layers.wq" ("layers.3.wq" per
    layer), a packed weight's field after it ("layers.wq.scale")."""
    return ".".join(str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k))))
                    for k in path)


def check_params(cfg: ModelConfig, params: Params | Mapping[str, Any], *,
                 source: str = "params") -> Params:
    """`params` as `Params` (a mapping of weight keys converted, `as_params`), or
    ParamsMismatchError naming every weight missing, unexpected or mis-shaped relative to
    `param_shapes(cfg)`. Stacked layers are compared as they are; per-layer ones each
    against the stacked shape less the layer axis."""
    params = as_params(params)
    expected = param_shapes(cfg)
    if per_layer(params):
        if len(params.layers) != cfg.n_layers:
            raise ParamsMismatchError(f"{source} holds {len(params.layers)} layers, the "
                                      f"model config {cfg.n_layers}")
        one = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape[1:], s.dtype),
                           expected.layers)
        expected = expected.replace(layers=tuple(one for _ in params.layers))
    want = {weight_name(p): leaf for p, leaf in jax.tree_util.tree_leaves_with_path(expected)}
    got = {weight_name(p): leaf for p, leaf in jax.tree_util.tree_leaves_with_path(
        params, is_leaf=_weight_leaf)}  # an int8 or output-major weight has its w's shape
    problems = []
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    if missing:
        problems.append(f"missing {missing}")
    if extra:
        problems.append(f"unexpected {extra}")
    for key in sorted(set(want) & set(got)):
        if tuple(np.shape(got[key])) != tuple(want[key].shape):
            problems.append(f"{key} has shape {tuple(np.shape(got[key]))}, expected "
                            f"{tuple(want[key].shape)}")
    if problems:
        raise ParamsMismatchError(
            f"{source} does not match the model config: " + "; ".join(problems))
    return params


def init_params(cfg: ModelConfig, key: jax.Array, scale: float = 0.02) -> Params:
    """Random parameters (tests, benchmarks with same-shape weights). Norms scale by about
    1 whatever the family's norm rule. The keys go to the weights in the order of the
    nested-dict form (sorted names), so a seed gives the same weights as it always has."""
    shapes = param_shapes(cfg).to_dict()
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    keys = jax.random.split(key, len(leaves))
    out = []
    for (path, sd), k in zip(leaves, keys, strict=True):
        if "norm" in path[-1].key:  # a norm weight (attn_norm, final_norm, q_norm, ...)
            out.append((1.0 - cfg.norm_offset) + 0.1 * jax.random.normal(k, sd.shape, sd.dtype))
        else:
            out.append(scale * jax.random.normal(k, sd.shape, sd.dtype))
    return as_params(jax.tree_util.tree_unflatten(treedef, out))


def _weight_leaf(a) -> bool:
    return is_packed(a)


def cast_params(params: Params, dtype) -> Params:
    """Every array in `dtype`; int8 (QArray) and GGUF-block (BlockQ) weights stay as they
    are (they are applied in the activations' dtype)."""
    return jax.tree.map(lambda a: a if isinstance(a, QArray | BlockQ) else jnp.asarray(a, dtype),
                        params, is_leaf=lambda a: isinstance(a, QArray | BlockQ))


@jax.jit
def layer_params(params: Params, i) -> LayerParams:
    """Layer `i` (a Python int or a traced scalar) of the stacked layers."""
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False),
                        params.layers)


# Layer layouts (docs/architecture.md, "Layer layouts"). "stacked": params.layers one
# LayerParams of arrays with a leading layer axis, a layer read by a dynamic slice (TPU reads
# it in place; CPU too). "per_layer": a tuple of one LayerParams a layer, each weight a buffer
# of its own (XLA's GPU compiler copies a dynamic slice of a stacked weight out before its
# GEMMs; a buffer of its own it reads in place). Same math, same dtypes.
LAYOUTS = ("stacked", "per_layer")


def layout_for(platform: str) -> str:
    """The layer layout a target's steps read their weights best in (docs/roofline.md,
    "CUDA"): per layer on GPU, stacked elsewhere."""
    return "per_layer" if platform in ("gpu", "cuda", "rocm") else "stacked"


def per_layer(params: Params) -> bool:
    """Whether params hold their layers per layer (a tuple) rather than stacked."""
    return isinstance(params.layers, tuple | list)


def unstack_layers(params: Params) -> Params:
    """params with the stacked layers as a tuple of per-layer LayerParams (abstract leaves:
    ShapeDtypeStructs without the layer axis, their sharding kept)."""
    if per_layer(params):
        return params
    return params.replace(layers=unstack(params.layers))


def unstack(tree) -> tuple:
    """A tree whose leaves share a leading axis as a tuple of trees, one an index of it, each
    leaf a buffer of its own (abstract leaves: ShapeDtypeStructs without the axis, their
    sharding kept). The per-layer layout's layers, the per-exit heads' parts."""
    n = jax.tree.leaves(tree)[0].shape[0]

    def take(a, i):
        if isinstance(a, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(a.shape[1:], a.dtype, sharding=_drop_axis(a.sharding))
        return a[i]

    return tuple(jax.tree.map(lambda a, i=i: take(a, i), tree) for i in range(n))


def _drop_axis(sharding):
    """A NamedSharding of a stacked leaf, less its (replicated) layer axis."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh,
                                          jax.sharding.PartitionSpec(*sharding.spec[1:]))
    return sharding


# --------------------------------------------------------------------------- building blocks


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """RMSNorm computed in f32, returned in the input dtype.

    offset 0: Llama's `weight * normed.astype(dtype)`; offset 1: Gemma's
    `(normed * (1 + weight)).astype(dtype)`, the scale taken in f32."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if offset:
        return (x32 * (offset + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * x32.astype(x.dtype)


def norm(x: jax.Array, weight: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The model's norm (over the last axis) with its family's weight rule. Every model norm
    weight (layers, final, exit heads) goes through here."""
    return rms_norm(x, weight, cfg.rms_eps, cfg.norm_offset)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies [hd/2] in f32, with Llama-3 scaling when configured."""
    hd = cfg.head_dim
    inv = (1.0 / (np.float32(cfg.rope_theta) ** (np.arange(0, hd, 2, dtype=np.float32) / hd)))
    inv = inv.astype(np.float32)
    rs = cfg.rope_scaling
    if rs is None:
        return inv
    low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = (2 * math.pi / inv).astype(np.float32)
    scaled = np.where(wavelen > low_wavelen, inv / rs.factor, inv).astype(np.float32)
    smooth = ((rs.original_max_position_embeddings / wavelen - rs.low_freq_factor)
              / (rs.high_freq_factor - rs.low_freq_factor)).astype(np.float32)
    smoothed = ((1 - smooth) * scaled / rs.factor + smooth * scaled).astype(np.float32)
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate-half RoPE (the Hugging Face layout). x: [..., T, heads, hd]; positions: [..., T]."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [..., T, hd/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[..., None, :]  # [..., T, 1, hd]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * cos + rotated * sin).astype(x.dtype)


def _split_heads(x: jax.Array, n: int) -> jax.Array:
    return x.reshape(*x.shape[:-1], n, x.shape[-1] // n)


def _project_heads(lp: LayerParams, xn: jax.Array, which: str, n: int, cfg: ModelConfig):
    """xn @ w{which} (+ bias) split into n heads: [..., T, D] -> [..., T, n, hd]; q and k get
    the per-head norm (Qwen3) here, before RoPE."""
    y = linear(xn, getattr(lp, "w" + which))
    if cfg.qkv_bias:
        y = y + getattr(lp, "b" + which)
    y = _split_heads(y, n)
    if cfg.qk_norm and which in ("q", "k"):
        y = norm(y, getattr(lp, which + "_norm"), cfg)
    return y


def q_project(lp: LayerParams, xn: jax.Array, positions: jax.Array, cfg: ModelConfig):
    """Q (with RoPE) of already-normed input. xn: [..., T, D] -> [..., T, H, hd]."""
    q = _project_heads(lp, xn, "q", cfg.n_heads, cfg)
    return apply_rope(q, positions, rope_inv_freq(cfg))


def kv_from_normed(lp: LayerParams, xn: jax.Array, positions: jax.Array, cfg: ModelConfig):
    """K (with RoPE) and V of already-normed input. xn: [..., T, D] -> [..., T, K, hd] each.
    Every family change to K/V (bias, k norm, RoPE) lives here, so back-fill stays exact."""
    k = _project_heads(lp, xn, "k", cfg.n_kv_heads, cfg)
    v = _project_heads(lp, xn, "v", cfg.n_kv_heads, cfg)
    return apply_rope(k, positions, rope_inv_freq(cfg)), v


def kv_project(lp: LayerParams, x: jax.Array, positions: jax.Array, cfg: ModelConfig):
    """A layer's K/V of its *input* hidden state: input norm, W_k, W_v, RoPE on K.

    The layer itself and the early-exit back-fill both go through this function, so the
    cache entries a back-fill writes are exactly what the layer would have written.
    """
    return kv_from_normed(lp, norm(x, lp.attn_norm, cfg), positions, cfg)


def layer_window(cfg: ModelConfig, layer) -> jax.Array | None:
    """The sliding window of `layer` (a Python int or a traced scalar) as an int32 scalar,
    0 for a global layer; None (static) when no layer of the model has a window."""
    windows = cfg.layer_windows
    if windows is None:
        return None
    return jnp.asarray(windows, jnp.int32)[layer]


def attention_weights_mask(q_pos: jax.Array, k_pos: jax.Array, k_valid: jax.Array | None = None,
                           window: jax.Array | int | None = None) -> jax.Array:
    """Mask [..., T, S]: a key is seen iff k_pos <= q_pos, it is valid, and (with a window
    > 0) q_pos - k_pos < window — transformers' sliding-window rule (`kv_idx > q_idx -
    sliding_window`): the query and the window - 1 keys before it. window None or <= 0:
    no window (a global layer)."""
    diff = q_pos[..., :, None] - k_pos[..., None, :]  # [..., T, S]
    mask = diff >= 0
    if window is not None:
        window = jnp.asarray(window, jnp.int32)
        mask = mask & ((window <= 0) | (diff < window))
    if k_valid is not None:
        mask = mask & k_valid[..., None, :]
    return mask


def gqa_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *,
                  scale: float | None = None, softcap: float | None = None) -> jax.Array:
    """Grouped-query attention with a boolean mask.

    q: [..., T, H, hd]; k, v: [..., S, K, hd]; mask: [..., T, S] -> [..., T, H, hd] in q's
    dtype. Scores are q.k * scale (default 1/sqrt(hd); pass `cfg.attn_scale`), soft-capped as
    tanh(s / softcap) * softcap when `softcap` is set (Gemma 2), then masked.
    Heads are moved in front so both products are plain batched matmuls (the query heads
    sharing a kv head are folded into the row axis); XLA's CPU backend runs that layout
    about twice as fast as a dot_general with interleaved batch axes. Softmax in f32.
    """
    *lead, T, H, hd = q.shape
    K = k.shape[-2]
    G = H // K
    scale = hd ** -0.5 if scale is None else scale
    qh = jnp.moveaxis(q.reshape(*lead, T, K, G, hd), -3, -4).reshape(*lead, K, T * G, hd)
    kh = jnp.moveaxis(k, -2, -3)  # [..., K, S, hd]
    vh = jnp.moveaxis(v, -2, -3)
    scores = jnp.matmul(qh, jnp.swapaxes(kh, -1, -2),
                        preferred_element_type=jnp.float32) * scale  # [..., K, T*G, S]
    if softcap is not None:
        scores = jnp.tanh(scores / softcap) * softcap
    m = jnp.repeat(mask, G, axis=-2)[..., None, :, :]  # rows are (t, g), t-major
    scores = jnp.where(m, scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    # A fully-masked row (padding) would be NaN: make it zero instead.
    probs = jnp.where(jnp.any(m, axis=-1, keepdims=True), probs, 0.0)
    out = jnp.matmul(probs.astype(v.dtype), vh)  # [..., K, T*G, hd]
    out = jnp.moveaxis(out.reshape(*lead, K, T, G, hd), -4, -3)
    # In q's dtype: K/V may be held wider than the model (a 16-bit cache on CPU is stored
    # in f32, see ee_jax.serving.kv_cache); the residual stream keeps the model dtype.
    return out.reshape(*lead, T, H, hd).astype(q.dtype)


def mlp(lp: LayerParams, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """A layer's gated MLP (`gated_mlp` with its w_gate, w_up, w_down)."""
    return gated_mlp(x, lp.w_gate, lp.w_up, lp.w_down, cfg)


def gated_mlp(x: jax.Array, w_gate, w_up, w_down, cfg: ModelConfig) -> jax.Array:
    """Gated MLP: SwiGLU, or GeGLU (tanh GELU) when cfg.activation is "gelu_tanh" (the layers'
    and an EE-LLM branch exit's)."""
    gate = linear(x, w_gate)
    if cfg.activation == "gelu_tanh":
        act = jax.nn.gelu(gate, approximate=True)
    else:
        act = jax.nn.silu(gate)
    return linear(act * linear(x, w_up), w_down)


def decoder_layer(lp: LayerParams, x: jax.Array, positions: jax.Array, cfg: ModelConfig,
                  attend: AttendFn) -> tuple[jax.Array, Any]:
    """One pre-norm block (with Gemma 2's extra norms on both outputs when cfg.post_norms).
    x: [..., T, D]. `attend` sees this layer's q, k, v and may read and write a cache; it
    applies the layer's mask (`layer_window`), `cfg.attn_scale` and `cfg.attn_logit_softcap`.
    Whatever it returns besides the output comes back as `aux`."""
    out, _, aux = decoder_layer_mid(lp, x, positions, cfg, attend)
    return out, aux


def decoder_layer_mid(lp: LayerParams, x: jax.Array, positions: jax.Array, cfg: ModelConfig,
                      attend: AttendFn) -> tuple[jax.Array, jax.Array, Any]:
    """`decoder_layer` that also returns the state after attention (the residual the MLP
    adds to, [..., T, D]): what an EE-LLM branch exit reads (`exit_heads.exit_input`)."""
    q, k, v = attention_inputs(lp, x, positions, cfg)
    o, aux = attend(q, k, v)
    y, mid = layer_outputs(lp, x, o, cfg)
    return y, mid, aux


def attention_inputs(lp: LayerParams, x: jax.Array, positions: jax.Array, cfg: ModelConfig
                     ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A layer's weights before attention: q, k, v of x [..., T, D] (normed, projected,
    rotated). With `layer_outputs`, the two halves of a layer that read its weights:
    a per-layer program runs each as a branch of its layer, attention between them
    (`paged_model.paged_layer`)."""
    xn = norm(x, lp.attn_norm, cfg)
    q = q_project(lp, xn, positions, cfg)
    k, v = kv_from_normed(lp, xn, positions, cfg)
    return q, k, v


def layer_outputs(lp: LayerParams, x: jax.Array, o: jax.Array, cfg: ModelConfig
                  ) -> tuple[jax.Array, jax.Array]:
    """A layer's weights after attention: the output projection of o [..., T, H, hd], the
    residual, the MLP. Returns (the layer's output, the state after attention)."""
    o = linear(o.reshape(*o.shape[:-2], -1), lp.wo)
    if cfg.post_norms:
        o = norm(o, lp.post_attn_norm, cfg)
    x = x + o
    m = mlp(lp, norm(x, lp.mlp_norm, cfg), cfg)
    if cfg.post_norms:
        m = norm(m, lp.post_mlp_norm, cfg)
    return x + m, x


def unembed(params: Params, xn: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The LM head on an already-normed hidden state; logits in f32, soft-capped when the
    family caps them (Gemma 2). Exit heads reuse it, so their logits are capped alike.
    A tied head is the embedding [V, D], i.e. the head stored output-major: it goes through
    `quant.out_major_matmul` (2-64 rows: E @ x.T, 11-21% faster than x @ E.T on CPU)."""
    if cfg.tie_embeddings:
        logits = table_matmul(xn, params.embed, preferred_element_type=jnp.float32)
    else:
        logits = jnp.matmul(xn, params.lm_head, preferred_element_type=jnp.float32)
    return cap_logits(logits, cfg)


def head_rows(params: Params, ids: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The LM head's rows at token ids, [..., D] (output-major, as the tied head is): what
    the exit heads' candidate and subset logits read."""
    if cfg.tie_embeddings:
        return take_rows(params.embed, ids, cfg.jnp_dtype)
    return jnp.moveaxis(jnp.take(params.lm_head, ids, axis=1), 0, -1)


def cap_logits(logits: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The family's final soft-cap, tanh(l / c) * c (Gemma 2), on LM-head logits: every head
    that projects onto (part of) the vocabulary applies it, so exits score as the model does."""
    if cfg.final_logit_softcap is None:
        return logits
    c = cfg.final_logit_softcap
    return jnp.tanh(logits / c) * c


def final_head(params: Params, h: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Final norm + LM head. h: [..., D] -> logits [..., V] (f32)."""
    return unembed(params, norm(h, params.final_norm, cfg), cfg)


def embed(params: Params, tokens: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Token embeddings [..., D]; times sqrt(d_model) (rounded to the model dtype, as
    transformers does) for families with `cfg.embed_scale` (Gemma). `cfg` is required: every
    path into the layers (dense, paged, evaluation, tuning) must scale alike."""
    x = take_rows(params.embed, tokens, cfg.jnp_dtype)
    if cfg.embed_scale:
        x = x * jnp.asarray(math.sqrt(cfg.d_model), x.dtype)
    return x


# --------------------------------------------------------------------------- dense forward


def forward(params: Params, tokens: jax.Array, cfg: ModelConfig, *,
            positions: jax.Array | None = None, return_hidden: bool = False,
            return_mid: bool = False):
    """Dense, cache-free causal forward over a full sequence: the reference everything else
    is tested against.

    tokens: [B, T] int. Right padding is harmless (causal attention never looks forward).
    Returns logits [B, T, V] (f32), and with `return_hidden` also the hidden state after
    every layer, [L, B, T, D] (before the final norm); with `return_mid` also every layer's
    state after attention, [L, B, T, D] (`decoder_layer_mid`).
    """
    B, T = tokens.shape
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))

    def body(x, layer):
        lp, i = layer
        mask = attention_weights_mask(positions, positions,
                                      window=layer_window(cfg, i))  # [B, T, T]

        def attend(q, k, v):
            return gqa_attention(q, k, v, mask, scale=cfg.attn_scale,
                                 softcap=cfg.attn_logit_softcap), None

        x, mid, _ = decoder_layer_mid(lp, x, positions, cfg, attend)
        return x, (x if return_hidden else None, mid if return_mid else None)

    x = embed(params, tokens, cfg)
    layer_ids = jnp.arange(cfg.n_layers, dtype=jnp.int32)
    x, (hidden, mid) = jax.lax.scan(body, x, (params.layers, layer_ids))
    logits = final_head(params, x, cfg)
    if return_hidden or return_mid:
        return (logits, *((hidden,) if return_hidden else ()), *((mid,) if return_mid else ()))
    return logits
