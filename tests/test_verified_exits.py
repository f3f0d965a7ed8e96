"""Verified exits (ExitConfig.verify, docs/early_exit.md): exit-head drafts checked by the
layers they skipped; the output is exactly full depth's.

Truths: the dense full-depth forward (greedy tokens, and every K/V an accepted position holds
in the cache), and the full-depth engine's seeded samples (its sampler is tested in
test_sampling.py; a verified row samples every position with the same key, so equal seeds
must give equal tokens). Exit patterns vary by per-request thresholds (a runtime input: one
compiled program per engine serves them all) and by `max_draft` (one engine each).
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ee_jax.models import llama
from ee_jax.models.exits import heads as exit_heads
from ee_jax.models.exits.config import NEVER, ExitConfig, ExitConfigError
from ee_jax.models.exits.cost import CostModel, verified_sequence_speedup, verified_speedup
from ee_jax.serving.controller import ControllerConfig, exit_predictor
from ee_jax.serving.engine import EngineConfig, LLMEngine
from ee_jax.serving.kv_cache import gather_layer
from ee_jax.serving.params import SamplingParams
from ee_jax.serving.server import protocol
from ee_jax.testing import tiny_config
from tests.reference import dense_greedy, run_requests

CFG = tiny_config(eos_token_ids=())  # 4 layers, vocab 128
# small init scale: the exits' greedy tokens often agree with the last layer's (drafts are
# accepted as well as rejected, runs of every length occur)
PARAMS = llama.init_params(CFG, jax.random.PRNGKey(5), scale=0.1)
L = CFG.n_layers
EXIT_LAYERS = (1, 2, 3)
RNG = np.random.default_rng(11)
PROMPTS = [RNG.integers(3, CFG.vocab_size, n).tolist() for n in (5, 23, 1, 12)]
MAX_NEW = 14


def _ec(policy: str, max_draft: int, **kw) -> ExitConfig:
    return ExitConfig(exit_layers=EXIT_LAYERS, threshold=0.0, policy=policy,
                      **kw).verified(max_draft)


def _heads(ec, noise: float):
    """Norm heads: the final norm (LayerSkip's shared head), perturbed by `noise`."""
    heads = exit_heads.init_heads(CFG, ec, PARAMS)
    eps = jax.random.normal(jax.random.PRNGKey(3), heads.norm.shape)
    return heads.replace(norm=heads.norm * (1 + noise * eps))


def _engine(ec=None, heads=None, **kw) -> LLMEngine:
    # one batch bucket: a lone request runs padded to 4 rows (padding rows attend to no key;
    # no step has code of its own for one row), so each engine compiles one program a kind
    base = dict(max_num_seqs=4, max_model_len=64, page_size=8, num_pages=40,
                max_prefill_chunk=32, max_num_batched_tokens=128, batch_buckets=(4,),
                attention="reference", exit_control=ControllerConfig(mode="exits"))
    base.update(kw)
    return LLMEngine(CFG, PARAMS, None, EngineConfig.make(**base), ec, heads)


# (policy, max_draft, head noise, min_row_bucket): batch-wide and per-row exits, runs of 1,
# 3 and 8; per_row-3's rows compacted into buckets 4, 2, 1 (the CPU runner's default),
# per_row-1's in one stage (as on accelerators; each stage is another layer loop to compile)
CONFIGS = {"per_row-3": ("per_row", 3, 0.0, None), "all-8": ("all", 8, 0.0, None),
           "per_row-1": ("per_row", 1, 0.3, 4)}


@pytest.fixture(scope="module")
def engines():
    out = {}
    for name, (policy, max_draft, noise, min_rows) in CONFIGS.items():
        ec = _ec(policy, max_draft, min_row_bucket=min_rows)
        out[name] = _engine(ec, _heads(ec, noise))
    return out


@pytest.fixture(scope="module")
def full_engine():
    return _engine()


@pytest.fixture(scope="module")
def dense():
    return [dense_greedy(CFG, PARAMS, p, MAX_NEW) for p in PROMPTS]


# --------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_equals_full_depth_with_drafts_kept_and_dropped(engines, dense, name):
    """Batch 4 (prompts of 1-23 tokens, rows drafting and verifying at different steps) and
    batch 1: tokens equal the dense forward's; drafts were both confirmed and rejected."""
    eng = engines[name]
    before = dataclasses.replace(eng.stats)
    outs = run_requests(eng, PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_NEW))
    assert [o.token_ids for o in outs] == dense
    assert all(o.finish_reason == "length" for o in outs)
    drafted = eng.stats.num_drafted - before.num_drafted
    accepted = eng.stats.num_accepted - before.num_accepted
    assert 0 < accepted < drafted, (accepted, drafted)
    assert sum(o.metrics.num_drafted for o in outs) == drafted
    # every emitted token counted once, in the request's exit layers too
    assert all(len(o.exit_layers) == len(o.token_ids) == len(o.logprobs or o.token_ids)
               for o in outs)
    one = run_requests(eng, PROMPTS[1:2], SamplingParams(temperature=0, max_tokens=MAX_NEW))
    assert one[0].token_ids == dense[1]


@settings(max_examples=6, deadline=None, derandomize=True)
@given(thresholds=st.lists(st.sampled_from([0.0, 0.05, 0.2, 0.5, 0.9, NEVER]),
                           min_size=4, max_size=4),
       max_tokens=st.lists(st.integers(1, MAX_NEW), min_size=4, max_size=4),
       name=st.sampled_from(list(CONFIGS)))
def test_any_exit_pattern_is_lossless(engines, dense, thresholds, max_tokens, name):
    """Per-request thresholds (from 'every token drafts' to 'never') and length limits that
    fall inside runs: every request's tokens are the dense forward's prefix."""
    params = [SamplingParams(temperature=0, max_tokens=n, exit_threshold=t)
              for t, n in zip(thresholds, max_tokens, strict=True)]
    outs = run_requests(engines[name], PROMPTS, params)
    for o, ref, n in zip(outs, dense, max_tokens, strict=True):
        assert o.token_ids == ref[:n]


def test_cache_holds_full_depths_kv_at_every_confirmed_position(engines):
    """Mid-generation (runs in flight), the K/V at every position before the row's first
    unconfirmed token equal the dense forward's in every layer."""
    eng = engines["per_row-3"]
    eng.add_request("kv", PROMPTS[0], SamplingParams(temperature=0, max_tokens=MAX_NEW))
    seq = eng._requests["kv"]
    seen_drafts = False
    for _ in range(9):
        eng.step()
        seen_drafts |= seq.num_draft > 0
    assert seen_drafts and not seq.finished
    tokens = seq.prompt_token_ids + seq.output_token_ids
    n = len(tokens) - seq.num_draft - 1  # positions whose K/V are confirmed and complete
    hidden = llama.forward(PARAMS, jnp.asarray([tokens]), CFG, return_hidden=True)[1]
    inputs = [llama.embed(PARAMS, jnp.asarray([tokens]), CFG)] + [hidden[j] for j in range(L - 1)]
    pos = jnp.arange(len(tokens), dtype=jnp.int32)[None]
    table = jnp.asarray([eng.blocks.page_table(seq.seq_id)], jnp.int32)
    for j in range(L):
        k_ref, v_ref = llama.kv_project(llama.layer_params(PARAMS, j), inputs[j], pos, CFG)
        k, v = gather_layer(eng.runner.cache, j, table)
        np.testing.assert_allclose(np.asarray(k[0, :n]), np.asarray(k_ref[0, :n]), atol=2e-5)
        np.testing.assert_allclose(np.asarray(v[0, :n]), np.asarray(v_ref[0, :n]), atol=2e-5)
    eng.abort_request("kv")


# --------------------------------------------------------------------------- sampling


@pytest.mark.parametrize("name", ["per_row-3", "all-8"])
def test_seeded_samples_equal_full_depths(engines, full_engine, name):
    """Temperature, top-k and top-p with seeds: the verified engine emits exactly the
    full-depth engine's samples (same key per position), so the distribution is the full
    model's; a seeded request repeats whatever shares its batch (alone vs in a batch of 4
    under the batch-wide rule, where the others decide when it drafts)."""
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, seed=s, max_tokens=MAX_NEW)
              for t, k, p, s in ((0.8, 0, 1.0, 1), (1.0, 20, 1.0, 2), (1.2, 0, 0.9, 3),
                                 (0.6, 5, 0.8, 4))]
    ref = run_requests(full_engine, PROMPTS, params)
    eng = engines[name]
    before = eng.stats.num_accepted
    outs = run_requests(eng, PROMPTS, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert eng.stats.num_accepted > before
    alone = run_requests(eng, PROMPTS[2:3], params[2])
    assert alone[0].token_ids == ref[2].token_ids


# --------------------------------------------------------------------------- rejection sampling


DRAFT_EXIT = 3


@pytest.fixture(scope="module")
def rejection_engine():
    """Standard speculative sampling (verify_sampling "rejection"); every token drafts at exit
    3 (threshold 0; its top-4 overlaps the last layer's enough that drafts are kept as well
    as replaced), runs of 2, so almost every token after the prefill's is a checked draft.
    One row stage a bucket (rows leave together at the one exit: stages would only add
    loops to compile)."""
    ec = ExitConfig(exit_layers=(DRAFT_EXIT,), threshold=0.0, policy="per_row",
                    verify_sampling="rejection", min_row_bucket=16).verified(2)
    return _engine(ec, _heads(ec, 0.0), max_num_seqs=16, batch_buckets=(1, 4, 16),
                   num_pages=160, max_num_batched_tokens=512)


def test_rejection_greedy_equals_full_depth(rejection_engine, dense):
    outs = run_requests(rejection_engine, PROMPTS,
                        SamplingParams(temperature=0, max_tokens=MAX_NEW))
    assert [o.token_ids for o in outs] == dense


def _first_tokens_distribution(prompt: list[int], n: int, k: int, exit_layer: int | None):
    """The exact distribution of the first n sampled tokens (temperature 1, top-k k) [k**n
    sequences -> probability], each token drawn from the full model (exit_layer None) or,
    after the first, from the norm head at `exit_layer` (what the drafts are drawn from):
    dense forwards, no cache, no engine."""
    fwd = jax.jit(lambda toks: llama.forward(PARAMS, toks, CFG, return_hidden=True))
    probs = {(): 1.0}
    for i in range(n):
        seqs = list(probs)
        toks = jnp.asarray([prompt + list(s) for s in seqs], jnp.int32)
        logits, hidden = fwd(toks)
        if i > 0 and exit_layer is not None:
            logits = llama.final_head(PARAMS, hidden[exit_layer - 1], CFG)
        last = np.asarray(logits[:, -1], np.float64)  # [S, V]
        nxt = {}
        for s, row in zip(seqs, last, strict=True):
            top = np.argsort(-row)[:k]
            w = np.exp(row[top] - row[top].max())
            for t, pt in zip(top, w / w.sum(), strict=True):
                nxt[(*s, int(t))] = probs[s] * pt
        probs = nxt
    return probs


def _chi_square(counts: dict, probs: dict, n: int) -> tuple[float, int]:
    """Pearson's statistic of `counts` (n samples) against `probs`, cells with an expected
    count under 5 pooled into one; returns (statistic, degrees of freedom)."""
    stat, pool_obs, pool_exp, cells = 0.0, 0, 0.0, 0
    for seq, p in probs.items():
        obs, exp = counts.get(seq, 0), n * p
        if exp < 5:
            pool_obs, pool_exp = pool_obs + obs, pool_exp + exp
            continue
        stat, cells = stat + (obs - exp) ** 2 / exp, cells + 1
    outside = n - sum(counts.get(s, 0) for s in probs)  # sequences the truth calls impossible
    assert outside == 0, f"{outside} samples outside the full model's top-k support"
    if pool_exp > 0:
        stat, cells = stat + (pool_obs - pool_exp) ** 2 / pool_exp, cells + 1
    return stat, cells - 1


def _chi_square_critical(df: int, z: float = 3.09) -> float:
    """The chi-square quantile at a normal quantile z (3.09: false-alarm rate 1e-3), by
    Wilson and Hilferty's cube-root approximation (within a few % for df >= 3)."""
    a = 2 / (9 * df)
    return df * (1 - a + z * np.sqrt(a)) ** 3


def test_rejection_sampling_has_the_full_models_distribution(rejection_engine):
    """The first three tokens (the first from the prefill, then checked drafts) of 1504
    seeded requests at temperature 1, top-k 4: their joint frequencies fit the full model's
    exact distribution (Pearson's chi-square, false-alarm rate 1e-3; the seeds are fixed, so
    the outcome is too), and do not fit the drafts' own (the exit head's), so the test can
    tell the two apart; drafts were both kept and replaced."""
    n, k, prompt = 1504, 4, PROMPTS[0]
    params = [SamplingParams(temperature=1.0, top_k=k, seed=s, max_tokens=4) for s in range(n)]
    eng = rejection_engine
    before = dataclasses.replace(eng.stats)
    # in waves of a full batch: a decode row drafts only in pure decode steps, not beside
    # another request's prefill
    outs = [o for i in range(0, n, 16) for o in run_requests(eng, [prompt] * 16,
                                                             params[i:i + 16])]
    drafted = eng.stats.num_drafted - before.num_drafted
    accepted = eng.stats.num_accepted - before.num_accepted
    assert n < drafted and 0.05 * drafted < accepted < 0.95 * drafted, (accepted, drafted)
    counts: dict = {}
    for o in outs:
        key = tuple(o.token_ids[:3])
        counts[key] = counts.get(key, 0) + 1
    full = _first_tokens_distribution(prompt, 3, k, None)
    stat, df = _chi_square(counts, full, n)
    assert stat < _chi_square_critical(df), (stat, df)
    drafts = _first_tokens_distribution(prompt, 3, k, DRAFT_EXIT)
    drafts = {s: drafts.get(s, 0.0) for s in set(drafts) | set(counts)}
    stat_q, df_q = _chi_square({s: c for s, c in counts.items() if drafts[s] > 0},
                               {s: p for s, p in drafts.items() if p > 0},
                               sum(c for s, c in counts.items() if drafts[s] > 0))
    assert stat_q > _chi_square_critical(df_q), (stat_q, df_q)


def test_rejection_seeded_request_repeats_whatever_shares_its_batch(rejection_engine):
    """Per-row drafts fall where the row's own confidence puts them, so a seeded request's
    checks, and its tokens, are the same alone and in a batch of 4."""
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, seed=s, max_tokens=MAX_NEW)
              for t, k, p, s in ((0.8, 0, 1.0, 1), (1.0, 20, 1.0, 2), (1.2, 0, 0.9, 3),
                                 (0.6, 5, 0.8, 4))]
    batch = run_requests(rejection_engine, PROMPTS, params)
    for i in (0, 2):
        alone = run_requests(rejection_engine, PROMPTS[i:i + 1], params[i])
        assert alone[0].token_ids == batch[i].token_ids


# --------------------------------------------------------------------------- the engine around


def test_stream_shows_only_confirmed_tokens_and_stops_inside_runs(engines, dense):
    """Every streamed output's tokens are a prefix of the final ones (no rejected draft is
    ever shown); a stop token met inside a run ends the request there, as full depth."""
    eng = engines["all-8"]
    stop = dense[0][5]
    eng.add_request("s", PROMPTS[0], SamplingParams(temperature=0, max_tokens=MAX_NEW,
                                                    stop_token_ids=(stop,)))
    eng.add_request("t", PROMPTS[1], SamplingParams(temperature=0, max_tokens=MAX_NEW))
    streamed = {"s": [], "t": []}
    finals = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            streamed[o.request_id].append(list(o.token_ids))
            if o.finished:
                finals[o.request_id] = o
    assert finals["s"].token_ids == dense[0][:dense[0].index(stop) + 1]
    assert finals["s"].finish_reason == "stop"
    assert finals["t"].token_ids == dense[1]
    for rid, seen in streamed.items():
        final = finals[rid].token_ids
        assert all(final[:len(s)] == s for s in seen)
        assert all(len(a) <= len(b) for a, b in itertools.pairwise(seen))


def test_preemption_aborts_and_mixed_steps_keep_the_output(dense):
    """A pool too small for every row (the newest is preempted, its drafts dropped and its
    confirmed tokens recomputed), requests arriving mid-run (prefill steps beside drafting
    rows) and an abort among them: every finished request's tokens are full depth's. One
    row stage (a program of its own: the pool's size is in its shapes)."""
    ec = _ec("per_row", 3, min_row_bucket=4)
    eng = _engine(ec, _heads(ec, 0.0), num_pages=11)
    sp = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    eng.add_request("a0", PROMPTS[0], sp)
    eng.add_request("a1", PROMPTS[1], sp)
    outs = {}
    for i in range(400):
        if i == 3:
            eng.add_request("a2", PROMPTS[2], sp)
            eng.add_request("x", PROMPTS[3], sp)
        if i == 6:
            outs["x"] = eng.abort_request("x")
        if i == 8:
            eng.add_request("a3", PROMPTS[3], sp)
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
        if not eng.has_unfinished_requests():
            break
    assert eng.stats.num_preemptions > 0 and eng.stats.num_mixed_steps > 0
    assert eng.stats.num_accepted > 0
    for i in range(4):
        assert outs[f"a{i}"].token_ids == dense[i]
    assert outs["x"].finish_reason == "abort"


def test_steady_state_compiles_one_program_per_shape(engines):
    eng = engines["per_row-3"]
    run_requests(eng, PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_NEW))
    assert all(n == 1 for n in eng.runner.traces.values()), eng.runner.traces


# --------------------------------------------------------------------------- bad settings


def test_bad_settings_name_the_setting():
    with pytest.raises(ExitConfigError, match="max_draft"):
        ExitConfig(exit_layers=(1,), verify=True, max_draft=0)
    with pytest.raises(ExitConfigError, match="backfill"):
        ExitConfig(exit_layers=(1,), verify=True, backfill="learned")
    with pytest.raises(ExitConfigError, match="verify_sampling"):
        ExitConfig(exit_layers=(1,), verify_sampling="typical").verified(2)
    with pytest.raises(ExitConfigError, match="out of range"):
        _engine(ExitConfig(exit_layers=(1, L)).verified(2))


# --------------------------------------------------------------------------- cost, by hand


def test_verified_costs_count_drafts_verifies_and_thrown_work():
    cm = CostModel(n_layers=4, checked=(1, 2, 3), final_head=2.0, exit_head=0.5,
                   first_check=0.1, later_check=0.1)
    ec = ExitConfig(exit_layers=(1, 2, 3), measure="candidates", vocab_subset=16,
                    policy="per_row").verified(2)
    # memory-bound, riding drafts free: 3 draft steps at 2 (2 + 0.2 checks + 0.5 head) and
    # one verify (4 + 0.3 + 2: the final head's weights read once for the run), 3 tokens
    assert verified_speedup(cm, ec, {2: 3, 4: 1}, 3) == pytest.approx(3 * 6 / (3 * 2.7 + 6.3))
    # max_draft 2 over 5 tokens: t0, t1 draft (t1 rejected), verify -> emits 2 (t0, full t1);
    # t2 drafts, t3 not confident -> verify emits 2; t4 is the last: a verify step alone
    exits, agrees = [2, 2, 2, 4, 2], [True, False, True, True, True]
    speed, acceptance, drafted = verified_sequence_speedup(cm, ec, exits, agrees)
    assert (drafted, acceptance) == (3, pytest.approx(2 / 3))
    assert speed == pytest.approx(5 * 6 / (3 * 2.7 + 3 * 6.3))
    # a second rule for extending a run that never drafts: runs of one; t0 drafts and is
    # kept (emits t0, t1), t2 drafts and is kept (t2, t3), t4 alone: 2 drafts, 3 verifies
    speed, acceptance, drafted = verified_sequence_speedup(
        cm, ec, exits, agrees, in_run=([4] * 5, [False] * 5))
    assert (drafted, acceptance) == (2, 1.0)
    assert speed == pytest.approx(5 * 6 / (2 * 2.7 + 3 * 6.3))


def test_controller_decides_verified_exits_from_the_steps_it_saw(dense):
    """A verified engine's controller reads its steps (drafts, verifies, tokens emitted): with
    an overhead no exit can pay (5 full-depth steps) it moves to the full-depth program after
    its probe, with runs in flight verified first; the output stays full depth's."""
    ec = _ec("per_row", 3)
    eng = _engine(ec, _heads(ec, 0.0), batch_buckets=(4,), exit_control=ControllerConfig(
        probe_steps=6, probe_every=1000, check_overhead=5.0))
    outs = run_requests(eng, PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_NEW))
    assert [o.token_ids for o in outs] == dense
    assert "batch 4: full depth" in eng.controller.summary()
    dec = [s for s in eng.runner.traces if s.kind == "decode"]
    assert {s.exits for s in dec} == {True, False}
    # the prediction itself, from steps: runs of 3 drafts at exit 1 all confirmed pay where
    # riding is free (memory-bound), not where each riding entry (all max_draft of a row's,
    # `exit_cost.step_work`) costs its row a layer in every layer it rides (compute-bound)
    steps = [((1,) * 4, (k,) * 4, 0) for k in range(3)] + [((L,) * 4, (3,) * 4, 16)]
    free = exit_predictor(CFG, ec, ControllerConfig(check_overhead=0.0, ride_cost=0.0,
                                                    memory_bound_batch=4))
    costly = exit_predictor(CFG, ec, ControllerConfig(check_overhead=0.0, ride_cost=0.0,
                                                      memory_bound_batch=1))
    assert free(4, steps) > 1.02 > costly(4, steps)
    assert free(4, steps[:3]) == 1.0  # no token emitted yet: no evidence


def test_blocking_steps_give_the_same_tokens(dense):
    """Without overlapped steps (the host reads each step before the next: no rollback on
    the device) the tokens are the same; the engines share one compiled program."""
    ec = _ec("per_row", 3)
    eng = _engine(ec, _heads(ec, 0.0), async_scheduling=False)
    outs = run_requests(eng, PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_NEW))
    assert [o.token_ids for o in outs] == dense
    assert eng.stats.num_accepted > 0


def test_server_verify_exits_field():
    """`verify_exits` true on a server whose exits are not verified: 400 naming the field;
    false on any server: full depth (threshold never reached); true where they are: as is."""
    body = protocol.CompletionBody(model="m", prompt="x", max_tokens=4, verify_exits=True)
    lossy = protocol.Limits(64, 63, 128, has_exits=True, verifies=False)
    with pytest.raises(protocol.ApiError, match="verify-exits") as e:
        protocol.sampling_params(body, 3, 0, lossy, chat=False)
    assert e.value.param == "verify_exits"
    verified = dataclasses.replace(lossy, verifies=True)
    assert protocol.sampling_params(body, 3, 0, verified, chat=False).exit_threshold is None
    off = protocol.CompletionBody(model="m", prompt="x", max_tokens=4, verify_exits=False)
    assert protocol.sampling_params(off, 3, 0, lossy, chat=False).exit_threshold == NEVER
