"""Decode-sized projections compiled for an H100 on this CPU (the cuda-aot venv): XLA's bytes
for x [B, D] @ w [D, F] in bf16 against the operands' and the output's bytes, for SmolLM2's and
Llama-3.2-1B's projection shapes, at B = 1, 2, 8, 32 rows: as written (`x @ w`, XLA's default
tiling: a compile without a GPU cannot autotune), with GEMMs in one pass (the roofline's
`CUDA_COUNT_OPTIONS`, split_k 1), and at one row accumulated in f32 (`preferred_element_type`),
with the fusions XLA made. Why the engine's GPU buckets start at two rows
(`scheduler.default_batch_buckets`) and why the roofline counts one-pass GEMMs.

    JAX_PLATFORMS=cpu .venv-cuda-aot/bin/python -m bench.cuda_dots
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from bench.roofline import CUDA_COUNT_OPTIONS
from ee_jax.serving import aot

SHAPES = [(576, 576), (576, 192), (576, 1536), (1536, 576),  # SmolLM2
          (2048, 2048), (2048, 512), (2048, 8192), (8192, 2048)]  # Llama-3.2-1B
ROWS = (1, 2, 8, 32)
VARIANTS = {  # name: (fn, compiler options, rows it is compiled at)
    "x @ w": (lambda x, w: x @ w, {}, ROWS),
    "one-pass GEMM (split_k 1)": (lambda x, w: x @ w, CUDA_COUNT_OPTIONS, ROWS),
    "f32 accumulation": (lambda x, w: jnp.matmul(x, w, preferred_element_type=jnp.float32)
                         .astype(jnp.bfloat16), {}, (1,)),
}


def main() -> int:
    if not aot.cuda_compiles():
        raise SystemExit("needs the cuda-aot venv (requirements-cuda-aot.txt), JAX_PLATFORMS=cpu")
    dev = aot.target_devices(aot.parse_target("cuda:h100"))[0]
    s = jax.sharding.SingleDeviceSharding(dev)
    print("XLA's bytes / (x + w + out bytes), and the fusions of the compiled module\n")
    print("| rows | D x F | " + " | ".join(VARIANTS) + " |\n|---:|---|" + "---|" * len(VARIANTS))
    for rows in ROWS:
        for d, f in SHAPES:
            x = jax.ShapeDtypeStruct((rows, d), jnp.bfloat16, sharding=s)
            w = jax.ShapeDtypeStruct((d, f), jnp.bfloat16, sharding=s)
            operands = 2 * (d * f + rows * d + rows * f)
            cells = []
            for fn, opts, at in VARIANTS.values():
                if rows not in at:
                    cells.append("")
                    continue
                c = jax.jit(fn).lower(x, w).compile(compiler_options=opts)
                entry = c.as_text().split("\nENTRY")[1]
                fus = [ln.split("=")[0].strip().lstrip("%").removeprefix("ROOT ").strip("%")
                       for ln in entry.splitlines() if "fusion(" in ln]
                cells.append(f"{aot.cost_of(c)[1] / operands:.2f}x ({', '.join(fus)})")
            print(f"| {rows} | {d} x {f} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
