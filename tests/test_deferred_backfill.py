"""Back-fill "deferred": a token that left early gets its skipped layers' exact K/V from its
row's next decode step (ExitConfig.backfill; ee_jax/serving/step.py).

Two decode steps, token a then token b, on rows whose prompts are in the cache at full depth,
checked against the dense full-depth forward of prompt + [a, b] (an independent truth):

* a left at e_a, b ran to L: both tokens' K/V in every layer are full depth's, and b's
  logits are full depth's, as if a had never left;
* b left at e_b too: a's K/V are full depth's below max(e_a, e_b) and propagated from its
  dense state after max(e_a, e_b) layers above; b's are full depth's below e_b and
  propagated from its dense state at e_b above; b's logits are its exit head's.

Back-fill "deferred_learned" is the same, with the propagated K/V above the first skipped
layer corrected by the fitted map of the exit they are propagated from (computed here in
numpy from the maps' definition, `ee_jax.models.exits.backfill_maps`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ee_jax.models import llama
from ee_jax.models.exits import backfill_maps
from ee_jax.models.exits import heads as exit_heads
from ee_jax.models.exits.config import NEVER, ExitConfig
from ee_jax.serving.attention import AttentionMetadata
from ee_jax.serving.kv_cache import NULL_PAGE, KVCache
from ee_jax.serving.step import BatchExit, PerRow, model_step
from ee_jax.testing import tiny_config

CFG = tiny_config(eos_token_ids=())  # 4 layers
PARAMS = llama.init_params(CFG, jax.random.PRNGKey(8), scale=0.4)
L = CFG.n_layers
EXIT_LAYERS = (1, 2, 3)
LAYERS = [llama.layer_params(PARAMS, i) for i in range(L)]
PAGE, NUM_PAGES = 4, 16
RNG = np.random.default_rng(21)
# (prompt, pages, a, b): disjoint pages; a and b may straddle a page boundary (row 0).
ROWS = [(RNG.integers(3, 128, n).tolist(), pages, a, b) for n, pages, a, b in
        ((3, [3, 1], 17, 40), (9, [7, 2, 9], 101, 5), (5, [4, 12], 55, 77))]
C = {1: 0.2, 2: 0.5, 3: 0.8}  # every row's confidence at each exit (classifier with w = 0)
GRID = [0.1, 0.3, 0.6, 0.9, NEVER]  # -> first confident exit 1, 2, 3, L, L


def _heads(ec):
    heads = exit_heads.init_heads(CFG, ec, PARAMS)
    noise = jax.random.normal(jax.random.PRNGKey(2), heads.norm.shape)
    b = [np.log(C[e] / (1 - C[e])) for e in EXIT_LAYERS]
    return heads.replace(norm=heads.norm * (1 + 0.3 * noise),
                classifier={"w": jnp.zeros((len(EXIT_LAYERS), CFG.d_model), jnp.float32),
                            "b": jnp.asarray(b, jnp.float32)})


def _ec(policy, backfill="deferred"):
    return ExitConfig(exit_layers=EXIT_LAYERS, measure="classifier", policy=policy,
                      backfill=backfill)


def _maps(rank=2):
    """Random maps, zero where the format holds zero (a map's exit layer and below)."""
    shapes = backfill_maps.map_shapes(CFG, EXIT_LAYERS, rank)
    rng = np.random.default_rng(5)
    maps = backfill_maps.Maps(**{k: 0.3 * rng.standard_normal(getattr(shapes, k).shape).astype(
        np.float32) for k in backfill_maps.LEAVES})
    for s_, e in enumerate(EXIT_LAYERS):
        for j in range(e + 1 - EXIT_LAYERS[0]):
            maps.a[s_, j] = 0.0
    return maps


MAPS = _maps()
HEADS = _heads(_ec("per_row")).replace(backfill=jax.tree.map(jnp.asarray, MAPS))
# deferred_learned only under per_row, in one row stage: what it adds (the maps' correction in
# the back-fill after the layers) is the same code under both policies and every stage
COMBOS = (("per_row", "deferred"), ("all", "deferred"), ("per_row", "deferred_learned"))


def _correction(h, e, j, pos):
    """The map's (dk with RoPE, dv) [K, hd] for a token whose state after e layers is h,
    in skipped layer j, straight from the definition: n = [h / rms(h), 1], n @ a @ b."""
    n = np.append(h / np.sqrt(np.mean(h * h) + CFG.rms_eps), 1.0)
    s, jj = EXIT_LAYERS.index(e), j - EXIT_LAYERS[0]
    c = n @ MAPS.a[s, jj] @ MAPS.b[s, jj]
    kv = CFG.n_kv_heads * CFG.head_dim
    dk = c[:kv].reshape(CFG.n_kv_heads, CFG.head_dim)
    rope = llama.apply_rope(jnp.asarray(dk)[None, None], jnp.asarray([[pos]]),
                            llama.rope_inv_freq(CFG))
    return np.asarray(rope)[0, 0], c[kv:].reshape(CFG.n_kv_heads, CFG.head_dim)


@jax.jit
def _dense_hidden(tokens):
    return llama.forward(PARAMS, tokens[None], CFG, return_hidden=True)[1][:, 0]  # [L, T, D]


@jax.jit
def _kv(lp, h, pos):
    k, v = llama.kv_project(lp, h[None], pos[None], CFG)
    return k[0], v[0]


def _slot(pages, p):
    return pages[p // PAGE], p % PAGE


@pytest.fixture(scope="module")
def case():
    k0 = np.zeros((L, NUM_PAGES, PAGE, CFG.n_kv_heads, CFG.head_dim), np.float32)
    v0 = np.zeros_like(k0)
    refs = []
    for prompt, pages, a, b in ROWS:
        seq = [*prompt, a, b]
        hidden = np.asarray(_dense_hidden(jnp.asarray(seq)))  # [L, T, D]
        inputs = lambda p: [np.asarray(PARAMS.embed[seq[p]])] + [hidden[i, p]  # noqa: E731
                                                                   for i in range(L - 1)]
        for p in range(len(prompt)):
            page, off = _slot(pages, p)
            for j, x in enumerate(inputs(p)):
                k0[j, page, off], v0[j, page, off] = _kv(LAYERS[j], x, p)
        n = len(prompt)
        refs.append(dict(pos=n, hidden=hidden, full={p: [_kv(LAYERS[j], x, p) for j, x in
                                                        enumerate(inputs(p))]
                                                     for p in (n, n + 1)}))

    steps = {}
    for policy, backfill in COMBOS:
        ec = _ec(policy, backfill)
        if backfill == "deferred_learned":
            ec = dataclasses.replace(ec, min_row_bucket=len(ROWS))
        pol = PerRow(ec) if policy == "per_row" else BatchExit(ec)

        def two_steps(cache, meta_a, meta_b, tokens_a, tokens_b, thr_a, thr_b, pol=pol):
            ra, cache = model_step(PARAMS, HEADS, cache, tokens_a, meta_a, thr_a, CFG, pol)
            rb, cache = model_step(PARAMS, HEADS, cache, tokens_b, meta_b, thr_b, CFG, pol,
                                   pending=ra.pending)
            return ra.exit_layer, rb.exit_layer, rb.logits, cache

        steps[policy, backfill] = jax.jit(two_steps)
    return dict(k0=k0, v0=v0, refs=refs, steps=steps)


def _first(t):
    return next((e for e in EXIT_LAYERS if C[e] >= t), L)


@settings(max_examples=40, deadline=None)
@given(combo=st.sampled_from(COMBOS),
       thr=st.lists(st.tuples(st.sampled_from(GRID), st.sampled_from(GRID)),
                    min_size=len(ROWS), max_size=len(ROWS)))
def test_next_step_completes_the_skipped_layers(case, combo, thr):
    policy, backfill = combo
    B, W = len(ROWS), 3
    table = np.full((B, W), NULL_PAGE, np.int32)
    for r, (_, pages, _, _) in enumerate(ROWS):
        table[r, :len(pages)] = pages
    pos = np.array([ref["pos"] for ref in case["refs"]], np.int32)

    def meta(shift):
        return AttentionMetadata(jnp.asarray(pos[:, None] + shift), jnp.asarray(table),
                                 jnp.asarray(pos + shift + 1))

    tok = lambda i: jnp.asarray([[row[2 + i]] for row in ROWS], jnp.int32)  # noqa: E731
    ta = jnp.asarray([t[0] for t in thr], jnp.float32)
    tb = jnp.asarray([t[1] for t in thr], jnp.float32)
    cache = KVCache(jnp.asarray(case["k0"]), jnp.asarray(case["v0"]))
    ea, eb, logits, cache = case["steps"][policy, backfill](cache, meta(0), meta(1), tok(0),
                                                            tok(1), ta, tb)
    want_a = [_first(t[0]) for t in thr]
    want_b = [_first(t[1]) for t in thr]
    if policy == "all":
        want_a, want_b = [max(want_a)] * B, [max(want_b)] * B
    assert np.asarray(ea).tolist() == want_a and np.asarray(eb).tolist() == want_b
    k1, v1 = np.asarray(cache.k), np.asarray(cache.v)
    logits = np.asarray(logits)
    for r, ((_, pages, _, _), ref) in enumerate(zip(ROWS, case["refs"], strict=True)):
        p, hid = ref["pos"], ref["hidden"]
        e_a, e_b = want_a[r], want_b[r]
        top_a = max(e_a, e_b) if e_b < L else L  # layers token a has really run
        for q, top in ((p, top_a), (p + 1, e_b)):
            page, off = _slot(pages, q)
            for j in range(L):
                k, v = ref["full"][q][j] if j < top else _kv(LAYERS[j], hid[top - 1, q], q)
                if backfill == "deferred_learned" and top < j:
                    dk, dv = _correction(hid[top - 1, q], top, j, q)
                    k, v = np.asarray(k) + dk, np.asarray(v) + dv
                np.testing.assert_allclose(k1[j, page, off], k, atol=1e-4, rtol=1e-4,
                                           err_msg=f"K row {r} pos {q} layer {j} {e_a}/{e_b}")
                np.testing.assert_allclose(v1[j, page, off], v, atol=1e-4, rtol=1e-4,
                                           err_msg=f"V row {r} pos {q} layer {j} {e_a}/{e_b}")
        want = (exit_heads.exit_logits(PARAMS, HEADS, EXIT_LAYERS.index(e_b),
                                       hid[e_b - 1, p + 1], CFG)
                     if e_b < L else llama.final_head(PARAMS, jnp.asarray(hid[L - 1, p + 1]), CFG))
        np.testing.assert_allclose(logits[r], want, atol=2e-4, rtol=2e-4, err_msg=f"row {r}")
