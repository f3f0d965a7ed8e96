"""Policy "per_row": every row leaves at its own first confident exit, the rows still running
compacted into smaller row buckets inside the step (ee_jax/serving/step.py).

Checked against independent references: the dense full-depth forward (tokens, hidden states,
K/V), `exit_heads.exit_logits` of the dense hidden state at each row's exit, and `kv_project` of
that state for the back-filled layers. Programs are compiled once per module.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ee_jax.models import llama
from ee_jax.models.exits import checks as exit_checks
from ee_jax.models.exits import heads as exit_heads
from ee_jax.models.exits.config import NEVER, ExitConfig, ExitConfigError
from ee_jax.serving.attention import AttentionMetadata
from ee_jax.serving.controller import ControllerConfig
from ee_jax.serving.engine import EngineConfig, LLMEngine
from ee_jax.serving.kv_cache import NULL_PAGE, KVCache, allocate_cache
from ee_jax.serving.model_runner import ModelRunner, StepShape
from ee_jax.serving.params import greedy
from ee_jax.serving.step import PerRow, model_step, policy_for
from ee_jax.testing import tiny_config
from tests.reference import dense_greedy, run_requests

CFG = tiny_config(eos_token_ids=())  # 4 layers, vocab 128, d 48, GQA 4/2, head_dim 16
# Large init scale: peaked distributions, so max_prob confidences spread over (0, 1).
PARAMS = llama.init_params(CFG, jax.random.PRNGKey(5), scale=0.4)
L = CFG.n_layers
EXIT_LAYERS = (1, 2, 3)
RNG = np.random.default_rng(7)
PROMPTS = [RNG.integers(3, CFG.vocab_size, n).tolist() for n in (5, 23, 1, 12)]
MAX_NEW = 12
LAYERS = [llama.layer_params(PARAMS, i) for i in range(L)]


def perturbed_heads(ec, seed=2):
    """Exit norms that differ from the final norm and from each other (a wrong slot shows)."""
    heads = exit_heads.init_heads(CFG, ec, PARAMS)
    noise = jax.random.normal(jax.random.PRNGKey(seed), heads.norm.shape)
    return heads.replace(norm=heads.norm * (1 + 0.3 * noise))


# --------------------------------------------------------------------------- references


@functools.partial(jax.jit, static_argnums=2)
def _dense_hidden(params, tokens, width):
    return llama.forward(params, tokens[None], CFG, return_hidden=True)[1][:, 0]


def dense_hidden(tokens, width=32):
    """Hidden states after every layer [L, T, D] of one sequence (dense, no cache)."""
    buf = np.zeros(width, np.int32)
    buf[:len(tokens)] = tokens
    return np.asarray(_dense_hidden(PARAMS, jnp.asarray(buf), width))


@jax.jit
def _kv(lp, h, pos):
    """kv_project of one hidden state h [D] at position pos -> k, v [K, hd]."""
    k, v = llama.kv_project(lp, h[None], pos[None], CFG)
    return k[0], v[0]


def kv_of(layer, h, pos):
    k, v = _kv(LAYERS[layer], jnp.asarray(h), jnp.asarray(pos))
    return np.asarray(k), np.asarray(v)


# --------------------------------------------------------------------------- one step, direct

PAGE = 4
NUM_PAGES = 16
# Four rows with disjoint pages; their prompts' K/V are in the cache at full depth.
STEP_ROWS = [(RNG.integers(3, 128, n).tolist(), table, tok) for n, table, tok in
             ((6, [3, 1], 17), (9, [7, 2, 9], 101), (3, [4], 55), (10, [5, 6, 11], 8))]
CLS_EC = ExitConfig(exit_layers=EXIT_LAYERS, measure="classifier", policy="per_row")
CLS_HEADS = perturbed_heads(CLS_EC, seed=4)
C_GRID = [0.05, 0.15, 0.25, 0.35, 0.45, 0.55, 0.65, 0.75, 0.85, 0.95]
T_GRID = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, NEVER]  # never ties C_GRID


@pytest.fixture(scope="module")
def step_case():
    """The cache after the prompts, and for every row: the position of its new token, the
    dense hidden states there, the full-depth K/V per layer and the back-fill K/V per exit."""
    k0 = np.zeros((L, NUM_PAGES, PAGE, CFG.n_kv_heads, CFG.head_dim), np.float32)
    v0 = np.zeros_like(k0)
    refs = []
    for prompt, table, tok in STEP_ROWS:
        seq = [*prompt, tok]
        hidden = dense_hidden(seq)  # [L, T, D]
        for p, t in enumerate(seq):
            layer_in = [np.asarray(PARAMS.embed[t])] + [hidden[i, p] for i in range(L - 1)]
            kvs = [kv_of(j, layer_in[j], p) for j in range(L)]
            if p < len(prompt):
                for j, (k, v) in enumerate(kvs):
                    k0[j, table[p // PAGE], p % PAGE] = k
                    v0[j, table[p // PAGE], p % PAGE] = v
        pos = len(prompt)
        fills = {e: [kv_of(j, hidden[e - 1, pos], pos) for j in range(L)] for e in EXIT_LAYERS}
        refs.append(dict(pos=pos, hidden=hidden[:, pos], full_kv=kvs, fill_kv=fills))
    traces = []

    @jax.jit
    def step(heads, cache, tokens, meta, thresholds):
        traces.append(1)
        result, cache = model_step(PARAMS, heads, cache, tokens, meta, thresholds, CFG,
                                   PerRow(CLS_EC))
        return result.logits, result.exit_layer, result.checks, result.work, cache

    return dict(k0=k0, v0=v0, refs=refs, step=step, traces=traces)


def first_confident(c_by_layer, t):
    return next((e for e in EXIT_LAYERS if c_by_layer[e] >= t), L)


def expected_work(exit_layers, sizes=(4, 2, 1)):
    """Row-layers under the cost model: the layers run on the smallest bucket holding the
    running rows, re-bucketed only at exits where the running rows fit a smaller one."""
    def fit(count):
        return min(z for z in sizes if z >= count)

    running = [e for e in exit_layers if e > 0]
    bucket, work, n = fit(len(running)), 0, 0
    while n < L and running:
        work += bucket
        n += 1
        running = [e for e in running if e > n]
        if running and fit(len(running)) < bucket:
            bucket = fit(len(running))
    return work


@settings(max_examples=60, deadline=None)
@given(c_by_layer=st.fixed_dictionaries({e: st.sampled_from(C_GRID) for e in EXIT_LAYERS}),
       row_thresholds=st.lists(st.one_of(st.none(), st.sampled_from(T_GRID)),
                               min_size=4, max_size=4))
def test_each_row_exits_at_its_first_confident_exit(step_case, c_by_layer, row_thresholds):
    """Classifier with w = 0: every row's confidence at exit e is sigmoid(b[e]) = c[e], so
    its per-row threshold alone decides its first confident exit; None = a padding row."""
    b = [np.log(c_by_layer[e] / (1 - c_by_layer[e])) for e in EXIT_LAYERS]
    heads = CLS_HEADS.replace(classifier={"w": jnp.zeros((3, CFG.d_model), jnp.float32),
                                          "b": jnp.asarray(b, jnp.float32)})
    B, W = 4, 3
    tokens = np.zeros((B, 1), np.int32)
    positions = np.zeros((B, 1), np.int32)
    table = np.full((B, W), NULL_PAGE, np.int32)
    kv_lens = np.zeros(B, np.int32)
    thresholds = np.zeros(B, np.float32)
    for r, ((_, pages, tok), ref, t) in enumerate(zip(STEP_ROWS, step_case["refs"],
                                                      row_thresholds, strict=True)):
        if t is None:
            continue
        tokens[r, 0], positions[r, 0] = tok, ref["pos"]
        table[r, :len(pages)] = pages
        kv_lens[r] = ref["pos"] + 1
        thresholds[r] = t
    cache = KVCache(jnp.asarray(step_case["k0"]), jnp.asarray(step_case["v0"]))
    meta = AttentionMetadata(jnp.asarray(positions), jnp.asarray(table), jnp.asarray(kv_lens))
    logits, exit_layers, _, work, cache = step_case["step"](
        heads, cache, jnp.asarray(tokens), meta, jnp.asarray(thresholds))
    logits, exit_layers = np.asarray(logits), np.asarray(exit_layers)
    k1, v1 = np.asarray(cache.k), np.asarray(cache.v)

    touched = np.zeros((NUM_PAGES, PAGE), bool)
    touched[NULL_PAGE] = True
    want_layers = []
    for r, ((_, pages, _), ref, t) in enumerate(zip(STEP_ROWS, step_case["refs"],
                                                    row_thresholds, strict=True)):
        if t is None:
            want_layers.append(0)
            continue
        e = first_confident(c_by_layer, t)
        want_layers.append(e)
        # Logits: that exit's head on the dense hidden state after e layers.
        if e < L:
            want = exit_heads.exit_logits(PARAMS, heads, EXIT_LAYERS.index(e), ref["hidden"][e - 1],
                                          CFG)
        else:
            want = llama.final_head(PARAMS, jnp.asarray(ref["hidden"][L - 1]), CFG)
        np.testing.assert_allclose(logits[r], want, atol=2e-4, rtol=2e-4, err_msg=f"row {r}")
        # Cache: layers below e hold the full-depth K/V, layers >= e the back-fill.
        pos = ref["pos"]
        page, off = pages[pos // PAGE], pos % PAGE
        touched[page, off] = True
        for j in range(L):
            k, v = ref["fill_kv"][e][j] if j >= e else ref["full_kv"][j]
            np.testing.assert_allclose(k1[j, page, off], k, atol=1e-4, rtol=1e-4,
                                       err_msg=f"K row {r} layer {j} exit {e}")
            np.testing.assert_allclose(v1[j, page, off], v, atol=1e-4, rtol=1e-4,
                                       err_msg=f"V row {r} layer {j} exit {e}")
    assert exit_layers.tolist() == want_layers  # rows in their own order
    assert int(work) == expected_work(want_layers)  # the buckets the cost model chose
    # Nothing else moved: padding rows' pages, other slots, the prompts' entries.
    np.testing.assert_array_equal(k1[:, ~touched], step_case["k0"][:, ~touched])
    np.testing.assert_array_equal(v1[:, ~touched], step_case["v0"][:, ~touched])
    assert len(step_case["traces"]) == 1  # one program for every exit pattern


def candidate_case(exit_layers):
    """Candidate-feature heads (the shipped kind: MLP head, vocabulary subset, decision
    MLP per exit) over a shuffled subset of the whole vocabulary; 3 candidates of 128 ids, so
    the first check takes `exit_checks.top_k`'s block path."""
    ec = ExitConfig(exit_layers=exit_layers, head="mlp", adapter_rank=8, measure="candidates",
                    vocab_subset=CFG.vocab_size, candidates=3, policy="per_row")
    heads = exit_heads.init_heads(CFG, ec, PARAMS, jax.random.PRNGKey(11))
    key = jax.random.PRNGKey(12)
    heads = heads.replace(vocab=jnp.asarray(
        np.random.default_rng(3).permutation(CFG.vocab_size), jnp.int32))
    heads = heads.replace(
        mlp=heads.mlp.replace(up=0.3 * jax.random.normal(key, heads.mlp.up.shape)),
        decision=heads.decision.replace(w2=2.0 * jax.random.normal(
            jax.random.fold_in(key, 1), heads.decision.w2.shape)))
    return ec, heads


@pytest.mark.parametrize("exit_layers", [(1, 2, 3), (2, 3)], ids=["exits123", "exits23"])
def test_candidate_checks_in_the_step_decide_as_chained_checks(step_case, exit_layers):
    """The step's checks (first check outside the loop, later checks in it, vocabulary rows
    gathered once or per step, candidates searched in f32 or int8) decide exactly as
    `check_confidence` chained over the exits with the same heads on the dense hidden states,
    under per_row and all; with checks run but no exit taken (threshold 1.0) or none run
    (NEVER), the logits are full depth's."""
    ec, heads = candidate_case(exit_layers)
    B = len(STEP_ROWS)
    tokens = jnp.asarray([[tok] for _, _, tok in STEP_ROWS], jnp.int32)
    table = np.full((B, 3), NULL_PAGE, np.int32)
    for r, (_, pages, _) in enumerate(STEP_ROWS):
        table[r, :len(pages)] = pages
    refs = step_case["refs"]
    meta = AttentionMetadata(jnp.asarray([[ref["pos"]] for ref in refs], jnp.int32),
                             jnp.asarray(table),
                             jnp.asarray([ref["pos"] + 1 for ref in refs], jnp.int32))
    def chained(hv):  # the reference: chained checks with the same heads
        conf = np.zeros((B, len(exit_layers)), np.float32)
        for r, ref in enumerate(refs):
            state = exit_checks.init_check_state(llama.embed(PARAMS, tokens[r], CFG), ec)
            for s, e in enumerate(exit_layers):
                c, _, state = exit_checks.check_confidence(PARAMS, hv, s, jnp.asarray(
                    ref["hidden"][e - 1])[None], state, CFG, ec)
                conf[r, s] = float(c[0])
        return conf

    # gathered once, int8 search (the default); with the first exit at layer 1 also gathered
    # per step and gathered once with an f32 search (the heads' forms are independent of
    # where the first exit sits: one exit layout runs them all)
    variants = [exit_heads.with_vocab_rows(PARAMS, heads, CFG)]
    if exit_layers[0] == 1:
        variants += [heads, exit_heads.with_vocab_rows(PARAMS, heads, CFG,
                                                       candidate_dtype=None)]
    confs = [chained(hv) for hv in variants]
    conf = confs[0]
    assert conf.min() < 0.9 and conf.max() > 0.1, conf  # the thresholds below mean something

    def expect(thr, policy, conf):
        first = [next((e for e, c in zip(exit_layers, conf[r], strict=True) if c >= thr[r]),
                      L) for r in range(B)]
        if policy == "all":
            first = [max(first)] * B
        logits = [exit_heads.exit_logits(PARAMS, heads, exit_layers.index(e),
                                         refs[r]["hidden"][e - 1], CFG) if e < L else
                  llama.final_head(PARAMS, jnp.asarray(refs[r]["hidden"][L - 1]), CFG)
                  for r, e in enumerate(first)]
        return first, np.stack([np.asarray(x) for x in logits])

    for policy in ("per_row", "all"):
        # the heads' forms decide row by row; "all" only takes the rows' deepest exit, so it
        # runs the default form alone (each form is a compile per policy); under per_row the
        # default form runs the rows' stages (4, 2, 1), the others one stage (the forms do not
        # depend on the stages: each stage is another layer loop to compile)
        n = len(variants) if policy == "per_row" else 1
        for i, (hv, conf) in enumerate(zip(variants[:n], confs[:n], strict=True)):
            sizes = (B, B // 2, 1) if i == 0 else (B,)
            pol = policy_for(dataclasses.replace(ec, policy=policy, min_row_bucket=sizes[-1]),
                             "decode")
            # per row: leave just below its confidence at exit j (row r: j = r mod exits),
            # 1.0, NEVER, 0
            picked = np.asarray([conf[r, r % len(exit_layers)] - 1e-4 for r in range(B)],
                                np.float32)
            cases = [picked, np.full(B, 1.0, np.float32), np.full(B, NEVER, np.float32),
                     np.zeros(B, np.float32)]
            for thr in cases:
                cache = KVCache(jnp.asarray(step_case["k0"]), jnp.asarray(step_case["v0"]))
                result, _ = _model_step_jit(hv, cache, tokens, meta, jnp.asarray(thr), pol)
                want_layers, want_logits = expect(thr, policy, conf)
                assert np.asarray(result.exit_layer).tolist() == want_layers, (policy, thr)
                np.testing.assert_allclose(np.asarray(result.logits), want_logits, atol=2e-4,
                                           rtol=2e-4, err_msg=f"{policy} {thr}")
                if policy == "per_row":
                    assert int(result.work) == expected_work(want_layers, sizes)
                if thr[0] >= 1.0:  # full depth, checks run (1.0) or not (NEVER)
                    assert want_layers == [L] * B


@functools.partial(jax.jit, static_argnums=5)
def _model_step_jit(heads, cache, tokens, meta, thresholds, policy):
    return model_step(PARAMS, heads, cache, tokens, meta, thresholds, CFG, policy)


def test_row_exit_logits_match_exit_logits():
    ec = ExitConfig(exit_layers=EXIT_LAYERS, head="adapter", adapter_rank=8)
    heads = perturbed_heads(ec, seed=9)
    k1, k2 = jax.random.split(jax.random.PRNGKey(3))
    heads = heads.replace(adapter={
        "down": jax.random.normal(k1, heads.adapter.down.shape) * 0.1,
        "up": jax.random.normal(k2, heads.adapter.up.shape) * 0.1})
    h = jax.random.normal(jax.random.PRNGKey(4), (5, CFG.d_model))
    slots = jnp.asarray([2, -1, 0, 1, 0])
    got = exit_heads.row_exit_logits(PARAMS, heads, slots, h, CFG)
    for b, s in enumerate(slots.tolist()):
        want = (exit_heads.exit_logits(PARAMS, heads, s, h[b], CFG) if s >= 0
                     else llama.final_head(PARAMS, h[b], CFG))
        np.testing.assert_allclose(got[b], want, atol=1e-5, rtol=1e-5)


def test_row_buckets():
    ec = ExitConfig(exit_layers=(1,), policy="per_row")
    assert ec.row_buckets(32) == (32, 16, 8, 4, 2, 1)
    assert ec.row_buckets(6) == (6, 3, 2, 1)
    assert ec.row_buckets(1) == (1,)
    ec4 = ExitConfig(exit_layers=(1,), policy="per_row", min_row_bucket=4)
    assert ec4.row_buckets(32) == (32, 16, 8, 4)
    assert ec4.row_buckets(2) == (2,)
    with pytest.raises(ExitConfigError, match="min_row_bucket"):
        ExitConfig(min_row_bucket=0)


def test_rows_are_compacted_only_where_a_layer_is_compute_bound():
    """By default a CPU runner compacts the running rows (stages 4, 2, 1: loops of their
    own); a runner built for a TPU or GPU runs one stage, as policy "all" does (its layers
    are memory-bound at serving batches: fewer rows would save nothing and each stage is
    compiled again). On CPU an explicit min_row_bucket is served as given; an accelerator
    never compacts (heads saved with min_row_bucket 1, as the shipped ones are, included)."""
    ec = ExitConfig(exit_layers=EXIT_LAYERS, policy="per_row")
    shape = StepShape(4, 1, 4, kind="decode")

    def loops(policy, platform, **kw):
        e = dataclasses.replace(ec, policy=policy, **kw)
        cache = allocate_cache(CFG, 8, 16, CFG.dtype)
        runner = ModelRunner(CFG, PARAMS, cache, e, attention="xla", max_batch=4,
                             platform=platform)
        return runner.lower(shape).as_text().count("stablehlo.while")

    one_stage = loops("all", "tpu")
    assert loops("per_row", "tpu") == loops("per_row", "gpu") == one_stage
    assert loops("per_row", "cpu") > one_stage
    assert loops("per_row", "cpu", min_row_bucket=4) == one_stage
    assert loops("per_row", "tpu", min_row_bucket=1) == one_stage


# --------------------------------------------------------------------------- engine


@pytest.fixture(scope="module")
def engine():
    """max_prob, global threshold NEVER (requests set their own); one decode program."""
    ec = ExitConfig(exit_layers=EXIT_LAYERS, measure="max_prob", threshold=NEVER,
                    policy="per_row")
    config = EngineConfig.make(max_num_seqs=4, max_model_len=64, page_size=16, num_pages=24,
                               max_prefill_chunk=32, max_num_batched_tokens=128, batch_buckets=(4,),
                               exit_control=ControllerConfig(mode="exits"))
    return LLMEngine(CFG, PARAMS, None, config, ec, perturbed_heads(ec))


def test_exits_disabled_equals_full_depth(engine):
    outs = run_requests(engine, PROMPTS, greedy(MAX_NEW))
    want = [dense_greedy(CFG, PARAMS, p, MAX_NEW, width=64) for p in PROMPTS]
    assert [o.token_ids for o in outs] == want
    assert all(o.exit_layers == [L] * MAX_NEW for o in outs)


THRESHOLDS = (0.3, 0.5, 0.7, 0.4)


def test_rows_do_not_depend_on_their_batch(engine):
    """Greedy: each prompt alone, all four together, and in another order with a second
    copy, give the same tokens and exit layers per request."""
    params = [greedy(MAX_NEW, exit_threshold=t) for t in THRESHOLDS]
    alone = [run_requests(engine, [p], [sp])[0] for p, sp in zip(PROMPTS, params, strict=True)]
    before = engine.stats.num_decode_rows, engine.stats.decode_row_layers
    together = run_requests(engine, PROMPTS, params)
    order = [2, 0, 3, 2]
    mixed = run_requests(engine, [PROMPTS[i] for i in order], [params[i] for i in order])
    for got in (together, [mixed[1], None, mixed[0], mixed[2]]):
        for a, b in zip(alone, got, strict=True):
            if b is not None:
                assert (b.token_ids, b.exit_layers) == (a.token_ids, a.exit_layers)
    assert mixed[3].token_ids == mixed[0].token_ids
    layers = [e for o in together + mixed for e in o.exit_layers[1:]]  # [0]: prefill
    assert len(set(layers)) >= 3 and min(layers) < L and L in layers, layers
    # Stats count each row's own layers.
    s = engine.stats
    assert (s.num_decode_rows - before[0], s.decode_row_layers - before[1]) == \
        (len(layers), sum(layers))
    assert s.decode_row_layers <= s.row_layers_computed < s.row_layers_full_depth
    assert s.mean_layers_per_row < L and s.ideal_row_speedup(L) > 1


def test_one_decode_program_whatever_the_exits(engine):
    """Many exit patterns (every exit layer and full depth), one program each. Self-contained:
    the patterns come from this test's own requests, whichever tests ran before it."""
    outs = run_requests(engine, PROMPTS, [greedy(5, exit_threshold=t) for t in THRESHOLDS])
    outs += run_requests(engine, PROMPTS[:3],
                         [greedy(5, exit_threshold=t) for t in (0.0, NEVER, 0.6)])
    seen = {e for o in outs for e in o.exit_layers[1:]}  # [0]: prefill
    assert seen == {*EXIT_LAYERS, L}, seen
    assert all(v <= 1 for v in engine.runner.traces.values()), engine.runner.traces
    assert len([s for s in engine.runner.traces if s.tokens == 1]) == 1
    assert set(engine.stats.row_exit_counts) == {*EXIT_LAYERS, L}
