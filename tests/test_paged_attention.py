"""Paged attention equals dense attention for any page table, length and page size."""

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings

from ee_jax.models.llama import attention_weights_mask, gqa_attention
from ee_jax.serving.attention import AttentionMetadata, paged_attention, write_kv
from ee_jax.serving.kv_cache import NULL_PAGE, KVCache
from ee_jax.testing import tiny_config

CFG = tiny_config(n_layers=2)
# One program per example's shapes (not one per op: eager ops each compile for new shapes).
_write = jax.jit(write_kv, static_argnums=1)
_paged = jax.jit(paged_attention, static_argnums=2)
_dense = jax.jit(lambda q, k, v, q_pos, key_pos, valid: gqa_attention(
    q, k, v, attention_weights_mask(q_pos, key_pos, valid)))


@settings(max_examples=12, deadline=None)
@given(page_size=st.sampled_from([1, 2, 4, 8]),
       lengths=st.lists(st.integers(1, 40), min_size=1, max_size=3),
       q_len=st.integers(1, 5), layer=st.integers(0, 1), seed=st.integers(0, 2**16))
def test_paged_equals_dense(page_size, lengths, q_len, layer, seed):
    rng = np.random.default_rng(seed)
    B, K, H, hd = len(lengths), CFG.n_kv_heads, CFG.n_heads, CFG.head_dim
    W = max(-(-n // page_size) for n in lengths) + 1  # one spare column of null pages
    num_pages = 1 + B * W + 3
    # Random, disjoint page tables drawn from a shuffled pool (page 0 is the null page).
    pool = rng.permutation(np.arange(1, num_pages))
    table = np.full((B, W), NULL_PAGE, np.int32)
    for b, n in enumerate(lengths):
        need = -(-n // page_size)
        table[b, :need] = pool[:need]
        pool = pool[need:]
    shape = (2, num_pages, page_size, K, hd)
    cache = KVCache(jnp.asarray(rng.normal(size=shape), jnp.float32),  # garbage everywhere
                    jnp.asarray(rng.normal(size=shape), jnp.float32))
    T = max(lengths)
    k = rng.normal(size=(B, T, K, hd)).astype(np.float32)
    v = rng.normal(size=(B, T, K, hd)).astype(np.float32)
    lens = np.asarray(lengths, np.int32)
    positions = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))
    cache = _write(cache, layer, AttentionMetadata(jnp.asarray(positions), jnp.asarray(table),
                                                   jnp.asarray(lens)), jnp.asarray(k),
                   jnp.asarray(v))
    # Queries: the last q_len real positions of each row (clipped at 0).
    q_pos = np.stack([np.maximum(n - q_len + np.arange(q_len), 0) for n in lengths]).astype(
        np.int32)
    q = rng.normal(size=(B, q_len, H, hd)).astype(np.float32)
    meta = AttentionMetadata(jnp.asarray(q_pos), jnp.asarray(table), jnp.asarray(lens))
    got = np.asarray(_paged(jnp.asarray(q), cache, layer, meta))

    key_pos = np.arange(T)
    for b, n in enumerate(lengths):
        want = _dense(q[b], k[b], v[b], q_pos[b], key_pos, key_pos < n)
        np.testing.assert_allclose(got[b], np.asarray(want), atol=1e-5, rtol=1e-5)


def test_padding_writes_never_touch_live_pages():
    cache = KVCache(jnp.zeros((1, 4, 2, 1, 2)), jnp.zeros((1, 4, 2, 1, 2)))
    table = jnp.asarray([[1, 2], [3, 0]], jnp.int32)
    # Row 1 is a padding row (kv_len 0) whose positions would map to live page 3.
    meta = AttentionMetadata(jnp.asarray([[0, 1], [0, 1]], jnp.int32), table,
                             jnp.asarray([2, 0], jnp.int32))
    ones = jnp.ones((2, 2, 1, 2))
    cache = write_kv(cache, 0, meta, ones, ones)
    k = np.asarray(cache.k)
    assert k[0, 1].sum() == 4  # row 0 wrote its two tokens into page 1
    assert k[0, 3].sum() == 0 and k[0, 2].sum() == 0  # padding row touched no live page


def test_write_is_a_scatter_not_a_copy():
    """The jaxpr of a write holds a scatter and no select over the whole cache."""
    cache = KVCache(jnp.zeros((2, 8, 4, 2, 4)), jnp.zeros((2, 8, 4, 2, 4)))
    meta = AttentionMetadata(jnp.zeros((3, 1), jnp.int32), jnp.ones((3, 2), jnp.int32),
                             jnp.ones((3,), jnp.int32))
    jaxpr = jax.make_jaxpr(lambda c, k: write_kv(c, 1, meta, k, k))(cache,
                                                                      jnp.ones((3, 1, 2, 4)))
    eqns = list(_all_eqns(jaxpr.jaxpr))
    assert any(e.primitive.name == "scatter" for e in eqns)
    big = [e.primitive.name for e in eqns
           if any(getattr(v.aval, "shape", ()) == cache.k.shape for v in e.outvars)
           and e.primitive.name not in ("scatter", "jit", "pjit")]
    assert not big, f"whole-cache ops besides the scatter: {big}"


def _all_eqns(jaxpr):
    for e in jaxpr.eqns:
        yield e
        for param in e.params.values():
            inner = getattr(param, "jaxpr", None)
            if inner is not None:
                yield from _all_eqns(getattr(inner, "jaxpr", inner))
