"""Decode step time per exit policy, same prompts, one process (a quick side-by-side check).

    python -m bench.policy_steps --batch 8 --new-tokens 48

Engines: no exit config (plain full depth), policy "never", "all" at threshold 0.9, and
"per_row" at thresholds inf (no row may leave: its fixed overhead) and 0.9; the shipped heads of
the default model. Every engine runs the prompts once to compile (excluded), then --repeats
interleaved rounds with EOS ignored (all see the same sequence lengths); the best round's mean
decode step time is printed with mean executed layers per row and the share of row-layers
computed.

    python -m bench.policy_steps --step --batch 1 4

`--step`: the decode step alone (`step.model_step` jitted, cache donated, no engine, no host
work), the shipped heads on random tokens at a context of 200 keys: full depth against the
exit step whose checks all run and never fire (threshold 1.0) under "all" and "per_row"
(back-fill "propagate"), and under "per_row" with back-fill "deferred": with no pending token
(the cost of the second query a row carries) and with every row completing a token that left
at layer 20 (its 10 layers run beside the row's own). Interleaved rounds; median and best wall
ms per step and process CPU ms per step (on a shared machine the CPU figure moves less).
"""

from __future__ import annotations

import argparse
import dataclasses

from bench.common import humaneval_prompts, log


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--step", nargs="*", type=int, default=None, metavar="BATCH",
                   help="time the decode step alone at these batch sizes (see above)")
    args = p.parse_args(argv)
    if args.step is not None:
        return step_costs(args.model, args.step or [1, 4], max(args.repeats, 10))

    from ee_jax.models.loading import load_model
    from ee_jax.serving.engine import EngineStats
    from ee_jax.serving.llm import LLM
    from ee_jax.serving.params import greedy

    m = load_model(args.model)
    shipped = m.shipped_exit_heads()
    if shipped is None:
        raise SystemExit(f"{args.model} ships no exit heads")
    ec, heads = shipped
    prompts = [ids for _, ids in humaneval_prompts(m.tokenizer, 100, 200)][:args.batch]

    def engine(exit_config=None):
        return LLM(m, exit_config=exit_config, exit_heads=heads if exit_config else None,
                   early_exit=exit_config is not None, progress=False,
                   max_num_seqs=args.batch, max_model_len=256 + args.new_tokens)

    per_row = engine(dataclasses.replace(ec, policy="per_row"))
    runs = {"no exit config": (engine(), None),
            "never": (engine(dataclasses.replace(ec, policy="never")), None),
            "all @ 0.9": (engine(dataclasses.replace(ec, policy="all")), 0.9),
            "per_row @ inf": (per_row, float("inf")),
            "per_row @ 0.9": (per_row, 0.9)}
    sp = lambda thr: greedy(args.new_tokens, ignore_eos=True, exit_threshold=thr)  # noqa: E731
    for name, (e, thr) in runs.items():
        log(f"compiling {name}")
        e.generate(prompts, sp(thr), use_tqdm=False)
    best: dict[str, EngineStats] = {}
    for _ in range(args.repeats):
        for name, (e, thr) in runs.items():
            e.engine.stats = EngineStats()
            e.generate(prompts, sp(thr), use_tqdm=False)
            s = e.engine.stats
            if name not in best or s.decode_step_time < best[name].decode_step_time:
                best[name] = s
    base = best["never"].decode_step_time
    print(f"batch {args.batch}, {len(prompts)} HumanEval prompts, {args.new_tokens} tokens")
    for name, s in best.items():
        t = s.decode_step_time
        print(f"{name:16s} {1000 * t:6.1f} ms/step ({base / t:.2f}x never)"
              f"  mean layers/row {s.mean_layers_per_row:4.1f}  row-layers computed "
              f"{s.work_fraction:.2f}  rows per exit layer {{{s.row_exit_histogram()}}}")
    return 0


def step_costs(model: str, batches, repeats: int, steps: int = 5, context: int = 200) -> int:
    """The decode step's cost with checks that never fire, against full depth (--step)."""
    import functools
    import statistics
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np

    from ee_jax.models import exit_heads
    from ee_jax.models.loading import load_model
    from ee_jax.serving.attention import AttentionMetadata
    from ee_jax.serving.kv_cache import allocate_cache
    from ee_jax.serving.step import FullDepth, Pending, policy_for

    m = load_model(model, progress=False)
    cfg, params = m.config, m.params
    ec, heads = m.shipped_exit_heads()
    rows = exit_heads.with_vocab_rows(params, heads, cfg)
    for B in batches:
        width = context // 16 + 2
        table = 1 + np.arange(B * width, dtype=np.int32).reshape(B, width)
        meta = AttentionMetadata(jnp.full((B, 1), context, jnp.int32), jnp.asarray(table),
                                 jnp.full((B,), context + 1, jnp.int32))
        tokens = jnp.asarray(np.random.default_rng(B).integers(3, 1000, (B, 1)), jnp.int32)
        none = Pending.none(B, cfg)
        from_20 = Pending(jnp.asarray(np.random.default_rng(0).normal(size=(B, cfg.d_model)),
                                      cfg.jnp_dtype), jnp.full((B,), 20, jnp.int32))
        variants = {"full depth": (FullDepth(), None, None)}
        for pol in ("all", "per_row"):
            policy = policy_for(dataclasses.replace(ec, policy=pol, backfill="propagate"),
                                "decode")
            variants[f"{pol}, checks never fire"] = (policy, rows, None)
        deferred = policy_for(dataclasses.replace(ec, policy="per_row", backfill="deferred"),
                              "decode")
        variants["per_row, deferred, nothing pending"] = (deferred, rows, none)
        variants["per_row, deferred, completing from 20"] = (deferred, rows, from_20)
        fns, caches, compile_s = {}, {}, {}
        for name, (policy, hv, pending) in variants.items():
            @functools.partial(jax.jit, donate_argnums=(1,))
            def f(params, cache, hv=hv, policy=policy, pending=pending):
                from ee_jax.serving.step import model_step

                r, cache = model_step(params, hv, cache, tokens, meta,
                                      jnp.ones((B,), jnp.float32), cfg, policy, "xla",
                                      pending=pending)
                return r.exit_layer, cache

            caches[name] = allocate_cache(cfg, B * width + 1, 16)
            t = time.perf_counter()
            out, caches[name] = f(params, caches[name])
            out.block_until_ready()
            compile_s[name] = time.perf_counter() - t
            assert (np.asarray(out) == cfg.n_layers).all(), f"{name}: a row left early"
            fns[name] = f
        wall = {k: [] for k in fns}
        cpu = {k: [] for k in fns}
        for r in range(repeats):
            for name in (list(fns) if r % 2 == 0 else list(reversed(fns))):
                c0, t0 = time.process_time(), time.perf_counter()
                for _ in range(steps):
                    out, caches[name] = fns[name](params, caches[name])
                out.block_until_ready()
                wall[name].append((time.perf_counter() - t0) / steps)
                cpu[name].append((time.process_time() - c0) / steps)
        base_w = statistics.median(wall["full depth"])
        base_c = statistics.median(cpu["full depth"])
        print(f"batch {B}, context {context}, {repeats} interleaved rounds of {steps} steps "
              f"(compile s, first call, in brackets)")
        for name in fns:
            w, c = statistics.median(wall[name]), statistics.median(cpu[name])
            print(f"  {name:48s} {1e3 * w:6.1f} ms ({base_w / w:.2f}x), best "
                  f"{1e3 * min(wall[name]):6.1f}, cpu {1e3 * c:6.1f} ms ({base_c / c:.2f}x) "
                  f"[{compile_s[name]:.1f}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
