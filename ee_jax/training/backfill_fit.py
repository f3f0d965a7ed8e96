"""Fit learned back-fill maps (`ee_jax.models.exits.backfill_maps`) in closed form from the dense
forward's hidden states: reduced-rank ridge regression, streamed over chunks of tokens.

For exit e and skipped layer j > e, with X = [h_e / rms(h_e), 1] (N x (D + 1)) and R the
difference between layer j's pre-RoPE K/V of its true input h_j and of h_e (what propagate
writes), the ridge solution is C = (X'X + lam I)^-1 X'R. The map keeps its best rank-r part
in the fitted values' sense (reduced-rank regression): with S scaling K and V columns to
equal weight (1 / their RMS), U_r the top r eigenvectors of (CS)' X'X (CS), a = C S U_r and
b = U_r' S^-1. Only sufficient statistics are kept (X'X per exit, X'R per pair), so any
number of tokens fits in memory. Pre-RoPE K/V come from `llama.kv_project` at position 0
(RoPE at 0 rotates nothing), so bias and K-norm are included exactly as the layer has them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ee_jax.models import llama
from ee_jax.models.config import ModelConfig
from ee_jax.models.exits import backfill_maps as bm


@functools.partial(jax.jit, static_argnames=("cfg",))
def _pre_rope_kv(params, j, h, cfg: ModelConfig) -> jax.Array:
    """Layer j's K/V of input h [N, D] without RoPE: [N, 2 * K * hd] f32."""
    lp = jax.tree.map(lambda a: a[j], params.layers)
    k, v = llama.kv_project(lp, h[:, None], jnp.zeros((h.shape[0], 1), jnp.int32), cfg)
    return jnp.concatenate([k.reshape(h.shape[0], -1), v.reshape(h.shape[0], -1)],
                           axis=-1).astype(jnp.float32)


class MapFitter:
    """Accumulates X'X per exit and X'R per (exit, layer) over chunks of hidden states."""

    def __init__(self, cfg: ModelConfig, params, exit_layers: tuple[int, ...]):
        self.cfg, self.params, self.exits = cfg, params, tuple(exit_layers)
        self.first = self.exits[0]
        D1, O = cfg.d_model + 1, 2 * bm.kv_dim(cfg)
        self.G = {e: np.zeros((D1, D1)) for e in self.exits}
        self.XR = {(e, j): np.zeros((D1, O)) for _, e in enumerate(self.exits)
                   for j in range(e + 1, cfg.n_layers)}
        self.y2 = np.zeros((cfg.n_layers, 2))  # sum of squares of true K, V per layer
        self.n = 0

    def add(self, states: np.ndarray) -> None:
        """states [N, L - first, D]: the hidden state after k layers for k = first..L-1 (the
        input of layers first..L-1), for N tokens of the dense forward."""
        cfg, kv = self.cfg, bm.kv_dim(self.cfg)
        if states.ndim != 3 or states.shape[1:] != (cfg.n_layers - self.first, cfg.d_model):
            raise bm.BackfillMapsError(
                f"states must be [N, {cfg.n_layers - self.first}, {cfg.d_model}] (the hidden "
                f"state after layers {self.first}..{cfg.n_layers - 1}), got {states.shape}")
        hs = jnp.asarray(states)
        true = {j: np.asarray(_pre_rope_kv(self.params, j, hs[:, j - self.first], cfg),
                              np.float64) for j in range(self.first + 1, cfg.n_layers)}
        for j, y in true.items():
            self.y2[j] += [np.sum(y[:, :kv] ** 2), np.sum(y[:, kv:] ** 2)]
        for e in self.exits:
            he = hs[:, e - self.first]
            X = np.asarray(bm.normed_input(he, cfg), np.float64)
            self.G[e] += X.T @ X
            for j in range(e + 1, cfg.n_layers):
                prop = np.asarray(_pre_rope_kv(self.params, j, he, cfg), np.float64)
                self.XR[(e, j)] += X.T @ (true[j] - prop)
        self.n += len(states)

    def solve(self, rank: int, ridge: float = 1e-3) -> bm.Maps:
        """The maps at `rank`; ridge: lam as a fraction of the mean diagonal of X'X."""
        cfg, kv = self.cfg, bm.kv_dim(self.cfg)
        if self.n == 0:
            raise bm.BackfillMapsError("no states were added: nothing to fit maps on")
        if not 1 <= rank <= 2 * kv:
            raise bm.BackfillMapsError(f"rank must be in [1, {2 * kv}], got {rank}")
        shapes = bm.map_shapes(cfg, self.exits, rank)
        a = np.zeros(shapes.a.shape, np.float32)
        b = np.zeros(shapes.b.shape, np.float32)
        for s, e in enumerate(self.exits):
            G = self.G[e]
            lam = ridge * float(np.mean(np.diag(G)))
            Gi = np.linalg.inv(G + lam * np.eye(len(G)))
            for j in range(e + 1, cfg.n_layers):
                C = Gi @ self.XR[(e, j)]
                rms = np.sqrt(np.maximum(self.y2[j] / (self.n * kv), 1e-30))
                S = np.concatenate([np.full(kv, 1 / rms[0]), np.full(kv, 1 / rms[1])])
                aa, bb = reduce_rank(C, G, S, rank)
                a[s, j - self.first], b[s, j - self.first] = aa, bb
        return bm.Maps(a=jnp.asarray(a), b=jnp.asarray(b))


def reduce_rank(C: np.ndarray, G: np.ndarray, S: np.ndarray, rank: int
                ) -> tuple[np.ndarray, np.ndarray]:
    """(a [D1, r], b [r, O]) with a @ b the rank-r part of C [D1, O] that best keeps the
    fitted values X C in the column weighting S (G = X'X). rank >= O: C itself, exactly."""
    O = C.shape[1]
    if rank >= O:
        return C, np.eye(O)
    Cw = C * S
    _, U = np.linalg.eigh(Cw.T @ G @ Cw)
    U = U[:, ::-1][:, :rank]
    return Cw @ U, U.T / S


def kv_errors(cfg: ModelConfig, params, exit_layers: tuple[int, ...], maps: bm.Maps,
              states: np.ndarray) -> dict[tuple[int, int], tuple[float, float, float, float]]:
    """Held-out relative errors per (exit, layer) of the pre-RoPE K/V a back-fill writes:
    (K propagate, K learned, V propagate, V learned), each ||pred - true|| / ||true||."""
    kv, first = bm.kv_dim(cfg), exit_layers[0]
    hs = jnp.asarray(states)
    out = {}
    for s, e in enumerate(exit_layers):
        he = hs[:, e - first]
        X = np.asarray(bm.normed_input(he, cfg), np.float64)
        for j in range(e + 1, cfg.n_layers):
            y = np.asarray(_pre_rope_kv(params, j, hs[:, j - first], cfg), np.float64)
            prop = np.asarray(_pre_rope_kv(params, j, he, cfg), np.float64)
            fit = prop + X @ np.asarray(maps.a[s, j - first], np.float64) @ np.asarray(
                maps.b[s, j - first], np.float64)

            def rel(p, sl):
                return float(np.linalg.norm(p[:, sl] - y[:, sl]) / np.linalg.norm(y[:, sl]))

            K, V = slice(0, kv), slice(kv, None)
            out[(e, j)] = (rel(prop, K), rel(fit, K), rel(prop, V), rel(fit, V))
    return out


@functools.partial(jax.jit, static_argnames=("cfg", "first"))
def states_of(params, tokens, cfg: ModelConfig, first: int) -> jax.Array:
    """tokens [B, T] -> the state after first..L-1 layers [B, T, L - first, D] (f32)."""
    hidden = llama.forward(params, tokens, cfg, return_hidden=True)[1]  # [L, B, T, D]
    return jnp.moveaxis(hidden[first - 1:cfg.n_layers - 1], 0, 2).astype(jnp.float32)


def fit_from_rows(cfg: ModelConfig, params, exit_layers: tuple[int, ...], rows: np.ndarray,
                  scored: np.ndarray | None = None, *, batch: int = 4,
                  progress: bool = True) -> MapFitter:
    """A MapFitter fed with the dense forward's states of `rows` [N, T] (only the tokens
    where `scored` [N, T] holds, e.g. answer tokens); solve it at the rank you ship."""
    import sys

    from tqdm.auto import tqdm

    fitter = MapFitter(cfg, params, exit_layers)
    first = fitter.first
    for i in tqdm(range(0, len(rows), batch), desc="back-fill maps", file=sys.stderr,
                  disable=not progress):
        chunk = rows[i:i + batch]
        pad = np.concatenate([chunk, np.zeros((batch - len(chunk), rows.shape[1]),
                                              rows.dtype)])
        hs = np.asarray(states_of(params, jnp.asarray(pad), cfg, first))[:len(chunk)]
        keep = np.ones(chunk.shape, bool) if scored is None else scored[i:i + batch]
        if keep.any():
            fitter.add(hs[keep])
    return fitter
