"""Every attention backend equals dense attention computed in numpy from the tokens' own K/V.

The oracle never reads the paged cache: each row's K/V are drawn first, written into random
distinct pages (the rest of the cache is garbage, the table padded with the null page), and
attention is recomputed in float64 from the drawn arrays. Pallas kernels run in interpret
mode on CPU.
"""

from __future__ import annotations

import functools

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from ee_jax.serving import attention_kernels as ak
from ee_jax.serving.attention import AttentionMetadata, paged_attention
from ee_jax.serving.kv_cache import NULL_PAGE, KVCache

H, K, HD, LAYERS = 6, 2, 16, 2
MAX_LEN = 40

PALLAS_GPU = functools.partial(ak.pallas_gpu, interpret=True)
PALLAS_TPU = functools.partial(ak.pallas_tpu, interpret=True)


def make_case(seed: int, lengths: list[int], page_size: int, T: int, spare: int = 1,
              dtype=jnp.float32, bf16_values: bool = False, tight_pool: bool = False):
    """q, cache, meta and the numpy truth inputs for rows of `lengths` tokens (0: padding
    row). Queries are each row's last T positions (clipped at 0). The page pool has room for
    every table entry, or (tight_pool) just the pages the rows hold plus two."""
    rng = np.random.default_rng(seed)
    B = len(lengths)
    # The table width depends on the page size and `spare` only (few compiled shapes); a row
    # of MAX_LEN tokens with spare 0 fills the whole table.
    W = -(-max(MAX_LEN, *lengths) // page_size) + spare
    num_pages = 1 + B * W + 2
    if tight_pool:
        num_pages = 1 + sum(-(-n // page_size) for n in lengths) + 2
    shape = (LAYERS, num_pages, page_size, K, HD)
    ck = rng.normal(size=shape).astype(np.float32)  # garbage everywhere
    cv = rng.normal(size=shape).astype(np.float32)
    ks = [rng.normal(size=(LAYERS, n, K, HD)).astype(np.float32) for n in lengths]
    vs = [rng.normal(size=(LAYERS, n, K, HD)).astype(np.float32) for n in lengths]
    if bf16_values or dtype == jnp.bfloat16:  # values the cache dtype holds exactly
        rnd = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32))  # noqa: E731
        ks, vs = [rnd(a) for a in ks], [rnd(a) for a in vs]
    pool = rng.permutation(np.arange(1, num_pages))
    table = np.full((B, W), NULL_PAGE, np.int32)
    for b, n in enumerate(lengths):
        need = -(-n // page_size)
        table[b, :need], pool = pool[:need], pool[need:]
        for j in range(n):
            ck[:, table[b, j // page_size], j % page_size] = ks[b][:, j]
            cv[:, table[b, j // page_size], j % page_size] = vs[b][:, j]
    positions = np.stack([np.maximum(n - T + np.arange(T), 0) for n in lengths]).astype(np.int32)
    q = rng.normal(size=(B, T, H, HD)).astype(np.float32)
    if dtype == jnp.bfloat16:
        q = np.asarray(jnp.asarray(q, jnp.bfloat16).astype(jnp.float32))
    cache = KVCache(jnp.asarray(ck, dtype), jnp.asarray(cv, dtype))
    meta = AttentionMetadata(jnp.asarray(positions), jnp.asarray(table),
                             jnp.asarray(lengths, jnp.int32))
    return jnp.asarray(q, dtype), cache, meta, (q, ks, vs, positions)


def dense_truth(truth, layer: int, scale: float, window: int | None, softcap: float | None):
    """float64 attention from the drawn K/V; a query that sees no key gives zeros."""
    q, ks, vs, positions = truth
    B, T = positions.shape
    out = np.zeros((B, T, H, HD))
    heads = np.arange(H) // (H // K)  # query head h reads kv head h // (H/K)
    for b in range(B):
        k = ks[b][layer][:, heads].astype(np.float64)  # [n, H, hd]
        v = vs[b][layer][:, heads].astype(np.float64)
        n = k.shape[0]
        if n == 0:
            continue
        s = np.einsum("thd,nhd->thn", q[b].astype(np.float64), k) * scale
        if softcap is not None:
            s = np.tanh(s / softcap) * softcap
        diff = positions[b][:, None] - np.arange(n)[None, :]  # [T, n]
        seen = diff >= 0
        if window:
            seen &= diff < window
        seen = seen[:, None, :]
        s = np.where(seen, s, -np.inf)
        m = np.max(s, axis=-1, keepdims=True)
        p = np.where(seen, np.exp(s - np.where(np.isfinite(m), m, 0)), 0.0)
        den = p.sum(-1, keepdims=True)
        p = np.where(den > 0, p / np.where(den > 0, den, 1), 0)
        out[b] = np.einsum("thn,nhd->thd", p, v)
    return out


# Four rows (padding rows among them), lengths 1 and MAX_LEN often.
lengths_st = st.lists(st.sampled_from([0, 1, MAX_LEN]) | st.integers(0, MAX_LEN),
                      min_size=4, max_size=4)


@functools.cache
def jitted(backend: str):
    """The backend under jit, layer and window traced (as in the decode step)."""
    fn = {"pallas_gpu": PALLAS_GPU, "pallas_tpu": PALLAS_TPU}.get(backend)
    return jax.jit(fn or ak.select_backend(backend), static_argnames=("scale", "softcap"))


@settings(max_examples=20, deadline=None)
@given(backend=st.sampled_from(["reference", "xla"]), page_size=st.sampled_from([1, 2, 4, 16]),
       lengths=lengths_st, T=st.sampled_from([1, 1, 3]), spare=st.integers(0, 2),
       layer=st.integers(0, LAYERS - 1), window=st.sampled_from([None, 0, 1, 3, 8]),
       softcap=st.sampled_from([None, 2.0]), scale=st.sampled_from([None, 0.4]),
       seed=st.integers(0, 2**16))
def test_backend_equals_dense(backend, page_size, lengths, T, spare, layer, window, softcap,
                              scale, seed):
    q, cache, meta, truth = make_case(seed, lengths, page_size, T, spare)
    win = None if window is None else jnp.int32(window)
    got = np.asarray(jitted(backend)(q, cache, jnp.int32(layer), meta, scale=scale, window=win,
                                     softcap=softcap))
    want = dense_truth(truth, layer, HD ** -0.5 if scale is None else scale, window, softcap)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("lengths,page_size", [([1, 16, 7], 4), ([64, 0, 33], 16)])
def test_xla_chunks_and_full_bucket(lengths, page_size):
    """Several chunks (8 keys each), a row that fills the whole table, length 1."""
    q, cache, meta, truth = make_case(3, lengths, page_size, T=1, spare=0)
    for chunk in (8, 16, 1024):
        got = jax.jit(functools.partial(ak.xla, chunk_keys=chunk))(q, cache, 1, meta)
        np.testing.assert_allclose(np.asarray(got), dense_truth(truth, 1, HD ** -0.5, None, None),
                                   atol=1e-5, rtol=1e-5)


@functools.cache
def _xla_blocks(row_block: int):
    return jax.jit(functools.partial(ak.xla, row_block=row_block), static_argnames=("softcap",))


@settings(max_examples=10, deadline=None)
@given(row_block=st.sampled_from([1, 2, 3]), page_size=st.sampled_from([1, 4, 16]),
       lengths=st.lists(st.sampled_from([0, 1, MAX_LEN]) | st.integers(0, MAX_LEN), min_size=6,
                        max_size=7),
       T=st.sampled_from([1, 1, 3]), window=st.sampled_from([None, 3]),
       softcap=st.sampled_from([None, 2.0]), seed=st.integers(0, 2**16))
def test_xla_row_blocks_equal_dense(row_block, page_size, lengths, T, window, softcap, seed):
    """Rows sorted by length and attended in blocks (a block may be shorter than the rest,
    padding rows among them) come back in their own order, each equal to the truth."""
    q, cache, meta, truth = make_case(seed, lengths, page_size, T)
    assert len(lengths) >= 2 * row_block  # the blocked path
    fn = _xla_blocks(row_block)
    win = None if window is None else jnp.int32(window)
    got = np.asarray(fn(q, cache, jnp.int32(1), meta, window=win, softcap=softcap))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, dense_truth(truth, 1, HD ** -0.5, window, softcap),
                               atol=1e-5, rtol=1e-5)


def test_xla_default_row_blocks():
    """Eight rows (two default blocks of four) of mixed lengths, padding rows among them."""
    q, cache, meta, truth = make_case(13, [5, MAX_LEN, 0, 17, 1, 33, 0, 40], 4, T=1)
    got = np.asarray(jitted("xla")(q, cache, jnp.int32(0), meta, scale=None))
    np.testing.assert_allclose(got, dense_truth(truth, 0, HD ** -0.5, None, None),
                               atol=1e-5, rtol=1e-5)


def test_xla_row_block_must_be_positive():
    q, cache, meta, _ = make_case(0, [3, 5], 4, T=1)
    with pytest.raises(ValueError, match="row_block"):
        ak.xla(q, cache, 0, meta, row_block=0)


@settings(max_examples=5, deadline=None)
@given(page_size=st.sampled_from([2, 4, 16]), lengths=lengths_st, T=st.sampled_from([1, 1, 2]),
       window=st.sampled_from([None, None, 3]), softcap=st.sampled_from([None, 2.0]),
       seed=st.integers(0, 2**16))
def test_pallas_gpu_interpreted_equals_dense(page_size, lengths, T, window, softcap, seed):
    """Decode through the Triton kernel (T = 2, deferred's pending query: as two rows; a
    window falls back to xla)."""
    q, cache, meta, truth = make_case(seed, lengths, page_size, T)
    win = None if window is None else jnp.int32(window)
    got = np.asarray(jitted("pallas_gpu")(q, cache, jnp.int32(1), meta, scale=0.3, window=win,
                                          softcap=softcap))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, dense_truth(truth, 1, 0.3, window, softcap),
                               atol=1e-5, rtol=1e-5)


@settings(max_examples=3, deadline=None)
@given(page_size=st.sampled_from([4, 16]), lengths=lengths_st, T=st.sampled_from([1, 2]),
       softcap=st.sampled_from([None, 2.0]), seed=st.integers(0, 2**16))
def test_pallas_tpu_interpreted_equals_dense(page_size, lengths, T, softcap, seed):
    """The TPU kernel rounds K and V to bf16 inside (whatever the cache dtype), so the cache
    holds bf16-representable values here; then it agrees with the f64 truth to f32 level.
    T = 2 (deferred's pending query beside the row's own) runs as two rows."""
    q, cache, meta, truth = make_case(seed, lengths, page_size, T=T, bf16_values=True)
    got = np.asarray(jitted("pallas_tpu")(q, cache, jnp.int32(0), meta, scale=0.3,
                                          softcap=softcap))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, dense_truth(truth, 0, 0.3, None, softcap),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["pallas_gpu", "pallas_tpu"])
@pytest.mark.parametrize("tight_pool", [False, True])
def test_pallas_either_copy_of_the_layer(backend, tight_pool):
    """The wrappers copy the batch's table entries or the layer's whole pool, whichever is
    smaller; both give the truth."""
    q, cache, meta, truth = make_case(11, [MAX_LEN, 3, 0, 17], 4, T=1, bf16_values=True,
                                      tight_pool=tight_pool)
    B, W = meta.page_table.shape
    assert (cache.num_pages <= B * W) == tight_pool
    got = np.asarray(jitted(backend)(q, cache, jnp.int32(1), meta, scale=None))
    np.testing.assert_allclose(got, dense_truth(truth, 1, HD ** -0.5, None, None),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["pallas_gpu", "pallas_tpu"])
def test_pallas_two_queries_a_row(backend):
    """Deferred's decode step: the pending token's query beside the row's own (positions
    n-2, n-1), through the kernel as two rows each stopping at its own position; a row of
    one key (its first query sees it too, clipped at 0) and a padding row among them."""
    q, cache, meta, truth = make_case(4, [MAX_LEN, 1, 0, 9], 4, T=2, bf16_values=True)
    got = np.asarray(jitted(backend)(q, cache, jnp.int32(1), meta, scale=None))
    np.testing.assert_allclose(got, dense_truth(truth, 1, HD ** -0.5, None, None),
                               atol=1e-5, rtol=1e-5)


BF16_TOL = 2e-2  # outputs are O(1); bf16 keeps 8 bits of mantissa (relative step 2^-8)


@pytest.mark.parametrize("backend", ["reference", "xla", "pallas_gpu", "pallas_tpu"])
def test_bf16_cache(backend):
    """bf16 q and cache: each backend within BF16_TOL of the f64 truth on the same values."""
    q, cache, meta, truth = make_case(5, [37, 1, 0, 16], 4, T=1, dtype=jnp.bfloat16)
    got = jitted(backend)(q, cache, 1, meta, scale=None)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got.astype(jnp.float32)),
                               dense_truth(truth, 1, HD ** -0.5, None, None),
                               atol=BF16_TOL, rtol=BF16_TOL)


@pytest.mark.parametrize("backend", ["reference", "xla", "pallas_gpu", "pallas_tpu"])
def test_padding_rows_are_zero(backend):
    """kv_lens 0 (a padding row, its table all null pages) gives zeros, never NaN."""
    q, cache, meta, _ = make_case(7, [0, 5, 0], 4, T=1)
    got = np.asarray(jitted(backend)(q, cache, 0, meta, scale=None))
    assert np.isfinite(got).all()
    assert not got[0].any() and not got[2].any() and got[1].any()


@pytest.mark.parametrize("backend", ["reference", "xla", "pallas_gpu", "pallas_tpu"])
def test_traced_layer_in_fori_loop_compiles_once(backend):
    """Jitted, the layer a traced loop index: each layer's output equals the truth, and a
    second batch of other lengths (same shapes) reuses the compiled program."""
    fn = {"pallas_gpu": PALLAS_GPU, "pallas_tpu": PALLAS_TPU}.get(backend)
    fn = fn or ak.select_backend(backend)
    traces = []

    @jax.jit
    def all_layers(q, cache, meta):
        traces.append(1)

        def body(i, outs):
            return outs.at[i].set(fn(q, cache, i, meta, scale=None))

        return jax.lax.fori_loop(0, LAYERS, body, jnp.zeros((LAYERS, *q.shape), q.dtype))

    for seed, lengths in ((1, [9, 3, 0]), (2, [12, 1, 4])):
        q, cache, meta, truth = make_case(seed, lengths, 4, T=1,
                                          bf16_values=backend == "pallas_tpu")
        got = np.asarray(all_layers(q, cache, meta))
        for layer in range(LAYERS):
            np.testing.assert_allclose(got[layer], dense_truth(truth, layer, HD ** -0.5, None,
                                                               None), atol=1e-5, rtol=1e-5)
    assert len(traces) == 1


def test_reference_is_the_gather_oracle():
    assert ak.select_backend("reference") is paged_attention


def test_select_backend_by_platform():
    assert ak.select_backend("auto", "cpu") is ak.xla
    assert ak.select_backend("auto", "gpu") is ak.pallas_gpu
    assert ak.select_backend("auto", "tpu") is ak.pallas_tpu
    assert ak.select_backend("xla", "tpu") is ak.xla
    assert ak.select_backend("pallas_gpu", "cuda") is ak.pallas_gpu
    # a concrete name needs no platform (a step's, resolved when its config was built);
    # "auto" does: nothing defaults to the platform this process runs on
    assert ak.select_backend("xla") is ak.xla
    assert ak.select_backend("pallas_tpu") is ak.pallas_tpu
    assert ak.backend_name("auto", "TPU") == "pallas_tpu"
    with pytest.raises(ValueError, match=r"'auto' names no backend without a platform"):
        ak.select_backend("auto")


def test_select_backend_refuses_clearly():
    with pytest.raises(ValueError, match=r"unknown attention backend 'flash'.*'xla'"):
        ak.select_backend("flash")
    with pytest.raises(ValueError, match=r"'pallas_tpu' needs a TPU.*'cpu'.*interpret=True"):
        ak.select_backend("pallas_tpu", "cpu")


def test_bad_shapes_are_named():
    q, cache, meta, _ = make_case(0, [3], 4, T=1)
    with pytest.raises(ValueError, match="head_dim"):
        ak.xla(q[..., :8], cache, 0, meta)
    with pytest.raises(ValueError, match="metadata does not fit"):
        ak.xla(jnp.concatenate([q, q]), cache, 0, meta)
