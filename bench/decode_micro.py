"""Microbenchmarks behind the "where the time goes" notes in docs/benchmarks.md.

    python -m bench.decode_micro
    python -m bench.decode_micro --weights --batches 1 2 8 32

SmolLM2-135M shapes (30 layers, d=576, ffn 1536, 9/3 heads of 64), random f32 data, XLA on
CPU; each figure is the best of a few runs of all 30 layers.

1. Weight matvec/GEMM: x [B, 576] times 30 stacked [576, 1536] matrices, in the layouts a
   decode step can use (input-major slices of a stacked array, as loaded; output-major slices,
   `x @ w.T` and the serving layout's `quant.out_major_matmul`; unstacked arrays), as weight
   GB/s; and the tied LM head [V, D] as `x @ E.T` and as `out_major_matmul` (ms per call,
   best wall and median CPU time, interleaved).
2. Decode attention (T = 1) over 30 layers: the engine's paged path (K/V scatter, page gather,
   `gqa_attention`) on a donated cache, the gather alone, `gqa_attention` on contiguous K/V,
   and torch's `scaled_dot_product_attention` on the same shapes for comparison.
3. `--step`: the engine's whole full-depth decode step (`step.model_step`, FullDepth, cache
   donated) on random weights, one program per attention variant, timed interleaved: wall
   median / best and this process's CPU time per step (on a shared machine the CPU time and
   the best wall are the steadier figures). Variants: any `attention_kernels.BACKENDS` name,
   `xla_unblocked` (xla as one loop over all rows) and `none` (no attention: the dense part),
   times `--layouts`: `in` (dense f32 arrays, input-major), `out` (after
   `llama.serving_layout`: layer weights output-major) and `blocks` (layer weights in Q4_1
   blocks, `quant.BlockQ`, as ee-jax serves a Q4_1 GGUF; quantized by the `gguf` package).

    python -m bench.decode_micro --step --batches 1 8 32 --attention xla xla_unblocked none
    python -m bench.decode_micro --step --batches 1 2 8 32 --attention xla --layouts in out
    python -m bench.decode_micro --step --batches 1 8 32 --attention xla --layouts in blocks
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
import os
import resource
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import best_time as best
from bench.common import smollm2_shaped_config
from ee_jax.models import quant

CFG = smollm2_shaped_config()
L, D, F, H, K, HD = (CFG.n_layers, CFG.d_model, CFG.ffn_dim, CFG.n_heads, CFG.n_kv_heads,
                     CFG.head_dim)


def weight_layouts(batches=(1, 2, 8, 32)) -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((L, D, F), np.float32)
    stacked, stacked_t = jnp.asarray(w), jnp.asarray(np.ascontiguousarray(w.transpose(0, 2, 1)))
    unstacked = [jnp.asarray(w[i]) for i in range(L)]
    nbytes = w.nbytes

    def loop(f):
        return lambda x, ws: jax.lax.fori_loop(0, L, lambda i, a: a + f(x, ws, i).sum(), 0.0)

    def out_major(x, ws, i):  # the serving layout's product (quant.out_major_matmul)
        return quant.out_major_matmul(x, ws[i])

    variants = {
        "stacked [D,F], fori, x @ w[i] (loaded layout)": (loop(lambda x, ws, i: x @ ws[i]),
                                                           stacked),
        "stacked [F,D], fori, x @ w[i].T": (loop(lambda x, ws, i: x @ ws[i].T), stacked_t),
        "stacked [F,D], fori, out_major_matmul (serving layout)": (loop(out_major), stacked_t),
        "unstacked [D,F], x @ w": (lambda x, ws: sum((x @ v).sum() for v in ws), unstacked),
    }
    E = jnp.asarray(rng.standard_normal((CFG.vocab_size, D), np.float32))  # tied head [V, D]
    heads = {"x @ E.T": lambda x, E: jnp.matmul(x, E.T, preferred_element_type=jnp.float32),
             "out_major_matmul (llama.unembed)": lambda x, E: quant.out_major_matmul(
                 x, E, preferred_element_type=jnp.float32)}
    for B in batches:
        x = jnp.ones((B, D), jnp.float32)
        parts = []
        for name, (f, ws) in variants.items():
            t = best(jax.jit(f), x, ws)
            parts.append(f"{name} {nbytes / t / 1e9:.1f} GB/s")
        print(f"matmul B={B}: " + "; ".join(parts), flush=True)
        fns = {name: jax.jit(lambda x, E, f=f: f(x, E).sum()) for name, f in heads.items()}
        parts = [f"{name} {1e3 * w:.2f} ms (cpu {1e3 * c:.2f})"
                 for name, (w, c) in _interleaved(fns, (x, E)).items()]
        print(f"tied LM head B={B}: " + "; ".join(parts), flush=True)


def _interleaved(fns: dict, args: tuple, rounds: int = 7, calls: int = 5) -> dict:
    """{name: (best wall s, median CPU s)} per call, the functions timed in turn each round
    (steadier than back-to-back bests on a shared machine)."""
    for fn in fns.values():
        jax.block_until_ready(fn(*args))
    wall: dict = {n: [] for n in fns}
    cpu: dict = {n: [] for n in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            c0, t0 = _cpu_seconds(), time.perf_counter()
            for _ in range(calls):
                out = fn(*args)
            jax.block_until_ready(out)
            wall[name].append((time.perf_counter() - t0) / calls)
            cpu[name].append((_cpu_seconds() - c0) / calls)
    return {n: (min(wall[n]), statistics.median(cpu[n])) for n in fns}


def attention(shapes=((1, 512), (8, 512), (32, 512), (32, 256))) -> None:
    from ee_jax.models.llama import gqa_attention
    from ee_jax.serving.attention import AttentionMetadata, paged_attention, write_kv
    from ee_jax.serving.kv_cache import allocate_cache, gather_layer

    try:
        import torch
        import torch.nn.functional as tF
        torch.set_num_threads(os.cpu_count() or 1)
    except ImportError:
        torch = None
    cfg = CFG  # SmolLM2-135M's shapes: only the cache shape matters here
    S, P = 16, 1456
    cache = allocate_cache(cfg, P, S)
    rng = np.random.default_rng(0)
    for B, keys in shapes:
        W = keys // S
        ctx = keys - 5
        table = jnp.asarray((1 + np.arange(B * W).reshape(B, W)) % P, jnp.int32)
        kv_lens = jnp.full((B,), ctx, jnp.int32)
        meta = AttentionMetadata(jnp.full((B, 1), ctx - 1, jnp.int32), table, kv_lens)
        q = jnp.asarray(rng.standard_normal((B, 1, H, HD), np.float32))
        k_new = jnp.asarray(rng.standard_normal((B, 1, K, HD), np.float32))

        def paged(cache, q, meta=meta, k_new=k_new):
            def body(i, carry):
                acc, cache = carry
                cache = write_kv(cache, i, meta, k_new, k_new)
                return acc + paged_attention(q, cache, i, meta).sum(), cache
            return jax.lax.fori_loop(0, L, body, (0.0, cache))

        step = jax.jit(paged, donate_argnums=0)
        acc, cache = step(cache, q)
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            acc, cache = step(cache, q)
            jax.block_until_ready(acc)
            ts.append(time.perf_counter() - t0)
        t_paged = min(ts)

        def gather(cache, table=table):
            def body(i, a):
                k, v = gather_layer(cache, i, table)
                return a + k.sum() + v.sum()
            return jax.lax.fori_loop(0, L, body, 0.0)

        t_gather = best(jax.jit(gather), cache)
        kc = jnp.asarray(rng.standard_normal((L, B, keys, K, HD), np.float32))
        vc = jnp.asarray(rng.standard_normal((L, B, keys, K, HD), np.float32))
        mask = jnp.arange(keys)[None, None, :] < kv_lens[:, None, None]

        def contiguous(kc, vc, q, mask=mask):
            return jax.lax.fori_loop(
                0, L, lambda i, a: a + gqa_attention(q, kc[i], vc[i], mask).sum(), 0.0)

        t_contig = best(jax.jit(contiguous), kc, vc, q)
        line = (f"attention B={B} keys={keys} (K/V {2 * L * B * keys * K * HD * 4 / 1e6:.0f} MB):"
                f" paged step {1e3 * t_paged:.1f} ms; gather alone {1e3 * t_gather:.1f} ms; "
                f"gqa_attention on contiguous K/V {1e3 * t_contig:.1f} ms")
        if torch is not None:
            kt = torch.from_numpy(np.asarray(kc).transpose(0, 1, 3, 2, 4).copy())
            vt = torch.from_numpy(np.asarray(vc).transpose(0, 1, 3, 2, 4).copy())
            qt = torch.from_numpy(np.asarray(q).transpose(0, 2, 1, 3).copy())

            def sdpa(kt=kt, vt=vt, qt=qt):
                with torch.inference_mode():
                    for i in range(L):
                        tF.scaled_dot_product_attention(qt, kt[i], vt[i], enable_gqa=True)

            sdpa()
            tt = []
            for _ in range(5):
                t0 = time.perf_counter()
                sdpa()
                tt.append(time.perf_counter() - t0)
            line += f"; torch sdpa {1e3 * min(tt):.1f} ms"
        print(line, flush=True)


# --------------------------------------------------------------------------- whole step

# Context lengths of the rows per batch (uniform in [lo, hi]) and the page bucket, as in
# bench.serving's decode: HumanEval prompts of 128-323 tokens plus up to 128 new ones.
STEP_SHAPES = {1: (16, 220, 230), 8: (32, 148, 396), 32: (32, 128, 451)}


def _cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


@contextlib.contextmanager
def _extra_backends():
    """The bench's variants as attention backends for the length of the run."""
    from ee_jax.serving import attention_kernels as ak

    extra = {"xla_unblocked": functools.partial(ak.xla, row_block=1 << 30),
             "none": lambda q, cache, layer, meta, **_: q}
    added = [k for k in extra if k not in ak.BACKENDS]
    ak.BACKENDS.update({k: extra[k] for k in added})
    try:
        yield
    finally:
        for k in added:
            del ak.BACKENDS[k]


def step(batches=(1, 8, 32), attentions=("xla", "xla_unblocked"), layouts=("in",),
         repeats: int = 7, steps: int = 3) -> None:
    from bench.common import smollm2_shaped_random
    from ee_jax.models import llama
    from ee_jax.serving.attention import AttentionMetadata
    from ee_jax.serving.kv_cache import NULL_PAGE, allocate_cache
    from ee_jax.serving.step import FullDepth, model_step

    cfg, params = smollm2_shaped_random()
    by_layout = {"in": params}
    if "out" in layouts:
        by_layout["out"] = llama.serving_layout(params)
    if "blocks" in layouts:  # the layer weights as a Q4_1 GGUF holds them (quant.BlockQ)
        from ee_jax.models.gguf import block_quantize
        from ee_jax.models.quant import QUANTIZED_KEYS

        layers = dict(params["layers"])
        for key in QUANTIZED_KEYS:
            layers[key] = block_quantize(np.asarray(layers[key]), "Q4_1")
        by_layout["blocks"] = dict(params, layers=layers)
    S = 16

    takes_last_idx = "last_idx" in inspect.signature(model_step).parameters  # older step

    def program(attention: str):
        def f(params, cache, tokens, meta):
            B = tokens.shape[0]
            kw = {"last_idx": jnp.zeros((B,), jnp.int32)} if takes_last_idx else {}
            r, cache = model_step(params, None, cache, tokens, meta, thresholds=jnp.ones((B,)),
                                  cfg=cfg, policy=FullDepth(), attention=attention, **kw)
            return r.logits, cache
        return jax.jit(f, donate_argnums=1)

    for B in batches:
        W, lo, hi = STEP_SHAPES.get(B, (32, 128, 451))
        rng = np.random.default_rng(B)
        lens = rng.integers(lo, hi + 1, size=B).astype(np.int32)
        pool = rng.permutation(np.arange(1, 1 + B * W))
        table = np.full((B, W), NULL_PAGE, np.int32)
        for b, n in enumerate(lens):
            need = -(-int(n) // S)
            table[b, :need], pool = pool[:need], pool[need:]
        meta = AttentionMetadata(jnp.asarray(lens[:, None] - 1), jnp.asarray(table),
                                 jnp.asarray(lens))
        tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, size=(B, 1)), jnp.int32)
        fns, caches, logits, weights = {}, {}, {}, {}
        for attention in attentions:
            for layout in layouts:
                name = attention if len(layouts) == 1 else f"{attention}/{layout}"
                fns[name], weights[name] = program(attention), by_layout[layout]
                caches[name] = allocate_cache(cfg, 1 + B * W, S)
                out, caches[name] = fns[name](weights[name], caches[name], tokens, meta)
                logits[name] = np.asarray(out)
        wall: dict[str, list[float]] = {n: [] for n in fns}
        cpu: dict[str, list[float]] = {n: [] for n in fns}
        for _ in range(repeats):
            for name, fn in fns.items():  # interleaved
                c0, t0 = _cpu_seconds(), time.perf_counter()
                for _ in range(steps):
                    out, caches[name] = fn(weights[name], caches[name], tokens, meta)
                jax.block_until_ready(out)
                wall[name].append((time.perf_counter() - t0) / steps)
                cpu[name].append((_cpu_seconds() - c0) / steps)
        first = next(iter(fns))
        parts = []
        for name in fns:
            same = "" if name.startswith("none") or name == first else (
                f", max |logits - {first}| {np.abs(logits[name] - logits[first]).max():.1e}")
            med, best = statistics.median(wall[name]), min(wall[name])
            parts.append(f"{name} {1e3 * med:.1f} ms (best {1e3 * best:.1f}, cpu "
                         f"{1e3 * statistics.median(cpu[name]):.1f}){same}")
        print(f"step B={B} W={W} rows {lo}-{hi} keys: " + "; ".join(parts), flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--step", action="store_true", help="only the whole-step comparison")
    p.add_argument("--weights", action="store_true", help="only the weight layouts and head")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--attention", nargs="+", default=["xla", "xla_unblocked"])
    p.add_argument("--layouts", nargs="+", default=["in"], choices=["in", "out", "blocks"])
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    print(f"jax {jax.__version__}, devices {jax.devices()}", flush=True)
    if args.step:
        with _extra_backends():
            step(args.batches, args.attention, args.layouts, repeats=args.repeats)
        return 0
    if args.weights:
        weight_layouts(args.batches)
        return 0
    weight_layouts()
    attention()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
