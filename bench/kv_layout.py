"""The KV pool's layout on TPU (or CUDA, in the cuda-aot venv), compiled ahead of time on this
CPU: the engine's decode steps with JAX's Pallas kernel reading a head-major pool
([K, L, P, S, hd], the engine's layout where a kernel reads it: `kv_cache` docstring) against
a layer-major one ([L, P, S, K, hd], copied into the kernel's layout every layer:
`attention_kernels.layer_pages`).

Per program: XLA's bytes accessed (a `while_loop` body counted once: one layer, the head
and what the step does once), temporaries and arguments from the memory analysis, and the
copies of a whole pool-sized array in the compiled HLO.

    python -m bench.kv_layout [--model random:smollm2-135m] [--target tpu:v5e]
    JAX_PLATFORMS=cpu .venv-cuda-aot/bin/python -m bench.kv_layout --target cuda:h100
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import time

from bench.common import log

# an HLO instruction producing a copy, transpose, gather or dynamic slice, with its shape
_OP = re.compile(r"= (\w+)\[([\d,]*)\]\S* (copy|transpose|gather|dynamic-slice)\(")


def big_ops(hlo: str, min_elements: int) -> list[str]:
    """Copies, transposes, gathers and dynamic slices of at least `min_elements`."""
    out = []
    for dt, dims, op in _OP.findall(hlo):
        if math.prod(int(d) for d in dims.split(",") if d) >= min_elements:
            out.append(f"{op} {dt}[{dims}]")
    return out


def main(argv=None) -> int:
    from ee_jax.serving import aot
    from ee_jax.serving.plan import EngineConfig

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random:smollm2-135m")
    p.add_argument("--target", default="tpu:v5e")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    args = p.parse_args(argv)
    cfg, ec = aot.plan_model(args.model)
    config = EngineConfig.make(max_num_seqs=max(args.batches), max_model_len=args.max_model_len,
                               page_size=16, batch_buckets=tuple(args.batches))
    target = aot.parse_target(args.target)
    base = aot.Plan.make(cfg, target, config, ec, kinds=("decode",))  # the target's kernel
    print(f"{args.model} on {args.target}, {base.engine.attention}, {base.engine.num_pages} "
          f"pages of 16, max_model_len {args.max_model_len}\n")
    print("| pool | program | batch | pages a row | bytes accessed (MB) | temporaries (MB) "
          "| arguments (MB) | pool-sized copies |\n|---|---|---:|---:|---:|---:|---:|---|")
    for head_major in (False, True):
        plan = base if head_major else dataclasses.replace(  # the pool's layout forced
            base, engine=dataclasses.replace(base.engine, head_major=False))
        for name, e, shape in plan.items():
            if shape.pages not in (min(s.pages for s in plan.shapes),
                                   max(s.pages for s in plan.shapes)):
                continue
            t0 = time.perf_counter()
            runner = plan.runner(e)
            pool = math.prod(runner.cache.k.shape)
            compiled = runner.lower(shape).compile()
            _, nbytes = aot.cost_of(compiled)
            mem = compiled.memory_analysis()
            copies = big_ops(compiled.as_text(), pool // 4)
            print(f"| {'head-major' if head_major else 'layer-major'} | {name} | "
                  f"{shape.batch} | {shape.pages} | {nbytes / 1e6:.1f} | "
                  f"{mem.temp_size_in_bytes / 1e6:.1f} | "
                  f"{mem.argument_size_in_bytes / 1e6:.1f} | "
                  f"{', '.join(copies) or 'none'} |", flush=True)
            log(f"{name} batch {shape.batch} pages {shape.pages}: "
                f"{time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
