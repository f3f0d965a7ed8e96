"""Model families (Qwen2, Qwen3, Mistral with its sliding window, Gemma 2) against transformers.

Every model here is made by transformers itself (tiny dims, random weights, norms and biases
perturbed so they matter), saved with `save_pretrained` next to a `tokenizer.json`, and loaded
by ee-jax from that folder. The dense forward must match transformers' logits on a prompt
several windows long; the engine (`LLM`) must reproduce transformers' greedy generation at
full depth, and with tokens leaving at an exit (and later ones reading the layers they
skipped) it must follow a contiguous reference that back-fills the skipped layers from the
exit state (`kv_project`, which is exactly what each family's layer writes).
"""

from __future__ import annotations

import copy
import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ee_jax.errors import ModelLoadError, UnsupportedModelError
from ee_jax.models import llama
from ee_jax.models.exits import checks as exit_checks
from ee_jax.models.exits import heads as exit_heads
from ee_jax.models.exits.config import NEVER, ExitConfig
from ee_jax.models.formats.checkpoint import config_from_dict, config_to_dict
from ee_jax.models.formats.hf import config_from_hf, load_hf
from ee_jax.models.loading import load_model
from ee_jax.serving.controller import ControllerConfig
from ee_jax.serving.params import greedy

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

WINDOW = 16
SEQ = 160  # ten windows: a window bug shows from position WINDOW on
VOCAB = 128
DIMS = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
            max_position_embeddings=512, initializer_range=0.1, tie_word_embeddings=False,
            bos_token_id=None, eos_token_id=None, pad_token_id=0)
# name -> (transformers config class, model class, config overrides)
FAMILIES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen2-window": ("Qwen2Config", "Qwen2ForCausalLM",
                     dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=WINDOW)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               # caps low enough to bite on these scores; scalar != head_dim; tied head
               dict(sliding_window=WINDOW, query_pre_attn_scalar=24, attn_logit_softcapping=3.0,
                    final_logit_softcapping=4.0, tie_word_embeddings=True)),
}
WORDS = ["<pad>", "<unk>"] + [f"w{i}" for i in range(VOCAB - 2)]


def make_hf(family: str, seed: int = 0, **changes):
    """A tiny transformers model of `family`, f32, eval mode, norms and biases perturbed."""
    config_cls, model_cls, overrides = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**DIMS, **overrides, **changes})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):  # HF initialises them to 1 / 0
                p.add_(0.2 * torch.randn_like(p))
    return model


def write_tokenizer(folder) -> None:
    """A word-level tokenizer.json (one id per "w<i>" word) and its tokenizer_config.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                                pad_token="<pad>")
    fast.save_pretrained(folder)


@functools.cache
def hf_folder(family: str, tmp_root):
    model = make_hf(family)
    folder = tmp_root / family
    model.save_pretrained(folder, safe_serialization=True)
    write_tokenizer(folder)
    return model, folder


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory):
    return tmp_path_factory.mktemp("families")


def hf_logits(model, tokens) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)[None]).logits[0].float().numpy()


def tokens_for(n, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).integers(2, VOCAB, n).astype(np.int32)


_forward = jax.jit(llama.forward, static_argnums=(2,))


# --------------------------------------------------------------------------- config and logits


def test_configs_read_every_family_switch(tmp_root):
    want = {
        "qwen2": dict(qkv_bias=True, sliding_window=None),
        "qwen2-window": dict(qkv_bias=True, sliding_window=WINDOW,
                             layer_windows=(0, 0, WINDOW, WINDOW)),
        "qwen3": dict(qk_norm=True, qkv_bias=False, sliding_window=None),
        "mistral": dict(sliding_window=WINDOW, layer_types=None,
                        layer_windows=(WINDOW,) * 4, max_position=512),
        "gemma2": dict(norm_offset=1.0, embed_scale=True, post_norms=True,
                       activation="gelu_tanh", attn_logit_softcap=3.0, final_logit_softcap=4.0,
                       query_pre_attn_scalar=24.0, attn_scale=24.0 ** -0.5,
                       layer_windows=(WINDOW, 0, WINDOW, 0), tie_embeddings=True),
    }
    for family, fields in want.items():
        _, folder = hf_folder(family, tmp_root)
        cfg = config_from_hf(json.loads((folder / "config.json").read_text()))
        got = {k: getattr(cfg, k) for k in fields}
        assert got == fields, family
        assert config_from_dict(json.loads(json.dumps(config_to_dict(cfg)))) == cfg  # orbax


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers(tmp_root, family):
    model, folder = hf_folder(family, tmp_root)
    cfg, params = load_hf(folder)
    tokens = tokens_for(SEQ)
    ref = hf_logits(model, tokens)
    ours = np.asarray(_forward(params, jnp.asarray(tokens)[None], cfg))[0]
    assert np.abs(ref).max() > 1.0  # large enough for the comparison to mean something
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)
    # The comparison sees every switch the family sets: turning one off (the params stay)
    # moves the logits far past the tolerance.
    off = {"qkv_bias": dict(qkv_bias=False), "qk_norm": dict(qk_norm=False),
           "sliding_window": dict(sliding_window=None, layer_types=None),
           "layer_types": dict(layer_types=None),  # every layer windowed
           "norm_offset": dict(norm_offset=0.0), "embed_scale": dict(embed_scale=False),
           "post_norms": dict(post_norms=False), "activation": dict(activation="silu"),
           "attn_logit_softcap": dict(attn_logit_softcap=None),
           "final_logit_softcap": dict(final_logit_softcap=None),
           "query_pre_attn_scalar": dict(query_pre_attn_scalar=None)}
    for field, changes in off.items():
        if getattr(cfg, field) in (None, False, 0.0, "silu"):
            continue  # not a switch of this family
        other = np.asarray(_forward(params, jnp.asarray(tokens)[None], cfg.replace(**changes)))
        assert np.abs(other[0] - ref).max() > 1e-2, (family, field)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "gemma2"])
def test_kv_project_is_what_the_layer_writes(tmp_root, family):
    """The back-fill's K/V (`kv_project` of a layer's input) equal the K/V the layer itself
    attends with, biases, q/k norms and (1 + w) norms included."""
    _, folder = hf_folder(family, tmp_root)
    cfg, params = load_hf(folder)
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 5, cfg.d_model))
    pos = jnp.broadcast_to(jnp.arange(40, 45), (2, 5))
    seen = {}

    def attend(q, k, v):
        seen["kv"] = (k, v)
        return jnp.zeros_like(q), None

    lp = llama.layer_params(params, 1)
    llama.decoder_layer(lp, x, pos, cfg, attend)
    for got, want in zip(llama.kv_project(lp, x, pos, cfg), seen["kv"], strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_bfloat16_gemma2_tracks_transformers(tmp_root):
    """bf16 weights: the (1 + w) norms and the caps in f32 as transformers computes them."""
    model, folder = hf_folder("gemma2", tmp_root)
    cfg, params = load_hf(folder, dtype="bfloat16")
    tokens = tokens_for(64, seed=1)
    ref = hf_logits(copy.deepcopy(model).to(torch.bfloat16), tokens)  # the f32 one is shared
    ours = np.asarray(_forward(params, jnp.asarray(tokens)[None], cfg))[0]
    assert np.abs(ours - ref).max() < 0.1 * np.abs(ref).max()
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() > 0.9


def test_exit_heads_use_the_family_norm_and_cap(tmp_root):
    """Gemma 2: an exit head's (1 + w) norm and the final soft-cap are the model's own, on the
    full vocabulary and on a subset of it."""
    _, folder = hf_folder("gemma2", tmp_root)
    cfg, params = load_hf(folder)
    ec = ExitConfig(exit_layers=(2,))
    heads = exit_heads.init_heads(cfg, ec, params)  # norm = the final norm: the final head
    h = jax.random.normal(jax.random.PRNGKey(0), (3, cfg.d_model)) * 4.0
    full = llama.final_head(params, h, cfg)
    np.testing.assert_allclose(exit_heads.exit_logits(params, heads, 0, h, cfg), full, atol=1e-6)
    assert np.abs(full).max() <= cfg.final_logit_softcap
    ids = jnp.asarray([5, 17, 90])
    hn = llama.norm(h, params.final_norm, cfg)
    raw = np.asarray(hn @ params.embed.T)  # tied head, before the cap
    assert np.abs(raw[:, ids] - np.asarray(full)[:, ids]).max() > 1e-2  # the cap bites
    np.testing.assert_allclose(exit_heads.unembed_rows(params, hn, ids, cfg), full[:, ids],
                                    atol=1e-6)


# --------------------------------------------------------------------------- bad input


def _hf_dict(family, **changes):
    config_cls, _, overrides = FAMILIES[family]
    d = getattr(transformers, config_cls)(**{**DIMS, **overrides}).to_dict()
    d.update(changes)
    return d


@pytest.mark.parametrize("family, changes, match", [
    ("qwen2", dict(model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"]),
     r"Qwen2MoeForCausalLM.*qwen2_moe.*not supported.*Gemma2ForCausalLM"),
    ("qwen2", dict(model_type=None, architectures=["PhiForCausalLM"]), r"PhiForCausalLM"),
    ("mistral", dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}),
     r"rope scaling 'yarn' is not supported"),
    ("qwen3", dict(attention_bias=True), r"attention_bias=true is not supported for qwen3"),
    ("gemma2", dict(hidden_activation="relu"), r"hidden_activation 'relu' is not supported"),
    ("gemma2", dict(layer_types=["sliding_attention", "chunked_attention"] * 2),
     r"layer_types \['chunked_attention'\] are not supported"),
    ("gemma2", dict(use_bidirectional_attention=True), r"use_bidirectional_attention=true"),
    ("qwen3", dict(partial_rotary_factor=0.5), r"partial_rotary_factor=0.5"),
])
def test_unsupported_families_and_options_name_the_option(family, changes, match):
    with pytest.raises(UnsupportedModelError, match=match):
        config_from_hf(_hf_dict(family, **changes), source="m/config.json")


def test_mismatched_layer_types_and_tensors(tmp_root, tmp_path):
    with pytest.raises(ModelLoadError, match=r"layer_types has 2 entries.*num_hidden_layers=4"):
        config_from_hf(_hf_dict("gemma2", layer_types=["full_attention"] * 2))
    # A Qwen2 folder relabelled Qwen3: its biases are unexpected, its q/k norms missing.
    _, folder = hf_folder("qwen2", tmp_root)
    import shutil

    copy = shutil.copytree(folder, tmp_path / "relabelled")
    config = json.loads((copy / "config.json").read_text())
    config.update(model_type="qwen3", architectures=["Qwen3ForCausalLM"])
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match=r"tensors a qwen3 model does not use.*"
                                                    r"q_proj\.bias"):
        load_hf(copy)


# --------------------------------------------------------------------------- GGUF


def write_family_gguf(path, family: str, model) -> None:
    """The GGUF llama.cpp's converter writes for a Qwen2 / Qwen3 / Gemma 2 model (written out
    here from its documented layout): HF-layout [out, in] tensors unpermuted (these archs use
    NEOX RoPE), Gemma norms stored as 1 + w, the family's metadata under its arch name."""
    import gguf

    arch = family.split("-")[0]
    c = model.config
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in [("block_count", c.num_hidden_layers),
                       ("context_length", c.max_position_embeddings),
                       ("embedding_length", c.hidden_size),
                       ("feed_forward_length", c.intermediate_size),
                       ("attention.head_count", c.num_attention_heads),
                       ("attention.head_count_kv", c.num_key_value_heads),
                       ("attention.key_length", c.head_dim), ("vocab_size", c.vocab_size),
                       ("attention.value_length", c.head_dim)]:
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.rope.freq_base", c.rope_parameters["rope_theta"])
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", c.rms_norm_eps)
    if arch == "gemma2":
        w.add_uint32(f"{arch}.attention.sliding_window", c.sliding_window)
        w.add_float32(f"{arch}.attn_logit_softcapping", c.attn_logit_softcapping)
        w.add_float32(f"{arch}.final_logit_softcapping", c.final_logit_softcapping)
    names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
             "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
             "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "post_attention_layernorm": "post_attention_norm" if arch == "gemma2" else "ffn_norm",
             "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
             "model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        stem, kind = name.rsplit(".", 1)
        layer = None
        if stem.startswith("model.layers."):
            _, _, layer, stem = stem.split(".", 3)
        base = names[stem]
        a = t.detach().float().numpy()
        if arch == "gemma2" and stem.endswith("norm"):
            a = a + 1.0
        w.add_tensor(f"blk.{layer}.{base}.{kind}" if layer is not None else f"{base}.{kind}",
                     np.ascontiguousarray(a, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# transformers' GGUF reader ignores key_length: head_dim is its config default there (Qwen2:
# d_model / heads, Qwen3: 128).
@pytest.mark.parametrize("family, head_dim", [("qwen2", 12), ("qwen3", 128), ("gemma2", 16)])
def test_gguf_families_load_as_their_hf_folder(tmp_path, family, head_dim):
    """The GGUF of a family model loads to the Hugging Face folder's config and weights (the
    1 + w norms undone, to f32 rounding); for Qwen, transformers' own GGUF reader agrees on
    the logits."""
    from ee_jax.models.formats.gguf import load_gguf

    model, folder = make_hf(family, head_dim=head_dim), tmp_path / "hf"
    model.save_pretrained(folder, safe_serialization=True)
    path = tmp_path / f"{family}.gguf"
    write_family_gguf(path, family, model)
    cfg, params = load_gguf(path)
    hf_cfg, hf_params = load_hf(folder)
    if family == "gemma2":  # llama.cpp scales Gemma 2's scores by 1/sqrt(head_dim)
        hf_cfg = hf_cfg.replace(query_pre_attn_scalar=float(hf_cfg.head_dim))
    assert cfg == hf_cfg.replace(name=cfg.name)
    for (key, a), b in zip(jax.tree_util.tree_leaves_with_path(params),
                           jax.tree.leaves(hf_params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-7, rtol=0,
                                   err_msg=str(key))
    if family != "gemma2":  # transformers reads Gemma 2 GGUF caps and scalar as defaults
        gguf_model = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path, gguf_file=path.name, dtype=torch.float32)
        tokens = tokens_for(SEQ // 2)
        ours = np.asarray(_forward(params, jnp.asarray(tokens)[None], cfg))[0]
        np.testing.assert_allclose(ours, hf_logits(gguf_model, tokens), atol=1e-4, rtol=0)


# --------------------------------------------------------------------------- engine


# One row at a time, so each prompt's exits are its own (policy "all" leaves when every row
# of the batch is confident); both prompts in one prefill bucket: two compiled programs.
# Exits always: the test checks what the exit program computes (the controller's "auto" could
# run full depth after its probe; its choice is tests/test_exit_controller.py's).
ENGINE = dict(max_num_seqs=1, max_model_len=64, page_size=16, num_pages=8,
              max_prefill_chunk=32, max_num_batched_tokens=32, batch_buckets=(1,),
              exit_control=ControllerConfig(mode="exits"))
PROMPT_LENS = (30, 25)  # both longer than the window
MAX_NEW = 16
EXIT = 2  # the one exit: after layer 2 of 4
REF_LEN = 64


def _prompts():
    return [" ".join(WORDS[t] for t in tokens_for(n, seed=n)) for n in PROMPT_LENS]


@functools.partial(jax.jit, static_argnums=(0,))
def _ref_prefill(cfg, params, tokens):
    """Full-depth K/V [L, REF_LEN, K, hd] of a right-padded prompt [REF_LEN] (each layer's
    `kv_project` of its input from the dense forward), and the logits [REF_LEN, V]."""
    logits, hidden = llama.forward(params, tokens[None], cfg, return_hidden=True)
    inputs = jnp.concatenate([llama.embed(params, tokens[None], cfg)[None], hidden[:-1]])
    pos = jnp.arange(REF_LEN)
    kv = jax.vmap(lambda lp, x: llama.kv_project(lp, x[0], pos, cfg))(params.layers, inputs)
    return kv, logits[0]


@functools.partial(jax.jit, static_argnums=(0,))
def _ref_token(cfg, params, heads, kv, token, pos, threshold):
    """One decode token at `pos` over contiguous K/V [L, REF_LEN, K, hd] (no pages). Layers
    < EXIT run; if exit EXIT's max-prob reaches `threshold` its head gives the logits and the
    layers >= EXIT get `kv_project` of the exit state (the back-fill), else the remaining
    layers run (attending to earlier tokens' back-filled entries) and the final head does.
    Returns (kv, logits [V], confidence, left)."""
    positions = pos[None]

    def layer(i, x, ks, vs):
        def attend(q, k, v):
            k_all, v_all = ks.at[i, pos].set(k[0]), vs.at[i, pos].set(v[0])
            mask = llama.attention_weights_mask(positions, jnp.arange(REF_LEN),
                                                window=llama.layer_window(cfg, i))
            out = llama.gqa_attention(q, k_all[i], v_all[i], mask, scale=cfg.attn_scale,
                                      softcap=cfg.attn_logit_softcap)
            return out, (k_all, v_all)

        return llama.decoder_layer(llama.layer_params(params, i), x, positions, cfg, attend)

    x, (ks, vs) = llama.embed(params, token[None], cfg), kv
    for i in range(EXIT):
        x, (ks, vs) = layer(i, x, ks, vs)
    exit_logits = exit_heads.exit_logits(params, heads, 0, x[0], cfg)
    conf = exit_checks.confidence_from_logits(exit_logits, "max_prob")
    left = conf >= threshold
    filled, full = (ks, vs), (ks, vs)
    for j in range(EXIT, cfg.n_layers):
        k, v = llama.kv_project(llama.layer_params(params, j), x, positions, cfg)
        filled = (filled[0].at[j, pos].set(k[0]), filled[1].at[j, pos].set(v[0]))
    y = x
    for j in range(EXIT, cfg.n_layers):
        y, full = layer(j, y, *full)
    kv = jax.tree.map(lambda a, b: jnp.where(left, a, b), filled, full)
    logits = jnp.where(left, exit_logits, llama.final_head(params, y[0], cfg))
    return kv, logits, conf, left


def reference_decode(cfg, params, heads, prompt, n_new, threshold):
    """Greedy early-exit decoding of one sequence with contiguous K/V: the prompt at full
    depth, then each token leaves at EXIT when confident. Returns tokens, exit layers (L
    for the prefill token) and the confidences seen."""
    tokens = np.zeros(REF_LEN, np.int32)
    tokens[:len(prompt)] = prompt
    kv, logits = _ref_prefill(cfg, params, jnp.asarray(tokens))
    out, layers, confs = [int(jnp.argmax(logits[len(prompt) - 1]))], [cfg.n_layers], []
    for pos in range(len(prompt), len(prompt) + n_new - 1):
        kv, logits, conf, left = _ref_token(cfg, params, heads, kv, jnp.asarray(out[-1]),
                                            jnp.asarray(pos), jnp.float32(threshold))
        out.append(int(jnp.argmax(logits)))
        layers.append(EXIT if bool(left) else cfg.n_layers)
        confs.append(float(conf))
    return out, layers, confs


def choose_threshold(cfg, params, heads, prompts):
    """A threshold at which the reference leaves early for some tokens and later runs full
    depth over their back-filled entries, with no confidence within 1e-4 of it (float noise
    between paged and contiguous attention, ~1e-6, cannot flip a decision)."""
    confs = np.sort([c for p in prompts
                     for c in reference_decode(cfg, params, heads, p, MAX_NEW, 2.0)[2]])
    middle = confs[len(confs) // 5: -len(confs) // 5]  # leave some tokens on either side
    gaps = np.diff(middle)
    for i in np.argsort(-gaps)[:8]:  # midpoints of the widest gaps first
        thr = (middle[i] + middle[i + 1]) / 2
        refs = [reference_decode(cfg, params, heads, p, MAX_NEW, thr) for p in prompts]
        seen = [c for _, _, cs in refs for c in cs]
        mixed = any(EXIT in ls and cfg.n_layers in ls[ls.index(EXIT):] for _, ls, _ in refs)
        if mixed and min(abs(c - thr) for c in seen) > 1e-4:
            return float(thr), refs
    raise AssertionError("no usable threshold: change the model seed or the prompts")


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral", "gemma2"])
def test_engine_greedy_matches_transformers_and_backfill_holds(tmp_root, family):
    from ee_jax.serving.llm import LLM

    model, folder = hf_folder(family, tmp_root)
    hf_tok = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
    ec = ExitConfig(exit_layers=(EXIT,), backfill="propagate")  # as the reference fills
    llm = LLM(load_model(folder, progress=False), exit_config=ec, **ENGINE)
    texts = _prompts()
    ids = [llm.tokenizer.encode(t) for t in texts]
    assert ids == [hf_tok.encode(t) for t in texts]  # tokenizer.json read alike
    assert [len(i) for i in ids] == list(PROMPT_LENS)

    # Full depth (a threshold no confidence reaches) == transformers' greedy generate.
    full = llm.generate(texts, greedy(MAX_NEW, exit_threshold=NEVER), use_tqdm=False)
    with torch.no_grad():
        want = [model.generate(torch.tensor([i]), max_new_tokens=MAX_NEW, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(i):].tolist()
                for i in ids]
    assert [o.token_ids for o in full] == want
    assert all(o.exit_layers == [4] * MAX_NEW for o in full)

    # Early exits, then full-depth tokens that attend to the back-filled layers: the engine
    # follows the contiguous reference token for token and exit for exit.
    lm, heads = llm.model, llm.engine.runner.exit_heads
    thr, refs = choose_threshold(lm.config, lm.params, heads, ids)
    early = llm.generate(texts, greedy(MAX_NEW, exit_threshold=thr), use_tqdm=False)
    assert [o.exit_layers for o in early] == [layers for _, layers, _ in refs]
    assert [o.token_ids for o in early] == [tokens for tokens, _, _ in refs]
    assert [o.token_ids for o in early] != want  # the exits changed tokens: not vacuous


# --------------------------------------------------------------------------- bf16 cache


def _abstract(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype) if isinstance(x, jax.Array | np.ndarray) \
        else x


class _SpyJit:
    """`jax.jit` that remembers the abstract arguments of every call, so each compiled step
    of an engine run can be compiled again and read, whatever the engine calls it."""

    def __init__(self, real, calls):
        self.real, self.calls = real, calls

    def __call__(self, fun=None, **kw):
        if fun is None:
            return lambda f: self(f, **kw)
        jitted = self.real(fun, **kw)
        calls = self.calls

        class Spied:
            def __call__(self, *args, **kwargs):
                abstract = jax.tree.map(_abstract, (args, kwargs))
                calls.setdefault(str(abstract), (jitted, abstract))
                return jitted(*args, **kwargs)

            def __getattr__(self, name):
                return getattr(jitted, name)

        return Spied()


_HLO_OP = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = \w+\[([\d,]*)\]\S* ([\w\-]+)\(")
_HLO_CALLS = re.compile(r"calls=%([\w.\-]+)")
_HLO_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) .*\{$")


def whole_array_ops(hlo: str, shape: tuple[int, ...]) -> list[str]:
    """Instructions of compiled HLO text that produce a whole array of `shape` other than
    in place: anything but parameters, tuple plumbing, bitcasts, and scatters /
    dynamic-update-slices (bare or as a fusion's root), e.g. a convert or a copy."""
    dims = ",".join(map(str, shape))
    roots, ops, computation = {}, [], None
    for line in hlo.splitlines():
        head = _HLO_COMPUTATION.match(line)
        if head:
            computation = head.group(1)
            continue
        m = _HLO_OP.match(line)
        if not m:
            continue
        if line.lstrip().startswith("ROOT"):
            roots[computation] = m.group(3)
        if m.group(2) == dims:
            calls = _HLO_CALLS.search(line)
            ops.append((m.group(1), m.group(3), calls and calls.group(1)))
    in_place = {"scatter", "dynamic-update-slice"}
    bad = []
    for name, op, called in ops:
        if op in {"parameter", "get-tuple-element", "bitcast"} | in_place:
            continue
        if op == "fusion" and roots.get(called) in in_place:
            continue
        bad.append(f"{name} = {op}" + (f" (root {roots.get(called)})" if called else ""))
    return bad


def test_whole_array_ops_sees_xla_cpu_16_bit_scatter():
    """Negative control for the test below: XLA's CPU backend scatters into a bf16 array by
    converting all of it to f32 and back; the check names those converts."""
    buf = jnp.zeros((3, 97, 8), jnp.bfloat16)
    fn = jax.jit(lambda b, u: b.at[1, jnp.asarray([2, 5])].set(u), donate_argnums=(0,))
    bad = whole_array_ops(fn.lower(buf, jnp.ones((2, 8), jnp.bfloat16)).compile().as_text(),
                          buf.shape)
    assert any("convert" in b for b in bad), bad
    f32 = jax.jit(lambda b, u: b.at[1, jnp.asarray([2, 5])].set(u), donate_argnums=(0,))
    assert whole_array_ops(f32.lower(buf.astype(jnp.float32), jnp.ones((2, 8))).compile()
                           .as_text(), buf.shape) == []


def test_bf16_engine_steps_write_only_the_tokens_slots(monkeypatch):
    """A bf16 model and bf16 cache, early exits on: no compiled step of the run (prefill,
    decode with back-fill) converts or copies the cache; it is only scattered into."""
    from ee_jax.serving.engine import EngineConfig, LLMEngine
    from ee_jax.testing import tiny_model
    from tests.reference import run_requests

    cfg, params = tiny_model(seed=0, eos_token_ids=())
    cfg, params = cfg.replace(dtype="bfloat16"), llama.cast_params(params, "bfloat16")
    calls = {}
    monkeypatch.setattr(jax, "jit", _SpyJit(jax.jit, calls))
    engine = LLMEngine(cfg, params, None, EngineConfig.make(
        max_num_seqs=2, max_model_len=64, page_size=8, num_pages=97, max_prefill_chunk=32,
        max_num_batched_tokens=64, batch_buckets=(2,)),
        ExitConfig(exit_layers=(1, 2), threshold=0.5))
    run_requests(engine, [[5, 6, 7, 8, 9], [3, 4]], greedy(6))
    monkeypatch.undo()
    shape = engine.runner.cache.k.shape  # [L, 97, 8, K, hd]
    steps = [(jitted, abstract) for jitted, abstract in calls.values()
             if any(getattr(a, "shape", None) == shape for a in jax.tree.leaves(abstract))]
    assert len(steps) >= 2, "expected a prefill and a decode step over the cache"
    for jitted, (args, kwargs) in steps:
        hlo = jitted.lower(*args, **kwargs).compile().as_text()
        assert whole_array_ops(hlo, shape) == [], jitted
