"""One decode step, in isolation: `per_row` against full depth and the batch-wide rule.

    python -m bench.per_row_step --batch 8 --context 200

The decode functions are jitted directly (no engine, no host work, no sampling): B rows with
`--context` keys each, the cache donated step to step. Exit heads: a single exit at layer
`--exit-layer` with an untrained classifier (confidence 0.5 for every row), so per-row
thresholds of 0 / inf make an exact exit pattern:

* `never`: full depth (the same program as no exit config);
* `per_row none`: per_row with no row allowed to leave (its fixed overhead);
* `per_row half`: every other row leaves at the exit layer (compaction to B/2);
* `per_row all` / `all all`: every row leaves there (the loop stops; both policies).

Every variant is compiled first (not timed), then `--repeats` interleaved rounds of `--steps`
steps; the best round's ms/step is printed with the ideal (layers run per row) ratio. The
weights are the default model's, or with `--random` same-shape random ones (no GGUF needed, for
accelerator machines); their values do not matter to the timing.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time

from bench.common import log, smollm2_shaped_random


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=200)
    p.add_argument("--exit-layer", type=int, default=10)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--random", action="store_true",
                   help="random weights of SmolLM2-135M's shapes (no model file)")
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from ee_jax.models import exit_heads
    from ee_jax.models.exit_config import ExitConfig
    from ee_jax.models.loading import load_model
    from ee_jax.serving.attention import AttentionMetadata
    from ee_jax.serving.kv_cache import allocate_cache
    from ee_jax.serving.step import model_step, policy_for

    if args.random:
        cfg, params = smollm2_shaped_random()
    else:
        m = load_model(args.model)
        cfg, params = m.config, m.params
    B, ctx, page = args.batch, args.context, 16
    L, e = cfg.n_layers, args.exit_layer
    if not 1 <= e < L:
        raise SystemExit(f"--exit-layer must be in [1, {L - 1}], got {e}")
    width = ctx // page + 2
    cache = allocate_cache(cfg, B * width + 1, page)
    table = 1 + np.arange(B * width, dtype=np.int32).reshape(B, width)  # page 0: null page
    meta = AttentionMetadata(jnp.full((B, 1), ctx, jnp.int32), jnp.asarray(table),
                             jnp.full((B,), ctx + 1, jnp.int32))
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, 1000, (B, 1)), jnp.int32)
    ec = ExitConfig(exit_layers=(e,), head="mlp", measure="classifier")
    heads = exit_heads.init_heads(cfg, ec, params)

    def thresholds(leave):
        return jnp.asarray([0.0 if leave(i) else np.inf for i in range(B)], jnp.float32)

    half = sum(1 for i in range(B) if i % 2 == 0)
    # name: (exit policy, thresholds, ideal mean layers per row). The baseline, "full depth",
    # is policy "never": the step with no checks (a fori_loop), the fastest full-depth program.
    variants = {
        "full depth": ("never", thresholds(lambda i: False), L),
        "per_row none": ("per_row", thresholds(lambda i: False), L),
        "per_row half": ("per_row", thresholds(lambda i: i % 2 == 0),
                         (half * e + (B - half) * L) / B),
        "per_row all": ("per_row", thresholds(lambda i: True), e),
        "all all": ("all", thresholds(lambda i: True), e),
    }
    steps = {}
    for name, (policy, thr, _) in variants.items():
        pol = policy_for(dataclasses.replace(ec, policy=policy), "decode")

        @functools.partial(jax.jit, donate_argnums=(1,))
        def step(params, cache, thr, pol=pol):
            result, cache = model_step(params, heads, cache, tokens, meta, thr, cfg, pol)
            return result.logits, cache

        t = time.perf_counter()
        logits, cache = step(params, cache, thr)
        logits.block_until_ready()
        log(f"compiled {name}: {time.perf_counter() - t:.1f}s")
        steps[name] = step
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, step in steps.items():
            thr = variants[name][1]
            t = time.perf_counter()
            for _ in range(args.steps):
                logits, cache = step(params, cache, thr)
            logits.block_until_ready()
            times[name].append((time.perf_counter() - t) / args.steps)
    base = min(times["full depth"])
    print(f"batch {B}, context {ctx}, exit at layer {e} of {L}; best of {args.repeats} rounds "
          f"of {args.steps} steps; {jax.devices()[0].device_kind}; "
          f"{'random' if args.random else args.model} weights")
    print("| variant | ms/step | vs full depth | ideal | rounds (ms) |")
    print("|---|---|---|---|---|")
    for name, ts in times.items():
        ideal = L / variants[name][2]
        print(f"| {name} | {1000 * min(ts):.1f} | {base / min(ts):.2f}x | {ideal:.2f}x | "
              + " ".join(f"{1000 * t:.0f}" for t in ts) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
