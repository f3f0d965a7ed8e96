"""Stage 2 of the issue-12 step-4 experiment (scratch): decision-MLP variants fitted on the
features of stage 1, calibrated with the shipped rule (per group, target 0.96, clusters), and
simulated teacher-forced on the evaluation workloads, in sequence order (the previous token's
exit layer is a feature of some variants; prompt positions and window starts count as full
depth, as the prefill runs every layer).
"""
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, ".")
from ee_jax.models import exit_cost
from ee_jax.models.loading import load_model
from ee_jax.models import exit_threshold

LAYERS = np.arange(16, 30)
L = 30
GRID = tuple(np.round(np.arange(0.995, 0.795, -0.005), 3).tolist())
TARGET = float(sys.argv[1]) if len(sys.argv) > 1 else 0.96


def log(m):
    print(f"[step4 {time.strftime('%H:%M:%S')}] {m}", file=sys.stderr, flush=True)


def prev_code(layer):
    return (np.asarray(layer, np.float32) - 16) / 14  # full depth (30) -> 1.0


def mlp_logit(d, x):  # d: per-exit params (w1 [E, F, H], b1 [E, H], w2 [E, H], b2 [E])
    E, extra = x.shape[0], (1,) * (x.ndim - 2)  # x [E, ..., F]
    hid = jnp.tanh(jnp.einsum("e...f,efh->e...h", x, d["w1"])
                   + jnp.reshape(d["b1"], (E, *extra, -1)))
    return (jnp.einsum("e...h,eh->e...", hid, d["w2"])
            + jnp.reshape(d["b2"], (E, *extra)))


def fit(x, y, steps=400, lr=1e-2, seed=0, hidden=16):
    """x [E, n, F], y [E, n] -> per-exit MLP (tanh, width 16) by full-batch Adam on BCE."""
    E, _, F = x.shape
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    p = y.mean(1).clip(1e-3, 1 - 1e-3)
    d = {"w1": jax.random.normal(k1, (E, F, hidden)) / np.sqrt(F),
         "b1": jnp.zeros((E, hidden)), "w2": 0.1 * jax.random.normal(k2, (E, hidden)),
         "b2": jnp.asarray(np.log(p) - np.log1p(-p), jnp.float32)}
    x, y = jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32)
    opt = optax.adam(lr)

    def loss(d):
        z = mlp_logit(d, x)
        return jnp.mean(jnp.logaddexp(0.0, z) - y * z, axis=1).sum()

    @jax.jit
    def step(d, s):
        l, g = jax.value_and_grad(loss)(d)
        u, s = opt.update(g, s, d)
        return optax.apply_updates(d, u), s, l

    s = opt.init(d)
    for _ in range(steps):
        d, s, _ = step(d, s)
    return jax.tree.map(np.asarray, d)


def shipped_params(heads):
    d = heads["decision"]
    return {k: np.asarray(d[k]) for k in ("w1", "b1", "w2", "b2")}


def conf_of(d, f):  # f [E, ..., F]
    return np.asarray(jax.nn.sigmoid(mlp_logit(d, jnp.asarray(f, jnp.float32))))


def simulate(d, f, a, m, thr, use_prev):
    """Sequential TF simulation on windows: f [E, W, T, F], a [E, W, T], m [W, T].
    Returns (exit layer [W, T], correct [W, T]) (exit layer L: full depth)."""
    E, W, T, _ = f.shape
    if not use_prev:
        c = conf_of(d, f)  # [E, W, T]
        ok = c >= thr
        leaves = ok.any(0)
        first = ok.argmax(0)
        layer = np.where(leaves, LAYERS[first], L)
        corr = np.where(leaves, np.take_along_axis(a, first[None], 0)[0], True)
        return layer, corr
    layer = np.full((W, T), L)
    corr = np.ones((W, T), bool)
    prev = np.ones(W, np.float32)
    for t in range(T):
        x = np.concatenate([f[:, :, t, :].astype(np.float32),
                            np.broadcast_to(prev[None, :, None], (E, W, 1))], -1)
        c = conf_of(d, x)  # [E, W]
        ok = c >= thr
        leaves = ok.any(0) & m[:, t]
        first = ok.argmax(0)
        lt = np.where(leaves, LAYERS[first], L)
        layer[:, t] = lt
        corr[:, t] = np.where(leaves, a[first, np.arange(W), t], True)
        prev = np.where(m[:, t], prev_code(lt), 1.0).astype(np.float32)
    return layer, corr


def table_of(d, f, a, m, clusters, use_prev):
    errors, exited, mean, by = [], [], [], []
    k = int(clusters.max()) + 1
    for thr in GRID:
        layer, corr = simulate(d, f, a, m, thr, use_prev)
        wrong = (~corr) & m
        errors.append(int(wrong.sum()))
        exited.append(int(((layer < L) & m).sum()))
        mean.append(float(layer[m].mean()))
        by.append(tuple(np.bincount(np.broadcast_to(clusters[:, None], m.shape)[m],
                                    weights=wrong[m], minlength=k).astype(int).tolist()))
    sizes = tuple(np.bincount(np.broadcast_to(clusters[:, None], m.shape)[m],
                              minlength=k).tolist())
    return exit_threshold.CalibrationTable(GRID, tuple(errors), tuple(exited), tuple(mean),
                                           int(m.sum()), sizes, tuple(by))


def main():
    z = np.load("runs/step4/feats.npz")
    S = lambda name: (z[f"{name}_f"], z[f"{name}_a"], z[f"{name}_m"], z[f"{name}_c"])  # noqa
    model = load_model("smollm2-135m-instruct", dtype="float32", progress=False)
    ec, heads = model.shipped_exit_heads()
    cost = exit_cost.cost_model(model.config, ec)
    shipped = shipped_params(heads)
    from ee_jax.training import cached as C
    x = np.random.default_rng(1).normal(size=(14, 50, 9)).astype(np.float32)
    assert np.allclose(conf_of(shipped, x), C.confidences(heads, x), atol=1e-5)

    def flat(name, prev_d=None, prev_thr=0.97):
        f, a, m, _ = S(name)
        E = f.shape[0]
        x = f.astype(np.float32)
        if prev_d is not None:  # previous position's exit under the shipped decision
            layer, _ = simulate(prev_d, f, a, m, prev_thr, False)
            prev = np.ones(m.shape, np.float32)
            prev[:, 1:] = np.where(m[:, :-1], prev_code(layer[:, :-1]), 1.0)
            x = np.concatenate([x, np.broadcast_to(prev[None, ..., None], (E, *m.shape, 1))],
                               -1)
        return x[:, m], a[:, m]

    rng = np.random.default_rng(0)

    def train_set(names, with_prev):
        xs, ys = zip(*(flat(n, shipped if with_prev else None) for n in names), strict=True)
        x, y = np.concatenate(xs, 1), np.concatenate(ys, 1)
        sel = rng.permutation(x.shape[1])[:40000]
        return x[:, sel], y[:, sel]

    variants = {"shipped": (shipped, False)}
    for name, sets, prev in (("refit", ["train"], False),
                             ("refit+everyday", ["train", "everyday"], False),
                             ("prev", ["train"], True),
                             ("prev+everyday", ["train", "everyday"], True)):
        x, y = train_set(sets, prev)
        log(f"fit {name}: {x.shape}")
        variants[name] = (fit(x, y), prev)
    res = {}
    groups = [k[4:-2] for k in z.files if k.startswith("cal-") and k.endswith("_f")]
    for vname, (d, prev) in variants.items():
        tables = {g: table_of(d, *S(f"cal-{g}"), prev) for g in groups}
        picks = {g: exit_threshold.pick_threshold(t, TARGET, 0.1) for g, t in tables.items()}
        thr = max(picks.values())
        r = {"picks": picks, "threshold": thr, "eval": {}}
        for w in ("instructions", "humaneval", "chat"):
            f, a, m, _ = S(f"eval-{w}")
            curve = []
            for t in sorted({thr, 0.9, 0.93, 0.95, 0.96, 0.965, 0.97, 0.975, 0.98}):
                layer, corr = simulate(d, f, a, m, t, prev)
                v, c = np.unique(layer[m], return_counts=True)
                hist = {int(a_): int(b_) for a_, b_ in zip(v, c, strict=True)}
                curve.append(dict(t=t, tf=float(corr[m].mean()), layers=float(layer[m].mean()),
                                  ideal=cost.ideal_speedup(hist), hist=hist))
            r["eval"][w] = curve
        res[vname] = r
        log(f"{vname}: picks {picks} -> {thr}")
        for w, curve in r["eval"].items():
            at = next(c for c in curve if c["t"] == thr)
            best = [c for c in curve if c["tf"] >= TARGET]
            best = min(best, key=lambda c: c["layers"]) if best else None
            log(f"   {w}: @{thr}: TF {at['tf']:.3f} layers {at['layers']:.2f} ideal "
                f"{at['ideal']:.3f}x" + (f"; lowest layers with TF>={TARGET} on the grid: "
                                         f"@{best['t']} {best['layers']:.2f} "
                                         f"({best['ideal']:.3f}x)" if best else ""))
    with open(f"runs/step4/variants-{TARGET}.json", "w") as fh:
        json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
