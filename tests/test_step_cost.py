"""The honest ceiling counts steps (ee_jax/models/exit_cost.py): hand-computed
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
# one row: leaves at 2, then at 1 (both early, consecutive), then at 3 (deeper than the
# pending one), then runs to full depth
SEQ = [[2], [1], [3], [4]]
FULL = 4 * (4 + 2.0)
# step 1 (e=2): 2 layers + checks at 1, 2 (0.6) + exit head 1 + K/V of layers 2, 3 (0.2) = 3.8
# step 2 (e=1): 1 + 0.5 + 1 + 0.3 = 2.8. Deferred: the pending token (left at 2) rides along
#   only in layers the new token runs (none below 2): the same 2.8
# step 3 (e=3): 3 + 0.7 + 1 + 0.1 = 4.8. Deferred, pending at 1: memory-bound the second
#   query reads the same weights (4.8); compute-bound it runs layers 1, 2 (+2) and the old
#   token's layer 3 is refilled from its state at 3 (+0.1): 6.9
# step 4 (e=4): 4 + 0.7 + final head 2 = 6.7; deferred compute-bound, pending at 3: + 1 = 7.7
CASES = [("propagate", "memory", 3.8 + 2.8 + 4.8 + 6.7),
         ("propagate", "compute", 3.8 + 2.8 + 4.8 + 6.7),
         ("deferred", "memory", 3.8 + 2.8 + 4.8 + 6.7),
         ("deferred", "compute", 3.8 + 2.8 + 6.9 + 7.7)]


@pytest.mark.parametrize("backfill, regime, cost", CASES)
def test_sequence_where_consecutive_tokens_leave_early(backfill, regime, cost):
    got = sc.sequence_speedup(CM, SEQ, backfill, regime, KV)
    assert got == pytest.approx(FULL / cost)


def test_learned_pays_its_maps_per_skipped_layer():
    # propagate's 18.1 plus the maps of the skipped layers: 2 + 3 + 1 = 6 of them at 0.02
    got = sc.sequence_speedup(CM, SEQ, "learned", "memory", KV, maps=0.02)
    assert got == pytest.approx(FULL / (18.1 + 6 * 0.02))


def test_a_memory_bound_step_pays_each_weight_once():
    # rows at 2 and 4: 4 layers, every check (0.7), both heads (2 + 1), K/V of layers 2-3
    assert sc.step_cost(CM, [2, 4], None, "propagate", "memory", KV) == pytest.approx(7.9)
    # compute-bound: per row, 3.8 + 6.7
    assert sc.step_cost(CM, [2, 4], None, "propagate", "compute", KV) == pytest.approx(10.5)
    # deferred, rows leaving at 1 with tokens pending at 4 (none) and 3: the pending token
    # runs no layer its row does not (1 layer, check, exit head, K/V of layers 1-3)
    assert sc.step_cost(CM, [1, 1], [4, 3], "deferred", "memory", KV) == pytest.approx(
        1 + 0.5 + 1 + 0.3)
    # memory-bound with a cost per ridden layer (a CPU dequantizing block weights per row):
    # the pending token at 1 rides layers 1, 2 of the new token's 3
    assert sc.step_cost(CM, [3], [1], "deferred", "memory", KV, ride=0.5) == pytest.approx(
        4.8 + 2 * 0.5)
    assert sc.step_cost(CM, [3], [1], "propagate", "memory", KV, ride=0.5) == pytest.approx(4.8)
    # compute-bound, rows leaving at 3 and 4 with pending tokens at 1 and none: the second
    # query runs from layer 1 for every running row (row 0: + 2, row 1: + 3) and row 0's
    # old token is refilled at layer 3
    assert sc.step_cost(CM, [3, 4], [1, 4], "deferred", "compute", KV) == pytest.approx(
        (3 + 2 + 0.7 + 1 + 2 * 0.1) + (4 + 3 + 0.7 + 2))


def test_step_speedup_of_a_single_exit_layer_is_exact():
    # every row leaves at 2: propagate memory-bound at batch 8: 2 + 0.6 + 1 + 0.2 per step
    got = sc.step_speedup(CM, {2: 10}, 8, "propagate", "memory", KV)
    assert got == pytest.approx(6.0 / 3.8)
    # deferred: the pending token left at 2 as well, so it never runs a layer: propagate's
    got = sc.step_speedup(CM, {2: 10}, 1, "deferred", "memory", KV)
    assert got == pytest.approx(6.0 / 3.8)


def test_bad_modes_are_named():
    with pytest.raises(sc.ExitConfigError, match="backfill 'later'"):
        sc.step_cost(CM, [2], None, "later", "memory", KV)
    with pytest.raises(sc.ExitConfigError, match="regime 'gpu'"):
        sc.step_cost(CM, [2], None, "propagate", "gpu", KV)
