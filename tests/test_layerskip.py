"""LayerSkip's self-speculation (arXiv 2404.16710) as verified exits: draft every token with
the first E layers and the model's own final norm and LM head (an untrained `norm` head: the
shared head LayerSkip trains), `max_draft` drafts (its num_speculations), verify with the
rest. Against transformers' `generate(..., assistant_early_exit=E)` on a tiny random Llama
saved as a Hugging Face folder (what a facebook/layerskip-* folder is)."""

from __future__ import annotations

import numpy as np
import pytest

from ee_jax.models.exits.config import ExitConfig
from ee_jax.models.loading import load_model
from ee_jax.serving.controller import ControllerConfig
from ee_jax.serving.llm import LLM
from ee_jax.serving.params import greedy

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

EXIT = 2
N_NEW = 20


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=48, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
        max_position_embeddings=256, initializer_range=0.05, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).float().eval()
    folder = tmp_path_factory.mktemp("layerskip")
    model.save_pretrained(folder, safe_serialization=True)
    return model, folder


def test_layerskip_drafts_verified_equal_transformers_assistant_early_exit(hf_llama):
    model, folder = hf_llama
    prompts = [np.random.default_rng(s).integers(3, 128, n).tolist()
               for s, n in ((0, 7), (1, 19))]
    ec = ExitConfig(exit_layers=(EXIT,), force_exit_layer=EXIT).verified(3)
    llm = LLM(load_model(str(folder)), exit_config=ec, max_num_seqs=2, max_model_len=64,
              page_size=8, progress=False, exit_control=ControllerConfig(mode="exits"))
    outs = llm.generate(prompts, greedy(N_NEW), use_tqdm=False)
    for ids, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            ref = model.generate(torch.tensor([ids]), max_new_tokens=N_NEW, do_sample=False,
                                 assistant_early_exit=EXIT, num_assistant_tokens=3,
                                 num_assistant_tokens_schedule="constant")
        assert out.token_ids == ref[0, len(ids):].tolist()
    s = llm.engine.stats
    assert 0 < s.num_accepted <= s.num_drafted
