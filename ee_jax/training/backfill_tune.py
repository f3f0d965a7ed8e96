"""Fine-tune learned back-fill maps through the served loss (what later tokens read, not
the squared K/V error the closed-form fit minimises).

The closed-form fit (`backfill_fit`) makes each map's K/V close to full depth's in squared
error, every (exit, layer) pair alone. What serving needs is different: that the tokens *after*
an early one, attending to its back-filled K/V, still produce full depth's next token. This
module measures and minimises that directly, in a teacher-forced simulation of batch-1
serving with back-fill "learned":

- each answer position leaves at the first exit whose confidence (the heads' own check, on
  the dense forward) reaches `threshold`, else runs all L layers (`exit_plan`);
- in the simulated forward (`served_forward`), at every layer j above a position's exit e,
  later tokens read that position's K/V as back-fill writes it: `kv_project(layer j, h_e)`
  plus the map's correction (`backfill_maps`), with h_e the position's state after e layers
  *in the simulation* (earlier back-filled tokens have moved it too);
- the loss is KL(full depth || simulated) of the final logits at the positions that run full
  depth (those are the tokens whose agreement learned back-fill loses: the "full-depth
  tokens" half of `bench.shipped_exits`' TF agreement), gradients flowing into the maps only.

Layers below the first exit are exact in the simulation (no K/V is back-filled there), so the
dense states after `first` layers are computed once and the simulation starts there.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from ee_jax.models import llama
from ee_jax.models.config import ModelConfig
from ee_jax.models.exits import backfill_maps as bm
from ee_jax.models.exits import checks as exit_checks
from ee_jax.models.exits.config import ExitConfig


@dataclasses.dataclass(frozen=True)
class Batch:
    """One bucket of rows, everything the simulation needs (numpy, host side)."""

    h_first: np.ndarray  # [B, T, D] f32: dense state after `first` layers
    exit_at: np.ndarray  # [B, T] int32: layers a position runs (L: full depth)
    loss_pos: np.ndarray  # [B, P] int32: positions scored by the loss (full depth, answer)
    loss_mask: np.ndarray  # [B, P] bool
    teacher: np.ndarray  # [B, P, D] f32: dense final state at loss_pos (before final norm)


def exit_plan(conf: np.ndarray, exit_layers: tuple[int, ...], can_leave: np.ndarray,
              threshold: float, n_layers: int) -> np.ndarray:
    """conf [E, B, T] (each exit's confidence) -> exit_at [B, T]: the first exit layer whose
    confidence reaches `threshold` where `can_leave` [B, T] holds, else n_layers."""
    ok = (conf >= threshold) & can_leave[None]
    first = ok.argmax(axis=0)
    return np.where(ok.any(axis=0), np.asarray(exit_layers)[first], n_layers).astype(np.int32)


def served_forward(params, maps: bm.Maps, h_first: jax.Array, exit_at: jax.Array,
                   cfg: ModelConfig, exit_layers: tuple[int, ...]) -> jax.Array:
    """The final hidden state [B, T, D] (before the final norm) of a teacher-forced forward
    in which every position that left at e < j is seen by later tokens, at layer j, through
    back-fill "learned" K/V. h_first [B, T, D]: the dense state after exit_layers[0] layers;
    exit_at [B, T]: layers each position runs (n_layers: all). Positions start at 0."""
    first, L = exit_layers[0], cfg.n_layers
    B, T, _ = h_first.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    mask = llama.attention_weights_mask(positions, positions)  # [B, T, T]
    slot_of = np.full(L + 1, -1, np.int32)
    slot_of[list(exit_layers)] = np.arange(len(exit_layers))
    onehot = jax.nn.one_hot(jnp.asarray(slot_of)[exit_at], len(exit_layers))  # [B, T, X]
    inv_freq = llama.rope_inv_freq(cfg)
    kv = bm.kv_dim(cfg)
    if cfg.layer_windows is not None:
        raise NotImplementedError(
            f"{cfg.name}: fine-tuning back-fill maps does not simulate sliding-window layers "
            f"yet; fit the maps in closed form only (ee-jax fit-backfill without "
            f"--finetune-epochs)")

    def body(carry, layer):
        x, frozen = carry
        lp, a, b, j = layer  # a [X, D+1, r], b [X, r, O]
        frozen = jnp.where((exit_at == j)[..., None], x, frozen)
        left = (exit_at < j)[..., None]  # [B, T, 1]: back-filled at this layer
        src = jnp.where(left, frozen, x)
        n = bm.normed_input(frozen, cfg)  # [B, T, D+1]
        z = jnp.einsum("btd,xdr->btxr", n, a.astype(jnp.float32)) * (
            onehot * left)[..., None]
        c = jnp.einsum("btxr,xro->bto", z, b.astype(jnp.float32))  # [B, T, 2KV]
        dk = c[..., :kv].reshape(B, T, cfg.n_kv_heads, cfg.head_dim)
        dv = c[..., kv:].reshape(B, T, cfg.n_kv_heads, cfg.head_dim)
        kb, vb = llama.kv_project(lp, src, positions, cfg)
        kb = kb + llama.apply_rope(dk, positions, inv_freq).astype(kb.dtype)
        vb = vb + dv.astype(vb.dtype)

        def attend(q, k, v):
            del k, v  # this layer's own K/V: kb/vb hold them wherever nothing left
            return llama.gqa_attention(q, kb, vb, mask, scale=cfg.attn_scale,
                                       softcap=cfg.attn_logit_softcap), None

        x, _ = llama.decoder_layer(lp, x, positions, cfg, attend)
        return (x, frozen), None

    layers = jax.tree.map(lambda w: w[first:], params.layers)
    js = jnp.arange(first, L, dtype=jnp.int32)
    a = jnp.moveaxis(maps.a, 1, 0)  # [L - first, X, D+1, r]
    b = jnp.moveaxis(maps.b, 1, 0)
    (x, _), _ = jax.lax.scan(jax.checkpoint(body), (h_first, h_first), (layers, a, b, js))
    return x


def _gather(x: jax.Array, pos: jax.Array) -> jax.Array:
    return jnp.take_along_axis(x, pos[..., None], axis=1)  # [B, P, D]


def served_loss(maps, params, batch: dict, cfg: ModelConfig, exit_layers: tuple[int, ...]):
    """(mean KL(full depth || simulated) at the loss positions, top-1 agreement there)."""
    x = served_forward(params, maps, batch["h_first"], batch["exit_at"], cfg, exit_layers)
    student = jax.nn.log_softmax(llama.final_head(params, _gather(x, batch["loss_pos"]), cfg))
    teacher = jax.nn.log_softmax(llama.final_head(params, batch["teacher"], cfg))
    kl = jnp.sum(jnp.exp(teacher) * (teacher - student), axis=-1)  # [B, P]
    m = batch["loss_mask"].astype(jnp.float32)
    n = jnp.maximum(m.sum(), 1.0)
    agree = (jnp.argmax(student, -1) == jnp.argmax(teacher, -1)).astype(jnp.float32)
    return jnp.sum(kl * m) / n, (jnp.sum(agree * m), m.sum())


@functools.partial(jax.jit, static_argnames=("cfg", "ec"))
def _dense_pass(params, heads, tokens, cfg: ModelConfig, ec: ExitConfig):
    """tokens [B, T] -> (every exit's confidence [E, B, T], the state after the first exit's
    layers [B, T, D], the final state [B, T, D]), from one dense forward."""
    logits, hidden = llama.forward(params, tokens, cfg, return_hidden=True)
    conf, _ = exit_checks.dense_confidences(params, heads, hidden, tokens,
                                           jnp.argmax(logits, axis=-1), cfg, ec)
    first = ec.exit_layers[0]
    return conf, hidden[first - 1].astype(jnp.float32), hidden[-1].astype(jnp.float32)


def make_batches(cfg: ModelConfig, params, ec: ExitConfig, heads, pairs,
                 thresholds: tuple[float, ...], *, rows: int = 8,
                 buckets=(64, 128, 192, 256), progress: bool = True) -> list[Batch]:
    """Rows of (prompt, answer) pairs (longest first, `rows` a batch, T the smallest bucket
    that holds them, longer rows cut) with their dense states and, per threshold, the exit
    plan the heads make there: one Batch per chunk and threshold (one dense pass a chunk)."""
    L = cfg.n_layers
    P = max(len(a) for _, a in pairs)
    order = sorted(range(len(pairs)), key=lambda i: -len(pairs[i][0]) - len(pairs[i][1]))
    out = []
    for s in tqdm(range(0, len(order), rows), desc="back-fill tuning data", unit="batch",
                  file=sys.stderr, disable=not progress):
        chunk = [pairs[i] for i in order[s:s + rows]]
        longest = max(len(p) + len(a) for p, a in chunk)
        T = next((t for t in buckets if t >= longest), buckets[-1])
        tokens = np.zeros((rows, T), np.int32)
        can_leave = np.zeros((rows, T), bool)
        full = np.zeros((rows, T), bool)
        for r, (p, a) in enumerate(chunk):
            ids = (p + a)[:T]
            tokens[r, :len(ids)] = ids
            # decode positions (the prefill's last, len(p) - 1, runs at full depth), up to
            # the one producing the last answer token
            can_leave[r, len(p):len(ids) - 1] = True
            full[r, len(p) - 1:len(ids) - 1] = True
        conf, h_first, h_last = map(np.asarray, _dense_pass(params, heads, jnp.asarray(tokens),
                                                              cfg, ec))
        for thr in thresholds:
            exit_at = exit_plan(conf, ec.exit_layers, can_leave, thr, L)
            scored = full & (exit_at == L)
            loss_pos = np.zeros((rows, P), np.int32)
            loss_mask = np.zeros((rows, P), bool)
            for r in range(rows):
                idx = np.flatnonzero(scored[r])[:P]
                loss_pos[r, :len(idx)] = idx
                loss_mask[r, :len(idx)] = True
            out.append(Batch(h_first, exit_at, loss_pos, loss_mask,
                             np.take_along_axis(h_last, loss_pos[..., None], axis=1)))
    return out


def _as_jax(b: Batch) -> dict:
    return {k: jnp.asarray(v) for k, v in dataclasses.asdict(b).items()}


def evaluate(cfg, params, maps, batches: list[Batch], exit_layers) -> dict:
    """Mean KL and simulated full-depth-token agreement over `batches`."""
    f = jax.jit(functools.partial(served_loss, cfg=cfg, exit_layers=tuple(exit_layers)))
    kl = agree = n = 0.0
    for b in batches:
        loss, (a, m) = f(maps, params, _as_jax(b))
        kl += float(loss) * float(m)
        agree += float(a)
        n += float(m)
    return {"kl": kl / max(n, 1), "agreement": agree / max(n, 1), "tokens": int(n)}


def finetune(cfg, params, maps, batches: list[Batch], exit_layers, *, epochs: int = 2,
             lr: float = 1e-4, held_out: list[Batch] | None = None, seed: int = 0,
             progress: bool = True) -> tuple[bm.Maps, list[dict]]:
    """Adam on the maps (f32 master copy; returned in `bm.MAP_DTYPE`) through `served_loss`,
    held-out evaluation after every epoch. Returns (maps, history)."""
    if not (isinstance(epochs, int) and epochs >= 1) or not lr > 0:
        raise bm.BackfillMapsError(f"fine-tuning back-fill maps needs epochs >= 1 and a "
                                   f"learning rate > 0, got epochs={epochs!r}, lr={lr!r}")
    if not batches:
        raise bm.BackfillMapsError("no batches to fine-tune the back-fill maps on")
    exit_layers = tuple(exit_layers)
    bm.check_maps(cfg, exit_layers, maps)
    # entries of layers at or below each exit stay zero (never read; kept so by the mask)
    live = np.zeros(maps.a.shape[:2], np.float32)
    for s, j in bm.used(exit_layers, cfg.n_layers):
        live[s, j - exit_layers[0]] = 1.0
    live = jnp.asarray(live)[..., None, None]
    m32 = jax.tree.map(lambda w: w.astype(jnp.float32), maps)
    steps = epochs * len(batches)
    opt = optax.chain(optax.clip_by_global_norm(1.0),
                      optax.adam(optax.cosine_decay_schedule(lr, max(steps, 1))))
    state = opt.init(m32)

    @jax.jit
    def step(m, state, params, batch):  # params an argument: closed over, XLA folds them
        (loss, (a, n)), g = jax.value_and_grad(served_loss, has_aux=True)(
            m, params, batch, cfg, exit_layers)
        g = jax.tree.map(lambda x: x * live, g)
        upd, state = opt.update(g, state, m)
        return optax.apply_updates(m, upd), state, loss, a / jnp.maximum(n, 1)

    history = []
    if held_out:
        history.append({"epoch": 0, **evaluate(cfg, params, m32, held_out, exit_layers)})
        _log(f"held out before: {history[-1]}")
    rng = np.random.default_rng(seed)
    for ep in range(1, epochs + 1):
        t0, losses = time.time(), []
        bar = tqdm(rng.permutation(len(batches)), desc=f"back-fill tuning epoch {ep}",
                   file=sys.stderr, disable=not progress)
        for i in bar:
            m32, state, loss, agree = step(m32, state, params, _as_jax(batches[i]))
            losses.append(float(loss))
            bar.set_postfix(kl=f"{np.mean(losses[-20:]):.4f}", agree=f"{float(agree):.3f}")
        rec = {"epoch": ep, "train_kl": float(np.mean(losses)), "seconds": time.time() - t0}
        if held_out:
            rec.update(evaluate(cfg, params, m32, held_out, exit_layers))
        history.append(rec)
        _log(f"epoch {ep}: {rec}")
    return jax.tree.map(lambda w: w.astype(bm.MAP_DTYPE), m32), history


def _log(msg: str) -> None:
    print(f"[backfill-tune] {msg}", file=sys.stderr, flush=True)
