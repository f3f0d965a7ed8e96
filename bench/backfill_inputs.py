"""Which inputs besides a token's exit state tell a back-fill map the far layers' K/V?

Full-rank ridge per (exit e, layer j), as `backfill_fit.MapFitter` fits the shipped maps (the
residual of propagate's K/V, lambda 1e-3 x the mean diagonal of X'X), fitted on the dense
forward's answer-token states of the model's own training answers; held-out relative V error
on the calibration answers per group (instructions / code / everyday), for regressor sets:
the exit state alone (what ships); plus the token's state 4 layers earlier; plus the previous
token's state at the exit; plus the previous token's true K/V at layer j; all of them.
No timing: a measure of what a map could know (docs/tuning.md, "What else a map could read").

    python -m bench.backfill_inputs [--prompts 96 48 96] [--pairs 16:29 20:29 24:29 20:24 16:20]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from bench.common import log

KINDS = ("exit", "earlier", "prevstate", "prevkv", "all")
EARLIER = 4  # layers below the exit for "earlier"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/tune-smollm2-135m-subset.yaml")
    p.add_argument("--prompts", type=int, nargs=3, default=[96, 48, 96],
                   metavar=("INSTRUCTIONS", "CODE", "EVERYDAY"))
    p.add_argument("--pairs", nargs="+", default=["16:29", "20:29", "24:29", "20:24", "16:20"])
    args = p.parse_args(argv)

    import jax.numpy as jnp

    from ee_jax.models import backfill_maps as bm
    from ee_jax.models.loading import load_model
    from ee_jax.training import tune
    from ee_jax.training.backfill_fit import _pre_rope_kv, states_of
    from ee_jax.training.tune_config import TuneConfig

    tc = TuneConfig.from_yaml(args.config)
    model = load_model(tc.model, dtype="float32", progress=False)
    cfg, params = model.config, model.params
    pairs = [tuple(int(x) for x in s.split(":")) for s in args.pairs]
    first = min(e for e, _ in pairs) - EARLIER
    kv = bm.kv_dim(cfg)

    def collect(answers):
        """{"h", "hprev"}: [N, L - first, D] states of each answer token and the one before."""
        rows, scored = tune._answer_rows(answers, tc.seq_len)
        h, hprev = [], []
        for i in range(0, len(rows), 4):
            chunk = rows[i:i + 4]
            pad = np.concatenate([chunk, np.zeros((4 - len(chunk), rows.shape[1]), rows.dtype)])
            hs = np.asarray(states_of(params, jnp.asarray(pad), cfg, first))[:len(chunk)]
            keep = scored[i:i + 4].copy()
            keep[:, 0] = False  # every kept position has a token before it
            h.append(hs[keep])
            hprev.append(hs[np.roll(keep, -1, axis=1)])
        return {"h": np.concatenate(h), "hprev": np.concatenate(hprev)}

    t0 = time.time()
    train = [pq for g in tune.split_answers(tc, model, "train", tuple(args.prompts)).values()
             for pq in g]
    held = {g: collect(a) for g, a in tune.calibration_answers(tc, model).items()}
    tr = collect(train)
    log(f"states: {len(tr['h'])} fitting tokens, held out "
        f"{ {g: len(d['h']) for g, d in held.items()} } ({time.time() - t0:.0f} s)")

    def normed(h):
        return np.asarray(bm.normed_input(jnp.asarray(h), cfg), np.float64)[:, :-1]

    def kv_at(h, j):
        return np.asarray(_pre_rope_kv(params, j, jnp.asarray(h), cfg), np.float64)

    def design(d, e, j, kind):
        cols = [normed(d["h"][:, e - first])]
        if kind in ("earlier", "all"):
            cols.append(normed(d["h"][:, e - EARLIER - first]))
        if kind in ("prevkv", "all"):
            cols.append(kv_at(d["hprev"][:, j - first], j) / 10.0)
        if kind == "prevstate":
            cols.append(normed(d["hprev"][:, e - first]))
        cols.append(np.ones((len(d["h"]), 1)))
        return np.concatenate(cols, 1)

    def truth_and_propagate(d, e, j):
        return kv_at(d["h"][:, j - first], j), kv_at(d["h"][:, e - first], j)

    def v_err(pred, y):
        return np.linalg.norm(pred[:, kv:] - y[:, kv:]) / np.linalg.norm(y[:, kv:])

    groups = list(held)
    print(f"Held-out relative V error ({' / '.join(groups)}); propagate in brackets.\n")
    print("| exit -> layer | " + " | ".join(KINDS) + " |")
    print("|---|" + "---|" * len(KINDS))
    for e, j in pairs:
        y, prop = truth_and_propagate(tr, e, j)
        cells = []
        for kind in KINDS:
            X = design(tr, e, j, kind)
            G = X.T @ X
            C = np.linalg.solve(G + 1e-3 * np.mean(np.diag(G)) * np.eye(len(G)),
                                X.T @ (y - prop))
            errs = []
            for g in groups:
                yh, ph = truth_and_propagate(held[g], e, j)
                errs.append(v_err(ph + design(held[g], e, j, kind) @ C, yh))
            cell = " / ".join(f"{x:.3f}" for x in errs)
            if kind == "exit":
                cell += " (" + " / ".join(
                    f"{v_err(ph, yh):.3f}" for yh, ph in
                    (truth_and_propagate(held[g], e, j) for g in groups)) + ")"
            cells.append(cell)
        print(f"| {e} -> {j} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
