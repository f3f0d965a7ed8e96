"""The full-depth serving engine against the dense no-cache reference (tiny random model)."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ee_jax.serving.engine import EngineConfig, LLMEngine
from ee_jax.serving.params import InvalidRequestError, SamplingParams, greedy
from ee_jax.testing import tiny_model
from tests.reference import dense_greedy, run_requests

CFG, PARAMS = tiny_model(seed=3, eos_token_ids=())
RNG = np.random.default_rng(0)
PROMPTS = [RNG.integers(3, CFG.vocab_size, n).tolist() for n in (5, 17, 1, 33, 9, 24)]
MAX_NEW = 12


def make_engine(**kw) -> LLMEngine:
    base = dict(max_num_seqs=8, max_model_len=128, page_size=4, num_pages=200,
                max_prefill_chunk=16, max_num_batched_tokens=48, batch_buckets=(1, 2, 4, 8))
    base.update(kw)
    return LLMEngine(CFG, PARAMS, None, EngineConfig.make(**base))


_ids = itertools.count()


@pytest.fixture(scope="module")
def shared():
    """One engine for the tests that need no special configuration (compiles once)."""
    return make_engine()


run = run_requests


@pytest.fixture(scope="module")
def reference():
    return [dense_greedy(CFG, PARAMS, p, MAX_NEW) for p in PROMPTS]


def test_greedy_equals_dense_reference(reference, shared):
    # Chunked prefill (prompts up to 33 tokens, chunks of 16), mixed lengths, 4-token pages.
    outs = run(shared, PROMPTS, greedy(MAX_NEW))
    for out, ref in zip(outs, reference, strict=True):
        assert out.token_ids == ref
        assert out.finish_reason == "length"


def test_tiny_page_pool_forces_preemption_same_output(reference):
    # 3 usable pages of 4 beyond one full sequence: sequences must be preempted to progress.
    engine = make_engine(num_pages=34, max_model_len=128)
    outs = run(engine, PROMPTS, greedy(MAX_NEW))
    assert engine.stats.num_preemptions > 0
    assert [o.token_ids for o in outs] == reference
    assert engine.blocks.num_used_pages == 0
    engine.blocks.check_invariants()


def test_output_does_not_depend_on_batch_mates(reference, shared):
    alone = run(shared, [PROMPTS[3]], greedy(MAX_NEW))[0]
    crowd = run(shared, [PROMPTS[0], PROMPTS[3], PROMPTS[5], PROMPTS[1]],
                greedy(MAX_NEW))[1]
    assert alone.token_ids == crowd.token_ids == reference[3]


def test_one_sequence_in_two_row_steps_equals_the_reference(reference):
    """GPU's buckets (`scheduler.default_batch_buckets`: from 2 rows) on this CPU: one
    running sequence at a time, every step padded to two rows, tokens as the reference's."""
    engine = make_engine(max_num_seqs=1, batch_buckets=(2, 4))
    outs = run(engine, PROMPTS[:3], greedy(MAX_NEW))
    assert [o.token_ids for o in outs] == reference[:3]
    assert {s.batch for s in engine.runner.traces} == {2}


def test_seeded_sampling_reproducible_across_batches(shared):
    sp = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, top_k=20, seed=1234)
    a = run(shared, [PROMPTS[2]], sp)[0]
    b = run(shared, [PROMPTS[4], PROMPTS[2]], [greedy(8), sp])[1]
    assert a.token_ids == b.token_ids


def test_trace_count_bounded_over_long_run(shared):
    engine = shared
    rng = np.random.default_rng(1)
    for wave in range(4):  # requests arrive between steps, batches keep changing
        for i in range(int(rng.integers(1, 6))):
            n = int(rng.integers(1, 40))
            engine.add_request(f"w{wave}-{i}", rng.integers(3, CFG.vocab_size, n).tolist(),
                               greedy(int(rng.integers(1, 20))))
        for _ in range(int(rng.integers(1, 15))):
            engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    compiled = engine.num_compiled_programs
    assert all(n <= 1 for n in engine.runner.traces.values()), engine.runner.traces
    # The same workload again compiles nothing new.
    for i, n in enumerate((3, 17, 38, 1, 9)):
        engine.add_request(f"again-{i}", rng.integers(3, CFG.vocab_size, n).tolist(), greedy(9))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.num_compiled_programs <= compiled + 3
    assert all(n <= 1 for n in engine.runner.traces.values())


def test_stop_token_and_max_model_len(reference, shared):
    stop_at = reference[0][4]
    out = run(shared, [PROMPTS[0]], greedy(MAX_NEW, stop_token_ids=(stop_at,)))[0]
    first = reference[0].index(stop_at)
    assert out.token_ids == reference[0][:first + 1] and out.finish_reason == "stop"
    # max_model_len caps prompt + output.
    out = run(make_engine(max_model_len=20), [PROMPTS[1]], greedy(50))[0]
    assert len(PROMPTS[1]) + len(out.token_ids) == 20 and out.finish_reason == "length"


@pytest.mark.parametrize("prompt, params, match", [
    ([], greedy(4), "empty"),
    ([5] * 200, greedy(4), "max_model_len"),
    ([5, CFG.vocab_size + 3], greedy(4), "outside the vocabulary"),
    ([5, -1], greedy(4), "outside the vocabulary"),
])
def test_bad_requests_rejected_others_carry_on(prompt, params, match, reference, shared):
    engine = shared
    rid = f"good{next(_ids)}"
    engine.add_request(rid, PROMPTS[0], greedy(MAX_NEW))
    with pytest.raises(InvalidRequestError, match=match):
        engine.add_request(f"bad{next(_ids)}", prompt, params)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in outs] == [rid] and outs[0].token_ids == reference[0]


@pytest.mark.parametrize("kw, match", [
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=-3), "max_tokens"),
    (dict(temperature=-0.5), "temperature"), (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
])
def test_bad_sampling_params(kw, match):
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(**kw)


def test_abort_frees_pages(shared):
    engine = shared
    engine.add_request("a", PROMPTS[3], greedy(50))
    engine.add_request("b", PROMPTS[1], greedy(5))
    for _ in range(4):
        engine.step()
    out = engine.abort_request("a")
    assert out.finish_reason == "abort"
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.blocks.num_used_pages == 0


def _dense_next_tokens(prompt, continuation):
    """Greedy next token after every prefix prompt + continuation[:i], by the dense model."""
    from tests.reference import _dense_logits_fn

    seq = list(prompt) + list(continuation)
    buf = np.zeros((1, 128), np.int32)
    buf[0, :len(seq)] = seq
    logits = np.asarray(_dense_logits_fn(CFG, 128)(PARAMS, buf))
    return [int(np.argmax(logits[len(prompt) - 1 + i])) for i in range(len(continuation))]


def test_teacher_forcing_feeds_given_tokens_and_reports_predictions(shared):
    # Forced continuations the model would never choose: the engine must follow them, and
    # each prediction must be the dense model's greedy token after the same forced prefix.
    forced = [RNG.integers(3, CFG.vocab_size, n).tolist() for n in (7, 3)]
    prompts = PROMPTS[:2]
    outs = run(shared, prompts, [greedy(50, forced_tokens=f) for f in forced])
    for out, p, f in zip(outs, prompts, forced, strict=True):
        assert out.token_ids == f
        assert out.finish_reason == "length"
        assert out.predicted_token_ids == _dense_next_tokens(p, f)


def test_forced_tokens_outside_vocabulary_are_refused(shared):
    with pytest.raises(InvalidRequestError, match="forced_tokens"):
        shared.add_request("bad-forced", [5, 6], greedy(4, forced_tokens=(3, CFG.vocab_size)))


# --------------------------------------------------------------------------- overlapped steps


def _drive(engine: LLMEngine, arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]],
           abort_at: dict[int, str]) -> dict[str, tuple[list[int], str | None, str]]:
    """Step until done; requests arrive and are aborted at given step numbers."""
    done: dict[str, tuple[list[int], str | None, str]] = {}
    step = 0
    while step <= max(arrivals) or engine.has_unfinished_requests():
        for rid, prompt, sp in arrivals.get(step, []):
            engine.add_request(rid, prompt, sp)
        if step in abort_at:
            out = engine.abort_request(abort_at[step])
            if out is not None:
                done[out.request_id] = (out.token_ids, out.finish_reason, out.text)
        for out in engine.step():
            assert min(out.token_ids, default=0) >= 0  # no token the host has not read
            assert len(out.token_ids) == len(out.exit_layers)
            if out.finished:
                done[out.request_id] = (out.token_ids, out.finish_reason, out.text)
        step += 1
        assert step < 500
    return done


def test_overlapped_engine_equals_blocking_engine():
    """Steps launched before the previous step's tokens are read give the same tokens, stop
    at the same token (stop ids, length, max_model_len), survive aborts and preemption, and
    leave no page behind — a long prompt arriving mid-run changes nothing for the others."""
    rng = np.random.default_rng(7)
    stop_tok = int(dense_greedy(CFG, PARAMS, PROMPTS[1], 4)[3])  # request 1 stops there
    arrivals = {
        0: [(f"r{i}", p, SamplingParams(max_tokens=MAX_NEW, temperature=0.0))
            for i, p in enumerate(PROMPTS[:3])],
        2: [("stop", PROMPTS[1], SamplingParams(max_tokens=20, temperature=0.0,
                                                stop_token_ids=(stop_tok,))),
            ("hot", PROMPTS[4], SamplingParams(max_tokens=9, temperature=0.9, seed=5))],
        5: [("long", rng.integers(3, CFG.vocab_size, 70).tolist(),
             SamplingParams(max_tokens=6, temperature=0.0)),
            ("abort-me", PROMPTS[5], SamplingParams(max_tokens=30, temperature=0.0))],
        9: [("edge", PROMPTS[3], SamplingParams(max_tokens=200, temperature=0.0))],
    }
    results = {}
    for mode in (False, True):
        engine = make_engine(async_scheduling=mode, num_pages=60, max_model_len=96)
        results[mode] = _drive(engine, arrivals, abort_at={8: "abort-me"})
        assert engine.blocks.num_used_pages == 0
        engine.blocks.check_invariants()
        assert not engine.has_unfinished_requests()
    # An abort lands at a driver step: overlapped steps have read one token fewer by then
    # (outputs come one step() later), so the aborted request may hold one token fewer.
    aborted = {mode: results[mode].pop("abort-me") for mode in results}
    assert results[True] == results[False]
    (early, why_early, _), (late, why_late, _) = aborted[True], aborted[False]
    assert why_early == why_late == "abort"
    assert late[:len(early)] == early and len(late) - len(early) <= 1
    got = results[True]
    assert got["stop"][1] == "stop" and got["stop"][0][-1] == stop_tok
    assert got["edge"][1] == "length" and len(PROMPTS[3]) + len(got["edge"][0]) == 96
    assert got["r0"][0] == dense_greedy(CFG, PARAMS, PROMPTS[0], MAX_NEW)


@pytest.mark.parametrize("kw", [dict(max_prefill_chunk=1), dict(max_prefill_chunk=1,
                                                                  max_num_batched_tokens=1),
                                dict(page_size=1, num_pages=400)])
def test_extreme_knobs_work_at_full_depth(kw, reference):
    """Prompt chunks of one token are prefill steps (full depth), never decode steps."""
    engine = make_engine(**kw)
    outs = run(engine, PROMPTS[:3], greedy(MAX_NEW))
    assert [o.token_ids for o in outs] == reference[:3]
    assert engine.blocks.num_used_pages == 0


def test_precompile_covers_every_shape_a_run_meets():
    """After `precompile`, a mixed run (chunked prompts, several batch sizes, growing pages)
    traces and compiles nothing new."""
    import jax

    engine = make_engine(max_num_seqs=2, max_model_len=32, batch_buckets=(1, 2), page_size=8,
                         max_num_batched_tokens=16)
    n = engine.precompile(progress=False)
    assert n == len(engine.runner.traces) == len(engine.scheduler.config.step_shapes())
    traced = dict(engine.runner.traces)
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, _secs, **kw: compiles.append(event)
        if event == "/jax/core/compile/backend_compile_duration" else None)
    outs = run(engine, [p[:20] for p in PROMPTS], greedy(8))  # chunks of 16 and of 4
    assert all(o.finish_reason == "length" and len(o.token_ids) == 8 for o in outs)
    assert engine.runner.traces == traced
    assert compiles == []


# Prefill shape policies: the default (rows padded to one per 64 packed tokens, one page-table
# width), every batch bucket with power-of-two widths (the policy before it), and odd ones.
PREFILL_POLICIES = [{}, dict(prefill_row_tokens=None, prefill_page_buckets=(4, 8, 16, 32, 64)),
                    dict(prefill_row_tokens=1, prefill_page_buckets=(1, 3, 50)),
                    dict(prefill_row_tokens=40)]


@settings(max_examples=60, deadline=None)
@given(seqs=st.integers(1, 9), model_len=st.integers(8, 200), page=st.sampled_from([1, 4, 16]),
       chunk=st.sampled_from([1, 4, 16, 32, 64]), budget=st.integers(1, 100),
       policy=st.sampled_from(range(len(PREFILL_POLICIES))))
def test_step_shapes_are_exactly_the_reachable_shapes(seqs, model_len, page, chunk, budget,
                                                      policy):
    _check_step_shapes(seqs, model_len, page, chunk, budget, **PREFILL_POLICIES[policy])


@pytest.mark.parametrize("policy", PREFILL_POLICIES[:2])
def test_step_shapes_exact_with_packed_steps_over_1024_tokens(policy):
    """Large budgets: packed steps past 1,024 tokens take the finer buckets."""
    _check_step_shapes(seqs=3, model_len=520, page=16, chunk=512, budget=1400, **policy)


def test_default_prefill_shapes_are_few():
    """The default config's prefill steps take one page-table width and a batch bucket of at
    least one row per 64 packed tokens: 46 programs (405 with every batch bucket and
    power-of-two widths), each prefill step padded by at most ~8% of its tokens in rows."""
    from ee_jax.serving.scheduler import SchedulerConfig

    cfg = SchedulerConfig()
    prefill = cfg.step_shapes(("prefill",))
    assert {s.pages for s in prefill} == {cfg.pages_per_seq}
    assert all(s.batch >= min(32, s.tokens // 64) for s in prefill)
    assert len(prefill) == 46
    assert len(cfg.step_shapes(("decode",))) == 66
    old = SchedulerConfig(prefill_row_tokens=None, prefill_page_buckets=(4, 8, 16, 32, 64))
    assert len(old.step_shapes(("prefill",))) == 405


def _check_step_shapes(seqs, model_len, page, chunk, budget, **policy):
    """`step_shapes` (what precompile compiles) equals a brute-force walk over every batch the
    scheduler can form: r rows, each with some query blocks (a chunk of n tokens takes
    ceil((n - 1) / QUERY_BLOCK); the fewest tokens for b >= 1 blocks are (b - 1) Q + 2, and
    longer chunks only shrink what is reachable), the rows' chunks within the token budget,
    and the furthest position reached from the longest chunk to max_model_len."""
    from ee_jax.serving.model_runner import QUERY_BLOCK, StepShape, query_blocks
    from ee_jax.serving.scheduler import SchedulerConfig

    cfg = SchedulerConfig(max_num_seqs=seqs, max_model_len=model_len, page_size=page,
                          max_prefill_chunk=chunk, max_num_batched_tokens=budget,
                          batch_buckets=(1, 2, 4, 8, 16), **policy)
    want = {StepShape(cfg.batch_bucket(r), 1, cfg.page_bucket(end), kind="decode")
            for r in range(1, seqs + 1) for end in range(1, model_len + 1)}
    longest_chunk = min(chunk, budget)

    def fewest_tokens(b):
        return (b - 1) * QUERY_BLOCK + 2 if b else 1

    for r in range(1, seqs + 1):
        for blocks in itertools.combinations_with_replacement(
                range(query_blocks(longest_chunk) + 1), r):
            n = [fewest_tokens(b) for b in blocks]
            assert all(query_blocks(x) == b for x, b in zip(n, blocks, strict=True))
            if sum(n) > budget or max(n) > longest_chunk:
                continue
            tokens = cfg.prefill_tokens(sum(blocks))
            want |= {StepShape(cfg.prefill_batch(r, tokens), tokens,
                               cfg.page_bucket(end, "prefill"), kind="prefill")
                     for end in range(max(n), model_len + 1)}
    assert set(cfg.step_shapes()) == want


@pytest.mark.parametrize("overlapped", [True, False])
def test_mixed_steps_equal_separate_steps(overlapped):
    """Decode rows riding along in prefill steps (at full depth) give the tokens of separate
    steps, greedy and seeded; a long prompt arriving mid-run no longer stalls the others."""
    rng = np.random.default_rng(11)
    arrivals = {0: [(f"a{i}", p, SamplingParams(max_tokens=10, temperature=0.0))
                    for i, p in enumerate(PROMPTS[:3])],
                3: [("long", rng.integers(3, CFG.vocab_size, 60).tolist(),
                     SamplingParams(max_tokens=5, temperature=0.0)),
                    ("seeded", PROMPTS[4], SamplingParams(max_tokens=8, temperature=0.8,
                                                          seed=3))],
                6: [("late", PROMPTS[5], SamplingParams(max_tokens=6, temperature=0.0))]}
    got = {}
    for mixed in (False, True):
        engine = make_engine(mixed_steps=mixed, async_scheduling=overlapped)
        got[mixed] = _drive(engine, arrivals, abort_at={})
        assert engine.blocks.num_used_pages == 0
        assert (engine.stats.num_mixed_steps > 0) == mixed
    assert got[True] == got[False]
    assert got[True]["a0"][0] == dense_greedy(CFG, PARAMS, PROMPTS[0], 10)
