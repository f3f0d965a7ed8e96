"""The first exit check alone, f32 vs int8 candidate search (issue 12; scratch, one process).

    python -m bench.first_check --batches 1 4 8 --reps 40

`exit_checks.candidate_features(..., first=True)` jitted on the shipped SmolLM2 heads, with the
subset's rows from `exit_heads.with_vocab_rows(candidate_dtype=None)` (the f32 search) and
`with_vocab_rows()` (int8 search, exact rescoring of the 8 candidates), on random hidden states.
Variants interleaved call by call (order alternating); each call timed alone after a 128 MB
write evicts the 32 MB L3 ("cold", as inside a decode step, where the layers' weights pass
through the cache between two first checks) and, separately, back to back ("warm"). Medians.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 4, 8])
    p.add_argument("--reps", type=int, default=40)
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from ee_jax.models import exit_checks, exit_heads
    from ee_jax.models.loading import load_model

    m = load_model(args.model, progress=False)
    cfg, params = m.config, m.params
    ec, heads = m.shipped_exit_heads()
    variants = {"f32 search": exit_heads.with_vocab_rows(params, heads, cfg, candidate_dtype=None),
                "int8 search": exit_heads.with_vocab_rows(params, heads, cfg)}
    big = jnp.ones((32 * 2**20,), jnp.float32)
    evict = jax.jit(lambda a: a * 1.0001)

    @jax.jit
    def first(hv, h):
        st = exit_checks.init_check_state(h, ec)
        f, st = exit_checks.candidate_features(params, hv, 0, h, st, cfg, ec, first=True)
        return f, st.cand

    for B in args.batches:
        h = jax.random.normal(jax.random.PRNGKey(B), (B, cfg.d_model)) * 3.0
        for hv in variants.values():
            jax.block_until_ready(first(hv, h))
        cold = {k: [] for k in variants}
        warm = {k: [] for k in variants}
        for r in range(args.reps):
            for name in (list(variants) if r % 2 == 0 else list(reversed(variants))):
                hv = variants[name]
                for _ in range(3):
                    evict(big).block_until_ready()
                    t = time.perf_counter()
                    jax.block_until_ready(first(hv, h))
                    cold[name].append(time.perf_counter() - t)
                t = time.perf_counter()
                for _ in range(5):
                    out = first(hv, h)
                jax.block_until_ready(out)
                warm[name].append((time.perf_counter() - t) / 5)
        c0, w0 = (statistics.median(x["f32 search"]) for x in (cold, warm))
        print(f"batch {B}: first check, median of {3 * args.reps} cold calls / {args.reps} "
              f"warm rounds of 5")
        for name in variants:
            c, w = statistics.median(cold[name]), statistics.median(warm[name])
            print(f"  {name:12s} cold {1e3 * c:6.3f} ms ({c / c0:.2f}x f32)   warm "
                  f"{1e3 * w:6.3f} ms ({w / w0:.2f}x f32)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
