"""Early-exit decoding (docs/architecture.md sections 5 and 6) against independent references.

Engines compile one program per step shape, so they are built once per module and every
engine here uses a single page bucket (page_size 16, max_model_len 64) and few batch buckets.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ee_jax.models import llama
from ee_jax.models.exits import checks as exit_checks
from ee_jax.models.exits import heads as exit_heads
from ee_jax.models.exits.config import NEVER, POLICIES, ExitConfig, ExitConfigError
from ee_jax.serving.controller import ControllerConfig
from ee_jax.serving.engine import EngineConfig, LLMEngine
from ee_jax.serving.kv_cache import NULL_PAGE, KVCache, allocate_cache
from ee_jax.serving.model_runner import ModelRunner, StepBatch, StepShape, unpack_results
from ee_jax.serving.params import InvalidRequestError, SamplingParams, greedy
from ee_jax.testing import tiny_config
from tests.reference import run_requests

CFG = tiny_config(eos_token_ids=())  # 4 layers, vocab 128, d 48, GQA 4/2, head_dim 16
# A larger init scale than tiny_model's gives peaked distributions, so exit confidences
# spread over (0, 1) and a threshold can split tokens between early and full depth.
PARAMS = llama.init_params(CFG, jax.random.PRNGKey(5), scale=0.4)
L = CFG.n_layers
EXIT_LAYERS = (1, 2, 3)
RNG = np.random.default_rng(7)
# Mixed lengths, one prefill step (chunks of 32) for all four.
PROMPTS = [RNG.integers(3, CFG.vocab_size, n).tolist() for n in (5, 23, 1, 12)]
MAX_NEW = 12

_ids = itertools.count()


def engine_config(**kw) -> EngineConfig:
    # page_size 16 with max_model_len 64: 4 pages per sequence, so a single page bucket;
    # prompts pack into a few packed-token buckets (query blocks of 32): few programs.
    # Blocking steps: these tests read each step's output and the cache after it (overlapped
    # steps give the same tokens:
    # tests/test_engine.py::test_overlapped_engine_equals_blocking_engine).
    base = dict(max_num_seqs=4, max_model_len=64, page_size=16, num_pages=24,
                max_prefill_chunk=32, max_num_batched_tokens=128, batch_buckets=(4,),
                async_scheduling=False,
                # the exit program always: these tests check what it computes (the
                # controller's choice is tests/test_exit_controller.py's)
                exit_control=ControllerConfig(mode="exits"))
    base.update(kw)
    return EngineConfig.make(**base)


def make_engine(exit_config=None, exit_heads=None, **kw) -> LLMEngine:
    return LLMEngine(CFG, PARAMS, None, engine_config(**kw), exit_config, exit_heads)


run = run_requests


def perturbed_heads(ec, seed=2):
    """Exit norms that differ from the final norm and from each other (a wrong slot shows)."""
    heads = exit_heads.init_heads(CFG, ec, PARAMS)
    noise = jax.random.normal(jax.random.PRNGKey(seed), heads.norm.shape)
    return heads.replace(norm=heads.norm * (1 + 0.3 * noise))


# --------------------------------------------------------------------------- engines


@pytest.fixture(scope="module")
def full_engine():
    return make_engine()


@pytest.fixture(scope="module")
def never_engine():
    return make_engine(ExitConfig(exit_layers=EXIT_LAYERS, policy="never"))


@pytest.fixture(scope="module")
def inf_engine():
    """Policy "all", global threshold NEVER; batch buckets (2, 4) for the trace test."""
    return make_engine(ExitConfig(exit_layers=EXIT_LAYERS, threshold=NEVER),
                       batch_buckets=(2, 4))


EE_CONFIG = ExitConfig(exit_layers=EXIT_LAYERS, measure="max_prob", threshold=0.0)
EE_HEADS = perturbed_heads(EE_CONFIG)


@pytest.fixture(scope="module")
def ee_engine():
    """Global threshold 0: every row is confident at the first exit unless its request
    says otherwise. Shared by the tests of sections 1 and 4 (one set of programs)."""
    return make_engine(EE_CONFIG, EE_HEADS)


@pytest.fixture(scope="module")
def full_tokens(full_engine):
    return [o.token_ids for o in run(full_engine, PROMPTS, greedy(MAX_NEW))]


# --------------------------------------------------------------------------- 1. exits off


def _assert_full_depth(engine, outs, full_tokens, steps_before):
    assert [o.token_ids for o in outs] == full_tokens
    for o in outs:
        assert o.exit_layers == [L] * MAX_NEW
    decode_steps = engine.stats.num_decode_steps - steps_before
    assert decode_steps > 0
    assert engine.stats.step_exit_counts == {L: engine.stats.num_decode_steps}
    assert engine.stats.ideal_speedup(L) == 1.0


def test_policy_never_equals_full_depth(never_engine, full_tokens):
    before = never_engine.stats.num_decode_steps
    outs = run(never_engine, PROMPTS, greedy(MAX_NEW))
    _assert_full_depth(never_engine, outs, full_tokens, before)


def test_threshold_never_equals_full_depth(inf_engine, full_tokens):
    before = inf_engine.stats.num_decode_steps
    outs = run(inf_engine, PROMPTS, greedy(MAX_NEW))
    assert [o.token_ids for o in outs] == full_tokens
    assert all(o.exit_layers == [L] * MAX_NEW for o in outs)
    assert inf_engine.stats.num_decode_steps > before


def test_per_request_infinite_threshold_overrides_global(ee_engine, full_tokens):
    outs = run(ee_engine, PROMPTS, greedy(MAX_NEW, exit_threshold=float("inf")))
    assert [o.token_ids for o in outs] == full_tokens
    assert all(o.exit_layers == [L] * MAX_NEW for o in outs)
    # The same engine without the override leaves at the first exit: the override mattered.
    outs = run(ee_engine, PROMPTS[:1], greedy(4))
    assert outs[0].exit_layers == [L, 1, 1, 1]


def test_first_token_of_every_prompt_runs_full_depth(ee_engine, full_engine):
    """A 33-token prompt with 32-token chunks leaves one prompt token after its first
    chunk; the scheduler runs that token in a decode step. Prefill runs at full depth
    (docs/architecture.md), so the first sampled token must come from the final head even when every
    decode step exits at layer 1."""
    rng = np.random.default_rng(11)
    prompts = [rng.integers(3, CFG.vocab_size, n).tolist() for n in (33, 5, 2, 20)]
    want = [o.token_ids[0] for o in run(full_engine, prompts, greedy(2))]
    outs = run(ee_engine, prompts, greedy(2))
    assert [o.exit_layers[0] for o in outs] == [L] * 4, [o.exit_layers for o in outs]
    assert [o.token_ids[0] for o in outs] == want


# --------------------------------------------------------------------------- references

DENSE_WIDTH = 32


@jax.jit
def _dense_hidden(params, tokens):
    """Hidden states after every layer [L, T, D] of one right-padded sequence [T]."""
    return llama.forward(params, tokens[None], CFG, return_hidden=True)[1][:, 0]


def dense_hidden(tokens):
    buf = np.zeros(DENSE_WIDTH, np.int32)
    buf[:len(tokens)] = tokens
    return _dense_hidden(PARAMS, jnp.asarray(buf))


@jax.jit
def _kv(lp, h, pos):
    """kv_project of one hidden state h [D] at position pos -> k, v [K, hd]."""
    k, v = llama.kv_project(lp, h[None], pos[None], CFG)
    return k[0], v[0]


LAYERS = [llama.layer_params(PARAMS, i) for i in range(L)]


# --------------------------------------------------------------------------- 2. forced exit


def _write_prompt_kv(cache_k, cache_v, prompt, table, page_size):
    """The prompt's K/V at full depth from the dense forward, written at its pages."""
    hidden = dense_hidden(prompt)
    for p, tok in enumerate(prompt):
        layer_in = [PARAMS.embed[tok]] + [hidden[i, p] for i in range(L - 1)]
        for layer in range(L):
            k, v = _kv(LAYERS[layer], layer_in[layer], jnp.asarray(p))
            cache_k[layer, table[p // page_size], p % page_size] = np.asarray(k)
            cache_v[layer, table[p // page_size], p % page_size] = np.asarray(v)


def test_forced_exit_backfills_cache_with_projection_of_exit_state():
    # Exit 2: layer 0 keeps the embedding's K/V, layer 1 its own input's, 2 and 3 are filled.
    e = 2
    ec = ExitConfig(exit_layers=EXIT_LAYERS, force_exit_layer=e)
    heads = perturbed_heads(ec, seed=e)
    page_size, num_pages = 4, 12
    runner = ModelRunner(CFG, PARAMS, allocate_cache(CFG, num_pages, page_size), ec, heads)
    rng = np.random.default_rng(e)
    # Rows 0 and 2 are real (prompts of 6 and 9 tokens), rows 1 and 3 are padding.
    rows = {0: (rng.integers(3, 128, 6).tolist(), [3, 1]),
            2: (rng.integers(3, 128, 9).tolist(), [7, 2, 9])}
    new_tok = {0: 17, 2: 101}
    k0 = np.zeros(runner.cache.k.shape, np.float32)
    v0 = np.zeros_like(k0)
    for prompt, table in rows.values():
        _write_prompt_kv(k0, v0, prompt, table, page_size)
    runner.cache = KVCache(jnp.asarray(k0), jnp.asarray(v0))

    shape = StepShape(batch=4, tokens=1, pages=4)
    b = StepBatch.empty(shape)
    b.threshold[:] = NEVER  # forcing must not depend on confidence
    for r, (prompt, table) in rows.items():
        b.tokens[r, 0] = new_tok[r]
        b.positions[r, 0] = len(prompt)
        b.page_table[r, :len(table)] = table
        b.kv_lens[r] = len(prompt) + 1
    tokens, _, extra = unpack_results(np.asarray(runner.step(b)))
    assert (extra[list(rows), 0] == e).all()  # real rows left at e
    assert (extra[[1, 3], 0] == 0).all()  # padding rows ran nothing
    k1, v1 = np.asarray(runner.cache.k), np.asarray(runner.cache.v)

    touched = np.zeros(k0.shape[1:3], bool)  # [pages, slots]
    touched[NULL_PAGE] = True
    for r, (prompt, table) in rows.items():
        pos = len(prompt)
        page, off = table[pos // page_size], pos % page_size
        touched[page, off] = True
        hidden = dense_hidden([*prompt, new_tok[r]])
        layer_in = [PARAMS.embed[new_tok[r]]] + [hidden[i, pos] for i in range(L - 1)]
        h_exit = hidden[e - 1, pos]
        for layer in range(L):
            src = h_exit if layer >= e else layer_in[layer]
            k, v = _kv(LAYERS[layer], src, jnp.asarray(pos))
            np.testing.assert_allclose(k1[layer, page, off], k, atol=1e-5, rtol=1e-5,
                                       err_msg=f"K row {r} layer {layer}")
            np.testing.assert_allclose(v1[layer, page, off], v, atol=1e-5, rtol=1e-5,
                                       err_msg=f"V row {r} layer {layer}")
        logits = exit_heads.exit_logits(PARAMS, heads, EXIT_LAYERS.index(e), h_exit, CFG)
        assert tokens[r] == int(jnp.argmax(logits))
    # Nothing else in the cache moved (the prompt entries, other pages, other slots).
    np.testing.assert_array_equal(k1[:, ~touched], k0[:, ~touched])
    np.testing.assert_array_equal(v1[:, ~touched], v0[:, ~touched])


# --------------------------------------------------------------------------- 3. batch rule


def _logit(c):
    return math.log(c / (1 - c))


C_GRID = [0.05, 0.15, 0.25, 0.35, 0.45, 0.55, 0.65, 0.75, 0.85, 0.95]
T_GRID = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, NEVER]  # never ties C_GRID


def expected_exit(c_by_layer, thresholds, min_exit, policy, quorum):
    """The batch exit layer by the rule (ExitConfig): at each exit layer >= min_exit,
    in order, a row is done once it has been confident at some checked exit; the batch
    leaves when every row (policy all) or a quorum of rows is done."""
    n = len(thresholds)
    done = [False] * n
    for e in EXIT_LAYERS:
        if e < min_exit:
            continue
        done = [d or c_by_layer[e] >= t for d, t in zip(done, thresholds, strict=True)]
        if (policy == "all" and all(done)) or (policy == "quorum" and
                                               sum(done) >= quorum * n):
            return e
    return L


class ClassifierRunner:
    """One compiled decode step with a "classifier" measure whose w = 0, so every row's
    confidence at exit slot s is exactly sigmoid(b[s])."""

    def __init__(self, policy, min_exit, quorum=0.5):
        self.ec = ExitConfig(exit_layers=EXIT_LAYERS, measure="classifier", policy=policy,
                             min_exit_layer=min_exit, quorum=quorum)
        self.heads = exit_heads.init_heads(CFG, self.ec, PARAMS)
        self.runner = ModelRunner(CFG, PARAMS, allocate_cache(CFG, 10, 4), self.ec,
                                  self.heads)
        self.shape = StepShape(batch=4, tokens=1, pages=2)

    def exit_layer(self, c_by_layer, row_thresholds, pad_threshold):
        """row_thresholds: [4] with None for padding rows."""
        b = [_logit(c_by_layer[e]) for e in EXIT_LAYERS]
        self.runner.exit_heads = self.heads.replace(
            classifier={"w": jnp.zeros((3, CFG.d_model), jnp.float32),
                        "b": jnp.asarray(b, jnp.float32)})
        batch = StepBatch.empty(self.shape)
        for r, t in enumerate(row_thresholds):
            if t is None:
                batch.threshold[r] = pad_threshold
                continue
            batch.tokens[r, 0] = 5 + r
            batch.positions[r, 0] = r + 1
            batch.page_table[r] = [1 + 2 * r, 2 + 2 * r]
            batch.kv_lens[r] = r + 2
            batch.threshold[r] = t
        _, _, extra = unpack_results(np.asarray(self.runner.step(batch)))
        real = [r for r, t in enumerate(row_thresholds) if t is not None]
        layers = set(extra[real, 0].tolist())  # the batch's exit layer, on every real row
        assert len(layers) == 1, layers
        pad = [r for r, t in enumerate(row_thresholds) if t is None]
        assert (extra[pad, 0] == 0).all()  # padding rows run nothing
        return layers.pop()


@pytest.fixture(scope="module")
def classifier_runners():
    return {"all": ClassifierRunner("all", min_exit=1),
            "quorum": ClassifierRunner("quorum", min_exit=2, quorum=0.5)}


batch_case = st.tuples(
    st.fixed_dictionaries({e: st.sampled_from(C_GRID) for e in EXIT_LAYERS}),
    st.lists(st.one_of(st.none(), st.sampled_from(T_GRID)), min_size=4, max_size=4)
    .filter(lambda ts: any(t is not None for t in ts)),
    st.sampled_from([0.0, NEVER]))


@pytest.mark.parametrize("policy", ["all", "quorum"])
@settings(max_examples=60, deadline=None)
@given(case=batch_case)
def test_batch_exit_layer_follows_the_rule(classifier_runners, policy, case):
    c_by_layer, row_thresholds, pad_threshold = case
    cr = classifier_runners[policy]
    real = [t for t in row_thresholds if t is not None]
    want = expected_exit(c_by_layer, real, cr.ec.min_exit_layer, policy, cr.ec.quorum)
    got = cr.exit_layer(c_by_layer, row_thresholds, pad_threshold)
    assert got == want
    if policy == "all":
        # architecture.md section 6: the latest of the rows' first confident exits (>= min_exit),
        # L if some row never is confident.
        firsts = [next((e for e in EXIT_LAYERS if e >= cr.ec.min_exit_layer
                        and c_by_layer[e] >= t), L) for t in real]
        assert got == max(firsts)
    assert set(cr.runner.traces) == {cr.shape} and cr.runner.traces[cr.shape] <= 1


@settings(max_examples=150, deadline=None)
@given(rows=st.lists(st.tuples(st.booleans(), st.booleans()), min_size=1, max_size=8),
       policy=st.sampled_from(POLICIES),
       quorum=st.sampled_from([0.25, 0.5, 0.75, 1.0]))
def test_batch_exits_matches_numpy_model(rows, policy, quorum):
    confident = np.array([c for c, _ in rows])
    active = np.array([a for _, a in rows])
    n_active = int(active.sum())
    n_conf = int((confident & active).sum())
    if policy == "never":
        want = False
    elif n_active == 0:
        want = True  # an all-padding batch has no one to wait for
    elif policy in ("all", "per_row"):  # per_row: the step ends when every row has left
        want = n_conf == n_active
    else:
        want = n_conf >= quorum * n_active
    got = exit_checks.batch_exits(jnp.asarray(confident), jnp.asarray(active), policy, quorum)
    assert bool(got) == want


# --------------------------------------------------------------------------- 4. reference


REF_PROMPT = np.random.default_rng(3).integers(3, CFG.vocab_size, 20).tolist()
REF_NEW = 24
REF_LEN = 64


@jax.jit
def _ref_layer(lp, x, positions, kc, vc):
    """One layer over contiguous K/V [S, K, hd] of one sequence; x [T, D] at `positions`."""

    def attend(q, k, v):
        kc2, vc2 = kc.at[positions].set(k), vc.at[positions].set(v)
        mask = jnp.arange(kc.shape[0])[None, :] <= positions[:, None]
        return llama.gqa_attention(q, kc2, vc2, mask), (kc2, vc2)

    x, (kc, vc) = llama.decoder_layer(lp, x, positions, CFG, attend)
    return x, kc, vc


@jax.jit
def _ref_exit_logits(heads, slot, h):
    return exit_heads.exit_logits(PARAMS, heads, slot, h, CFG)


_final_logits = jax.jit(lambda h: llama.final_head(PARAMS, h, CFG))


def _cos01(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.clip(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-6), 0.0, 1.0))


def _max_prob(logits):
    p = np.exp(logits - logits.max())
    return float(p.max() / p.sum())


def contiguous_reference(heads, ec, prompt, n_new, threshold):
    """Greedy early-exit decoding of one sequence with plain contiguous K/V, no paging.

    Back-fill as `ec.backfill` says: "propagate" fills a token's skipped layers from its exit
    state; "deferred" also runs them, one layer at a time before the next token's own, from
    where it left up to where that next token leaves (then it fills the layers still
    skipped from its state there, if it got deeper).

    Returns tokens, exit layers (L for the prefill token), every checked confidence, the
    smallest top-1/top-2 logit gap, and the K/V [L, S, K, hd].
    """
    zeros = jnp.zeros((REF_LEN, CFG.n_kv_heads, CFG.head_dim), jnp.float32)
    kc, vc = [zeros] * L, [zeros] * L
    x = llama.embed(PARAMS, jnp.asarray(prompt), CFG)
    pos = jnp.arange(len(prompt))
    for i in range(L):
        x, kc[i], vc[i] = _ref_layer(LAYERS[i], x, pos, kc[i], vc[i])
    logits = np.asarray(_final_logits(x[-1]))
    tokens, layers, confs, gaps = [int(logits.argmax())], [L], [], []
    gaps.append(float(np.diff(np.sort(logits)[-2:])[0]))
    pending = None  # (hidden state [1, D], layers it ran, layer it left at): previous token

    def fill(h, pos, first):  # its layers >= first from the state h
        for j in range(first, L):
            k, v = _kv(LAYERS[j], h[0], jnp.asarray(pos))
            kc[j], vc[j] = kc[j].at[pos].set(k), vc[j].at[pos].set(v)

    for step in range(1, n_new):
        p = len(prompt) + step - 1
        x = llama.embed(PARAMS, jnp.asarray([tokens[-1]]), CFG)
        h_prev = x[0]
        exit_at, out = L, None
        for i in range(L):
            if pending is not None and i >= pending[1]:  # the previous token's layer i
                hp, kc[i], vc[i] = _ref_layer(LAYERS[i], pending[0], jnp.asarray([p - 1]),
                                              kc[i], vc[i])
                pending = (hp, i + 1, pending[2])
            x, kc[i], vc[i] = _ref_layer(LAYERS[i], x, jnp.asarray([p]), kc[i], vc[i])
            n = i + 1
            if n == L or n not in ec.exit_layers or n < ec.min_exit_layer:
                continue
            lg = np.asarray(_ref_exit_logits(heads, ec.exit_layers.index(n), x[0]))
            if ec.measure == "saturation":  # cosine to the previous check (embedding first)
                conf = _cos01(x[0], h_prev)
                h_prev = x[0]
            else:
                assert ec.measure == "max_prob"
                conf = _max_prob(lg.astype(np.float64))
            confs.append(conf)
            if conf >= threshold:
                exit_at, out = n, lg
                break
        if out is None:
            out = np.asarray(_final_logits(x[0]))
        if pending is not None and exit_at < L and pending[1] == exit_at > pending[2]:
            fill(pending[0], p - 1, exit_at)  # got deeper, still incomplete
        fill(x, p, exit_at)  # back-fill the skipped layers from the exit state
        pending = (x, exit_at, exit_at) if ec.backfill == "deferred" and exit_at < L else None
        gaps.append(float(np.diff(np.sort(out)[-2:])[0]))
        tokens.append(int(out.argmax()))
        layers.append(exit_at)
    return tokens, layers, confs, min(gaps), (np.stack(kc), np.stack(vc))


def _choose_threshold(ec, heads):
    """A threshold near the median confidence at which the reference exits early for some
    tokens and at two or more different layers overall, with no checked confidence within
    2e-3 of it (float noise between paged and contiguous attention cannot flip a decision)."""
    confs = contiguous_reference(heads, ec, REF_PROMPT, REF_NEW, 2.0)[2]
    center = float(np.median(confs))
    for thr in sorted(np.arange(0.02, 0.99, 0.01), key=lambda t: abs(t - center)):
        ref = contiguous_reference(heads, ec, REF_PROMPT, REF_NEW, float(thr))
        decode_layers = set(ref[1][1:])
        if min(abs(c - thr) for c in ref[2]) > 2e-3 and ref[3] > 1e-3 \
                and len(decode_layers) >= 2 and min(decode_layers) < L:
            return float(thr), ref
    raise AssertionError("no usable threshold: change PARAMS' seed or REF_PROMPT")


@pytest.fixture(scope="module")
def saturation_engine():
    ec = ExitConfig(exit_layers=EXIT_LAYERS, measure="saturation")
    return make_engine(ec, perturbed_heads(ec))


@pytest.fixture(scope="module")
def deferred_engine():
    return make_engine(dataclasses.replace(EE_CONFIG, backfill="deferred"), EE_HEADS)


@pytest.mark.parametrize("engine_name", ["ee_engine", "saturation_engine", "deferred_engine"])
def test_engine_matches_contiguous_reference(engine_name, request):
    """One sequence (three padding rows in the batch bucket of 4), per-request threshold.
    Back-fill "deferred": the engine's next step completes an early token's layers."""
    engine = request.getfixturevalue(engine_name)
    ec, heads = engine.exit_config, engine.runner.exit_heads
    assert ec.measure == ("saturation" if engine_name == "saturation_engine" else "max_prob")
    thr, (ref_tokens, ref_layers, _, _, (ref_k, ref_v)) = _choose_threshold(ec, heads)
    if ec.backfill == "deferred":  # some early token's successor ran deeper: it completed
        assert any(a < b for a, b in itertools.pairwise(ref_layers[1:])), ref_layers

    counts_before = collections.Counter(engine.stats.step_exit_counts)
    engine.add_request("ref", REF_PROMPT, greedy(REF_NEW + 1, exit_threshold=thr))
    out = None
    while out is None or len(out.token_ids) < REF_NEW:
        (out,) = engine.step()
    assert out.token_ids == ref_tokens
    assert out.exit_layers == ref_layers
    # Every K/V the engine holds for this sequence, back-filled ones included.
    table = engine.blocks.page_table(engine._requests["ref"].seq_id)
    n_pos = len(REF_PROMPT) + REF_NEW - 1
    ps = engine.config.scheduler.page_size
    pages = np.asarray([table[p // ps] for p in range(n_pos)])
    offs = np.arange(n_pos) % ps
    np.testing.assert_allclose(np.asarray(engine.runner.cache.k)[:, pages, offs],
                               ref_k[:, :n_pos], atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(engine.runner.cache.v)[:, pages, offs],
                               ref_v[:, :n_pos], atol=1e-4, rtol=1e-4)
    engine.abort_request("ref")
    # Stats: one decode step per decoded token here, so the step histogram is the tokens'.
    counts = collections.Counter(ref_layers[1:])
    assert len(counts) >= 2
    assert collections.Counter(engine.stats.step_exit_counts) - counts_before == counts


def test_exit_stats_summaries():
    from ee_jax.serving.stats import EngineStats

    s = EngineStats(num_decode_steps=4, decode_layers_run=1 + 2 + 2 + 4,
                    step_exit_counts={4: 1, 1: 1, 2: 2})
    assert s.exit_histogram() == "1:1 2:2 4:1"
    assert s.ideal_speedup(4) == pytest.approx(4 / (9 / 4))
    assert EngineStats().ideal_speedup(4) == 1.0


# --------------------------------------------------------------------------- 5. traces


def test_one_program_per_shape_whatever_the_exits(inf_engine):
    runner = inf_engine.runner
    used = collections.defaultdict(set)  # shape -> exit layers seen
    step = runner.step

    def recording_step(batch):
        out = step(batch)
        used[batch.shape].add(int(unpack_results(np.asarray(out))[2][0, 0]))
        return out

    runner.step = recording_step
    try:
        rng = np.random.default_rng(5)
        thresholds = [0.0, 0.3, 0.5, 0.7, NEVER, None]
        for wave, n in enumerate((1, 3, 2, 4, 1, 4)):
            # 17..30 tokens: every prefill step falls in the 32-token bucket.
            prompts = [rng.integers(3, CFG.vocab_size, int(rng.integers(17, 31))).tolist()
                       for _ in range(n)]
            params = [greedy(int(rng.integers(3, 12)),
                             exit_threshold=thresholds[(wave + i) % len(thresholds)])
                      for i in range(n)]
            run(inf_engine, prompts, params)
    finally:
        del runner.step
    assert all(v <= 1 for v in runner.traces.values()), runner.traces
    assert set(used) <= set(runner.traces)
    decode = [s for s in runner.traces if s.tokens == 1]
    page_buckets = {s.pages for s in runner.traces}
    assert len(decode) <= len(inf_engine.scheduler.config.batch_buckets) * len(page_buckets)
    # Different exit outcomes ran through one and the same program.
    assert max(len(used[s]) for s in decode if s in used) >= 2, dict(used)


# --------------------------------------------------------------------------- 6. bad input


SMALL_CACHE = KVCache(jnp.zeros((L, 2, 4, CFG.n_kv_heads, CFG.head_dim)),
                      jnp.zeros((L, 2, 4, CFG.n_kv_heads, CFG.head_dim)))


@pytest.mark.parametrize("bad", [0, L, L + 3])
def test_exit_layer_out_of_range(bad):
    ec = ExitConfig(exit_layers=tuple(sorted({1, bad})))
    with pytest.raises(ExitConfigError, match=rf"\[{bad}\].*out of range"):
        make_engine(ec)
    with pytest.raises(ExitConfigError, match="out of range"):
        ModelRunner(CFG, PARAMS, SMALL_CACHE, ec)


@pytest.mark.parametrize(("kw", "match"), [
    (dict(exit_layers=(3, 1)), "strictly increasing"),
    (dict(exit_layers=(1, 1, 2)), "strictly increasing"),
    (dict(threshold=-0.1), "threshold"),
    (dict(threshold=1.5), "threshold"),
    (dict(threshold=float("nan")), "threshold"),
    (dict(measure="perplexity"), "measure"),
    (dict(head="transformer"), "head"),
    (dict(policy="any"), "policy"),
    (dict(quorum=0.0), "quorum"),
    (dict(force_exit_layer=2, exit_layers=(1, 3)), "force_exit_layer"),
    # A forced exit below min_exit_layer would never be checked, so never taken.
    (dict(force_exit_layer=1, exit_layers=(1, 3), min_exit_layer=2), "min_exit_layer"),
])
def test_bad_exit_config(kw, match):
    with pytest.raises(ExitConfigError, match=match):
        ExitConfig(**kw)


def test_never_threshold_accepted():
    assert ExitConfig(exit_layers=(1,), threshold=NEVER).threshold == NEVER
    assert SamplingParams(exit_threshold=float("inf")).exit_threshold == NEVER
    assert SamplingParams(exit_threshold=0.0).exit_threshold == 0.0


@pytest.mark.parametrize("t", [2.0, -0.5, float("nan"), -float("inf")])
def test_bad_request_threshold(t):
    with pytest.raises(InvalidRequestError, match="exit_threshold"):
        SamplingParams(exit_threshold=t)


def test_heads_with_wrong_shapes():
    ec = ExitConfig(exit_layers=EXIT_LAYERS, head="adapter", measure="classifier",
                    adapter_rank=8)
    good = exit_heads.init_heads(CFG, ec, PARAMS)
    exit_heads.check_heads(CFG, ec, good)
    short_norm = good.replace(norm=good.norm[:2])
    # a mapping of part names, as a caller may hold heads, is checked the same way
    no_classifier = {k: v for k, v in good.parts().items() if k != "classifier"}
    wide_rank = good.replace(adapter={"down": jnp.zeros((3, CFG.d_model, 9)),
                                      "up": jnp.zeros((3, 9, CFG.d_model))})
    for heads, leaf in [(short_norm, r"\.norm\W+\(2, 48\)"),
                        (no_classifier, r"\.classifier\.w\W"),
                        (wide_rank, r"\.adapter\.down\W+\(3, 48, 9\)"),
                        ({**good.parts(), "bias": good.norm}, r"no part\(s\) \['bias'\]")]:
        with pytest.raises(ExitConfigError, match=rf"exit heads.*{leaf}"):
            exit_heads.check_heads(CFG, ec, heads)
        with pytest.raises(ExitConfigError, match=leaf):
            ModelRunner(CFG, PARAMS, SMALL_CACHE, ec, heads)
    # a part given as a mapping of its fields is its type; a field it lacks or does not have
    # is named with the ones it needs
    assert isinstance(wide_rank.adapter, exit_heads.LowRank)
    for bad in ({"down": good.adapter.down}, {**dataclasses.asdict(good.adapter), "bias": 0}):
        with pytest.raises(ExitConfigError, match=r"part 'adapter' holds .*needs \['down', 'up'\]"):
            exit_heads.check_heads(CFG, ec, {**good.parts(), "adapter": bad})


# --------------------------------------------------------------------------- real model


def test_cli_serves_per_row_by_default_with_the_subset_rows_gathered_once(tmp_path):
    """`ee-jax generate/serve`: exit policy per_row unless --exit-policy says otherwise (under
    "all" the demo's batch never left early at the shipped threshold); trained heads with a
    vocabulary subset come with their LM-head rows (`exit_heads.with_vocab_rows`)."""
    from ee_jax import cli
    from ee_jax.models.exits.checkpoint import save_exit_heads
    from ee_jax.random_model import random_model
    from ee_jax.serving.llm import LLM

    model = random_model()
    args = cli.build_parser().parse_args(["generate", "--model", "random", "--prompt", "x",
                                          "--exit-layers", "1,2"])
    assert cli._exit_kwargs(args, model)["exit_config"].policy == "per_row"
    args.exit_policy = "all"
    assert cli._exit_kwargs(args, model)["exit_config"].policy == "all"
    cfg = model.config
    ec = ExitConfig(exit_layers=(1, 2), head="mlp", adapter_rank=4, measure="candidates",
                    vocab_subset=40, candidates=4)
    heads = exit_heads.init_heads(cfg, ec, model.params).replace(
        vocab=jnp.arange(3, 43, dtype=jnp.int32))
    save_exit_heads(tmp_path / "heads", cfg, ec, heads)
    args = cli.build_parser().parse_args(["generate", "--model", "random", "--prompt", "x",
                                          "--exit-heads", str(tmp_path / "heads")])
    kw = cli._llm_kwargs(args, model)
    assert kw["exit_config"].policy == "per_row"
    runner = LLM(model, progress=False, **kw).engine.runner  # how the CLI builds its engine
    head = np.asarray(llama.unembed(model.params, jnp.eye(cfg.d_model), cfg)).T  # [V, D]
    np.testing.assert_allclose(np.asarray(runner.exit_heads.vocab_rows), head[3:43],
                               rtol=1e-6, atol=1e-6)
