"""Fine-tuning learned back-fill maps through the served loss (ee_jax/training/backfill_tune.py).

Truths: the dense forward (nothing leaves), batch-1 decoding written out token by token with
back-fill "learned" (tests/reference.py), and the loss itself (a step of the optimiser lowers it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ee_jax.models import llama
from ee_jax.models.exits import backfill_maps as bm
from ee_jax.testing import random_backfill_maps, tiny_config
from ee_jax.training import backfill_tune as bt
from tests.reference import learned_backfill_states

CFG = tiny_config(eos_token_ids=(), n_layers=6)
PARAMS = llama.init_params(CFG, jax.random.PRNGKey(5), scale=0.4)
L, D = CFG.n_layers, CFG.d_model
EXITS = (2, 3, 4)
FIRST = EXITS[0]


def _random_maps(seed: int, rank: int = 3) -> bm.Maps:
    return random_backfill_maps(CFG, EXITS, rank, seed)


def _h_first(tokens: np.ndarray) -> jax.Array:
    return llama.forward(PARAMS, jnp.asarray(tokens), CFG, return_hidden=True)[1][FIRST - 1]


def test_nothing_leaving_is_the_dense_forward():
    tokens = np.random.default_rng(0).integers(3, CFG.vocab_size, (2, 12))
    exit_at = np.full(tokens.shape, L, np.int32)
    got = bt.served_forward(PARAMS, _random_maps(1), _h_first(tokens), jnp.asarray(exit_at),
                            CFG, EXITS)
    dense = llama.forward(PARAMS, jnp.asarray(tokens), CFG, return_hidden=True)[1][-1]
    np.testing.assert_allclose(np.asarray(got), np.asarray(dense), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("maps", ["zero", "random"])
def test_later_tokens_see_what_learned_backfill_writes(maps):
    """Consecutive tokens leave at different exits (and one at the first exit, one at the
    last); every full-depth position's final state is the token-by-token decode's."""
    tokens = np.random.default_rng(2).integers(3, CFG.vocab_size, 14)
    exit_at = np.full(14, L, np.int32)
    exit_at[[3, 4, 5, 8, 9, 12]] = [2, 4, 3, 2, 3, 4]
    m = bm.zero_maps(CFG, EXITS, 3) if maps == "zero" else _random_maps(3)
    got = np.asarray(bt.served_forward(PARAMS, m, _h_first(tokens[None]),
                                       jnp.asarray(exit_at[None]), CFG, EXITS))[0]
    want = learned_backfill_states(CFG, PARAMS, m, EXITS, tokens, exit_at)
    full = exit_at == L
    np.testing.assert_allclose(got[full], want[full], rtol=2e-4, atol=2e-4)
    # and the back-fill matters here: the dense forward differs at those positions
    dense = np.asarray(llama.forward(PARAMS, jnp.asarray(tokens[None]), CFG,
                                     return_hidden=True)[1][-1, 0])
    assert np.abs(dense[full] - got[full]).max() > 1e-2


def test_exit_plan_takes_the_first_confident_exit_where_a_token_may_leave():
    conf = np.zeros((3, 1, 5), np.float32)  # exits (2, 3, 4), positions 0..4
    conf[1, 0, 1] = 0.99  # position 1 at exit 3
    conf[0, 0, 2] = conf[2, 0, 2] = 0.99  # position 2 at exit 2 (the first)
    conf[2, 0, 3] = 0.98  # position 3 just below the threshold
    conf[0, 0, 4] = 0.99  # position 4 may not leave
    can = np.asarray([[True, True, True, True, False]])
    got = bt.exit_plan(conf, EXITS, can, 0.985, L)
    np.testing.assert_array_equal(got, [[L, 3, 2, L, L]])


def test_finetuning_lowers_the_served_loss_and_keeps_unused_entries_zero():
    rng = np.random.default_rng(4)
    tokens = rng.integers(3, CFG.vocab_size, (2, 16))
    exit_at = np.where(rng.random((2, 16)) < 0.4, rng.choice(EXITS, (2, 16)), L).astype(np.int32)
    exit_at[:, 0] = L
    pos = np.stack([np.flatnonzero(r == L)[:8] for r in exit_at]).astype(np.int32)
    _, hidden = llama.forward(PARAMS, jnp.asarray(tokens), CFG, return_hidden=True)
    batch = bt.Batch(np.asarray(hidden[FIRST - 1]), exit_at, pos, np.ones(pos.shape, bool),
                     np.take_along_axis(np.asarray(hidden[-1]), pos[..., None], axis=1))
    start = _random_maps(6)  # not zero: a zero low-rank product has a zero gradient
    before = bt.evaluate(CFG, PARAMS, start, [batch], EXITS)
    maps, _ = bt.finetune(CFG, PARAMS, start, [batch], EXITS, epochs=30, lr=3e-2,
                          progress=False)
    after = bt.evaluate(CFG, PARAMS, maps, [batch], EXITS)
    assert after["kl"] < 0.8 * before["kl"], (before, after)
    for s, e in enumerate(EXITS):  # layers at or below an exit are never read: still zero
        assert not np.any(np.asarray(maps.a[s, :e + 1 - FIRST], np.float32))
        assert not np.any(np.asarray(maps.b[s, :e + 1 - FIRST], np.float32))
    assert maps.a.dtype == bm.MAP_DTYPE


def test_bad_finetuning_settings_are_refused():
    tokens = np.zeros((1, 4), np.int32)
    _, hidden = llama.forward(PARAMS, jnp.asarray(tokens), CFG, return_hidden=True)
    pos = np.zeros((1, 2), np.int32)
    batch = bt.Batch(np.asarray(hidden[FIRST - 1]), np.full((1, 4), L, np.int32), pos,
                     np.ones(pos.shape, bool), np.asarray(hidden[-1][:, :2]))
    maps = _random_maps(0)
    for kw, what in [({"epochs": 0}, "epochs >= 1"), ({"lr": 0.0}, "learning rate > 0")]:
        with pytest.raises(bm.BackfillMapsError, match=what):
            bt.finetune(CFG, PARAMS, maps, [batch], EXITS, progress=False, **kw)
    with pytest.raises(bm.BackfillMapsError, match="no batches"):
        bt.finetune(CFG, PARAMS, maps, [], EXITS, progress=False)
    with pytest.raises(bm.BackfillMapsError, match="exit layers"):  # maps for other exits
        bt.finetune(CFG, PARAMS, maps, [batch], (2, 3), progress=False)
