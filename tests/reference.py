"""Independent references the serving tests compare against: no cache, no paging."""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from ee_jax.models import llama


@functools.lru_cache(maxsize=8)
def _dense_logits_fn(cfg, width):
    @jax.jit
    def fn(params, tokens):  # tokens [1, width], right padded
        return llama.forward(params, tokens, cfg)[0]

    return fn


def dense_greedy(cfg, params, prompt: list[int], max_tokens: int, width: int = 128,
                 stop_ids=()) -> list[int]:
    """Greedy decoding by re-running the full dense forward for every token."""
    fn = _dense_logits_fn(cfg, width)
    tokens = list(prompt)
    out = []
    for _ in range(max_tokens):
        assert len(tokens) <= width, "raise `width` in the test"
        buf = np.zeros((1, width), np.int32)
        buf[0, :len(tokens)] = tokens
        logits = np.asarray(fn(params, jnp.asarray(buf)))
        nxt = int(np.argmax(logits[len(tokens) - 1]))
        out.append(nxt)
        tokens.append(nxt)
        if nxt in stop_ids:
            break
    return out


_request_ids = itertools.count()


def run_requests(engine, prompts, params) -> list:
    """Add the prompts to an engine, step until all finish; outputs in prompt order."""
    from ee_jax.serving.params import SamplingParams

    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    rids = [f"r{next(_request_ids)}" for _ in prompts]
    for rid, p, sp in zip(rids, prompts, params, strict=True):
        engine.add_request(rid, p, sp)
    done = {}
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert not engine.has_unfinished_requests(), "engine did not finish in 10,000 steps"
    return [done[rid] for rid in rids]


def learned_backfill_states(cfg, params, maps, exit_layers, tokens, exit_at) -> np.ndarray:
    """Batch-1 decoding written out token by token, with back-fill "learned": position t runs
    layers below exit_at[t]; at every layer j >= exit_at[t] = e its K/V are layer j's of
    the state after e layers, plus (j > e) the map's correction n(h_e) @ a[s, j] @ b[s, j]
    (pre-RoPE, numpy). Returns each position's last state [T, D] (its exit state if it left)."""
    L, first = cfg.n_layers, exit_layers[0]
    kv = cfg.n_kv_heads * cfg.head_dim
    inv_freq = llama.rope_inv_freq(cfg)
    keys = [[] for _ in range(L)]
    vals = [[] for _ in range(L)]
    out = []
    for t, tok in enumerate(tokens):
        pos = jnp.asarray([[t]], jnp.int32)
        x = llama.embed(params, jnp.asarray([[tok]]), cfg)  # [1, 1, D]
        e = int(exit_at[t])
        for j in range(L):
            lp = llama.layer_params(params, j)
            if j >= e:  # skipped: back-filled from the exit state x
                k, v = llama.kv_project(lp, x, pos, cfg)
                if j > e:
                    h = np.asarray(x[0, 0], np.float64)
                    n = np.append(h / np.sqrt(np.mean(h * h) + cfg.rms_eps), 1.0)
                    s = exit_layers.index(e)
                    c = n @ np.asarray(maps.a[s, j - first], np.float64) @ np.asarray(
                        maps.b[s, j - first], np.float64)
                    dk = jnp.asarray(c[:kv].reshape(1, 1, cfg.n_kv_heads, cfg.head_dim),
                                     jnp.float32)
                    k = k + llama.apply_rope(dk, pos, inv_freq)
                    v = v + jnp.asarray(c[kv:].reshape(v.shape), jnp.float32)
                keys[j].append(k)
                vals[j].append(v)
                continue

            def attend(q, k, v, j=j):
                keys[j].append(k)
                vals[j].append(v)
                mask = jnp.ones((1, 1, len(keys[j])), bool)
                return llama.gqa_attention(q, jnp.concatenate(keys[j], axis=1),
                                           jnp.concatenate(vals[j], axis=1), mask,
                                           scale=cfg.attn_scale), None

            x, _ = llama.decoder_layer(lp, x, pos, cfg, attend)
        out.append(np.asarray(x[0, 0]))
    return np.stack(out)
