"""Collectives in the compiled decode step per tensor-parallel degree (issue 14's benchmark).

Simulated CPU devices give no speed figure; what they do give is the program XLA would run.
For tp = 1, 2, 4, 8 this compiles one full-depth decode step of a SmolLM2-shaped model
(random weights; heads 9 -> a 16-head variant so tp=8 divides) and counts, from the
optimized HLO, the collectives per layer and the bytes they move, against the minimum a
Megatron-style layer needs: two all-reduces of [B, D] (after the attention output
projection and after the MLP down projection).

    python -m bench.collectives [--batch 8] [--tp 1 2 4 8]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--attention", default="auto", help="attention backend (EngineConfig)")
    p.add_argument("--layers", type=int, default=4, help="layers of the shaped model (the "
                   "per-layer count does not depend on it)")
    args = p.parse_args(argv)
    need = max(args.tp)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={need}")
    import jax
    import numpy as np

    from bench.common import log, smollm2_shaped_config
    from ee_jax.models import llama
    from ee_jax.serving.engine import EngineConfig, LLMEngine
    from ee_jax.serving.model_runner import StepShape

    cfg = smollm2_shaped_config(n_layers=args.layers, n_heads=16, n_kv_heads=4)
    params = llama.init_params(cfg, jax.random.PRNGKey(0))
    B, D = args.batch, cfg.d_model
    rows = []
    for tp in args.tp:
        log(f"compiling tp={tp}")
        engine = LLMEngine(cfg, params, None, EngineConfig(
            max_num_seqs=B, max_model_len=256, page_size=16, num_pages=B * 16 + 1,
            batch_buckets=(B,), mesh=f"tp={tp}" if tp > 1 else None, attention=args.attention))
        runner = engine.runner
        shape = StepShape(B, 1, 16, kind="decode")
        buf = jax.ShapeDtypeStruct((shape.size,), np.int32)
        with jax.set_mesh(runner.mesh) if runner.mesh is not None else contextlib.nullcontext():
            hlo = runner._step.lower(shape, runner.params, runner.exit_heads, runner.cache,
                                     buf, runner.last_tokens).compile().as_text()
        by_comp: dict[str, list[str]] = {}
        counts, nbytes, comp = {}, 0, "?"
        for line in hlo.splitlines():
            head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
            if head:
                comp = head.group(1)
            m = re.search(r"= (\w+)\[([\d,]*)\][^ ]* (all-reduce|all-gather|reduce-scatter|"
                          r"all-to-all|collective-permute)(?:-start)?\(", line)
            if not m:
                continue
            dtype, dims, op = m.groups()
            counts[op] = counts.get(op, 0) + 1
            size = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
            nbytes += size * {"f32": 4, "bf16": 2, "s32": 4, "pred": 1}.get(dtype, 4)
            by_comp.setdefault(comp, []).append(f"{op} {dtype}[{dims}]")
        rows.append((tp, counts, nbytes))
        print(f"tp={tp}: {counts or 'no collectives'}; {nbytes} bytes", flush=True)
        for comp, ops in by_comp.items():
            print(f"    {comp}: " + ", ".join(ops), flush=True)
    print(f"\nMinimum per layer (Megatron): 2 all-reduces of [B, D] = 2 x {B * D * 4} bytes "
          f"(f32, B={B}, D={D}).")
    print("| tp | collectives in the step program (loop body once) | bytes |")
    print("|---|---|---|")
    for tp, counts, nbytes in rows:
        desc = ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) or "none"
        print(f"| {tp} | {desc} | {nbytes} |")
    print(f"\ncommand: python -m bench.collectives {' '.join(sys.argv[1:])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
