"""What exit checks cost inside the decode step, against full depth (issue #12).

    python -m bench.check_overhead --batches 1 8 --rounds 30
    git show main:ee_jax/serving/step.py > /tmp/step_main.py
    python -m bench.check_overhead --batches 1 8 --baseline-step /tmp/step_main.py --engine

The decode step alone (`model_step` jitted, cache donated; tokens, metadata, thresholds and
heads passed as arguments, as `ModelRunner` does, so nothing is constant-folded) on the shipped
SmolLM2 heads at a context of 200 keys: full depth; the step with checks where no check runs
(thresholds inf: the loop, switches and bookkeeping alone); every check run and none firing
(thresholds 1.0). Policy "all" at batch 1, "all" and "per_row" above; the shipped back-fill
("deferred", nothing pending). `--baseline-step FILE` loads another version of
`ee_jax/serving/step.py` (say main's) as a second module and times its variants in the same
rounds: before/after in one process. Rounds are interleaved in a random order each; per
variant: median wall ms per step, its median per-round ratio to full depth (neighbours in time
share the machine's load), process CPU ms, and, traced apart with `jax.profiler`, the XLA
thunks (kernels, copies, control flow) one step executes: a count that no load moves, and on
CPU the cost of the checks is mostly their count.

`--engine`: the shipped heads' real step, served: `LLM` on HumanEval prompts with the shipped
exit config (policy "all" at batch 1, "per_row" above, the shipped threshold) against the same
engine at full depth (`early_exit=False`), greedy, EOS ignored; mean decode ms per step over
interleaved rounds, with the rows-per-exit-layer histogram. With `--baseline-step` the
baseline module's step serves a third engine (patched into `model_runner` around its calls).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import glob
import importlib.util
import os
import random
import statistics
import sys
import tempfile
import time

from bench.common import humaneval_prompts, log


def load_step_module(path: str):
    """Another version of `ee_jax.serving.step`, loaded from a file under its own name."""
    spec = importlib.util.spec_from_file_location("bench_baseline_step", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve their module
    spec.loader.exec_module(mod)
    return mod


def count_thunks(fn, args, steps: int = 2) -> float:
    """XLA ops (thunks) one call of `fn(*args)` executes, from a profiler trace; fn returns
    (out, donated cache) and args[1] is the cache."""
    import jax

    args = list(args)
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(steps):
                out, args[1] = fn(*args)
            jax.block_until_ready(out)
        pb = glob.glob(f"{d}/**/*.xplane.pb", recursive=True)[0]
        data = jax.profiler.ProfileData.from_file(pb)
        n = sum(1 for plane in data.planes for line in plane.lines for ev in line.events
                if any(k == "hlo_op" for k, _ in ev.stats))
    return n / steps, args[1]


def step_overhead(m, batches, rounds: int, steps: int, modules: dict, thunks: bool) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from ee_jax.models import exit_heads
    from ee_jax.serving.attention import AttentionMetadata
    from ee_jax.serving.kv_cache import allocate_cache

    cfg, params = m.config, m.params
    ec, heads = m.shipped_exit_heads()
    rows = exit_heads.with_vocab_rows(params, heads, cfg)
    context = 200
    for B in batches:
        width = context // 16 + 2
        table = 1 + np.arange(B * width, dtype=np.int32).reshape(B, width)
        meta = AttentionMetadata(jnp.full((B, 1), context, jnp.int32), jnp.asarray(table),
                                 jnp.full((B,), context + 1, jnp.int32))
        tokens = jnp.asarray(np.random.default_rng(B).integers(3, 1000, (B, 1)), jnp.int32)
        first = next(iter(modules.values()))
        variants = {"full depth": (first, first.FullDepth(), 1.0)}
        for pol in ("all",) if B == 1 else ("all", "per_row"):
            for thr, what in ((float("inf"), "no check runs"), (1.0, "checks never fire")):
                for label, mod in modules.items():
                    policy = mod.policy_for(dataclasses.replace(ec, policy=pol), "decode")
                    variants[f"{pol}, {what} [{label}]"] = (mod, policy, thr)
        fns, caches, ths, compile_s, n_thunks = {}, {}, {}, {}, {}
        for name, (mod, policy, thr) in variants.items():
            @functools.partial(jax.jit, donate_argnums=(1,))
            def f(params, cache, th, tokens, meta, hv, mod=mod, policy=policy):
                r, cache = mod.model_step(params, hv, cache, tokens, meta, th, cfg, policy,
                                          "xla", pending=mod.Pending.none(B, cfg))
                return (r.exit_layer, r.logits), cache

            ths[name] = jnp.full((B,), thr, jnp.float32)
            cache = allocate_cache(cfg, B * width + 1, 16)
            t = time.perf_counter()
            out, cache = f(params, cache, ths[name], tokens, meta, rows)
            jax.block_until_ready(out)
            compile_s[name] = time.perf_counter() - t
            # the donated cache comes back committed to the device: jit compiles again for
            # that once (ModelRunner commits every argument up front instead)
            out, cache = f(params, cache, ths[name], tokens, meta, rows)
            assert (np.asarray(out[0]) == cfg.n_layers).all(), f"{name}: a row left early"
            if thunks:
                n_thunks[name], cache = count_thunks(f, (params, cache, ths[name], tokens,
                                                         meta, rows))
            fns[name], caches[name] = f, cache
        wall = {k: [] for k in fns}
        cpu = {k: [] for k in fns}
        rng = random.Random(B)
        loads = []
        for _ in range(rounds):
            order = list(fns)
            rng.shuffle(order)
            loads.append(os.getloadavg()[0])
            for name in order:
                c0, t0 = time.process_time(), time.perf_counter()
                for _ in range(steps):
                    out, caches[name] = fns[name](params, caches[name], ths[name], tokens, meta,
                                                  rows)
                jax.block_until_ready(out)
                wall[name].append((time.perf_counter() - t0) / steps)
                cpu[name].append((time.process_time() - c0) / steps)
        print(f"batch {B}, context {context}: {rounds} rounds of {steps} steps in random order; "
              f"load average {min(loads):.1f}-{max(loads):.1f} during them (2 cores: > 2 "
              f"means shared); ratio: median over rounds of full depth / variant")
        base = wall["full depth"]
        for name in fns:
            w = wall[name]
            ratios = sorted(b / x for b, x in zip(base, w, strict=True))
            q = ratios[len(ratios) // 4], statistics.median(ratios), ratios[3 * len(ratios) // 4]
            th = f" {n_thunks[name]:6.0f} thunks" if thunks else ""
            print(f"  {name:34s} {1e3 * statistics.median(w):6.1f} ms (best "
                  f"{1e3 * min(w):5.1f}) {q[1]:.2f}x [{q[0]:.2f}-{q[2]:.2f}] cpu "
                  f"{1e3 * statistics.median(cpu[name]):6.1f} ms{th}  (first call "
                  f"{compile_s[name]:.1f} s)")


@contextlib.contextmanager
def patched_step(mod):
    """model_runner's step (and policy) from `mod` while inside (None: unchanged)."""
    from ee_jax.serving import model_runner

    if mod is None:
        yield
        return
    saved = model_runner.model_step, model_runner.policy_for
    model_runner.model_step, model_runner.policy_for = mod.model_step, mod.policy_for
    try:
        yield
    finally:
        model_runner.model_step, model_runner.policy_for = saved


def engine_steps(m, batches, rounds: int, new_tokens: int, modules: dict) -> None:
    from ee_jax.serving.engine import EngineStats
    from ee_jax.serving.llm import LLM
    from ee_jax.serving.params import greedy

    ec, heads = m.shipped_exit_heads()
    prompts_all = [ids for _, ids in humaneval_prompts(m.tokenizer, 100, 200)]
    sp = greedy(new_tokens, ignore_eos=True)
    for B in batches:
        prompts = prompts_all[:B]
        pol = "all" if B == 1 else "per_row"
        engines = {"full depth": (LLM(m, early_exit=False, progress=False, max_num_seqs=B,
                                      max_model_len=256 + new_tokens), None)}
        for label, mod in modules.items():
            engines[f"{pol} @ {ec.threshold} [{label}]"] = (LLM(
                m, exit_config=dataclasses.replace(ec, policy=pol), exit_heads=heads,
                progress=False, max_num_seqs=B, max_model_len=256 + new_tokens),
                mod if label != "current" else None)
        for name, (e, mod) in engines.items():
            log(f"batch {B}: compiling {name}")
            with patched_step(mod):
                e.generate(prompts, sp, use_tqdm=False)
        stats: dict[str, list[EngineStats]] = {k: [] for k in engines}
        rng = random.Random(B)
        loads = []
        for _ in range(rounds):
            order = list(engines)
            rng.shuffle(order)
            loads.append(os.getloadavg()[0])
            for name in order:
                e, mod = engines[name]
                before = e.engine.stats.snapshot()
                with patched_step(mod):
                    e.generate(prompts, sp, use_tqdm=False)
                stats[name].append(e.engine.stats.since(before))
        print(f"engine, batch {B}, {len(prompts)} HumanEval prompts, {new_tokens} tokens, "
              f"{rounds} rounds in random order; load average {min(loads):.1f}-"
              f"{max(loads):.1f}; ratio: median over rounds of full depth / engine")
        base = [s.decode_step_time for s in stats["full depth"]]
        for name, ss in stats.items():
            t = [s.decode_step_time for s in ss]
            ratio = statistics.median(b / x for b, x in zip(base, t, strict=True))
            s = ss[-1]
            hist = f"  rows per exit layer {{{s.row_exit_histogram()}}}" if name != \
                "full depth" else ""
            print(f"  {name:30s} {1e3 * statistics.median(t):6.1f} ms/step (best "
                  f"{1e3 * min(t):5.1f}) {ratio:.2f}x  mean layers/row "
                  f"{s.mean_layers_per_row:4.1f}{hist}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--steps", type=int, default=3, help="steps per variant per round")
    p.add_argument("--baseline-step", default=None, metavar="FILE",
                   help="another version of ee_jax/serving/step.py to time beside this one")
    p.add_argument("--no-thunks", action="store_true", help="skip the traced thunk count")
    p.add_argument("--engine", action="store_true", help="also the served step (see above)")
    p.add_argument("--engine-rounds", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=32)
    args = p.parse_args(argv)

    from ee_jax.models.loading import load_model
    from ee_jax.serving import step

    modules = {"current": step}
    if args.baseline_step:
        modules["baseline"] = load_step_module(args.baseline_step)
    m = load_model(args.model, progress=False)
    step_overhead(m, args.batches, args.rounds, args.steps, modules, not args.no_thunks)
    if args.engine:
        engine_steps(m, args.batches, args.engine_rounds, args.new_tokens, modules)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
