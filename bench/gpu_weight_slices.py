"""What a GPU step pays for layer weights stacked [L, ...]: the full-depth decode step compiled
for an H100 on this CPU (the cuda-aot venv) three ways, XLA's bytes (`aot.cost_of`, GEMMs in
one pass) and the weight copies in the compiled module:

* stacked, `fori_loop` (the engine's program): the body counted once, so compare it with the
  roofline's fixed + one pool layer;
* stacked, a Python loop (static layer index);
* unstacked: each layer's weights a separate argument, a Python loop;

and the engine's program under XLA options that might avoid the copies (`OPTION_ROWS`): GEMMs
by cuBLAS (whose calls the cost analysis does not count: its MB is the rest), dynamic-slice
fusion (a library GEMM addressing a slice in place), XLA's own full unrolling of the loop.

Against the pieces the roofline composes (fixed + L pool layers, the pool layer as the step
runs it: attention "reference" over the pool). docs/roofline.md, "The compiled CUDA step
against the composition".

    JAX_PLATFORMS=cpu .venv-cuda-aot/bin/python -m bench.gpu_weight_slices --batches 8
"""

from __future__ import annotations

import argparse
import re
import sys

import jax
import jax.numpy as jnp

from bench.roofline import CUDA_COUNT_OPTIONS, PAGE, _place, full_step_fn, pieces, step_args
from ee_jax.models import llama
from ee_jax.serving import aot
from ee_jax.serving.paged_model import attend, paged_layer


def _copies(text: str) -> tuple[int, int]:
    """(dynamic-slice copy fusions, static slice fusions) called in a compiled module."""
    calls = re.findall(r"fusion\([^\n]*calls=%(\S+?),", text)
    return (sum("dynamic_slice" in c for c in calls),
            sum("slice" in c and "dynamic" not in c for c in calls))


def stacked_python_loop(cfg):
    def step(params, cache, tokens, meta, _th):
        x = llama.embed(params, tokens, cfg)
        for i in range(cfg.n_layers):
            x, cache = paged_layer(params, i, x, cache, meta, cfg, "reference")
        return jnp.argmax(llama.final_head(params, x[:, 0], cfg), -1), cache
    return step


def unstacked_python_loop(cfg):
    def step(rest, layers, cache, tokens, meta):
        x = llama.embed(rest, tokens, cfg)
        for i, lp in enumerate(layers):
            def layer_attend(q, k, v, i=i, c=cache):
                return attend(q, k, v, c, i, meta, cfg, "reference")

            x, cache = llama.decoder_layer(lp, x, meta.token_positions, cfg, layer_attend)
        return jnp.argmax(llama.final_head(rest, x[:, 0], cfg), -1), cache
    return step


OPTION_ROWS = {  # the engine's program (stacked, fori_loop) under these XLA GPU options
    "stacked, fori_loop, GEMMs by cuBLAS": {"xla_gpu_enable_triton_gemm": False},
    "stacked, fori_loop, dynamic-slice fusion": {"xla_gpu_enable_dynamic_slice_fusion": True},
    "stacked, fori_loop, cuBLAS + dynamic-slice fusion": {
        "xla_gpu_enable_triton_gemm": False, "xla_gpu_enable_dynamic_slice_fusion": True},
    "stacked, fori_loop, XLA's full unrolling": {
        "xla_gpu_enable_while_loop_unrolling": "WHILE_LOOP_UNROLLING_FULL_UNROLL"},
}


def compiled(fn, args, donate: int, options: dict | None = None):
    target = aot.parse_target("cuda:h100")
    return jax.jit(fn, donate_argnums=(donate,)).lower(*_place(args, target)).compile(
        compiler_options={**CUDA_COUNT_OPTIONS, **(options or {})})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", choices=list(aot.MODEL_SHAPES))
    ap.add_argument("--batches", type=int, nargs="+", default=[8])
    ap.add_argument("--context", type=int, default=512)
    args = ap.parse_args(argv)
    if not aot.cuda_compiles():
        raise SystemExit("needs the cuda-aot venv (requirements-cuda-aot.txt), JAX_PLATFORMS=cpu")
    cfg = aot.shape_config(args.model)
    W, L = -(-args.context // PAGE), cfg.n_layers
    target = aot.parse_target("cuda:h100")
    print(f"| {args.model} batch | program | XLA MB | dynamic-slice copies | static slice "
          f"fusions | pieces MB |\n|---:|---|---:|---:|---:|---:|")
    for B in args.batches:
        m = pieces(cfg, None, B, W, target, step=True)
        fixed = m.pieces.fixed.bytes + m.pieces.final_head.bytes
        pool_layer = m.parts["layer over the pool (as the step runs it)"][0].bytes
        params, cache, tokens, meta, th = step_args(cfg, B, W, None, "cuda")
        rest = {k: v for k, v in params.items() if k != "layers"}
        layers = [jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype),
                               params["layers"]) for _ in range(L)]
        runs = [("stacked, fori_loop (body once)", full_step_fn(cfg),
                 (params, cache, tokens, meta, th), 1, fixed + pool_layer),
                ("stacked, Python loop", stacked_python_loop(cfg),
                 (params, cache, tokens, meta, th), 1, fixed + L * pool_layer),
                ("unstacked, Python loop", unstacked_python_loop(cfg),
                 (rest, layers, cache, tokens, meta), 2, fixed + L * pool_layer)]
        runs += [(name, full_step_fn(cfg), (params, cache, tokens, meta, th), 1, None, opts)
                 for name, opts in OPTION_ROWS.items()]
        for name, fn, a, donate, want, *opts in runs:
            try:
                c = compiled(fn, a, donate, *opts)
            except Exception as e:  # e.g. an option XLA cannot compile without a GPU
                print(f"| {B} | {name} | fails: {' '.join(str(e).split())[:90]} | | | |")
                continue
            ds, st = _copies(c.as_text())
            print(f"| {B} | {name} | {aot.cost_of(c)[1] / 1e6:.1f} | {ds} | {st} | "
                  f"{'' if want is None else f'{want / 1e6:.1f}'} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
