"""One-row projections compiled for an H100 on this CPU (the cuda-aot venv): XLA's bytes for
x [1, D] @ w [D, F] in bf16, as written (`x @ w`), accumulated in f32
(`preferred_element_type`), and with x padded to two rows, for SmolLM2's and Llama-3.2-1B's
projection shapes, against the operands' bytes, and the fusions XLA made.

    JAX_PLATFORMS=cpu .venv-cuda-aot/bin/python -m bench.cuda_dots
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ee_jax.serving import aot

SHAPES = [(576, 576), (576, 192), (576, 1536), (1536, 576),  # SmolLM2
          (2048, 8192), (8192, 2048), (2048, 512)]  # Llama-3.2-1B
VARIANTS = {
    "x @ w": lambda x, w: x @ w,
    "f32 accumulation": lambda x, w: jnp.matmul(
        x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16),
    "two rows": lambda x, w: (jnp.concatenate([x, x]) @ w)[:1],
}


def main() -> int:
    if not aot.cuda_compiles():
        raise SystemExit("needs the cuda-aot venv (requirements-cuda-aot.txt), JAX_PLATFORMS=cpu")
    dev = aot.target_devices(aot.parse_target("cuda:h100"))[0]
    s = jax.sharding.SingleDeviceSharding(dev)
    print("| D x F | " + " | ".join(VARIANTS) + " |\n|---|" + "---|" * len(VARIANTS))
    for d, f in SHAPES:
        x = jax.ShapeDtypeStruct((1, d), jnp.bfloat16, sharding=s)
        w = jax.ShapeDtypeStruct((d, f), jnp.bfloat16, sharding=s)
        cells = []
        for fn in VARIANTS.values():
            c = jax.jit(fn).lower(x, w).compile()
            entry = c.as_text().split("ENTRY")[1]
            fus = [ln.split("=")[0].strip().lstrip("%") for ln in entry.splitlines()
                   if "fusion(" in ln]
            cells.append(f"{aot.cost_of(c)[1] / (2 * d * f):.2f}x ({', '.join(fus)})")
        print(f"| {d} x {f} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
