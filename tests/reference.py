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
