"""Cheap exit tuning (several epochs in the time one epoch of method "full" takes): the frozen
backbone runs once over the data, its hidden states at the exits are cached, and the heads train for
several epochs on the cache with KL over a restricted vocabulary; then the vocabulary subset, the
per-exit decision MLPs (measure "candidates") and the calibrated threshold are fitted and shipped
with the heads.

    cache_states     backbone once: exit hidden states (bf16), the final norm's output,
                     the teacher's top-k ids per position
    vocab_subset     the K most frequent tokens the model emits (teacher top-1) and reads
    batch_vocab      a batch's restricted vocabulary: real next tokens, then teacher top-k
    train_heads      AdamW on `restricted_exit_losses`
    decision_data    features (`exit_checks.candidate_features`, chained over exits exactly as
                     served) and labels (exit top-1 == final top-1) per exit and token
    fit_decisions    one tiny MLP per exit on those, by BCE
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

from ee_jax.models import llama
from ee_jax.models.config import ModelConfig
from ee_jax.models.exits import checks as exit_checks
from ee_jax.models.exits import heads as exit_heads
from ee_jax.models.exits.config import ExitConfig
from ee_jax.training.losses import LossWeights, restricted_exit_losses, trainable


def _log(msg: str) -> None:
    print(f"[ee-jax tune] {msg}", file=sys.stderr, flush=True)


@functools.partial(jax.jit, static_argnames=("cfg", "exit_layers", "k"))
def _cache_batch(params, tokens, cfg: ModelConfig, exit_layers: tuple[int, ...], k: int):
    logits, hidden = llama.forward(params, tokens, cfg, return_hidden=True)
    hs = hidden[np.asarray(exit_layers) - 1].astype(jnp.bfloat16)  # [E, B, T, D]
    fin = llama.norm(hidden[-1], params.final_norm, cfg)  # [B, T, D]
    return hs, fin, jax.lax.top_k(logits, k)[1].astype(jnp.int32)


def cache_states(cfg: ModelConfig, params, rows: np.ndarray, exit_layers: tuple[int, ...],
                 k: int, batch: int = 4, progress: bool = True) -> dict[str, np.ndarray]:
    """hs [N, E, T, D] bf16, final [N, T, D] f32, top [N, T, k] int32 for rows [N, T]."""
    from tqdm.auto import tqdm

    hs, fin, top = [], [], []
    n = len(rows)
    for i in tqdm(range(0, n, batch), desc="cache", file=sys.stderr, disable=not progress):
        chunk = rows[i:i + batch]
        pad = np.concatenate([chunk, np.zeros((batch - len(chunk), rows.shape[1]), rows.dtype)])
        h, f, t = _cache_batch(params, jnp.asarray(pad), cfg, exit_layers, k)
        m = len(chunk)
        hs.append(np.asarray(jnp.moveaxis(h, 0, 1))[:m])
        fin.append(np.asarray(f)[:m])
        top.append(np.asarray(t)[:m])
    return {"hs": np.concatenate(hs), "final": np.concatenate(fin), "top": np.concatenate(top)}


def vocab_subset(tokens: np.ndarray, teacher_top1: np.ndarray, size: int, vocab_size: int
                 ) -> np.ndarray:
    """The `size` ids the model emits (teacher top-1) and reads most often, most frequent
    first (emitted tokens count twice: they are what an exit must produce)."""
    counts = (2 * np.bincount(teacher_top1.reshape(-1), minlength=vocab_size)
              + np.bincount(tokens.reshape(-1), minlength=vocab_size))
    order = np.lexsort((np.arange(vocab_size), -counts))  # by count desc, then id
    return order[:size].astype(np.int32)


def coverage(ids: np.ndarray, tokens: np.ndarray) -> float:
    """Fraction of `tokens` that are in the subset `ids`."""
    return float(np.isin(np.asarray(tokens).reshape(-1), ids).mean())


def batch_vocab(targets: np.ndarray, top: np.ndarray, size: int, fill: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids [size], valid [size], target_pos [B, T-1]): the real next tokens, then the
    teacher's top-k by rank, then `fill` (frequent ids), first occurrence kept, cut at size.
    targets: [B, T-1]; top: [B, T, k]."""
    prio = np.concatenate([targets.reshape(-1), np.moveaxis(top, -1, 0).reshape(-1), fill])
    _, first = np.unique(prio, return_index=True)
    ids = prio[np.sort(first)][:size]
    valid = np.ones(size, bool)
    if len(ids) < size:
        valid[len(ids):] = False
        ids = np.concatenate([ids, np.zeros(size - len(ids), ids.dtype)])
    order = np.argsort(ids[valid], kind="stable")
    pos = order[np.searchsorted(ids[valid][order], targets)]
    return ids.astype(np.int32), valid, pos.astype(np.int32)


def make_restricted_step(cfg, ec, w: LossWeights, opt):
    def step(heads, opt_state, params, hs, final, ids, valid, pos):
        (loss, m), grads = jax.value_and_grad(restricted_exit_losses, has_aux=True)(
            heads, params, hs, final, ids, valid, pos, cfg, ec, w)
        updates, opt_state = opt.update(grads, opt_state, heads)
        return optax.apply_updates(heads, updates), opt_state, loss, m

    return jax.jit(step, donate_argnums=(0, 1))


def train_heads(cfg, ec, w, params, heads, cache, opt, *, batch: int, epochs: int,
                kl_vocab: int, seed: int, fill: np.ndarray, rows: np.ndarray,
                progress: bool = True, log_every: int = 25) -> tuple[dict, list[dict]]:
    """Epochs of AdamW on the cached states; returns (heads, history)."""
    from tqdm.auto import tqdm

    part = trainable(heads)
    opt_state = opt.init(part)
    step_fn = make_restricted_step(cfg, ec, w, opt)
    n = len(rows)
    per_epoch = n // batch
    history = []
    bar = tqdm(total=per_epoch * epochs, desc="tune", unit="step", file=sys.stderr,
               disable=not progress)
    for epoch in range(epochs):
        order = np.random.default_rng(seed + epoch).permutation(n)
        for i in range(per_epoch):
            sel = np.sort(order[i * batch:(i + 1) * batch])
            ids, valid, pos = batch_vocab(rows[sel, 1:], cache["top"][sel], kl_vocab, fill)
            t0 = time.perf_counter()
            part, opt_state, loss, m = step_fn(
                part, opt_state, params, jnp.asarray(np.moveaxis(cache["hs"][sel], 1, 0)),
                jnp.asarray(cache["final"][sel]), jnp.asarray(ids), jnp.asarray(valid),
                jnp.asarray(pos))
            loss = float(loss)
            if not np.isfinite(loss):
                raise FloatingPointError(f"tuning diverged at epoch {epoch} step {i}")
            rec = {"epoch": epoch, "step": len(history) + 1, "loss": loss,
                   "seconds": time.perf_counter() - t0,
                   **{k: np.asarray(v).round(4).tolist() for k, v in m.items()}}
            history.append(rec)
            bar.update()
            if progress and rec["step"] % log_every == 0:
                bar.set_postfix(loss=f"{loss:.3f}", agree=f"{np.mean(rec['agree']):.3f}")
    bar.close()
    return heads.replace(**part), history


# --------------------------------------------------------------------------- decisions


@functools.partial(jax.jit, static_argnames=("cfg", "ec"))
def _decision_batch(params, heads, hs, emb, final_top, cfg: ModelConfig,
                    ec: ExitConfig):
    """hs [E, n, D], emb [n, D], final_top [n] -> features [E, n, F], agree [E, n], and the
    exit head's top-1 [E, n]; the check state is chained over exits as in serving."""
    state = exit_checks.init_check_state(emb, ec)

    def body(state, xs):
        slot, h = xs
        h = h.astype(emb.dtype)
        feats, state = exit_checks.candidate_features(params, heads, slot, h, state, cfg, ec)
        hn = exit_heads.exit_hidden(heads, slot, h, cfg)
        if heads.vocab is not None:
            top = jnp.take(heads.vocab, jnp.argmax(
                exit_heads.unembed_rows(params, hn, heads.vocab, cfg), axis=-1))
        else:
            top = jnp.argmax(llama.unembed(params, hn, cfg), axis=-1)
        return state, (feats, top == final_top, top)

    _, (f, a, t) = jax.lax.scan(body, state, (jnp.arange(hs.shape[0]), hs))
    return f, a, t


def decision_data(cfg, ec, params, heads, hs: np.ndarray, tokens: np.ndarray,
                  final_top: np.ndarray, chunk: int = 1024, progress: bool = True
                  ) -> tuple[np.ndarray, np.ndarray]:
    """hs [n, E, D] (any float), tokens [n] (each position's input token, for the embedding
    the first check's saturation compares with), final_top [n] -> (features [E, n, F],
    agree [E, n])."""
    from tqdm.auto import tqdm

    feats, agree = [], []
    n = len(tokens)
    for i in tqdm(range(0, n, chunk), desc="features", file=sys.stderr, disable=not progress):
        m = min(chunk, n - i)
        sl = slice(i, i + m)
        pad = chunk - m
        h = np.pad(np.moveaxis(np.asarray(hs[sl], np.float32), 1, 0), ((0, 0), (0, pad), (0, 0)))
        emb = llama.embed(params, jnp.asarray(np.pad(tokens[sl], (0, pad))), cfg)
        f, a, _ = _decision_batch(params, heads, jnp.asarray(h), emb,
                                  jnp.asarray(np.pad(final_top[sl], (0, pad))), cfg, ec)
        feats.append(np.asarray(f)[:, :m])
        agree.append(np.asarray(a)[:, :m])
    return np.concatenate(feats, axis=1), np.concatenate(agree, axis=1)


def fit_decisions(heads: exit_heads.ExitHeads, feats: np.ndarray, agree: np.ndarray, *,
                  steps: int = 400, lr: float = 1e-2, seed: int = 0
                  ) -> tuple[exit_heads.ExitHeads, np.ndarray]:
    """Fit heads.decision (one MLP per exit, vmapped) by full-batch Adam on BCE of
    feats [E, n, F] against agree [E, n]; returns (heads, final BCE per exit [E])."""
    x, y = jnp.asarray(feats), jnp.asarray(agree, jnp.float32)
    d0 = jax.tree.map(jnp.asarray, heads.decision)
    d0 = dataclasses.replace(d0, b2=jnp.log(jnp.clip(y.mean(1), 1e-3, 1 - 1e-3))
                             - jnp.log1p(-jnp.clip(y.mean(1), 1e-3, 1 - 1e-3)))
    opt = optax.adam(lr)

    def bce(d):
        one = jax.vmap(lambda dd, xx: exit_checks.decision_logit(_one_decision(dd), 0, xx)
                       )(d, x)  # [E, n]
        return jnp.mean(jnp.logaddexp(0.0, one) - y * one, axis=1)

    @jax.jit
    def step(d, s):
        loss, g = jax.value_and_grad(lambda d: bce(d).sum())(d)
        u, s = opt.update(g, s, d)
        return optax.apply_updates(d, u), s, loss

    d, s = d0, opt.init(d0)
    for _ in range(steps):
        d, s, _ = step(d, s)
    return heads.replace(decision=d), np.asarray(bce(d))


def _one_decision(d: exit_heads.Decision) -> exit_heads.ExitHeads:
    """One exit's decision MLP as heads of one exit (slot 0)."""
    return exit_heads.ExitHeads(decision=jax.tree.map(lambda a: a[None], d))


def confidences(heads: exit_heads.ExitHeads, feats: np.ndarray) -> np.ndarray:
    """feats [E, n, F] -> the served confidence [E, n] (the decision MLP's sigmoid)."""
    out = jax.vmap(lambda dd, xx: exit_checks.decision_logit(_one_decision(dd), 0, xx)
                   )(heads.decision, jnp.asarray(feats))
    return np.asarray(jax.nn.sigmoid(out))
