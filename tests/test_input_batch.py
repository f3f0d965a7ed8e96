"""The persistent batch (`input_batch.InputBatch`) against the per-row build from scratch.

Every step the engine prepares is also built from scratch (`build_from_scratch`: the requests
and the BlockManager alone, no slots) and the two are compared field by field; the engine
drives random arrivals, aborts, stops, page growth and preemption. With the tiny model the
tokens must also equal the dense reference and the blocking engine.
"""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ee_jax.serving.engine import EngineConfig, LLMEngine
from ee_jax.serving.input_batch import build_from_scratch
from ee_jax.serving.model_runner import StepBatch
from ee_jax.serving.params import SamplingParams
from ee_jax.testing import tiny_model
from tests.reference import dense_greedy

CFG, PARAMS = tiny_model(seed=3, eos_token_ids=(2,))


def assert_batches_equal(got: StepBatch, want: StepBatch) -> None:
    assert got.shape == want.shape
    for f in dataclasses.fields(StepBatch):
        if f.name != "shape":
            a, b = getattr(got, f.name), getattr(want, f.name)
            assert a.dtype == b.dtype, f.name
            np.testing.assert_array_equal(a, b, err_msg=f"StepBatch.{f.name}")


SEEN: dict[int, object] = {}  # every sequence a checked step scheduled (the test clears it)


def checked(engine: LLMEngine) -> list[str]:
    """Compare every step the engine prepares with the build from scratch; returns the list
    the kinds of the steps checked are appended to."""
    prepare, kinds, previous = engine.input_batch.prepare, [], []
    threshold = engine.exit_config.threshold if engine.exit_config else np.inf

    def prepare_and_check(schedule, *, latest_unread):
        if schedule.kind == "decode":  # a prompt token never runs in a (possibly exiting)
            for row in schedule.rows:  # decode step; its chunk waits for a prefill step
                assert row.start >= len(row.seq.prompt_token_ids) and row.seq.num_pending == 1
        SEEN.update({id(r.seq): r.seq for r in schedule.rows})
        want = build_from_scratch(schedule, engine.blocks, threshold, previous)
        got = prepare(schedule, latest_unread=latest_unread)
        previous.append(schedule)
        assert_batches_equal(got, want)
        kinds.append(schedule.kind)
        return got

    engine.input_batch.prepare = prepare_and_check
    return kinds


class FakeRunner:
    """Stands in for the model runner: a step's tokens are random (token 2, EOS, now and
    then), so the engine's host side — scheduler, pages, overlap, stops — runs for real and
    fast. Results are the runner's [B, 5] int32 layout."""

    def __init__(self, rng: np.random.Generator):
        self.rng = rng
        self.traces: dict = {}

    def step(self, batch: StepBatch) -> np.ndarray:
        self.traces[batch.shape] = 1
        B = batch.shape.batch
        out = np.zeros((B, 5), np.int32)
        out[:, 0] = np.where(self.rng.random(B) < 0.04, 2, self.rng.integers(3, 128, B))
        out[:, 2] = CFG.n_layers
        return out


def _random_params(rng: np.random.Generator) -> SamplingParams:
    kw = dict(max_tokens=int(rng.integers(1, 24)))
    if rng.random() < 0.3:
        kw.update(temperature=float(rng.uniform(0.1, 1.5)), seed=int(rng.integers(0, 99)),
                  top_k=int(rng.integers(0, 50)), top_p=float(rng.uniform(0.1, 1.0)))
    if rng.random() < 0.2:
        kw.update(exit_threshold=float(rng.uniform(0, 1)))
    if rng.random() < 0.15:  # teacher forcing: the host knows the tokens at launch
        kw.update(forced_tokens=tuple(int(t) for t in rng.integers(3, 128,
                                                                   rng.integers(1, 12))))
    if rng.random() < 0.2:
        kw.update(ignore_eos=True)
    return SamplingParams(**kw)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_persistent_batch_equals_build_from_scratch(seed):
    """Random arrivals, aborts, EOS stops, length limits, page growth and preemption (a small
    page pool), overlapped or blocking, mixed steps or not: every step's inputs equal the
    build from scratch, and every slot is free at the end."""
    rng = np.random.default_rng(seed)
    page = int(rng.choice([1, 2, 4, 8]))
    model_len = int(rng.integers(16, 64))
    pages_per_seq = -(-model_len // page)
    engine = LLMEngine(CFG, PARAMS, None, EngineConfig.make(
        max_num_seqs=int(rng.integers(1, 9)), max_model_len=model_len, page_size=page,
        num_pages=pages_per_seq + 1 + int(rng.integers(0, 3 * pages_per_seq)),
        max_prefill_chunk=int(rng.choice([1, 4, 16, 32])),
        max_num_batched_tokens=int(rng.integers(1, 64)), batch_buckets=(1, 2, 4, 8),
        async_scheduling=bool(rng.random() < 0.6), mixed_steps=bool(rng.random() < 0.6)))
    engine.runner = FakeRunner(rng)
    SEEN.clear()
    kinds = checked(engine)
    n_req = 0
    for _ in range(int(rng.integers(20, 120))):
        for _ in range(int(rng.poisson(0.5))):
            prompt = rng.integers(3, 128, int(rng.integers(1, model_len))).tolist()
            engine.add_request(f"r{n_req}", prompt, _random_params(rng))
            n_req += 1
        if engine._requests and rng.random() < 0.08:
            engine.abort_request(str(rng.choice(sorted(engine._requests))))
        engine.step()
    for _ in range(5000):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    assert not engine.has_unfinished_requests()
    assert len(kinds) == engine.stats.num_steps
    # Every preemption reaches a launched step's schedule (and the engine's count).
    assert engine.stats.num_preemptions == sum(
        s.metrics.num_preemptions for s in SEEN.values())
    assert len(engine.input_batch) == 0 and engine.input_batch._pages_held == 0
    assert engine.blocks.num_used_pages == 0


# --------------------------------------------------------------------------- tiny model

RNG = np.random.default_rng(0)
PROMPTS = [RNG.integers(3, CFG.vocab_size, n).tolist() for n in (5, 17, 1, 33, 9, 24)]
MAX_NEW = 10


def make_engine(**kw) -> LLMEngine:
    base = dict(max_num_seqs=4, max_model_len=64, page_size=4, num_pages=200,
                max_prefill_chunk=16, max_num_batched_tokens=32, batch_buckets=(1, 2, 4))
    base.update(kw)
    return LLMEngine(CFG, PARAMS, None, EngineConfig.make(**base))


def _drive(engine: LLMEngine, arrivals, abort_at) -> dict[str, tuple[list[int], str]]:
    """Step until done; requests arrive and are aborted at given step numbers."""
    done, step = {}, 0
    while step <= max(arrivals) or engine.has_unfinished_requests():
        for rid, prompt, sp in arrivals.get(step, []):
            engine.add_request(rid, prompt, sp)
        if step in abort_at and (out := engine.abort_request(abort_at[step])) is not None:
            done[out.request_id] = (out.token_ids, out.finish_reason)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (out.token_ids, out.finish_reason)
        step += 1
        assert step < 1000
    return done


@pytest.mark.parametrize("num_pages", [200, 17], ids=["roomy", "preempting"])
def test_engine_tokens_equal_dense_reference_and_blocking(num_pages):
    """Greedy tokens through the persistent batch equal the dense reference, overlapped and
    blocking, with an abort mid-run and (a pool of 16 pages of 4 for 4 sequences of up to 43
    tokens) preemption; every step's inputs equal the build from scratch."""
    g = dict(temperature=0.0, ignore_eos=True)
    arrivals = {0: [(f"r{i}", p, SamplingParams(max_tokens=MAX_NEW, **g))
                    for i, p in enumerate(PROMPTS[:3])],
                2: [("abort-me", PROMPTS[5], SamplingParams(max_tokens=30, **g)),
                    ("hot", PROMPTS[4], SamplingParams(max_tokens=8, temperature=0.9, seed=5,
                                                       ignore_eos=True))],
                4: [("late", PROMPTS[3], SamplingParams(max_tokens=MAX_NEW, **g))]}
    got = {}
    for overlapped in (True, False):
        engine = make_engine(num_pages=num_pages, async_scheduling=overlapped)
        kinds = checked(engine)
        got[overlapped] = _drive(engine, arrivals, abort_at={6: "abort-me"})
        assert "decode" in kinds and "prefill" in kinds
        assert (engine.stats.num_preemptions > 0) == (num_pages == 17)
        assert engine.blocks.num_used_pages == 0 and len(engine.input_batch) == 0
    for mode in got:
        assert got[mode].pop("abort-me")[1] == "abort"
    assert got[True] == got[False]
    for rid, prompt in [("r0", PROMPTS[0]), ("r1", PROMPTS[1]), ("r2", PROMPTS[2]),
                        ("late", PROMPTS[3])]:
        assert got[True][rid] == (dense_greedy(CFG, PARAMS, prompt, MAX_NEW), "length")


def test_trace_count_bounded():
    """Changing batches through the persistent batch compile each shape once, and the same
    workload again compiles nothing new."""
    engine = make_engine()

    def serve_waves(prefix: str) -> None:
        rng = np.random.default_rng(1)
        for wave in range(3):
            for i in range(int(rng.integers(1, 4))):
                prompt = rng.integers(3, CFG.vocab_size, int(rng.integers(1, 30))).tolist()
                engine.add_request(f"{prefix}{wave}-{i}", prompt, SamplingParams(
                    max_tokens=int(rng.integers(1, 12)), temperature=0.0))
            for _ in range(int(rng.integers(1, 8))):
                engine.step()
        while engine.has_unfinished_requests():
            engine.step()

    serve_waves("w")
    compiled = dict(engine.runner.traces)
    assert all(n <= 1 for n in compiled.values()), compiled
    serve_waves("again")  # the same arrivals again
    assert engine.runner.traces == compiled
