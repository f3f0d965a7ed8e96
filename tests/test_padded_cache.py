"""A cache stored with head_dim padded to the TPU's 128 lanes (`kv_cache.storage_head_dim`)
serves exactly what the unpadded cache serves.

The truths: the unpadded cache's attention and tokens (checked against dense attention and
the dense model in tests/test_attention_backends.py and tests/test_early_exit.py). The
padding is forced on this CPU by patching the storage rule, the one place it is decided.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ee_jax.models import llama
from ee_jax.models.exits.config import ExitConfig
from ee_jax.serving import attention_kernels, kv_cache
from ee_jax.serving.attention import AttentionMetadata
from ee_jax.serving.controller import ControllerConfig
from ee_jax.serving.engine import EngineConfig, LLMEngine
from ee_jax.serving.kv_cache import NULL_PAGE, KVCache, storage_head_dim
from ee_jax.serving.paged_model import attend
from ee_jax.serving.params import greedy
from ee_jax.testing import tiny_config
from tests.reference import run_requests

CFG = tiny_config(eos_token_ids=())  # head_dim 16, GQA 4/2
PARAMS = llama.init_params(CFG, jax.random.PRNGKey(5), scale=0.4)


def test_storage_head_dim_pads_to_tpu_lanes_only_on_tpu():
    assert [storage_head_dim(d, "tpu") for d in (64, 96, 128, 192, 256)] == \
        [128, 128, 128, 256, 256]
    assert [storage_head_dim(d, "cpu") for d in (64, 128)] == [64, 128]
    assert storage_head_dim(64, "gpu") == 64
    smol = dataclasses.replace(CFG, head_dim=64)
    assert kv_cache.bytes_per_page(smol, 16, "bfloat16", "tpu") == \
        2 * kv_cache.bytes_per_page(smol, 16, "bfloat16", "gpu")
    assert kv_cache.cache_shape(smol, 5, 16, "tpu")[-1] == 128


def test_a_narrower_write_than_the_cache_is_refused_when_wider():
    cache = KVCache(jnp.zeros((1, 2, 4, 2, 8)), jnp.zeros((1, 2, 4, 2, 8)))
    wide = jnp.ones((1, 2, 16))
    with pytest.raises(ValueError, match="head_dim 16 does not fit a cache of head_dim 8"):
        kv_cache.write_layer(cache, 0, jnp.array([1]), jnp.array([0]), wide, wide)


def _case(seed: int, hd_store: int, dtype=jnp.float32):
    """A decode step of 3 rows (one padding row) over a cache stored at `hd_store`, its real
    K/V (the first CFG.head_dim columns) identical whatever hd_store; bf16-exact values."""
    rng = np.random.default_rng(seed)
    hd, K, H, S, P = CFG.head_dim, CFG.n_kv_heads, CFG.n_heads, 4, 12
    rnd = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32))  # noqa: E731
    real = rnd(rng.normal(size=(2, 1, P, S, K, hd)))
    store = np.zeros((2, 1, P, S, K, hd_store), np.float32)
    store[..., :hd] = real
    table = np.array([[3, 5, 7], [2, 4, NULL_PAGE], [NULL_PAGE] * 3], np.int32)
    kv_lens = np.array([10, 6, 0], np.int32)
    meta = AttentionMetadata(jnp.asarray(np.maximum(kv_lens - 1, 0)[:, None]),
                             jnp.asarray(table), jnp.asarray(kv_lens))
    q = rnd(rng.normal(size=(3, 1, H, hd)))
    k, v = (rnd(rng.normal(size=(3, 1, K, hd))) for _ in range(2))
    cache = KVCache(jnp.asarray(store[0], dtype), jnp.asarray(store[1], dtype))
    return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype), cache, meta)


@pytest.mark.parametrize("backend", ["reference", "xla"])
def test_attention_over_a_padded_cache_equals_the_unpadded(backend):
    q, k, v, narrow, meta = _case(0, CFG.head_dim)
    *_, wide, _ = _case(0, 128)
    want, narrow_after = attend(q, k, v, narrow, 0, meta, CFG, backend)
    got, wide_after = attend(q, k, v, wide, 0, meta, CFG, backend)
    assert got.shape == want.shape == q.shape
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=1e-6)
    for a, b in ((wide_after.k, narrow_after.k), (wide_after.v, narrow_after.v)):
        np.testing.assert_array_equal(np.asarray(a[..., :CFG.head_dim]), np.asarray(b))
        assert not np.asarray(a[..., CFG.head_dim:]).any()  # the write's extra columns: zeros


def test_the_tpu_kernel_runs_on_a_padded_cache_where_the_narrow_one_falls_back(monkeypatch):
    """As compiled for a TPU (the kernel interpreted here): at head_dim 16 the backend takes
    the XLA path, at the padded 128 the Pallas kernel, and both equal the reference."""
    from jax.experimental.pallas import tpu as pltpu

    q, k, v, narrow, meta = _case(1, CFG.head_dim)
    *_, wide, _ = _case(1, 128)
    want = attend(q, k, v, narrow, 0, meta, CFG, "reference")[0]
    fallbacks = []
    xla = attention_kernels.xla
    monkeypatch.setattr(attention_kernels, "xla",
                        lambda q, *a, **kw: fallbacks.append(q.shape[-1]) or xla(q, *a, **kw))
    with pltpu.force_tpu_interpret_mode():
        got_narrow = attend(q, k, v, narrow, 0, meta, CFG, "pallas_tpu")[0]
        assert fallbacks == [CFG.head_dim]
        got = attend(q, k, v, wide, 0, meta, CFG, "pallas_tpu")[0]
        assert fallbacks == [CFG.head_dim]  # the kernel, no fallback
    for out in (got, got_narrow):
        np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=1e-5, rtol=1e-5)


ENGINE = EngineConfig.make(max_num_seqs=2, max_model_len=32, page_size=8, num_pages=12,
                           max_prefill_chunk=16, max_num_batched_tokens=32, batch_buckets=(2,),
                           async_scheduling=False, exit_control=ControllerConfig(mode="exits"))


def test_an_engine_on_a_padded_cache_serves_the_same_tokens(monkeypatch):
    """Prefill, decode and the propagated back-fill of a forced exit write and read the
    padded cache: the same greedy tokens, the same K/V in the real columns, zeros beyond."""
    from ee_jax.models.exits import heads as exit_heads

    ec = ExitConfig(exit_layers=(1, 2), force_exit_layer=2, backfill="propagate")
    heads = exit_heads.init_heads(CFG, ec, PARAMS)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, CFG.vocab_size, n).tolist() for n in (5, 11)]
    params = greedy(max_tokens=8)

    def serve():
        engine = LLMEngine(CFG, PARAMS, None, ENGINE, ec, heads)
        outs = run_requests(engine, prompts, params)
        return [o.token_ids for o in outs], engine.runner.cache

    want, narrow = serve()
    monkeypatch.setattr(kv_cache, "storage_head_dim", lambda hd, platform=None: 32)
    got, wide = serve()
    assert wide.k.shape[-1] == 32 and narrow.k.shape[-1] == CFG.head_dim
    assert got == want
    hd = CFG.head_dim
    # the same K/V up to the order of float sums (attention's q.k over 32 columns, not 16)
    np.testing.assert_allclose(np.asarray(wide.k[..., :hd]), np.asarray(narrow.k), atol=1e-5)
    np.testing.assert_allclose(np.asarray(wide.v[..., :hd]), np.asarray(narrow.v), atol=1e-5)
    assert not np.asarray(wide.k[..., hd:]).any() and not np.asarray(wide.v[..., hd:]).any()
