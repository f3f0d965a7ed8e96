"""How fast can these exit heads be, at best? The honest ideal speed-up per back-fill
(`exit_cost.step_work` counts what each decode step really runs) of the oracle exit and of
the heads' own decision at TF error budgets, on the held-apart calibration split,
teacher-forced.

    python -m bench.exit_ceiling --out docs/benchmarks.md
    python -m bench.exit_ceiling --limit 8      # 8 answers per group: a quick look

Per calibration group (held-out instructions, code completions, everyday chat: the model's own
full-depth answers, `tune.calibration_rows`), from the dense forward:

* oracle: every token leaves at the first exit whose token equals the final layer's (no
  decision can do better with these heads);
* decision at a budget: the lowest threshold whose first-confident-exit rule changes at most
  that share of tokens (1 - TF agreement), i.e. the threshold a perfect calibration would pick.

Each packed row of answers is replayed token by token as a row of decode steps: batch 1
(memory-bound, this CPU at batch 1: a weight paid once per step) and batch 8 (8 rows side by
side, per_row, compute-bound: paid per row). Deferred back-fill's pending token (the row's
previous one, when it left early) rides along as a second query in the layers its row's new
token runs anyway: memory-bound it costs no weight, compute-bound its arithmetic (from the
step's lowest pending layer up, for every row of the bucket). A step where any row left
back-fills every layer from the first exit up, for every row (deferred: two queries a row;
learned: plus its maps), whatever the rows' exits: `exit_cost.step_work`. Ideal, not
measured: the measured figures are `bench.shipped_exits`'s.

backfill-inputs: which inputs besides a token's exit state tell a back-fill map the far
layers' K/V (the ceiling of what a map could know; docs/tuning.md, "What else a map could
read"). No timing.

    python -m bench.exit_ceiling backfill-inputs [--prompts 96 48 96] [--pairs 16:29 20:29]

Full-rank ridge per (exit e, layer j), as `backfill_fit.MapFitter` fits the shipped maps (the
residual of propagate's K/V, lambda 1e-3 x the mean diagonal of X'X), fitted on the dense
forward's answer-token states of the model's own training answers; held-out relative V error
on the calibration answers per group (instructions / code / everyday), for regressor sets:
the exit state alone (what ships); plus the token's state 4 layers earlier; plus the previous
token's state at the exit; plus the previous token's true K/V at layer j; all of them.
"""

from __future__ import annotations

import argparse
import dataclasses
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


def replay(cm, ec, seqs: list[list[int]], batch: int) -> float:
    """Full depth over early exit when the answers `seqs` (exit layer per token) are decoded
    `batch` at a time under `ec`, each a row of steps (memory-bound at batch 1,
    compute-bound above); a row's pending token is its previous one."""
    from ee_jax.models.exits import cost as exit_cost

    L, regime = cm.n_layers, "memory" if batch == 1 else "compute"
    total = full = 0.0
    for i in range(0, len(seqs), batch):
        group = seqs[i:i + batch]
        for t in range(max(map(len, group))):
            live = [q for q in group if t < len(q)]
            now = [q[t] for q in live]
            pend = [q[t - 1] if t else L for q in live]
            total += exit_cost.step_cost(cm, ec, now, pend, regime)
            full += exit_cost.full_step_cost(cm, len(live), regime)
    return full / total if total else 1.0


def logistic_fit(x: np.ndarray, y: np.ndarray, ridge: float = 1e-2, iters: int = 25
                 ) -> np.ndarray:
    """Ridge logistic regression by Newton steps: x [N, P] (a column of ones included),
    y [N] bool -> weights [P]."""
    w = np.zeros(x.shape[1])
    reg = ridge * len(x) * np.eye(x.shape[1])
    reg[-1, -1] = 0.0  # the intercept is free
    for _ in range(iters):
        p = 1.0 / (1.0 + np.exp(-np.clip(x @ w, -30, 30)))
        g = x.T @ (p - y) + reg @ w
        h = (x * (p * (1 - p))[:, None]).T @ x + reg
        step = np.linalg.solve(h, g)
        w -= step
        if np.abs(step).max() < 1e-6:
            break
    return w


def _logit(p: np.ndarray) -> np.ndarray:
    p = np.clip(p, 1e-4, 1 - 1e-4)
    return np.log(p) - np.log1p(-p)


def history_features(conf: np.ndarray, feats: np.ndarray, agree: np.ndarray,
                     row_of: np.ndarray, history: str) -> np.ndarray:
    """[E, n, P] inputs of a drafting decision at each exit of each token: the decision's own
    confidence and candidate features there, the first exit's confidence, which exit it is;
    with history "start" (the token after a verify step, whose input token the verify step
    ran at full depth, every exit checked) also whether the previous token's exit heads
    named the full model's token (at this exit, at any) and its first exit's confidence;
    "extend" (the previous token is an unverified draft): only its first exit's confidence;
    "none": no history."""
    E, n = conf.shape
    first = np.r_[True, row_of[1:] != row_of[:-1]]  # a row's first token: no history
    prev = np.maximum(np.arange(n) - 1, 0)
    cols = [_logit(conf)[..., None], np.asarray(feats, np.float64),
            np.broadcast_to(_logit(conf[0])[None, :, None], (E, n, 1))]
    cols.append(np.broadcast_to(np.eye(E)[:, None, :], (E, n, E)))
    if history != "none":
        c0 = np.where(first, 0.0, _logit(conf[0])[prev])
        cols.append(np.broadcast_to(c0[None, :, None], (E, n, 1)))
    if history == "start":
        a_here = np.where(first[None], 0.0, agree[:, prev].astype(float))
        a_any = np.where(first, 0.0, agree[:, prev].any(0).astype(float))
        cols += [a_here[..., None], np.broadcast_to(a_any[None, :, None], (E, n, 1))]
    if history != "none":
        cols.append(np.broadcast_to(first[None, :, None].astype(float), (E, n, 1)))
    x = np.concatenate([np.asarray(c, np.float64) for c in cols], -1)
    sd = x.reshape(-1, x.shape[-1]).std(0)
    x = (x - x.reshape(-1, x.shape[-1]).mean(0)) / np.where(sd > 0, sd, 1.0)  # one ridge scale
    return np.concatenate([x, np.ones((E, n, 1))], -1)


def state_features(hs: np.ndarray, fit_tok: np.ndarray, dims: int = 64) -> np.ndarray:
    """[E, n, dims] the exits' states h / rms(h) projected on the `dims` principal directions
    of the fitting tokens' (all exits pooled), standardised: what a probe of the state (CALM's
    learned confidence, measure "classifier") can read beyond the decision's features.
    hs: [n, E, D]."""
    h = np.asarray(hs, np.float64).transpose(1, 0, 2)  # [E, n, D]
    h = h / np.sqrt(np.mean(h * h, -1, keepdims=True) + 1e-6)
    pool = h[:, fit_tok].reshape(-1, h.shape[-1])
    mean = pool.mean(0)
    _, _, vt = np.linalg.svd(pool[:: max(1, len(pool) // 20000)] - mean, full_matrices=False)
    z = (h - mean) @ vt[:dims].T
    sd = z.reshape(-1, dims).std(0)
    return z / np.where(sd > 0, sd, 1.0)


def verified_rows(cm, ec, conf, agree, E, L, row_of, n, max_drafts, feats=None,
                  hs=None, probe_dims: int = 64) -> list[str]:
    """Table rows (after the group) of the verified-exits ceiling: the oracle, the heads'
    threshold and the best threshold of a grid, per max_draft; then draft rules fitted on the
    even answers and scored on the odd ones (held apart): one threshold, a threshold per exit
    (coordinate ascent), a threshold to start a run beside one to extend it, and (given the
    decision's features) a logistic decision refitted for drafting without and with the
    row's history (`history_features`), each with its start and extend thresholds; given the
    exits' states hs [n, E, D] also one reading a probe of the state (`state_features`)."""
    from ee_jax.models.exits import cost as exit_cost

    threshold = ec.threshold
    tokens = agree.shape[1]
    at = np.arange(tokens)

    def ceiling(rule, d, rows=None, in_run=None):
        lay, ok = rule
        total = cost_tokens = 0.0
        acc = drafts = 0
        for r in range(n) if rows is None else rows:
            sel = row_of == r
            if not sel.any():
                continue
            run = None if in_run is None else (in_run[0][sel].tolist(), in_run[1][sel].tolist())
            sp, a, k = exit_cost.verified_sequence_speedup(
                cm, ec.verified(d), lay[sel].tolist(), ok[sel].tolist(), in_run=run)
            total += sel.sum() / sp  # cost in full-depth tokens
            cost_tokens += sel.sum()
            acc += a * k if k else 0
            drafts += k
        return cost_tokens / total, (acc / drafts if drafts else float("nan")), drafts

    def rule(t):  # t: one threshold, or one an exit ([E])
        hit = conf >= np.reshape(t, (-1, 1))
        slot = np.where(hit.any(0), np.argmax(hit, 0), -1)
        lay = np.where(slot >= 0, E[slot], L)
        return lay, (slot >= 0) & agree[np.maximum(slot, 0), at]

    oracle = np.where(agree.any(0), E[np.argmax(agree, 0)], L)
    grid = np.unique(np.concatenate([np.linspace(0.1, 0.99, 90), 1 - np.logspace(-2, -4, 12)]))
    coarse = np.unique(np.concatenate([np.linspace(0.6, 0.99, 14), [0.995, 1.01]]))
    fit, held = range(0, n, 2), range(1, n, 2)
    out = []
    for d in max_drafts:
        sp, a, k = ceiling((oracle, np.ones(tokens, bool)), d)
        out.append(f"oracle | - | {d} | {k / tokens:.2f} | {a:.3f} | {sp:.2f}x")
        sp, a, k = ceiling(rule(threshold), d)
        out.append(f"heads' threshold | {threshold:.3f} | {d} | {k / tokens:.2f} | {a:.3f} | "
                   f"{sp:.2f}x")
        best = max(((ceiling(rule(t), d), t) for t in grid), key=lambda x: x[0][0])
        (sp, a, k), t = best
        out.append(f"best threshold | {t:.3f} | {d} | {k / tokens:.2f} | {a:.3f} | {sp:.2f}x")
        if n < 2:  # nothing to hold apart (a small --limit)
            log("verified: one answer: the held-out rules need two")
            continue
        # fitted on the even answers, scored on the odd ones
        t1 = max(coarse, key=lambda t: ceiling(rule(t), d, fit)[0])
        sp, a, k = ceiling(rule(t1), d, held)
        n_held = int(np.isin(row_of, list(held)).sum())
        out.append(f"one threshold, held out | {t1:.3f} | {d} | {k / n_held:.2f} | {a:.3f} | "
                   f"{sp:.2f}x")
        tv = np.full(len(E), t1)
        for _ in range(2):  # coordinate ascent over the exits
            for e in range(len(E)):
                def score(x, e=e):
                    return ceiling(rule(np.where(np.arange(len(E)) == e, x, tv)), d, fit)[0]
                tv[e] = max(coarse, key=score)
        sp, a, k = ceiling(rule(tv), d, held)
        per = " ".join(f"{int(E[e])}:{'-' if x > 1 else f'{x:.2f}'}" for e, x in enumerate(tv))
        out.append(f"a threshold per exit, held out | {per} | {d} | {k / n_held:.2f} | {a:.3f} "
                   f"| {sp:.2f}x")
        pairs = [(ts, tr) for ts in coarse for tr in coarse]
        ts, tr = max(pairs, key=lambda p: ceiling(rule(p[0]), d, fit, rule(p[1]))[0])
        sp, a, k = ceiling(rule(ts), d, held, rule(tr))
        out.append(f"start / extend a run, held out | {ts:.3f} / {tr:.3f} | {d} | "
                   f"{k / n_held:.2f} | {a:.3f} | {sp:.2f}x")
        if feats is None:
            continue
        fit_tok = np.isin(row_of, list(fit))
        prob = {}
        state = None if hs is None else state_features(hs, fit_tok, probe_dims)
        for h in ("none", "start", "extend") + (("state",) if state is not None else ()):
            x = history_features(conf, feats, agree, row_of, "none" if h == "state" else h)
            if h == "state":
                x = np.concatenate([state, x], -1)
            w = logistic_fit(x[:, fit_tok].reshape(-1, x.shape[-1]),
                             agree[:, fit_tok].reshape(-1))
            prob[h] = 1.0 / (1.0 + np.exp(-np.clip(x @ w, -30, 30)))  # [E, n]

        def prule(p, t):
            hit = p >= t
            slot = np.where(hit.any(0), np.argmax(hit, 0), -1)
            return np.where(slot >= 0, E[slot], L), (slot >= 0) & agree[np.maximum(slot, 0), at]

        for name, ps, pr in (("refitted decision, no history", "none", "none"),
                             ("refitted decision + the row's history", "start", "extend"),
                             ("refitted decision + a probe of the exit's state", "state",
                              "state")):
            if ps not in prob:
                continue
            ts, tr = max(pairs, key=lambda q, ps=ps, pr=pr: ceiling(
                prule(prob[ps], q[0]), d, fit, prule(prob[pr], q[1]))[0])
            sp, a, k = ceiling(prule(prob[ps], ts), d, held, prule(prob[pr], tr))
            out.append(f"{name}, held out | {ts:.3f} / {tr:.3f} | {d} | {k / n_held:.2f} | "
                       f"{a:.3f} | {sp:.2f}x")
    for r in out:
        log("verified: " + r)
    return out


def preset(config: str, limit: int | None):
    """The tuning preset, its calibration groups cut to `limit` prompts each (None: the
    preset's): only the answers that are used are generated."""
    from ee_jax.training.tune_config import TuneConfig

    small = ({} if not limit else dict(calib_instructions=limit, calib_code_prompts=limit,
                                       calib_everyday=limit))
    return TuneConfig.from_yaml(config, **small)


INPUT_KINDS = {"exit": "exit state (propagate)", "earlier": "+ earlier state",
               "prevstate": "+ previous token's exit state",
               "prevkv": "+ previous token's K/V at j", "all": "all"}
EARLIER = 4  # layers below the exit for "earlier"


def backfill_inputs_main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.exit_ceiling backfill-inputs",
                                description="which inputs besides the exit state lower the far "
                                "layers' K/V error a back-fill map could reach (module "
                                "docstring)")
    p.add_argument("--config", default=PRESET)
    p.add_argument("--prompts", type=int, nargs=3, default=[96, 48, 96],
                   metavar=("INSTRUCTIONS", "CODE", "EVERYDAY"))
    p.add_argument("--pairs", nargs="+", default=["16:29", "20:29", "24:29", "20:24", "16:20"])
    p.add_argument("--limit", type=int, default=None,
                   help="prompts per calibration group (default: the preset's)")
    args = p.parse_args(argv)

    import jax.numpy as jnp

    from ee_jax.models.exits import backfill_maps as bm
    from ee_jax.models.loading import load_model
    from ee_jax.training import tune
    from ee_jax.training.backfill_fit import _pre_rope_kv, states_of

    tc = preset(args.config, args.limit)
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
    counts = " / ".join(f"{len(held[g]['h']):,}" for g in groups)
    cmd = " ".join(["python -m bench.exit_ceiling backfill-inputs", *(argv or [])])
    print(f"`{cmd}` ({time.strftime('%Y-%m-%d %H:%M')}): fitted on {len(tr['h']):,} answer tokens; "
          f"held-out relative V error ({' / '.join(groups)}: {counts} tokens), propagate's "
          f"in brackets.\n")
    print("| exit -> layer | " + " | ".join(INPUT_KINDS.values()) + " |")
    print("|---|" + "---|" * len(INPUT_KINDS))
    for e, j in pairs:
        y, prop = truth_and_propagate(tr, e, j)
        cells = []
        for kind in INPUT_KINDS:
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


MODES = {"backfill-inputs": backfill_inputs_main}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] and argv[0] in MODES:
        return MODES[argv[0]](argv[1:])
    p = argparse.ArgumentParser(prog="python -m bench.exit_ceiling",
                                description=__doc__.split("\n")[0],
                                epilog=f"modes: {', '.join(MODES)} (MODE --help)")
    p.add_argument("--config", default=PRESET, help="tuning preset (calibration split, data)")
    p.add_argument("--exit-heads", type=Path, default=None,
                   help="folder of exit heads (default: the heads shipped for the model)")
    p.add_argument("--budgets", type=float, nargs="+", default=[0.02, 0.05])
    p.add_argument("--limit", type=int, default=None,
                   help="prompts per calibration group (default: the preset's)")
    p.add_argument("--max-drafts", type=int, nargs="+", default=[2, 4, 8],
                   help="verified exits: runs of at most this many drafts")
    p.add_argument("--probe-dims", type=int, default=64,
                   help="verified exits: principal directions of the exits' states the "
                        "state-probe decision reads")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    from ee_jax.models.exits import cost as exit_cost
    from ee_jax.models.exits.checkpoint import load_exit_heads
    from ee_jax.models.loading import load_model
    from ee_jax.training import cached as C
    from ee_jax.training.tune import calibration_rows

    tc = preset(args.config, args.limit)
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
    rank = heads.backfill.a.shape[-1] if heads.backfill is not None else 48
    cm = exit_cost.cost_model(cfg, ec, maps_rank=rank)
    kv, maps = cm.fill, cm.maps
    modes = [(bf, b) for bf in ("deferred", "propagate", "learned") for b in (1, 8)]
    # batch 1: one row, whatever the policy; batch 8: each row at its own exit
    mode_ec = {(bf, b): dataclasses.replace(ec, backfill=bf, policy="per_row")
               for bf, b in modes}
    log(f"calibration split of {args.config} (self-generated answers, cached in {tc.work_dir})")
    groups = calibration_rows(tc, model)
    verified: dict[str, list[str]] = {}
    lines = ["### The honest ceiling per back-fill (`bench/exit_ceiling.py`)", "",
             f"Command: `python -m bench.exit_ceiling {' '.join(argv)}`. Run "
             f"{time.strftime('%Y-%m-%d %H:%M')}. Heads: {what} ({len(E)} exits "
             f"{E[0]}-{E[-1]}, {ec.head} head, measure {ec.measure}, subset "
             f"{ec.vocab_subset}). Teacher-forced on the held-apart calibration split (the "
             "model's own full-depth answers; answer tokens only). Ideal speed-ups from the "
             "engine's cost model (head and checks counted), not measured.", "",
             "| group | tokens | exit rule | threshold | TF agreement | mean layers | tokens "
             "leaving early | " + " | ".join(f"{bf}, batch {b}" for bf, b in modes) + " |",
             "|---|---:|---|---:|---:|---:|---:|" + "---:|" * len(modes)]
    for g, (rows, scored) in groups.items():
        log(f"{g}: {len(rows)} rows, {int(scored.sum())} scored tokens")
        if not len(rows):  # a small --limit can leave a group without answers
            log(f"{g}: no rows at this --limit, left out")
            continue
        cache = C.cache_states(cfg, params, rows, ec.exit_layers, 1, progress=True)
        n, T = rows.shape
        keep = scored.reshape(-1)
        row_of = np.nonzero(keep)[0] // T  # the answer of each scored token, in order
        hs = cache["hs"].transpose(0, 2, 1, 3).reshape(n * T, len(E), -1)[keep]
        feats, agree = C.decision_data(cfg, ec, params, heads, hs, rows.reshape(-1)[keep],
                                       cache["top"][..., 0].reshape(-1)[keep])
        del cache
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
            seqs = [lay[row_of == r].tolist() for r in range(n)]
            seqs = [q for q in seqs if q]
            ideal = [replay(cm, mode_ec[bf, b], seqs, b) for bf, b in modes]
            lines.append(f"| {g} | {len(lay)} | {name} | {th} | {1 - wrong:.3f} | "
                         f"{lay.mean():.2f} | {np.mean(lay < L):.0%} | "
                         + " | ".join(f"{x:.2f}x" for x in ideal) + " |")
            log(lines[-1])
        verified[g] = verified_rows(cm, ec, conf, agree, E, L, row_of, n, args.max_drafts,
                                     feats, hs, args.probe_dims)
        del hs
    lines += ["", "Batch 1: memory-bound (each weight once per step); batch 8: 8 answers side "
              "by side, per_row, compute-bound (per row). Deferred: the pending token rides "
              "along in the layers the new token runs (memory-bound: no weight more; "
              "compute-bound: a second query a row from the step's lowest pending layer up). "
              f"A step where a row left projects the K/V of every layer from the first exit "
              f"up ({kv:.3f} of a layer each, a query; learned + {maps:.3f} for its rank-"
              f"{rank} maps), for every row, whatever the exits (`exit_cost.step_work`)."]
    lines += ["", "#### Verified exits (lossless): the ceiling per draft rule and max_draft", "",
              "Batch 1, memory-bound: a draft step costs its exit's layers, checks and exit "
              "head; a verify step every layer, the checks and the final head (the run rides "
              "on its weights); rejected drafts and the drafts after them are paid "
              "(`exit_cost.verified_sequence_speedup`). Oracle: every token drafts at its "
              "first agreeing exit, never rejected. Best: the threshold of the grid with the "
              "highest ceiling at that max_draft.", "",
              "| group | draft rule | threshold | max_draft | drafts / token | acceptance | "
              "ideal speed-up |", "|---|---|---:|---:|---:|---:|---:|"]
    for g, rows_ in verified.items():
        lines += [f"| {g} | {r} |" for r in rows_]
    text = "\n".join(lines) + "\n"
    if args.out:
        write_marked(args.out, text, MARK)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
