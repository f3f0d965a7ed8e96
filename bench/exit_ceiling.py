"""How fast can these exit heads be, at best? The ideal speed-up (issue #12's honest accounting:
head, checks and completion counted, `exit_cost.cost_model`) of the oracle exit and of the heads'
own decision at TF error budgets, on the held-apart calibration split, teacher-forced.

    python -m bench.exit_ceiling --out docs/benchmarks.md

Per calibration group (held-out instructions, code completions, everyday chat: the model's own
full-depth answers, `tune.calibration_rows`), from the dense forward:

* oracle: every token leaves at the first exit whose token equals the final layer's (no
  decision can do better with these heads);
* decision at a budget: the lowest threshold whose first-confident-exit rule changes at most
  that share of tokens (1 - TF agreement), i.e. the threshold a perfect calibration would pick.

Two ideals per row, from the same exit histogram: memory-bound (a token's skipped layers that
deferred back-fill runs in its row's next step ride on weights read anyway: completion free;
also what "propagate" costs, its key/value projections aside) and compute-bound (deferred
back-fill runs them as whole layers: exits save only the head). Ideal, not measured: the
measured figures are `bench.shipped_exits`'s.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import numpy as np

from bench.common import log, write_marked

MARK = ("<!-- bench.exit_ceiling:begin -->", "<!-- bench.exit_ceiling:end -->")
PRESET = "configs/tune-smollm2-135m-subset.yaml"


def first_exit(conf: np.ndarray, threshold: float, exit_layers: np.ndarray, n_layers: int
               ) -> tuple[np.ndarray, np.ndarray]:
    """conf [E, n] -> (exit layer [n] of the first exit with conf >= threshold or n_layers,
    its slot [n] or -1)."""
    hit = conf >= threshold
    slot = np.where(hit.any(0), np.argmax(hit, 0), -1)
    return np.where(slot >= 0, exit_layers[slot], n_layers), slot


def best_at_budget(conf: np.ndarray, agree: np.ndarray, exit_layers: np.ndarray, n_layers: int,
                   budget: float) -> tuple[float, np.ndarray, float]:
    """The threshold with the fewest mean layers whose changed-token share is <= budget:
    (threshold, exit layer per token, changed share)."""
    best = (1.0, np.full(agree.shape[1], n_layers), 0.0)
    grid = np.unique(np.concatenate([np.linspace(0.3, 0.99, 139), 1 - np.logspace(-2, -5, 40)]))
    for t in grid:
        lay, slot = first_exit(conf, t, exit_layers, n_layers)
        wrong = (slot >= 0) & ~agree[np.maximum(slot, 0), np.arange(agree.shape[1])]
        if wrong.mean() <= budget and lay.mean() < best[1].mean():
            best = (float(t), lay, float(wrong.mean()))
    return best


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m bench.exit_ceiling",
                                description=__doc__.split("\n")[0])
    p.add_argument("--config", default=PRESET, help="tuning preset (calibration split, data)")
    p.add_argument("--exit-heads", type=Path, default=None,
                   help="folder of exit heads (default: the heads shipped for the model)")
    p.add_argument("--budgets", type=float, nargs="+", default=[0.02, 0.05])
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    from ee_jax.models import exit_cost
    from ee_jax.models.exit_checkpoint import load_exit_heads
    from ee_jax.models.loading import load_model
    from ee_jax.training import cached as C
    from ee_jax.training.tune import TuneConfig, calibration_rows

    tc = TuneConfig.from_yaml(args.config)
    model = load_model(tc.model, dtype="float32", progress=False)
    cfg, params = model.config, model.params
    if args.exit_heads is not None:
        ec, heads = load_exit_heads(args.exit_heads, cfg)
        what = str(args.exit_heads)
    else:
        ec, heads = model.shipped_exit_heads()
        what = f"the heads shipped for {tc.model}"
    if ec.measure != "candidates":
        raise SystemExit(f"measure {ec.measure!r}: this bench reads the candidate decision")
    L, E = cfg.n_layers, np.asarray(ec.exit_layers)
    costs = {"memory": exit_cost.cost_model(cfg, ec, completion=0.0),
             "compute": exit_cost.cost_model(cfg, ec, completion=1.0)}  # -bound (deferred)
    log(f"calibration split of {args.config} (self-generated answers, cached in {tc.work_dir})")
    groups = calibration_rows(tc, model)
    lines = ["### Ceiling of the exit heads (`bench/exit_ceiling.py`)", "",
             f"Command: `python -m bench.exit_ceiling {' '.join(argv)}`. Run "
             f"{time.strftime('%Y-%m-%d %H:%M')}. Heads: {what} ({len(E)} exits "
             f"{E[0]}-{E[-1]}, {ec.head} head, measure {ec.measure}, subset "
             f"{ec.vocab_subset}). Teacher-forced on the held-apart calibration split (the "
             "model's own full-depth answers; answer tokens only). Ideal speed-ups from the "
             "engine's cost model (head and checks counted), not measured.", "",
             "| group | tokens | exit rule | threshold | TF agreement | mean layers | tokens "
             "leaving early | ideal, memory-bound | ideal, compute-bound (deferred) |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for g, (rows, scored) in groups.items():
        log(f"{g}: {len(rows)} rows, {int(scored.sum())} scored tokens")
        cache = C.cache_states(cfg, params, rows, ec.exit_layers, 1, progress=True)
        n, T = rows.shape
        keep = scored.reshape(-1)
        hs = cache["hs"].transpose(0, 2, 1, 3).reshape(n * T, len(E), -1)[keep]
        feats, agree = C.decision_data(cfg, ec, params, heads, hs, rows.reshape(-1)[keep],
                                       cache["top"][..., 0].reshape(-1)[keep])
        del cache, hs
        conf = C.confidences(heads, feats)
        oracle = np.where(agree.any(0), E[np.argmax(agree, 0)], L)
        found = [("oracle (first agreeing exit)", "-", oracle, 0.0)]
        for b in args.budgets:
            t, lay, wrong = best_at_budget(conf, agree, E, L, b)
            found.append((f"decision, TF error <= {b:.0%}", f"{t:.3f}", lay, wrong))
        t = ec.threshold
        lay, slot = first_exit(conf, t, E, L)
        wrong = ((slot >= 0) & ~agree[np.maximum(slot, 0), np.arange(agree.shape[1])]).mean()
        found.append(("decision at the heads' threshold", f"{t:.3f}", lay, float(wrong)))
        for name, th, lay, wrong in found:
            hist = collections.Counter(int(x) for x in lay)
            ideal = {k: cm.ideal_speedup(hist) for k, cm in costs.items()}
            lines.append(f"| {g} | {len(lay)} | {name} | {th} | {1 - wrong:.3f} | "
                         f"{lay.mean():.2f} | {np.mean(lay < L):.0%} | "
                         f"{ideal['memory']:.2f}x | {ideal['compute']:.2f}x |")
            log(lines[-1])
    lines += ["", "Memory-bound: the completion of a deferred token is free (it rides on "
              "weights its row's next token reads anyway; propagate's cost, its key/value "
              "projections aside). Compute-bound, deferred: the completion runs as whole "
              "layers, so an exit saves only the head."]
    text = "\n".join(lines) + "\n"
    if args.out:
        write_marked(args.out, text, MARK)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
