"""Back-fill "learned": fitted maps correct the K/V a skipped layer gets from a
token's exit state (ee_jax/models/exits/backfill_maps.py, ee_jax/training/backfill_fit.py,
ee_jax/serving/backfill.py).

Truths: numpy least squares for the fit; the dense forward's true K/V for the held-out error;
propagate back-fill (and numpy arithmetic on it) for what the step writes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ee_jax.models import llama
from ee_jax.models.exits import backfill_maps as bm
from ee_jax.serving.attention import AttentionMetadata
from ee_jax.serving.backfill import Learned, backfill
from ee_jax.serving.kv_cache import NULL_PAGE, KVCache, storage_dtype
from ee_jax.testing import random_backfill_maps, tiny_config
from ee_jax.training.backfill_fit import MapFitter, kv_errors
from tests.test_families import whole_array_ops

CFG = tiny_config(eos_token_ids=(), n_layers=6)
PARAMS = llama.init_params(CFG, jax.random.PRNGKey(3), scale=0.4)
L, D = CFG.n_layers, CFG.d_model
EXITS = (2, 3, 4)
FIRST = EXITS[0]
KV = CFG.n_kv_heads * CFG.head_dim
PAGE, PAGES = 4, 10


@jax.jit
def _hidden(tokens):  # [B, T] -> the state after each layer [L, B, T, D]
    return llama.forward(PARAMS, tokens, CFG, return_hidden=True)[1]


def _states(n_seq: int, seed: int) -> np.ndarray:
    """[N, L - FIRST, D]: the state after FIRST..L-1 layers of every token of random text."""
    toks = np.random.default_rng(seed).integers(3, CFG.vocab_size, (n_seq, 24))
    h = np.asarray(_hidden(jnp.asarray(toks)))  # [L, B, T, D]
    return np.moveaxis(h[FIRST - 1:L - 1], 0, -2).reshape(-1, L - FIRST, D)


def _np_pre_rope_kv(h: np.ndarray, j: int) -> np.ndarray:
    """Layer j's K/V of input h [N, D] before RoPE, in numpy (the model has no bias/k-norm)."""
    g = np.asarray(PARAMS.layers.attn_norm[j], np.float64)
    x = h.astype(np.float64)
    xn = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + CFG.rms_eps) * g
    return np.concatenate([xn @ np.asarray(PARAMS.layers.wk[j], np.float64),
                           xn @ np.asarray(PARAMS.layers.wv[j], np.float64)], -1)


def _np_regressors(h: np.ndarray) -> np.ndarray:
    x = h.astype(np.float64)
    n = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + CFG.rms_eps)
    return np.concatenate([n, np.ones((len(n), 1))], -1)


@pytest.fixture(scope="module")
def fitted():
    fitter = MapFitter(CFG, PARAMS, EXITS)
    train = _states(24, seed=0)
    fitter.add(train[:300])
    fitter.add(train[300:])  # streamed in two chunks
    return fitter, train


def test_full_rank_fit_without_ridge_is_numpy_least_squares(fitted):
    fitter, train = fitted
    maps = fitter.solve(rank=2 * KV, ridge=0.0)
    for s, e in enumerate(EXITS):
        X = _np_regressors(train[:, e - FIRST])
        for j in range(e + 1, L):
            R = _np_pre_rope_kv(train[:, j - FIRST], j) - _np_pre_rope_kv(train[:, e - FIRST], j)
            want = np.linalg.lstsq(X, R, rcond=None)[0]
            got = np.asarray(maps.a[s, j - FIRST]) @ np.asarray(maps.b[s, j - FIRST])
            np.testing.assert_allclose(X @ got, X @ want, rtol=1e-3, atol=1e-3 * np.abs(
                X @ want).max(), err_msg=f"exit {e} layer {j}")
        # the exit's own layer (its input is the exit state) and below: no correction
        assert not np.any(np.asarray(maps.a[s, :e + 1 - FIRST]))


def test_fitted_maps_lower_held_out_error_against_propagate(fitted):
    fitter, _ = fitted
    maps = fitter.solve(rank=8)
    errs = kv_errors(CFG, PARAMS, EXITS, maps, _states(8, seed=1))
    assert set(errs) == {(e, j) for e in EXITS for j in range(e + 1, L)}
    for (e, j), (kp, kl, vp, vl) in errs.items():
        assert kl < kp and vl < vp, (e, j, kp, kl, vp, vl)


def _step_inputs(seed: int):
    """Three rows (row 1 padding) at positions 5 / - / 9, their pages, and h [3, 1, D]."""
    rng = np.random.default_rng(seed)
    table = np.asarray([[3, 1, 0], [0, 0, 0], [7, 2, 9]], np.int32)
    pos = np.asarray([[5], [0], [9]], np.int32)
    meta = AttentionMetadata(jnp.asarray(pos), jnp.asarray(table),
                             jnp.asarray([6, 0, 10], jnp.int32))
    h = jnp.asarray(rng.normal(size=(3, 1, D)), jnp.float32)
    shape = (L, PAGES, PAGE, CFG.n_kv_heads, CFG.head_dim)
    cache = KVCache(jnp.asarray(rng.normal(size=shape), jnp.float32),
                    jnp.asarray(rng.normal(size=shape), jnp.float32))
    return meta, h, cache


def _random_maps(seed: int, rank: int = 3) -> bm.Maps:
    return random_backfill_maps(CFG, EXITS, rank, seed)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_zero_maps_write_exactly_what_propagate_writes(dtype):
    meta, h, cache = _step_inputs(0)
    cache = KVCache(cache.k.astype(dtype), cache.v.astype(dtype))
    params = llama.cast_params(PARAMS, dtype)
    n_done = jnp.asarray([3, L, 2], jnp.int32)
    slots = jnp.asarray([1, -1, 0], jnp.int32)
    fn = jax.jit(backfill, static_argnames=("cfg", "first"))
    cfg = CFG.replace(dtype=dtype)
    prop = fn(params, cache, h.astype(dtype), n_done, meta, cfg, FIRST)
    learned = fn(params, cache, h.astype(dtype), n_done, meta, cfg, FIRST,
                 learned=Learned(bm.zero_maps(CFG, EXITS, 2), slots, FIRST))
    np.testing.assert_array_equal(np.asarray(learned.k.astype(jnp.float32)),
                                  np.asarray(prop.k.astype(jnp.float32)))
    np.testing.assert_array_equal(np.asarray(learned.v.astype(jnp.float32)),
                                  np.asarray(prop.v.astype(jnp.float32)))


@pytest.mark.parametrize("gather", [True, False], ids=["gather", "every-slot"])
def test_learned_writes_propagate_plus_map_at_the_skipped_slots_only(gather):
    """Each row gets its own exit's maps, whether they are gathered per row (CPU, GPU, small
    TPU batches) or every slot's correction is computed and each row picks its own (TPU at
    larger batches: `backfill_maps.gathers`)."""
    meta, h, cache = _step_inputs(1)
    k0, v0 = np.asarray(cache.k), np.asarray(cache.v)
    maps = _random_maps(2)
    exit_of = {0: 3, 2: 2}  # row -> exit layer; row 1 is padding
    n_done = jnp.asarray([3, L, 2], jnp.int32)
    slots = jnp.asarray([EXITS.index(3), -1, EXITS.index(2)], jnp.int32)
    fn = jax.jit(backfill, static_argnames=("cfg", "first"), donate_argnums=(1,))
    out = fn(PARAMS, cache, h, n_done, meta, CFG, FIRST,
             learned=Learned(maps, slots, FIRST, gather))
    k1, v1 = np.asarray(out.k), np.asarray(out.v)
    inv = llama.rope_inv_freq(CFG)
    touched = np.zeros((PAGES, PAGE), bool)
    touched[NULL_PAGE] = True
    for r, e in exit_of.items():
        p = int(meta.positions[r, 0])
        page, off = int(meta.page_table[r, p // PAGE]), p % PAGE
        touched[page, off] = True
        x = _np_regressors(np.asarray(h[r]))  # [1, D + 1]
        for j in range(L):
            if j < e:  # not skipped: untouched
                np.testing.assert_array_equal(k1[j, page, off], k0[j, page, off])
                continue
            lp = llama.layer_params(PARAMS, j)
            k, v = llama.kv_project(lp, h[r][None], meta.positions[r][None], CFG)
            s = EXITS.index(e)  # zero at j == e: propagate is exact there
            c = x @ np.asarray(maps.a[s, j - FIRST]) @ np.asarray(maps.b[s, j - FIRST])
            dk = c[:, :KV].reshape(1, 1, CFG.n_kv_heads, CFG.head_dim)
            dk = llama.apply_rope(jnp.asarray(dk, jnp.float32), meta.positions[r][None], inv)
            np.testing.assert_allclose(k1[j, page, off], np.asarray(k + dk)[0, 0], atol=1e-5,
                                       rtol=1e-5, err_msg=f"K row {r} layer {j}")
            np.testing.assert_allclose(v1[j, page, off], np.asarray(v)[0, 0] + c[0, KV:].reshape(
                CFG.n_kv_heads, CFG.head_dim), atol=1e-5, rtol=1e-5, err_msg=f"V row {r} {j}")
    np.testing.assert_array_equal(k1[:, ~touched], k0[:, ~touched])
    np.testing.assert_array_equal(v1[:, ~touched], v0[:, ~touched])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_learned_backfill_scatters_into_the_donated_cache(dtype):
    """bf16 model: its cache is stored in f32 on CPU (`kv_cache.storage_dtype`)."""
    meta, h, cache = _step_inputs(2)
    store = storage_dtype(dtype)
    cache = KVCache(cache.k.astype(store), cache.v.astype(store))
    fn = jax.jit(backfill, static_argnames=("cfg", "first"), donate_argnums=(1,))
    args = (llama.cast_params(PARAMS, dtype), cache, h.astype(dtype),
            jnp.asarray([3, L, 2], jnp.int32), meta, CFG.replace(dtype=dtype), FIRST)
    hlo = fn.lower(*args, any_exit=jnp.asarray(True),
                   learned=Learned(_random_maps(0), jnp.asarray([1, -1, 0], jnp.int32), FIRST)
                   ).compile().as_text()
    assert whole_array_ops(hlo, cache.k.shape) == []


def test_maps_for_other_exits_or_shapes_are_refused(tmp_path):
    maps = _random_maps(4)
    with pytest.raises(bm.BackfillMapsError, match=r"exit layers \[1, 3\]"):
        bm.check_maps(CFG, (1, 3), maps)
    with pytest.raises(bm.BackfillMapsError, match="leaves 'a' and 'b'"):
        bm.check_maps(CFG, EXITS, {"a": maps.a})
    bad = maps.replace(b=maps.b[..., :-1])
    with pytest.raises(bm.BackfillMapsError, match="'b' has shape"):
        bm.check_maps(CFG, EXITS, bad)
    bm.save_maps(tmp_path, CFG, EXITS, maps, info={"tokens": 1})
    got, info = bm.load_maps(tmp_path, CFG, EXITS)
    assert info == {"tokens": 1}
    used = [(s, j - FIRST) for s, j in bm.used(EXITS, L)]
    for k in ("a", "b"):  # bf16 on disk; unused pairs come back zero
        mk = getattr(maps, k)
        want = np.zeros(mk.shape, np.float32)
        for s, j in used:
            want[s, j] = np.asarray(mk[s, j].astype(jnp.bfloat16).astype(jnp.float32))
        np.testing.assert_array_equal(np.asarray(getattr(got, k)), want)
    with pytest.raises(bm.BackfillMapsError, match=r"fitted for exit layers \[2, 3, 4\]"):
        bm.load_maps(tmp_path, CFG, (2, 3))
    with pytest.raises(bm.BackfillMapsError, match="fitted for a model"):
        bm.load_maps(tmp_path, CFG.replace(d_model=64), EXITS)
    with pytest.raises(bm.BackfillMapsError, match="missing"):
        bm.load_maps(tmp_path / "nothing", CFG, EXITS)



def test_saved_heads_and_maps_are_readable_by_others_as_the_umask_allows(tmp_path):
    """safetensors' own writer makes owner-only files (0600): heads tuned by one user could
    not be served by another. Saved files get what `open` gives under the umask."""
    import os
    import stat

    from ee_jax.models.exits import checkpoint as exit_checkpoint
    from ee_jax.models.exits.config import ExitConfig

    ec = ExitConfig(exit_layers=EXITS, backfill="learned")
    heads = _heads(ec, _random_maps(4, rank=5))
    old = os.umask(0o022)
    try:
        exit_checkpoint.save_exit_heads(tmp_path / "h", CFG, ec, heads)
    finally:
        os.umask(old)
    files = sorted((tmp_path / "h").iterdir())
    assert {f.name for f in files} >= {bm.FILE, exit_checkpoint.HEADS}
    for f in files:
        assert stat.S_IMODE(f.stat().st_mode) == 0o644, f.name
    got_ec, got = exit_checkpoint.load_exit_heads(tmp_path / "h", CFG)
    assert got_ec.backfill == "learned" and bm.rank_of(got.backfill) == 5


# --------------------------------------------------------------------------- in the engine

ENGINE_PROMPTS = [[5, 6, 7, 8, 9], [3, 4, 10], [11, 12]]


def _engine(ec, heads, mesh=None):
    from ee_jax.serving.controller import ControllerConfig
    from ee_jax.serving.engine import EngineConfig, LLMEngine

    return LLMEngine(CFG, PARAMS, None, EngineConfig.make(
        max_num_seqs=4, max_model_len=64, page_size=4, num_pages=40, batch_buckets=(4,),
        mesh=mesh, exit_control=ControllerConfig(mode="exits")), ec, heads)


def _heads(ec, maps):
    from ee_jax.models.exits import heads as exit_heads

    return exit_heads.init_heads(CFG, ec, PARAMS).replace(backfill=maps)


@pytest.mark.parametrize("backfill", ["deferred", "propagate", "learned", "deferred_learned"])
def test_exits_never_taken_give_full_depth_tokens(backfill):
    from ee_jax.models.exits.config import NEVER, ExitConfig
    from ee_jax.serving.params import greedy
    from tests.reference import dense_greedy, run_requests

    ec = ExitConfig(exit_layers=EXITS, threshold=NEVER, backfill=backfill)
    outs = run_requests(_engine(ec, _heads(ec, _random_maps(5))), ENGINE_PROMPTS, greedy(6))
    assert [o.token_ids for o in outs] == [dense_greedy(CFG, PARAMS, p, 6)
                                            for p in ENGINE_PROMPTS]


def test_learned_serves_sharded_as_on_one_device():
    """tp=2 (8 simulated devices, conftest): tokens agree, the back-filled cache to the
    rounding of split reductions."""
    from ee_jax.models.exits.config import ExitConfig
    from ee_jax.serving.params import greedy
    from tests.reference import run_requests

    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS, set in conftest.py)")
    ec = ExitConfig(exit_layers=EXITS, force_exit_layer=3, backfill="learned")
    heads = _heads(ec, _random_maps(6))
    got = {}
    for mesh in (None, "tp=2"):
        engine = _engine(ec, heads, mesh)
        outs = run_requests(engine, ENGINE_PROMPTS, greedy(5))
        assert set(engine.stats.row_exit_counts) == {3}
        got[mesh] = ([o.token_ids for o in outs], np.asarray(engine.runner.cache.k),
                     np.asarray(engine.runner.cache.v))
    assert got[None][0] == got["tp=2"][0]
    np.testing.assert_allclose(got["tp=2"][1], got[None][1], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got["tp=2"][2], got[None][2], rtol=1e-4, atol=1e-4)


def test_engine_refuses_maps_that_do_not_fit():
    from ee_jax.models.exits.config import ExitConfig, ExitConfigError

    ec = ExitConfig(exit_layers=EXITS, backfill="learned")
    with pytest.raises(ExitConfigError, match="needs fitted maps"):
        _engine(ec, _heads(ec, None).replace(backfill=None))
    other = tiny_config(eos_token_ids=(), n_layers=6, d_model=64)
    with pytest.raises(bm.BackfillMapsError, match="'a' has shape"):  # another model's
        _engine(ec, _heads(ec, bm.zero_maps(other, EXITS, 2)))
    with pytest.raises(bm.BackfillMapsError, match=r"exit layers \[2, 3, 4\]"):  # other exits
        _engine(ec, _heads(ec, bm.zero_maps(CFG, (1, 3), 2)))
