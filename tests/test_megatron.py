"""EE-LLM / EE-Tuning Megatron checkpoints: tiny random Llamas written in the format as
Megatron splits them (tensor parallel 2, pipeline parallel 2; `ee_jax.testing.write_megatron`
follows EE-LLM's own converters), read back by `ee_jax.models.formats.megatron`.

Oracles: transformers' logits on the same (fp16-rounded) weights for the backbone; for each
exit, a torch computation written here from the format's description (the layer's state after
attention + branch MLP -> exit norm -> exit output / temperature, or the layer's input for a
pre exit); transformers' greedy generation for verified exits served by the engine."""

from __future__ import annotations

import argparse
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from ee_jax.errors import ModelLoadError, UnsupportedModelError
from ee_jax.models import llama
from ee_jax.models.exits import heads as exit_heads
from ee_jax.models.formats import megatron
from ee_jax.models.loading import load_model
from ee_jax.serving.controller import ControllerConfig
from ee_jax.serving.llm import LLM
from ee_jax.serving.params import greedy
from ee_jax.testing import write_megatron

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PROMPTS = [[3, 17, 42, 99, 5, 7, 64], [11, 12, 13, 100, 101, 9, 8, 4, 77, 30, 2]]


def _hf_llama(tied: bool, seed: int):
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
        max_position_embeddings=256, initializer_range=0.08, tie_word_embeddings=tied,
        bos_token_id=None, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).float().eval()
    with torch.no_grad():  # the checkpoint holds fp16: the oracle runs the same weights
        for p in model.parameters():
            p.copy_(p.half().float())
    state = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    if tied:
        state.pop("lm_head.weight", None)
    return model, config.to_dict(), state


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    """EE-Tuning's layout: untied embedding and output, exits with norm, branch MLP and their
    own outputs at layers 1 and 3, and one at the last layer (4) that ee-jax cannot place."""
    model, hc, state = _hf_llama(tied=False, seed=0)
    folder = tmp_path_factory.mktemp("ee_tuning")
    parts = write_megatron(folder, hc, state, tp=2, pp=2, exit_layer_nums=(1, 3, 4),
                           use_exit_norm=True, use_exit_mlp=True,
                           untie_exit_output_weights=True)
    return model, folder, parts


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    """EE-LLM pretraining's: tied embedding, exits on it (no own outputs), pre exits at
    layers 2 and 3 (reading their layers' inputs) with norms and temperatures."""
    model, hc, state = _hf_llama(tied=True, seed=1)
    folder = tmp_path_factory.mktemp("ee_llm")
    parts = write_megatron(folder, hc, state, tp=2, pp=2, exit_layer_nums=(2, 3),
                           pre_exit=True, use_exit_norm=True, use_exit_mlp=False,
                           untie_exit_output_weights=False, exit_layer_temperature=(1.0, 2.0))
    return model, folder, parts


def _rms(x, w, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _torch_states(model, ids):
    """transformers' logits, hidden states (index n: the input of layer n + 1) and each
    layer's state after attention (what its post-attention norm reads)."""
    mids = {}
    hooks = [layer.post_attention_layernorm.register_forward_pre_hook(
        lambda _m, inp, i=i: mids.__setitem__(i, inp[0].detach()))
        for i, layer in enumerate(model.model.layers)]
    try:
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_hidden_states=True)
    finally:
        for h in hooks:
            h.remove()
    return out.logits[0], out.hidden_states, mids


@torch.no_grad()
def _untied_exit(model, parts, ids, n):
    """Exit at Megatron layer n (post, branch MLP, own norm and output), from the format."""
    _, _, mids = _torch_states(model, ids)
    m = mids[n - 1][0]
    post = model.model.layers[n - 1].post_attention_layernorm.weight
    t = lambda k: torch.from_numpy(parts[f"{k}.{n}"])  # noqa: E731
    x = _rms(m, post)
    x = m + (torch.nn.functional.silu(x @ t("branch.gate").T) * (x @ t("branch.up").T)) \
        @ t("branch.down").T
    return _rms(x, t("exit_norm")) @ t("exit_output").T


@torch.no_grad()
def _tied_exit(model, parts, ids, n, temperature):
    """Pre exit at Megatron layer n: the layer's input, its exit norm, the tied embedding."""
    _, hidden, _ = _torch_states(model, ids)
    x = _rms(hidden[n - 1][0], torch.from_numpy(parts[f"exit_norm.{n}"]))
    return x @ model.model.embed_tokens.weight.T / temperature


def _ee_jax_exit(lm, slot, ids):
    ec, heads = lm.shipped_exit_heads()
    _, hidden, mid = llama.forward(lm.params, jnp.asarray([ids]), lm.config, return_hidden=True,
                                   return_mid=True)
    e = ec.exit_layers[slot]
    h = exit_heads.exit_input(heads, slot, hidden[e - 1], mid[e - 1], lm.config)
    return np.asarray(exit_heads.exit_logits(lm.params, heads, slot, h, lm.config,
                                             ec.temperatures))[0]


def test_untied_checkpoint_backbone_and_exits(untied):
    model, folder, parts = untied
    lm = load_model(str(folder), progress=False)
    ec, _ = lm.exits
    assert (ec.exit_layers, ec.head, ec.exit_norm, ec.exit_output) == ((1, 3), "branch", True,
                                                                       True)
    assert not lm.config.tie_embeddings and lm.config.n_layers == 4
    for ids in PROMPTS:
        ref, _, _ = _torch_states(model, ids)
        got = np.asarray(llama.forward(lm.params, jnp.asarray([ids]), lm.config))[0]
        np.testing.assert_allclose(got, ref.numpy(), atol=2e-5, rtol=1e-4)
        for slot, n in enumerate((1, 3)):  # layer 3's output is the stage's exit 0
            want = _untied_exit(model, parts, ids, n).numpy()
            np.testing.assert_allclose(_ee_jax_exit(lm, slot, ids), want, atol=2e-5, rtol=1e-4)


def test_tied_pre_exit_checkpoint_with_temperatures(tied):
    model, folder, parts = tied
    lm = load_model(str(folder), progress=False)
    ec, heads = lm.exits
    assert lm.config.tie_embeddings and heads.output is None and heads.branch is None
    assert ec.exit_layers == (1, 2) and ec.temperatures == (1.0, 2.0)
    for ids in PROMPTS:
        ref, _, _ = _torch_states(model, ids)
        got = np.asarray(llama.forward(lm.params, jnp.asarray([ids]), lm.config))[0]
        np.testing.assert_allclose(got, ref.numpy(), atol=2e-5, rtol=1e-4)
        for slot, (n, temp) in enumerate(((2, 1.0), (3, 2.0))):
            want = _tied_exit(model, parts, ids, n, temp).numpy()
            np.testing.assert_allclose(_ee_jax_exit(lm, slot, ids), want, atol=2e-5, rtol=1e-4)


def _llm(lm, ec, heads):
    return LLM(lm, exit_config=ec, exit_heads=heads, max_num_seqs=2, max_model_len=64,
               page_size=8, progress=False, exit_control=ControllerConfig(mode="exits"))


@pytest.mark.parametrize("policy", ["all", "per_row"])
def test_served_forced_exit_takes_the_checkpoints_exit_token(untied, policy):
    """A decode step forced to leave at an exit emits that exit's token: the prompt's next
    token comes from full depth (prefill), the one after from the exit (the oracle above).
    Rows leave together: one row stage (min_row_bucket = the batch)."""
    model, folder, parts = untied
    lm = load_model(str(folder), progress=False)
    ec, heads = lm.exits
    for slot, n in enumerate((1, 3)):
        e = ec.exit_layers[slot]
        llm = _llm(lm, dataclasses.replace(ec, force_exit_layer=e, policy=policy,
                                           min_row_bucket=2), heads)
        outs = llm.generate(PROMPTS, greedy(2), use_tqdm=False)
        for ids, out in zip(PROMPTS, outs, strict=True):
            first = int(torch.argmax(_torch_states(model, ids)[0][-1]))
            assert out.token_ids[0] == first
            want = int(torch.argmax(_untied_exit(model, parts, [*ids, first], n)[-1]))
            assert out.token_ids[1] == want


@pytest.mark.parametrize("fixture", ["untied", "tied"])
def test_verified_exits_serve_full_depths_tokens(request, fixture):
    """The checkpoint's own exits as verified drafts (per row, threshold 0: every token a
    draft until a run is full): exactly transformers' greedy tokens. One row stage
    (min_row_bucket = the batch: row compaction is test_verified_exits')."""
    model, folder, _ = request.getfixturevalue(fixture)
    lm = load_model(str(folder), progress=False)
    ec, heads = lm.exits
    ec = dataclasses.replace(ec, policy="per_row", threshold=0.0, min_row_bucket=2).verified(3)
    llm = _llm(lm, ec, heads)
    outs = llm.generate(PROMPTS, greedy(12), use_tqdm=False)
    for ids, out in zip(PROMPTS, outs, strict=True):
        with torch.no_grad():
            ref = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
        assert out.token_ids == ref[0, len(ids):].tolist()
    assert llm.engine.stats.num_drafted > 0


def test_served_calibration_of_the_checkpoints_exits(untied, tmp_path):
    """`ee-jax calibrate --served` on a converted checkpoint's own exits (branch MLP, own
    outputs, max_prob): at threshold 1.0 no token leaves (no error, every layer run), at 0.0
    every decoded token leaves at the first exit; the shipped pick is what loads."""
    from ee_jax.models.convert import convert
    from ee_jax.models.exits.checkpoint import load_exit_heads
    from ee_jax.models.loading import EXIT_HEADS_DIR
    from ee_jax.training import calibrate
    from ee_jax.training.tune import served_tables

    _, folder, _ = untied
    convert(folder, tmp_path / "conv", progress=False)
    lm = load_model(str(tmp_path / "conv"), progress=False)
    ec, heads = lm.shipped_exit_heads()
    full = LLM(lm, early_exit=False, max_num_seqs=2, max_model_len=64, page_size=8,
               progress=False)  # the answers: full depth's own
    outs = full.generate(PROMPTS, greedy(6), use_tqdm=False)
    answers = {g: [(ids, o.token_ids) for ids, o in zip(PROMPTS, outs, strict=True)]
               for g in ("instructions", "code")}
    tables = served_tables(lm, ec, heads, answers, (1.0, 0.0), batch=4, progress=False)
    decoded = sum(len(a) - 1 for _, a in answers["code"])  # the first token is prefill's
    for t in tables.values():
        assert t.thresholds == (1.0, 0.0) and t.n == decoded
        assert t.errors[0] == 0 and t.mean_layers[0] == lm.config.n_layers
        assert t.mean_layers[1] == ec.exit_layers[0]
    cal = calibrate.served_calibration(tables, 0.5, 0.5, command="test")
    calibrate.ship_calibration(tmp_path / "conv" / EXIT_HEADS_DIR, cal)
    ec2, _ = load_exit_heads(tmp_path / "conv" / EXIT_HEADS_DIR, lm.config)
    assert ec2.threshold == cal["threshold"] in (1.0, 0.0)


class _WritesAFile:
    """A pickle that would run code on load (writes a marker file)."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (_touch, (str(self.path),))


def _touch(path):
    with open(path, "w") as f:
        f.write("ran")


def test_a_pickle_naming_another_class_is_refused_and_nothing_runs(tmp_path):
    marker = tmp_path / "ran.txt"
    it = tmp_path / "ckpt" / "iter_0000001" / "mp_rank_00"
    it.mkdir(parents=True)
    (tmp_path / "ckpt" / megatron.TRACKER).write_text("1")
    torch.save({"args": argparse.Namespace(num_layers=1), "model": {"x": _WritesAFile(marker)}},
               it / megatron.WEIGHTS)
    with pytest.raises(ModelLoadError, match="_touch") as e:
        load_model(str(tmp_path / "ckpt"), progress=False)
    assert "refused" in str(e.value)
    assert not marker.exists()
    # the same file read by an unrestricted torch.load does write it: the pickle is live
    torch.load(it / megatron.WEIGHTS, weights_only=False)
    assert marker.exists()


def test_bad_checkpoints_are_named(untied, tmp_path):
    _, folder, _ = untied
    import shutil
    # a missing shard
    broken = tmp_path / "missing"
    shutil.copytree(folder, broken)
    (broken / "iter_0000001" / "mp_rank_01_001" / megatron.WEIGHTS).unlink()
    with pytest.raises(ModelLoadError, match="mp_rank_01_001"):
        load_model(str(broken), progress=False)
    # an option ee-jax does not implement: named
    _, hc, state = _hf_llama(tied=False, seed=0)
    for option, value in (("use_exit_block", True), ("normalization", "LayerNorm")):
        other = tmp_path / option
        write_megatron(other, hc, state, tp=1, pp=1, exit_layer_nums=(2,),
                       extra_args={option: value})
        with pytest.raises(UnsupportedModelError, match=option):
            load_model(str(other), progress=False)
    # a tensor of the wrong shape: named with its file
    bad = tmp_path / "shape"
    shutil.copytree(folder, bad)
    shard = bad / "iter_0000001" / "mp_rank_00_000" / megatron.WEIGHTS
    with torch.serialization.safe_globals(megatron._allowed()):
        ck = torch.load(shard, weights_only=True)
    enc = ck["model"]["language_model"]["encoder"]
    enc["layers.1.self_attention.dense.weight"] = enc["layers.1.self_attention.dense.weight"][:, :5]
    _save_with_megatron_names(ck, shard)
    with pytest.raises(ModelLoadError, match=r"layers\.1\.self_attention\.dense\.weight"):
        load_model(str(bad), progress=False)


def _save_with_megatron_names(ck, path):
    """Save a checkpoint read back with the stand-in ModelType under Megatron's class name."""
    import sys
    import types
    mods = {n: types.ModuleType(n) for n in ("megatron", "megatron.core", "megatron.core.enums")}
    mods["megatron.core.enums"].ModelType = megatron.ModelType
    old = megatron.ModelType.__module__
    megatron.ModelType.__module__ = "megatron.core.enums"
    saved = {n: sys.modules.get(n) for n in mods}
    sys.modules.update(mods)
    try:
        torch.save(ck, path)
    finally:
        megatron.ModelType.__module__ = old
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m



def test_convert_once_then_serve_without_torch(untied, tmp_path, capsys):
    """`ee-jax convert` writes a Hugging Face folder with the exits beside it: ee-jax loads
    it with the same exits, transformers loads the backbone, and `ee-jax generate` serves it
    with the tokenizer given (token for token what the Megatron folder serves)."""
    import json

    import tokenizers

    from ee_jax.cli import main

    model, folder, _ = untied
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {f"t{i}": i for i in range(128)}, unk_token="t0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    out = tmp_path / "converted"
    assert main(["convert", str(folder), str(out), "--tokenizer",
                 str(tmp_path / "tokenizer.json"), "--quiet"]) == 0
    meg, conv = load_model(str(folder), progress=False), load_model(str(out), progress=False)
    ec, _ = conv.shipped_exit_heads()
    assert ec == meg.exits[0] and conv.tokenizer is not None
    ids = PROMPTS[1]
    for slot in range(2):
        np.testing.assert_array_equal(_ee_jax_exit(conv, slot, ids), _ee_jax_exit(meg, slot, ids))
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        np.testing.assert_allclose(back(torch.tensor([ids])).logits[0].numpy(),
                                   model(torch.tensor([ids])).logits[0].numpy(), atol=1e-5)
    prompt = " ".join(f"t{i}" for i in ids)
    outs = []
    for src in (folder, out):
        capsys.readouterr()
        assert main(["generate", "--model", str(src), "--tokenizer",
                     str(tmp_path / "tokenizer.json"), "--prompt", prompt, "--no-chat",
                     "--max-tokens", "6", "--json", "--quiet", "--max-model-len", "64",
                     "--exit-control", "exits", "--exit-threshold", "0.0"]) == 0
        outs.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert outs[0]["text"] == outs[1]["text"] and outs[0]["text"]
