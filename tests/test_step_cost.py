"""The one step-cost model (ee_jax/models/exits/cost.py `step_work`, priced by `CostModel.price`
and `roofline.Pieces.price`), against hand counts read off `serving/step.py`, per back-fill,
policy, verified exits and regime; then against the step itself (its own row-layer counter,
and the back-fill's projection in its jaxpr).

The hand counts all use one model: L = 4 layers, exits 1, 2, 3 checked after layers 1, 2, 3
(measure "candidates": the first check 0.5, a later one 0.1), an exit head of 1 (over a 16-id
subset: a product of its own, not the check's logits), a final head of 2, a layer's K/V
projection 0.1 and its learned map 0.02, all in layer-equivalents.
Memory-bound a piece is paid once a pass over its weights, compute-bound once a row.

What the step runs, as read from `step._with_checks` and `backfill.backfill`:
* layer n runs over the smallest row bucket holding the rows still running (per_row,
  `ExitConfig.row_buckets`; min_row_bucket = B: no compaction), a batch-wide policy over all;
* a check after each checked layer up to the deepest exit, over that layer's rows;
* the exit head over all B rows if any left, the final head over all B rows if any ran to L;
* once any row left, `backfill_kv` projects the K/V of layers first_exit..L-1 = 1..3 (static:
  whatever the exits) for all B rows and every query of theirs (2 under deferred); learned
  maps the same layers for half the bucket's rows (all when more left; one at batch 1);
* deferred's pending token rides along (one more query a row of the bucket) from the lowest
  pending depth among the rows running when the stage starts, up to the step's deepest layer.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ee_jax.models import llama
from ee_jax.models.exits import cost as sc
from ee_jax.models.exits import heads as exit_heads
from ee_jax.models.exits.config import NEVER, ExitConfig, ExitConfigError
from ee_jax.serving.aot.roofline import Cost, Pieces, per_unit, seconds
from ee_jax.serving.attention import AttentionMetadata
from ee_jax.serving.kv_cache import KVCache
from ee_jax.serving.step import Pending, PerRow, model_step
from ee_jax.testing import tiny_config

L = 4
CM = sc.CostModel(n_layers=L, checked=(1, 2, 3), final_head=2.0, exit_head=1.0,
                  first_check=0.5, later_check=0.1, fill=0.1, maps=0.02)


def ec(backfill="propagate", policy="per_row", **kw):
    return ExitConfig(exit_layers=(1, 2, 3), head="mlp", measure="candidates", vocab_subset=16,
                      candidates=8, backfill=backfill, policy=policy, **kw)


def cost(rows, pending=None, regime="memory", ride=0.0, **kw):
    bucket = kw.pop("bucket", None)
    return sc.step_cost(CM, ec(**kw), rows, pending, regime, ride, bucket)


# --------------------------------------------------------------------------- by hand


def test_backfill_projects_every_layer_from_the_first_exit():
    # one row leaving at 3: layers 0-2 (3), checks at 1, 2, 3 (0.5 + 0.1 + 0.1), the exit
    # head (1), and the K/V of layers 1, 2, 3 (3 x 0.1): `backfill_kv` slices the layers from
    # first_exit = 1 statically. The previous models charged L - 3 = 1 layer (0.1): 4.8.
    assert cost([3]) == pytest.approx(3 + 0.7 + 1 + 0.3)
    # leaving at the first exit the two agree: 1 + 0.5 + 1 + 0.3
    assert cost([1]) == pytest.approx(2.8)
    # nobody left: no back-fill (the lax.cond), the final head, every check
    assert cost([4]) == pytest.approx(4 + 0.7 + 2)
    # min_exit_layer 2 (with a classifier: "candidates" must check its first exit): checks
    # after layers 2 and 3 only, and the first exit that can be taken, 2, is where the
    # back-fill starts: layers 2, 3
    late = ExitConfig(exit_layers=(1, 2, 3), measure="classifier", min_exit_layer=2,
                      policy="per_row", backfill="propagate")
    work = sc.step_work(late, L, [3])
    assert (work.first_check, work.later_checks) == (sc.Count(1, 1), sc.Count(1, 1))
    assert work.fill == sc.Count(2, 2)


def test_per_row_memory_bound_pays_each_weight_once():
    # rows leaving at 2 and 4: 4 layers, every check (0.7), both heads (1 + 2), K/V of
    # layers 1-3 once (0.3)
    assert cost([2, 4]) == pytest.approx(4 + 0.7 + 3 + 0.3)


def test_per_row_compute_bound_pays_the_buckets_rows():
    # rows at 2 and 4, buckets (2, 1): layers 0, 1 over both rows, layers 2, 3 over the one
    # still running (2 + 2 + 1 + 1 = 6); the check after layer 1 over 2 rows (2 x 0.5), after
    # 2 over 2 (2 x 0.1), after 3 over 1 (0.1); the exit head and the final head each over
    # both rows (2 x 1 + 2 x 2): one product over the batch each; the K/V of layers 1-3 for
    # both rows (2 x 3 x 0.1)
    assert cost([2, 4], regime="compute") == pytest.approx(6 + 1.3 + 6 + 0.6)
    # a runner that does not compact (min_row_bucket = B): every layer over both rows
    assert cost([2, 4], regime="compute", min_row_bucket=2) == pytest.approx(
        8 + 1.4 + 6 + 0.6)
    # padding: one active row at 3 in a bucket of 4 rows (buckets 4, 2, 1): compacted
    # before the first layer, so layers run over 1 row (3), the checks over 1 (0.7); the
    # heads and the back-fill over all 4 rows (4 x 1 + 4 x 3 x 0.1)
    assert cost([3], regime="compute", bucket=4) == pytest.approx(3 + 0.7 + 4 + 1.2)


def test_batch_wide_policy_runs_one_head_over_the_batch():
    # "all", both rows left at 2: layers 0, 1 (2), checks at 1, 2 (0.6), one exit head (1),
    # K/V of layers 1-3 (0.3); compute-bound each of those over both rows
    assert cost([2, 2], policy="all") == pytest.approx(2 + 0.6 + 1 + 0.3)
    assert cost([2, 2], regime="compute", policy="all") == pytest.approx(
        2 * 2 + 2 * 0.6 + 2 * 1 + 2 * 3 * 0.1)
    # the batch ran to L: the final head, no back-fill
    assert cost([4, 4], policy="all") == pytest.approx(4 + 0.7 + 2)
    with pytest.raises(ValueError, match="leaves as a batch"):
        cost([2, 4], policy="all")
    # a vocabulary measure's check computed the exit's logits: the step keeps them and runs
    # no exit head (`step._with_checks`' keep_logits)
    vocab = ExitConfig(exit_layers=(1, 2, 3), measure="max_prob", backfill="propagate")
    assert sc.step_work(vocab, L, [2]).exit_head == sc.Count()
    # whole-vocabulary exits with a measure that is not a product of the head (per_row):
    # one product serves the rows that left and the rows that did not (`row_exit_logits`)
    whole = ExitConfig(exit_layers=(1, 2, 3), measure="classifier", policy="per_row")
    w = sc.step_work(whole, L, [2, 4])
    assert (w.exit_head, w.final_head) == (sc.Count(), sc.Count(1, 2))


def test_deferred_rides_along_and_projects_two_queries():
    # one row leaving at 3 whose previous token left at 1: the pending query rides in
    # layers 1, 2 (the step runs 0-2); memory-bound at 0.5 a ridden layer: + 1.0; the
    # back-fill projects both tokens' states from one read of layers 1-3 (0.3)
    assert cost([3], [1], backfill="deferred", ride=0.5) == pytest.approx(
        3 + 0.7 + 1 + 0.3 + 2 * 0.5)
    # compute-bound: a query a ridden layer (2) and 2 queries x 3 layers of K/V (0.6)
    assert cost([3], [1], "compute", backfill="deferred") == pytest.approx(
        3 + 2 + 0.7 + 1 + 0.6)
    # pending at or above the new exit: rides nowhere (the step never runs a layer more)
    assert cost([1], [2], backfill="deferred", ride=0.5) == pytest.approx(2.8)
    # rows at 3 and 4, pending at 1 and none, buckets (2, 1), compute-bound. Stage of 2 rows
    # (layers 0-2, the lowest pending depth 1): 3 x 2 row-layers, layers 1, 2 ridden by both
    # rows (4); stage of 1 row (layer 3): only row 1 runs, nothing pending there, no ride.
    # Checks 2 x 0.5 + 2 x 0.1 + 2 x 0.1 (the check after layer 3 is still over 2 rows),
    # heads 2 x 1 + 2 x 2, K/V 2 rows x 2 queries x 3 layers x 0.1
    assert cost([3, 4], [1, 4], "compute", backfill="deferred") == pytest.approx(
        7 + 4 + 1.4 + 6 + 1.2)


def test_learned_maps_correct_half_the_bucket():
    # one row at 3: its maps for layers 1-3 (3 x 0.02) on top of propagate's 5.0
    assert cost([3], backfill="learned") == pytest.approx(5.0 + 0.06)
    # 4 rows, one left (at 2): `kv_correction` corrects a static half of the bucket, 2 rows,
    # each its maps for layers 1-3: 6 maps whatever the regime (one query a row); with 3
    # rows left (more than half) all 4 rows: 12
    assert sc.step_work(ec("learned"), L, [2, 4, 4, 4]).maps == sc.Count(6, 6)
    assert sc.step_work(ec("learned"), L, [2, 2, 3, 4]).maps == sc.Count(12, 12)
    # compute-bound, no compaction: 16 row-layers, checks 4 x 0.7, heads 4 x 3, K/V
    # 4 x 3 x 0.1, maps 6 x 0.02
    assert cost([2, 4, 4, 4], regime="compute", backfill="learned",
                min_row_bucket=4) == pytest.approx(16 + 2.8 + 12 + 1.2 + 0.12)
    # deferred_learned: both states corrected from one read of the row's maps
    assert sc.step_work(ec("deferred_learned"), L, [3], [1]).maps == sc.Count(3, 6)
    # on TPU above 4 rows every exit slot's correction for every row: 3 exits x 3 layers
    # of maps read, 3 x 8 rows x 3 layers computed
    tpu = sc.step_work(ec("learned"), L, [2] + [4] * 7, platform="tpu")
    assert tpu.maps == sc.Count(9, 72)


def test_verified_steps_ride_the_run_and_verify_it():
    v = ec().verified(2)  # max_draft 2: both entries of a run ride, empty or not
    # a draft step at 2 whose run holds one draft at depth 1: it rides layer 1 (0.5 a layer
    # memory-bound), checks 0.6, the exit head; no back-fill
    assert sc.step_cost(CM, v, [2], [[1]], "memory", 0.5) == pytest.approx(2 + 0.6 + 1 + 0.5)
    # compute-bound: layer 1 ridden by both entries of the row (2)
    assert sc.step_cost(CM, v, [2], [[1]], "compute") == pytest.approx(2 + 2 + 0.6 + 1)
    # the verify step of a run at depths 2, 3: layers 2, 3 ridden; the final head over the
    # run's 2 entries and the row's own token (`run_widths(2)`: 2), one read of its weights
    assert sc.step_cost(CM, v, [4], [[2, 3]], "memory", 0.5) == pytest.approx(
        4 + 0.7 + 2 + 2 * 0.5)
    assert sc.step_cost(CM, v, [4], [[2, 3]], "compute") == pytest.approx(
        4 + 2 * 2 + 0.7 + 3 * 2)
    # max_draft 4, a run of 3: the head reads the bucketed width 4 (+ the own token)
    assert sc.step_work(ec().verified(4), L, [4], [[3, 3, 3]]).final_head == sc.Count(1, 5)


def test_sequences_where_consecutive_tokens_leave_early():
    # one row: leaves at 2, then at 1 (both early, consecutive), then at 3 (deeper than the
    # pending one), then runs to full depth; full depth is 4 + 2 a step
    seq, full = [[2], [1], [3], [4]], 4 * 6.0
    # propagate: 2 + 0.6 + 1 + 0.3, 1 + 0.5 + 1 + 0.3, 3 + 0.7 + 1 + 0.3, 4 + 0.7 + 2
    prop = 3.9 + 2.8 + 5.0 + 6.7
    assert sc.sequence_speedup(CM, ec(), seq, "memory") == pytest.approx(full / prop)
    # deferred, memory-bound: the rides (layers 1-2 in step 3, layer 3 in step 4) read no
    # weight more; compute-bound each ridden layer is a query (+2, +1) and every early step
    # projects two queries (+0.3 each of steps 1-3)
    assert sc.sequence_speedup(CM, ec("deferred"), seq, "memory") == pytest.approx(full / prop)
    assert sc.sequence_speedup(CM, ec("deferred"), seq, "compute") == pytest.approx(
        full / (prop + 3 + 3 * 0.3))
    # learned: 3 maps in each early step
    assert sc.sequence_speedup(CM, ec("learned"), seq, "memory") == pytest.approx(
        full / (prop + 3 * 0.06))


def test_step_speedup_of_a_single_exit_layer_is_exact():
    # every row leaves at 2, memory-bound at batch 8: 2 + 0.6 + 1 + 0.3 a step
    assert sc.step_speedup(CM, ec(), {2: 10}, 8, "memory") == pytest.approx(6.0 / 3.9)
    # deferred: the pending token left at 2 as well, so it never rides
    assert sc.step_speedup(CM, ec("deferred"), {2: 10}, 1, "memory", ride=0.5) == \
        pytest.approx(6.0 / 3.9)


def test_the_roofline_prices_the_same_count():
    # pieces measured at a bucket of 2 rows (one pass, 2 rows): a row's flops, a pass's bytes
    one = sc.Count(1, 2)
    p = Pieces(fixed=Cost(10.0, 100.0), layer=per_unit(Cost(4.0, 50.0), one),
               first_check=per_unit(Cost(8.0, 20.0), one),
               later_check=per_unit(Cost(2.0, 5.0), one),
               exit_head=per_unit(Cost(6.0, 30.0), one), final_head=per_unit(Cost(12.0, 60.0), one),
               fill=per_unit(Cost(1.0, 3.0), one), ride=per_unit(Cost(4.0, 7.0), one))
    assert p.full_depth(4, 2) == Cost(10 + 4 * 4 + 12, 100 + 4 * 50 + 60)
    # both rows leave at 3 under deferred with nothing pending: 3 layers, 3 checks, the exit
    # head, the K/V of layers 1-3 for 2 rows x 2 queries (flops twice, weights once)
    work = sc.step_work(ec("deferred"), 4, [3, 3], bucket=2)
    assert p.price(work) == Cost(10 + 3 * 4 + 8 + 2 * 2 + 6 + 3 * 2 * 1,
                                 100 + 3 * 50 + 20 + 2 * 5 + 30 + 3 * 3)
    # a one-row histogram in the 2-row bucket, deferred: half the steps leave at 3, half
    # run to 4, the pending token drawn alike. The row runs alone (compacted: layers, checks
    # and the ride a row each), the heads and the back-fill over the bucket's 2 rows.
    # Leaving at 3: 3 layers (6, 150), the checks (4 + 2, 20 + 10), the exit head (6, 30),
    # the K/V of layers 1-3 for 2 rows x 2 queries (6, 9): (34, 319) with fixed.
    # Running to 4: 4 layers (8, 200), the checks (6, 30), the final head (12, 60): (36, 390).
    # Only (pending 3, exit 4) rides, layer 3, a quarter of the steps: + (2, 7) / 4.
    mean = p.expected({3: 1, 4: 1}, ec("deferred"), 4, bucket=2)
    assert mean.flops == pytest.approx(0.5 * 34 + 0.5 * 36 + 0.25 * 2)
    assert mean.bytes == pytest.approx(0.5 * 319 + 0.5 * 390 + 0.25 * 7)
    assert seconds(Cost(2e12, 1e9), 1e12, 1e12) == 2.0  # compute-bound
    assert seconds(Cost(1e9, 3e12), 1e12, 1e12) == 3.0  # memory-bound


def test_bad_modes_are_named():
    with pytest.raises(ExitConfigError, match="regime 'gpu'"):
        cost([2], regime="gpu")
    with pytest.raises(ValueError, match="bucket of 1"):
        cost([2, 2], bucket=1)
    with pytest.raises(ExitConfigError, match="verify=True"):
        sc.verified_speedup(CM, ec(), {2: 1}, 1)


# --------------------------------------------------------------------------- the step itself

CFG = tiny_config(eos_token_ids=())  # 4 layers
PARAMS = llama.init_params(CFG, jax.random.PRNGKey(3))
CONF = {1: 0.2, 2: 0.5, 3: 0.8}  # every row's confidence at each exit (classifier, w = 0)
THRESHOLD = {1: 0.1, 2: 0.3, 3: 0.6, 4: NEVER}  # a row's threshold -> its first confident exit


def _heads(e):
    heads = exit_heads.init_heads(CFG, e, PARAMS)
    b = [np.log(CONF[x] / (1 - CONF[x])) for x in e.exit_layers]
    return heads.replace(classifier={"w": jnp.zeros((3, CFG.d_model), jnp.float32),
                                   "b": jnp.asarray(b, jnp.float32)})


def _step_args(B):
    shape = (CFG.n_layers, 2 * B + 1, 4, CFG.n_kv_heads, CFG.head_dim)
    cache = KVCache(jnp.zeros(shape), jnp.zeros(shape))
    meta = AttentionMetadata(jnp.full((B, 1), 1, jnp.int32),
                             jnp.arange(1, 2 * B + 1, dtype=jnp.int32).reshape(B, 2),
                             jnp.full((B,), 2, jnp.int32))
    return cache, meta, jnp.ones((B, 1), jnp.int32)


def test_the_count_of_layers_is_the_steps_own():
    """`StepResult.work` counts the row-layers the step computed (its buckets, padding rows
    of a bucket included): the count `step_work` gives for the same rows."""
    e = ExitConfig(exit_layers=(1, 2, 3), measure="classifier", policy="per_row",
                   backfill="propagate")
    B = 8
    heads, (cache, meta, tokens) = _heads(e), _step_args(B)
    step = jax.jit(lambda thr: model_step(PARAMS, heads, cache, tokens, meta, thr, CFG,
                                          PerRow(e))[0])
    for rows in ([1, 4, 4, 4, 4, 2, 3, 4], [1, 1, 1, 1, 1, 2, 2, 4], [1] * 7 + [3], [4] * 8,
                 [2, 2, 2, 2, 1, 1, 1, 1]):
        res = step(jnp.asarray([THRESHOLD[r] for r in rows], jnp.float32))
        assert np.asarray(res.exit_layer).tolist() == rows
        assert int(res.work) == sc.step_work(e, L, rows).layers.rows, rows


@pytest.mark.parametrize("backfill, min_exit, layers, queries",
                         [("propagate", 1, 3, 1), ("propagate", 2, 2, 1), ("deferred", 1, 3, 2)])
def test_the_steps_backfill_spans_the_layers_counted(backfill, min_exit, layers, queries):
    """The K/V projections in the step's jaxpr ([layers, B, queries, K x hd]) span L minus
    the first exit that can be taken, whatever the rows' exits: what `step_work` counts."""
    e = ExitConfig(exit_layers=(1, 2, 3), measure="classifier", policy="per_row",
                   backfill=backfill, min_exit_layer=min_exit)
    B = 2
    heads, (cache, meta, tokens) = _heads(e), _step_args(B)
    jaxpr = str(jax.make_jaxpr(lambda thr: model_step(
        PARAMS, heads, cache, tokens, meta, thr, CFG, PerRow(e),
        pending=Pending.none(B, CFG)))(jnp.zeros((B,), jnp.float32)))
    kv = CFG.n_kv_heads * CFG.head_dim
    found = set(re.findall(rf"f32\[(\d+),{B},(\d+),{kv}\]", jaxpr))
    assert found == {(str(layers), str(queries))}
    work = sc.step_work(e, L, [3, 4], [1, 4])
    assert work.fill == sc.Count(layers, B * queries * layers)


def test_the_runners_row_buckets_are_counted():
    # the controller and the ceilings count with the runner's config: a runner that does not
    # compact (accelerators) runs every layer over the bucket
    e = dataclasses.replace(ec(), min_row_bucket=8)
    assert sc.step_work(e, L, [1] * 7 + [4]).layers == sc.Count(4, 32)
    assert sc.step_work(ec(), L, [1] * 7 + [4]).layers == sc.Count(4, 8 + 1 + 1 + 1)
    # priced for an accelerator, the stages its runner serves: none, an explicit 1 included
    for platform in ("tpu", "gpu"):
        for asked in (None, 1):
            e = dataclasses.replace(ec(), min_row_bucket=asked)
            assert sc.step_work(e, L, [1] * 7 + [4], platform=platform).layers == \
                sc.Count(4, 32), (platform, asked)
