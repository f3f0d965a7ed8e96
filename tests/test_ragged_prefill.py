"""Ragged prefill: prompt chunks packed on one token axis in query blocks, each row's last
token in its own slot (architecture.md section 5), against the dense no-cache reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ee_jax.models import llama
from ee_jax.serving.attention import AttentionMetadata
from ee_jax.serving.engine import EngineConfig, LLMEngine
from ee_jax.serving.model_runner import QUERY_BLOCK, StepShape, query_blocks
from ee_jax.serving.params import greedy
from ee_jax.serving.scheduler import SchedulerConfig
from ee_jax.serving.step import FullDepth, model_step
from ee_jax.testing import tiny_model
from tests.reference import dense_greedy, run_requests

CFG, PARAMS = tiny_model(seed=5, eos_token_ids=())
RNG = np.random.default_rng(3)
Q = QUERY_BLOCK
# Lengths around the block edges: one token (no block), exactly one block plus the row's own
# token, one more, several blocks, and short ones beside long ones.
LENGTHS = (1, 2, Q, Q + 1, Q + 2, 3 * Q + 5, 7, 90)
PROMPTS = [RNG.integers(3, CFG.vocab_size, n).tolist() for n in LENGTHS]
NEW = 6


def make_engine(**kw) -> LLMEngine:
    base = dict(max_num_seqs=8, max_model_len=160, page_size=4, num_pages=400,
                max_prefill_chunk=128, max_num_batched_tokens=512, batch_buckets=(1, 2, 4, 8))
    base.update(kw)
    return LLMEngine(CFG, PARAMS, None, EngineConfig.make(**base))


@pytest.fixture(scope="module")
def reference():
    return [dense_greedy(CFG, PARAMS, p, NEW, width=160) for p in PROMPTS]


@pytest.mark.parametrize("attention", ["reference", "xla"])
def test_batch_of_very_different_lengths_equals_dense(attention, reference):
    """Every prompt in one prefill step (one packed axis), then decode: the dense tokens."""
    engine = make_engine(attention=attention)
    outs = run_requests(engine, PROMPTS, greedy(NEW))
    assert [o.token_ids for o in outs] == reference
    prefill = [s for s in engine.runner.traces if s.kind == "prefill"]
    # one prefill step held every prompt: its packed axis is the blocks' bucket, not B x T
    blocks = sum(query_blocks(n) for n in LENGTHS)
    assert prefill == [StepShape(8, engine.scheduler.config.prefill_tokens(blocks),
                                 prefill[0].pages, kind="prefill")]
    assert prefill[0].tokens < len(PROMPTS) * max(LENGTHS)


def _dense_kv(prompt):
    """K/V [L, T, K, hd] each of the dense forward: kv_project of every layer's input."""
    tokens = jnp.asarray(prompt)[None]
    _, hidden = llama.forward(PARAMS, tokens, CFG, return_hidden=True)  # [L, 1, T, D]
    inputs = jnp.concatenate([llama.embed(PARAMS, tokens, CFG)[None], hidden[:-1]])[:, 0]
    pos = jnp.arange(len(prompt), dtype=jnp.int32)
    ks, vs = zip(*(llama.kv_project(llama.layer_params(PARAMS, i), inputs[i], pos, CFG)
                   for i in range(CFG.n_layers)), strict=True)
    return np.stack(ks), np.stack(vs)


@pytest.mark.parametrize("chunk", [128, 32])
def test_cache_after_prefill_equals_dense_kv(chunk):
    """After the prompt steps, every layer's cache holds the dense K/V at every position
    (chunk 32: the long prompts take several steps, later chunks start mid-sequence)."""
    engine = make_engine(max_prefill_chunk=chunk, async_scheduling=False)
    for i, p in enumerate(PROMPTS):  # short prompts decode (mixed steps) while long ones
        engine.add_request(f"r{i}", p, greedy(40))  # still prefill: none finishes first
    seqs = [engine._requests[f"r{i}"] for i in range(len(PROMPTS))]
    while any(s.num_computed < len(s.prompt_token_ids) for s in seqs):
        engine.step()
    assert engine.stats.num_decode_steps == 0
    S = engine.config.scheduler.page_size
    cache_k, cache_v = np.asarray(engine.runner.cache.k), np.asarray(engine.runner.cache.v)
    for seq, p in zip(seqs, PROMPTS, strict=True):
        table = np.asarray(engine.blocks.page_table(seq.seq_id))
        pos = np.arange(len(p))
        got_k = cache_k[:, table[pos // S], pos % S]  # [L, T, K, hd]
        got_v = cache_v[:, table[pos // S], pos % S]
        want_k, want_v = _dense_kv(p)
        np.testing.assert_allclose(got_k, want_k, rtol=2e-4, atol=2e-5)
        np.testing.assert_allclose(got_v, want_v, rtol=2e-4, atol=2e-5)


def test_chunked_prefill_and_decode_rows_beside_prompt_chunks(reference):
    """Prompts longer than max_prefill_chunk (continued mid-sequence), a small budget that
    splits a step's chunks, and decode rows riding in prefill steps (mixed steps)."""
    for kw in (dict(max_prefill_chunk=32, max_num_batched_tokens=48),
               dict(max_prefill_chunk=16, max_num_batched_tokens=40, mixed_steps=True),
               dict(max_prefill_chunk=2, max_num_batched_tokens=5)):
        engine = make_engine(**kw)
        outs = run_requests(engine, PROMPTS, greedy(NEW))
        assert [o.token_ids for o in outs] == reference, kw
        assert engine.blocks.num_used_pages == 0


def test_trace_count_bounded_over_many_prompt_lengths():
    """Prompts of every length 1..100 arriving in waves: each shape traces once, and every
    traced shape is one `step_shapes` lists (what precompile compiles)."""
    engine = make_engine(max_prefill_chunk=64, max_num_batched_tokens=128)
    rng = np.random.default_rng(9)
    lengths = rng.permutation(np.arange(1, 101))
    for wave in np.array_split(lengths, 8):
        prompts = [rng.integers(3, CFG.vocab_size, int(n)).tolist() for n in wave]
        outs = run_requests(engine, prompts, greedy(2))
        assert all(len(o.token_ids) == 2 for o in outs)
    traces = engine.runner.traces
    assert set(traces.values()) <= {0, 1}  # 0: an earlier engine's program had it
    assert set(traces) <= set(engine.scheduler.config.step_shapes())
    prefill = [s for s in traces if s.kind == "prefill"]
    assert len(prefill) <= 20, prefill  # buckets, not one program per length


def test_packed_write_slots_are_each_rows_slots():
    """The packed layout writes every real token where its row's page table puts it, and
    padding tokens, padding blocks and padding rows to the null page."""
    S, W = 4, 8
    table = np.array([[5, 6, 7, 8, 0, 0, 0, 0], [9, 3, 0, 0, 0, 0, 0, 0],
                      [0] * W], np.int32)
    # row 0: positions 2..12 (block of 10 + its own token 12); row 1: 0..2; row 2: padding
    block_pos = np.full((3, Q), 99, np.int32)
    block_pos[0, :10] = np.arange(2, 12)
    block_pos[0, 10:] = 13
    block_pos[1, :2] = [0, 1]
    block_pos[1, 2:] = 3
    meta = AttentionMetadata(jnp.asarray([[12], [2], [0]]), jnp.asarray(table),
                             jnp.asarray([13, 3, 0]), jnp.asarray(block_pos),
                             jnp.asarray([0, 1, -1]))
    pages, offsets = map(np.asarray, meta.write_slots(S))
    assert pages.shape == offsets.shape == (3 * Q + 3,)
    want = np.zeros(3 * Q + 3, np.int32)
    for j, p in enumerate(range(2, 12)):
        want[j] = table[0, p // S]
    want[Q:Q + 2] = table[1, 0]
    want[3 * Q:] = [table[0, 12 // S], table[1, 0], 0]
    np.testing.assert_array_equal(pages, want)
    real = want != 0
    np.testing.assert_array_equal(offsets[real], np.concatenate(
        [np.arange(2, 12), [0, 1], [12, 2]]) % S)
    assert meta.token_positions.shape == (3 * Q + 3,)


def test_bad_layouts_are_refused():
    with pytest.raises(ValueError, match="multiple of QUERY_BLOCK"):
        StepShape(2, Q + 1, 4, kind="prefill")
    with pytest.raises(ValueError, match="one token per row"):
        StepShape(2, 2, 4, kind="decode")
    cache = None
    meta = AttentionMetadata(jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32),
                             jnp.ones((1,), jnp.int32))
    with pytest.raises(ValueError, match="come together"):
        model_step(PARAMS, None, cache, jnp.zeros((1, 1), jnp.int32), meta,
                   jnp.zeros(1), CFG, FullDepth(), block_tokens=jnp.zeros(Q, jnp.int32))
    with pytest.raises(ValueError, match="one token per row"):
        model_step(PARAMS, None, cache, jnp.zeros((1, 2), jnp.int32), meta,
                   jnp.zeros(1), CFG, FullDepth())


def test_step_shapes_count_and_budget_bound():
    """The default config's program count stays small, and no prefill shape packs more
    tokens than the budget can fill (plus one block of padding per row)."""
    cfg = SchedulerConfig()
    shapes = cfg.step_shapes()
    assert len(shapes) <= 120  # 112: one prefill page width, rows padded to one per 64 tokens
    #                           (471 with every batch bucket and width; 666 before ragged)
    for s in shapes:
        if s.kind == "prefill":
            most = -(-cfg.max_num_batched_tokens // Q) + s.batch  # blocks, generously
            assert s.tokens <= 2 * Q * most


def test_prefill_logits_match_dense_at_every_row():
    """The step's sampled logits (each row's last token) equal the dense forward's, for rows
    of 1..40 tokens packed together (logprob of the greedy token as a scalar check)."""
    engine = make_engine(async_scheduling=False)
    lengths = (1, 5, Q, Q + 1, 40)
    prompts = [RNG.integers(3, CFG.vocab_size, n).tolist() for n in lengths]
    from ee_jax.serving.params import SamplingParams

    outs = run_requests(engine, prompts, SamplingParams(max_tokens=1, temperature=0.0,
                                                        logprobs=True))
    for p, o in zip(prompts, outs, strict=True):
        logits = llama.forward(PARAMS, jnp.asarray(p)[None], CFG)[0, -1]
        want = jax.nn.log_softmax(logits)
        assert o.token_ids == [int(jnp.argmax(logits))]
        np.testing.assert_allclose(o.logprobs[0], float(want[o.token_ids[0]]), rtol=1e-4,
                                   atol=1e-5)
