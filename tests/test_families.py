"""Model families (Qwen2, Qwen3, Mistral with its sliding window, Gemma 2) against transformers.

Every model here is made by transformers itself (tiny dims, random weights, norms and biases
perturbed so they matter), saved with `save_pretrained` next to a `tokenizer.json`, and loaded
by ee-jax from that folder. The dense forward must match transformers' logits on a prompt
several windows long; the engine (`LLM`) must reproduce transformers' greedy generation at
full depth, and with every decode token leaving at an exit it must reproduce a contiguous
reference that back-fills the skipped layers from the exit state (`kv_project`).
"""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ee_jax.errors import ModelLoadError, UnsupportedModelError
from ee_jax.models import exits, llama
from ee_jax.models.checkpoint import config_from_dict, config_to_dict
from ee_jax.models.exits import NEVER, ExitConfig
from ee_jax.models.hf import config_from_hf, load_hf
from ee_jax.models.loading import load_model
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


def make_hf(family: str, seed: int = 0):
    """A tiny transformers model of `family`, f32, eval mode, norms and biases perturbed."""
    config_cls, model_cls, overrides = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**DIMS, **overrides})
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
    # The comparison sees every switch: leaving one out moves the logits well past 1e-4.
    switches = dict(sliding_window=None, layer_types=None, attn_logit_softcap=None,
                    final_logit_softcap=None, query_pre_attn_scalar=None, norm_offset=0.0,
                    embed_scale=False, post_norms=None, activation="silu", qk_norm=None,
                    qkv_bias=None)
    for field, off in switches.items():
        if getattr(cfg, field) in (None, False, 0.0, "silu") or off is None:
            continue
        if field == "layer_types" and cfg.layer_types is not None:
            off = ("sliding_attention",) * cfg.n_layers  # every layer windowed
        elif field == "sliding_window":
            changed = cfg.replace(sliding_window=None, layer_types=None)
        changed = cfg.replace(**{field: off}) if field != "sliding_window" else changed
        other = np.asarray(_forward(params, jnp.asarray(tokens)[None], changed))[0]
        assert np.abs(other - ref).max() > 1e-2, (family, field)


def test_bfloat16_gemma2_tracks_transformers(tmp_root):
    """bf16 weights: the (1 + w) norms and the caps in f32 as transformers computes them."""
    model, folder = hf_folder("gemma2", tmp_root)
    cfg, params = load_hf(folder, dtype="bfloat16")
    tokens = tokens_for(64, seed=1)
    ref = hf_logits(model.to(torch.bfloat16), tokens)
    model.float()
    ours = np.asarray(_forward(params, jnp.asarray(tokens)[None], cfg))[0]
    assert np.abs(ours - ref).max() < 0.1 * np.abs(ref).max()
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() > 0.9


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


# --------------------------------------------------------------------------- engine


ENGINE = dict(max_num_seqs=2, max_model_len=64, page_size=8, num_pages=24,
              max_prefill_chunk=32, max_num_batched_tokens=64, batch_buckets=(2,))
PROMPT_LENS = (40, 27)  # both longer than the window; the first takes two prefill chunks
MAX_NEW = 16
EXIT = 2  # every decode token leaves after layer 2 (threshold 0 at the only exit)


def _prompts():
    return [" ".join(WORDS[t] for t in tokens_for(n, seed=n)) for n in PROMPT_LENS]


def _reference_forced_exit(cfg, params, heads, prompt, n_new):
    """Greedy decoding with contiguous per-layer K/V: prefill at full depth, then every token
    runs layers < EXIT, takes exit EXIT's head, and writes `kv_project` of its exit state
    into the layers >= EXIT (the back-fill)."""
    S = len(prompt) + n_new
    kc = [jnp.zeros((S, cfg.n_kv_heads, cfg.head_dim))] * cfg.n_layers
    vc = list(kc)

    @jax.jit
    def layer(i, x, pos, kc, vc):
        lp = llama.layer_params(params, i)

        def attend(q, k, v):
            kc2, vc2 = kc.at[pos].set(k), vc.at[pos].set(v)
            mask = llama.attention_weights_mask(pos, jnp.arange(S), window=llama.layer_window(
                cfg, i))
            return llama.gqa_attention(q, kc2, vc2, mask, scale=cfg.attn_scale,
                                       softcap=cfg.attn_logit_softcap), (kc2, vc2)

        x, (kc, vc) = llama.decoder_layer(lp, x, pos, cfg, attend)
        return x, kc, vc

    x = llama.embed(params, jnp.asarray(prompt), cfg)
    pos = jnp.arange(len(prompt))
    for i in range(cfg.n_layers):
        x, kc[i], vc[i] = layer(i, x, pos, kc[i], vc[i])
    out = [int(jnp.argmax(llama.final_head(params, x[-1], cfg)))]
    for p in range(len(prompt), len(prompt) + n_new - 1):
        x = llama.embed(params, jnp.asarray([out[-1]]), cfg)
        pos = jnp.asarray([p])
        for i in range(EXIT):
            x, kc[i], vc[i] = layer(i, x, pos, kc[i], vc[i])
        for j in range(EXIT, cfg.n_layers):
            k, v = llama.kv_project(llama.layer_params(params, j), x, pos, cfg)
            kc[j], vc[j] = kc[j].at[pos].set(k), vc[j].at[pos].set(v)
        out.append(int(jnp.argmax(exits.exit_logits(params, heads, 0, x[0], cfg))))
    return out


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral", "gemma2"])
def test_engine_greedy_matches_transformers_and_forced_exits_backfill(tmp_root, family):
    from ee_jax.serving.llm import LLM

    model, folder = hf_folder(family, tmp_root)
    hf_tok = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
    ec = ExitConfig(exit_layers=(EXIT,), threshold=0.0)
    llm = LLM(load_model(folder, progress=False), exit_config=ec, **ENGINE)
    texts = _prompts()
    ids = [llm.tokenizer.encode(t) for t in texts]
    assert ids == [hf_tok.encode(t) for t in texts]  # tokenizer.json read alike
    assert [len(i) for i in ids] == list(PROMPT_LENS)

    # Full depth (per-request threshold no confidence reaches) == transformers' generate.
    full = llm.generate(texts, greedy(MAX_NEW, exit_threshold=NEVER), use_tqdm=False)
    with torch.no_grad():
        want = [model.generate(torch.tensor([i]), max_new_tokens=MAX_NEW, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(i):].tolist()
                for i in ids]
    assert [o.token_ids for o in full] == want
    assert all(o.exit_layers == [4] * MAX_NEW for o in full)

    # Every decode token leaves at EXIT; the skipped layers' K/V are back-filled.
    early = llm.generate(texts, greedy(MAX_NEW), use_tqdm=False)
    assert all(o.exit_layers == [4] + [EXIT] * (MAX_NEW - 1) for o in early)
    lm = llm.model
    heads = llm.engine.runner.exit_heads
    ref = [_reference_forced_exit(lm.config, lm.params, heads, i, MAX_NEW) for i in ids]
    assert [o.token_ids for o in early] == ref
    assert ref != want  # the exit changed the tokens: the comparison is not vacuous
