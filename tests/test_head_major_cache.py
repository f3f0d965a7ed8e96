"""A head-major pool ([K, L, P, S, hd], what the Pallas kernels read: `kv_cache` docstring)
serves exactly what the layer-major pool serves.

The truths: the layer-major pool's attention and tokens (each checked against dense attention
and the dense model in tests/test_attention_backends.py and tests/test_early_exit.py). The
layout is forced on this CPU by patching the engine's rule, the one place it is decided.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ee_jax.models import llama
from ee_jax.models.exits import heads as exit_heads
from ee_jax.models.exits.config import ExitConfig
from ee_jax.serving import attention_kernels as ak
from ee_jax.serving import plan as plan_module
from ee_jax.serving.attention import AttentionMetadata
from ee_jax.serving.controller import ControllerConfig
from ee_jax.serving.engine import EngineConfig, LLMEngine
from ee_jax.serving.kv_cache import NULL_PAGE, KVCache, write_slots
from ee_jax.serving.params import greedy
from ee_jax.testing import tiny_config
from tests.reference import run_requests

CFG = tiny_config(eos_token_ids=())  # 4 layers, head_dim 16, GQA 4/2
PARAMS = llama.init_params(CFG, jax.random.PRNGKey(5), scale=0.4)
L, K, HD, H = CFG.n_layers, CFG.n_kv_heads, CFG.head_dim, CFG.n_heads


def head_major(cache: KVCache) -> KVCache:
    """The same pool, head-major: [L, P, S, K, hd] -> [K, L, P, S, hd]."""
    return KVCache(*(jnp.transpose(a, (3, 0, 1, 2, 4)) for a in (cache.k, cache.v)), True)


def _pool(seed: int, P: int = 9, S: int = 4) -> KVCache:
    rng = np.random.default_rng(seed)
    return KVCache(*(jnp.asarray(rng.normal(size=(L, P, S, K, HD)), jnp.float32)
                     for _ in range(2)))


def test_writes_land_in_the_same_slots():
    """write_slots at (layer, page, offset) index arrays that broadcast, and one slot."""
    pool = _pool(0)
    rng = np.random.default_rng(1)
    layers = jnp.arange(L)[:, None, None]  # [L, 1, 1] against [2, 3] slots
    pages = jnp.asarray(rng.integers(1, pool.num_pages, (2, 3)), jnp.int32)
    offsets = jnp.asarray(rng.integers(0, pool.page_size, (2, 3)), jnp.int32)
    k = jnp.asarray(rng.normal(size=(L, 2, 3, K, HD)), jnp.float32)
    for idx, kk in (((layers, pages, offsets), k),
                    ((jnp.int32(2), pages[0, :1], offsets[0, :1]), k[2, 0, :1])):
        want = head_major(write_slots(pool, *idx, kk, -kk))
        got = write_slots(head_major(pool), *idx, kk, -kk)
        assert got.head_major and got.num_pages == pool.num_pages
        np.testing.assert_array_equal(np.asarray(got.k), np.asarray(want.k))
        np.testing.assert_array_equal(np.asarray(got.v), np.asarray(want.v))


def _attention_case(T: int):
    rng = np.random.default_rng(7)
    pool = _pool(2)
    lengths = np.array([13, 1, 0, 27])
    B, W = len(lengths), 8
    table = np.full((B, W), NULL_PAGE, np.int32)
    free = list(rng.permutation(np.arange(1, pool.num_pages)))
    for b, n in enumerate(lengths):
        for j in range(-(-int(n) // pool.page_size)):
            table[b, j] = free.pop() if free else 1
    positions = np.stack([np.maximum(n - T + np.arange(T), 0) for n in lengths])
    meta = AttentionMetadata(jnp.asarray(positions, jnp.int32), jnp.asarray(table),
                             jnp.asarray(lengths, jnp.int32))
    q = jnp.asarray(rng.normal(size=(B, T, H, HD)), jnp.float32)
    return q, pool, meta


BACKENDS = {"reference": ak.reference, "xla": ak.xla,
            "pallas_gpu": functools.partial(ak.pallas_gpu, interpret=True),
            "pallas_tpu": functools.partial(ak.pallas_tpu, interpret=True)}


@pytest.mark.parametrize("T", [1, 2, 3])
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_every_backend_reads_a_head_major_pool_as_the_layer_major_one(backend, T):
    """Pools of 9 pages of 4, so the table of 8 pages a row is smaller than the pool for
    the layer-major kernels' copy of the table's pages; T = 3 takes the kernels' XLA path."""
    q, pool, meta = _attention_case(T)
    fn = jax.jit(BACKENDS[backend])
    want = np.asarray(fn(q, pool, jnp.int32(2), meta))
    got = np.asarray(fn(q, head_major(pool), jnp.int32(2), meta))
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-6)


def test_the_kernels_read_a_head_major_pool_without_a_copy():
    """`layer_pages` of a head-major pool is reshapes and the table's offset: no gather, no
    slice, no transpose of the pool (the layer-major pool's is one of them)."""
    _, pool, meta = _attention_case(1)
    copies = {"gather", "dynamic_slice", "transpose", "copy", "slice"}

    def prims(cache):
        jaxpr = jax.make_jaxpr(lambda c, n, t: ak.layer_pages(c, n, t))(cache, jnp.int32(1),
                                                                         meta.page_table)
        return {e.primitive.name for e in jaxpr.eqns}

    assert not prims(head_major(pool)) & copies, prims(head_major(pool))
    assert prims(pool) & copies  # the layer-major pool is copied (what head-major saves)


ENGINE = EngineConfig.make(max_num_seqs=2, max_model_len=32, page_size=8, num_pages=12,
                           max_prefill_chunk=16, max_num_batched_tokens=32, batch_buckets=(2,),
                           attention="xla", async_scheduling=False,
                           exit_control=ControllerConfig(mode="exits"))


@pytest.mark.parametrize("backfill", ["deferred", "propagate"])
def test_an_engine_on_a_head_major_pool_serves_the_same_tokens(monkeypatch, backfill):
    """Prefill, decode, exits at layer 2 and their back-fill (deferred: the pending token's
    second query and its refill) write and read the head-major pool: the same tokens and the
    same K/V in every slot."""
    ec = ExitConfig(exit_layers=(1, 2), force_exit_layer=2, backfill=backfill)
    heads = exit_heads.init_heads(CFG, ec, PARAMS)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, CFG.vocab_size, n).tolist() for n in (5, 11)]

    def serve():
        engine = LLMEngine(CFG, PARAMS, None, ENGINE, ec, heads)
        outs = run_requests(engine, prompts, greedy(max_tokens=8))
        assert set(engine.stats.row_exit_counts) == {2}
        return [o.token_ids for o in outs], engine.runner.cache

    want, layer_major = serve()
    monkeypatch.setattr(plan_module, "head_major_for", lambda backend: True)
    got, pool = serve()
    assert pool.head_major and not layer_major.head_major
    assert got == want
    np.testing.assert_array_equal(np.asarray(pool.k), np.asarray(head_major(layer_major).k))
    np.testing.assert_array_equal(np.asarray(pool.v), np.asarray(head_major(layer_major).v))
