"""SmolLM2-135M-Instruct: ee-jax against transformers on the same GGUF weights (f32)."""

import dataclasses

import numpy as np
import pytest
import torch

from ee_jax.models import llama, registry
from ee_jax.models.exits.checkpoint import load_exit_heads
from ee_jax.serving.controller import ControllerConfig
from ee_jax.serving.llm import LLM
from ee_jax.serving.params import greedy
from tests.reference import dense_greedy

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

LONG_TEXT = (
    "The history of computing is a story of abstraction layered on abstraction. Early "
    "machines were programmed by rewiring panels; then came stored programs, assemblers, "
    "compilers and operating systems. In 1957 FORTRAN showed that a compiler could produce "
    "code nearly as fast as a careful human, and by 1972 C gave systems programmers a "
    "portable language close to the machine. Meanwhile, numerical analysts worried about "
    "rounding: IEEE 754, ratified in 1985, fixed the meaning of 0.1 + 0.2 on every chip.\n\n"
    "def fibonacci(n: int) -> int:\n    a, b = 0, 1\n    for _ in range(n):\n"
    "        a, b = b, a + b\n    return a\n\n"
    "Transformers process sequences with attention; rotary position embeddings rotate "
    "query and key vectors by an angle proportional to the position, so that their dot "
    "product depends only on the relative offset. A bug in the rotation often hides on "
    "short prompts and shows only hundreds of tokens in, which is why this test uses a long "
    "one. Caches of keys and values make decoding linear in the sequence length, and paging "
    "those caches, as virtual memory pages a process, lets a server pack many sequences "
    "into one pool without fragmentation. Early-exit models add prediction heads at "
    "intermediate layers and stop when a head is confident. Serving them well is hard because "
    "a batch disagrees about when to exit, and skipped layers leave holes in the cache that "
    "later tokens attend to; filling those holes before the iteration ends keeps every "
    "later token's attention exact.")


def test_config_matches_the_published_architecture(smollm2):
    cfg = smollm2.config
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == \
        (30, 576, 9, 3, 64)
    assert cfg.tie_embeddings and cfg.vocab_size == 49152


def test_logits_match_transformers_on_a_long_prompt(smollm2, smollm2_hf):
    ids = smollm2.tokenizer.encode(LONG_TEXT)
    assert len(ids) >= 300, len(ids)
    ours = np.asarray(llama.forward(smollm2.params, np.asarray([ids]), smollm2.config))[0]
    with torch.no_grad():
        theirs = smollm2_hf(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(ours - theirs).max() <= 5e-3
    top2 = np.sort(theirs, axis=-1)[:, -2:]
    decisive = (top2[:, 1] - top2[:, 0]) > 1e-2
    assert decisive.mean() > 0.9
    np.testing.assert_array_equal(ours.argmax(-1)[decisive], theirs.argmax(-1)[decisive])


CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a concise assistant who answers in one line."},
     {"role": "user", "content": "Write a Python function that reverses a string."}],
    [{"role": "user", "content": "Name three primary colors."},
     {"role": "assistant", "content": "Red, yellow and blue."},
     {"role": "user", "content": "And the secondary colors, with how each is mixed?"}],
]


@pytest.fixture(scope="module")
def llm(smollm2):
    # one batch bucket: the tests here decode 1 to 3 rows, one decode program to compile
    return LLM(smollm2, max_num_seqs=4, max_model_len=512, page_size=16, progress=False,
               batch_buckets=(4,))


DENSE_NEW = 24  # tokens past the prompt the dense references decode


@pytest.fixture(scope="module")
def dense_refs(smollm2) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, greedy tokens) of the dense forward after CHATS[:2], past EOS: the truth
    full depth and verified exits are both held to (each forward re-run for every token:
    computed once for the file)."""
    tok = smollm2.tokenizer
    prompts = [tok.encode(tok.apply_chat_template(c)) for c in CHATS[:2]]
    width = -(-(max(map(len, prompts)) + DENSE_NEW) // 16) * 16
    return prompts, [dense_greedy(smollm2.config, smollm2.params, ids, DENSE_NEW, width=width)
                     for ids in prompts]


def test_engine_greedy_equals_transformers_generate(smollm2, smollm2_hf, llm):
    """32 greedy tokens after chat prompts of mixed lengths, batched in our engine, each
    against transformers' own generate() on the same ids."""
    tok = smollm2.tokenizer
    prompts = [tok.encode(tok.apply_chat_template(c)) for c in CHATS]
    outs = llm.generate(prompts, greedy(32), use_tqdm=False)
    for ids, out in zip(prompts, outs, strict=True):
        with torch.no_grad():  # stops at the model's EOS, as ours does
            ref = smollm2_hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                                      eos_token_id=list(tok.stop_token_ids))
        assert out.token_ids == ref[0, len(ids):].tolist()
    assert "Paris" in outs[0].text and outs[0].finish_reason == "stop"
    assert max(len(o.token_ids) for o in outs) == 32


def test_engine_greedy_equals_dense_forward(llm, dense_refs):
    """Past EOS too (ignore_eos), batched with a prompt of another length, against the dense
    forward (the engine against transformers: the test above)."""
    prompts, refs = dense_refs
    outs = llm.generate(prompts, greedy(DENSE_NEW, ignore_eos=True), use_tqdm=False)
    for ref, out in zip(refs, outs, strict=True):
        assert out.token_ids == ref


def test_stop_string_is_cut_from_the_text(llm):
    out = llm.chat(CHATS[0], greedy(32, stop=("Paris",)), use_tqdm=False)[0]
    assert out.finish_reason == "stop" and "Paris" not in out.text
    assert out.text.startswith("The capital of France is")


def test_verified_exits_emit_full_depths_tokens(smollm2, dense_refs):
    """The shipped heads as verified drafts (exits taken often: threshold 0.5, runs of 4),
    batch 2 of mixed lengths, 24 tokens past EOS, against the dense forward: equal, except
    where the dense forward's top two logits tie (within 1e-4: the ride-along's other
    batching may order them differently), counted; drafts were confirmed and rejected."""
    ec, heads = load_exit_heads(registry.shipped_exit_heads("smollm2-135m-instruct"),
                                smollm2.config)
    # one row stage (min_row_bucket = the batch): the CPU's stages for these GGUF blocks would
    # double an optimised compile of 30 layers; compaction under verified exits is
    # test_verified_exits'
    ec = dataclasses.replace(ec, threshold=0.5, policy="per_row", min_row_bucket=2).verified(4)
    llm = LLM(smollm2, exit_config=ec, exit_heads=heads, max_num_seqs=2, max_model_len=512,
              page_size=16, progress=False, exit_control=ControllerConfig(mode="exits"),
              batch_buckets=(2,))  # the batch this test decodes: one program set to compile
    prompts, refs = dense_refs
    outs = llm.generate(prompts, greedy(DENSE_NEW, ignore_eos=True), use_tqdm=False)
    s = llm.engine.stats
    assert 0 < s.num_accepted < s.num_drafted
    ties = 0
    for ids, ref, out in zip(prompts, refs, outs, strict=True):
        diff = next((i for i, (a, b) in enumerate(zip(out.token_ids, ref, strict=True))
                     if a != b), None)
        if diff is None:
            continue
        logits = np.asarray(llama.forward(
            smollm2.params, np.asarray([ids + ref[:diff]]), smollm2.config))[0, -1]
        top2 = np.sort(logits)[-2:]
        assert top2[1] - top2[0] < 1e-4, (diff, top2)
        ties += 1
    assert ties <= 1, ties
