"""The honest ceiling counts steps (ee_jax/models/exit_cost.py, issue #23): hand-computed
sequences, including consecutive tokens that both leave early."""

from __future__ import annotations

import dataclasses

import pytest

from ee_jax.models import exit_cost as sc


@dataclasses.dataclass(frozen=True)
class _Costs:  # L = 4, exits 1..3; a check 0.5 (the first) / 0.1, heads 2 (final) / 1 (exit)
    n_layers: int = 4
    exit_layers: tuple = (1, 2, 3)
    final_head: float = 2.0
    exit_head: float = 1.0
    checks: tuple = (0.5, 0.1, 0.1)


CM, KV = _Costs(), 0.1
SEQ = [[2], [1], [4]]  # one row: leaves at 2, then at 1 (both early, consecutive), then full
FULL = 3 * (4 + 2.0)
# step 1 (e=2): 2 layers + checks at 1, 2 (0.6) + exit head 1 + K/V of layers 2, 3 (0.2) = 3.8
# step 2 (e=1): 1 + 0.5 + 1 + 0.3 = 2.8; deferred: the pending token (left at 2) runs
#   layers 2, 3, so the step runs every layer: 4 + 0.5 + 1 + 0.3 = 5.8 (memory-bound) or
#   1 + 2 + 0.5 + 1 + 0.3 = 4.8 (compute-bound: the row's own 1 layer plus the pending 2)
# step 3 (e=4): 4 + 0.7 + final head 2 = 6.7; deferred compute-bound: + 3 pending = 9.7
CASES = [("propagate", "memory", 3.8 + 2.8 + 6.7), ("propagate", "compute", 3.8 + 2.8 + 6.7),
         ("deferred", "memory", 3.8 + 5.8 + 6.7), ("deferred", "compute", 3.8 + 4.8 + 9.7)]


@pytest.mark.parametrize("backfill, regime, cost", CASES)
def test_sequence_where_consecutive_tokens_leave_early(backfill, regime, cost):
    got = sc.sequence_speedup(CM, SEQ, backfill, regime, KV)
    assert got == pytest.approx(FULL / cost)


def test_learned_pays_its_maps_per_skipped_layer():
    # propagate's 13.3 plus the maps of the skipped layers: 2 + 3 = 5 of them at 0.02
    got = sc.sequence_speedup(CM, SEQ, "learned", "memory", KV, maps=0.02)
    assert got == pytest.approx(FULL / (13.3 + 5 * 0.02))


def test_a_memory_bound_step_pays_each_weight_once():
    # rows at 2 and 4: 4 layers, every check (0.7), both heads (2 + 1), K/V of layers 2-3
    assert sc.step_cost(CM, [2, 4], None, "propagate", "memory", KV) == pytest.approx(7.9)
    # compute-bound: per row, 3.8 + 6.7
    assert sc.step_cost(CM, [2, 4], None, "propagate", "compute", KV) == pytest.approx(10.5)
    # deferred, a row with a pending token: every layer even though both rows leave at 1
    assert sc.step_cost(CM, [1, 1], [4, 3], "deferred", "memory", KV) == pytest.approx(
        4 + 0.5 + 1 + 0.3)


def test_step_speedup_of_a_single_exit_layer_is_exact():
    # every row leaves at 2: propagate memory-bound at batch 8: 2 + 0.6 + 1 + 0.2 per step
    got = sc.step_speedup(CM, {2: 10}, 8, "propagate", "memory", KV)
    assert got == pytest.approx(6.0 / 3.8)
    # deferred: always a pending token after the first: the step runs every layer
    got = sc.step_speedup(CM, {2: 10}, 1, "deferred", "memory", KV)
    assert got == pytest.approx(6.0 / (4 + 0.6 + 1 + 0.2))


def test_bad_modes_are_named():
    with pytest.raises(sc.ExitConfigError, match="backfill 'later'"):
        sc.step_cost(CM, [2], None, "later", "memory", KV)
    with pytest.raises(sc.ExitConfigError, match="regime 'gpu'"):
        sc.step_cost(CM, [2], None, "propagate", "gpu", KV)
