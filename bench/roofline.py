"""Where exits pay: a roofline from the compiler's own counts (issue 21).

For each model shape and target, the decode step's pieces are compiled (TPU, ahead of time
on this host) or lowered (CUDA) on their own, and XLA's cost analysis gives their flops and
bytes: one layer at each batch bucket (attention "reference": a gather of the rows' pages,
which XLA can count; the Pallas kernels are custom calls it cannot), the fixed part (embed,
final head, greedy pick), an exit check (first and later) and one layer's back-fill
(`llama.kv_project`). `ee_jax.serving.roofline` composes them into a step, weighted by an
exit histogram, and predicts max(flops / peak, bytes / bandwidth) with published peaks.

Cross-checks printed beside the tables: the composed full-depth step against the compiled
full-depth step (`step.model_step` under `FullDepth`: one fori_loop over the layers), and
each shape's bytes against the analytic count (weights + the KV the rows read).

    python -m bench.roofline                       # writes runs/roofline.md (and prints it)
    python -m bench.roofline --models smollm2-135m --targets tpu:v5e --batches 1 8
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import platform
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from ee_jax.models import exit_checks, exit_heads, llama
from ee_jax.serving import aot, attention_kernels
from ee_jax.serving.attention import AttentionMetadata
from ee_jax.serving.kv_cache import KVCache, cache_shape
from ee_jax.serving.paged_model import paged_layer
from ee_jax.serving.roofline import Cost, Pieces, seconds
from ee_jax.serving.step import FullDepth, checked_layers, model_step

PAGE = 16
# Row exit histograms of the shipped SmolLM2 heads at batch 1 (threshold 0.985; layer: rows,
# 30 = full depth), docs/benchmarks.md at dcc3eba (bench.shipped_exits at threshold 0.985).
SHIPPED = {
    "instructions": {20: 1, 21: 16, 22: 8, 23: 8, 24: 20, 25: 9, 26: 9, 27: 6, 28: 8, 29: 7,
                     30: 378},
    "HumanEval": {19: 1, 20: 1, 21: 11, 22: 6, 23: 8, 24: 19, 25: 3, 26: 3, 27: 10, 28: 11,
                  29: 6, 30: 407},
    "everyday chat": {21: 4, 22: 3, 23: 14, 24: 28, 25: 4, 26: 3, 27: 3, 28: 8, 29: 1,
                      30: 413},
}
SHIPPED_LAYERS = 30


def scaled_histogram(hist: dict[int, int], n_layers: int) -> dict[int, float]:
    """A histogram over SHIPPED_LAYERS moved to `n_layers` at the same fractions of depth."""
    out: dict[int, float] = {}
    for e, n in hist.items():
        k = n_layers if e >= SHIPPED_LAYERS else \
            max(1, min(n_layers - 1, round(e * n_layers / SHIPPED_LAYERS)))
        out[k] = out.get(k, 0) + n
    return out


def _place(tree, target: aot.Target):
    devices = aot.target_devices(target)
    s = jax.sharding.SingleDeviceSharding(devices[0]) if devices else None
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree)


def cost(fn, args, target: aot.Target) -> Cost:
    """XLA's flops and bytes of fn(*args): compiled for TPU/CPU, lowered for CUDA."""
    jitted = jax.jit(fn)
    with attention_kernels.target_platform(target.platform):
        if target.compiles:
            flops, nbytes = aot.cost_of(jitted.lower(*_place(args, target)).compile())
        else:
            ca = jitted.trace(*args).lower(lowering_platforms=("cuda",)).cost_analysis()
            flops, nbytes = float(ca["flops"]), float(ca["bytes accessed"])
    return Cost(flops, nbytes)


def sds(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))


def meta_for(B: int, W: int) -> AttentionMetadata:
    return AttentionMetadata(sds((B, 1), jnp.int32), sds((B, W), jnp.int32),
                             sds((B,), jnp.int32))


def pieces(cfg, ec, B: int, W: int, target: aot.Target) -> tuple[Pieces, Cost, Cost]:
    """(Pieces at batch B over W pages a row, the first check, the compiled full-depth
    step)."""
    dt = cfg.jnp_dtype
    P = B * W + 1
    cfg1 = dataclasses.replace(cfg, n_layers=1)
    p1 = aot.abstract_params(cfg1)
    c1 = KVCache(*(sds(cache_shape(cfg1, P, PAGE), dt) for _ in range(2)))
    meta = meta_for(B, W)
    layer = cost(lambda p, x, c, m: paged_layer(p, 0, x, c, m, cfg1, "reference"),
                 (p1, sds((B, 1, cfg.d_model), dt), c1, meta), target)
    params = aot.abstract_params(cfg)

    def fixed_fn(p, tokens):
        x = llama.embed(p, tokens, cfg)
        return jnp.argmax(llama.final_head(p, x[:, 0], cfg), axis=-1)

    fixed = cost(fixed_fn, (params, sds((B, 1), jnp.int32)), target)
    fill = cost(lambda p, h, pos: llama.kv_project(llama.layer_params(p, 0), h, pos, cfg1),
                (p1, sds((B, 1, cfg.d_model), dt), sds((B, 1), jnp.int32)), target)
    heads = jax.eval_shape(lambda p, h: exit_heads.with_vocab_rows(p, h, cfg), params,
                           exit_heads.head_shapes(cfg, ec))
    h = sds((B, cfg.d_model), dt)
    state = jax.eval_shape(lambda x: exit_checks.init_check_state(x, ec), h)

    def check_fn(first):
        return lambda p, hd, x, s: exit_checks.check_confidence(p, hd, 0, x, s, cfg, ec,
                                                          first=first)[0]

    first = cost(check_fn(True), (params, heads, h, state), target)
    later = cost(check_fn(False), (params, heads, h, state), target)
    cache = KVCache(*(sds(cache_shape(cfg, P, PAGE), dt) for _ in range(2)))
    step = cost(lambda p, c, t, m, th: model_step(p, None, c, t, m, th, cfg, FullDepth(),
                                                  "reference")[0].logits.argmax(-1),
                (params, cache, sds((B, 1), jnp.int32), meta, sds((B,), jnp.float32)), target)
    return Pieces(fixed, layer, later, fill), first, step


def analytic_layer_bytes(cfg, B: int, W: int) -> float:
    """One layer's weights once, and the K/V of B rows x W pages (reference attention reads
    whole pages)."""
    it = cfg.jnp_dtype.itemsize
    D, H, K, hd, F = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim
    weights = (D * H * hd * 2 + D * K * hd * 2 + 3 * D * F + 2 * D) * it
    kv = 2 * B * W * PAGE * K * hd * it
    return weights + kv


def _step_cost(p: Pieces, first: Cost, e: int, L: int, checked, backfill: str) -> Cost:
    """One step leaving at e (L: full depth without checks)."""
    if e >= L and backfill == "none":
        return p.full_depth(L)
    n = sum(1 for c in checked if c <= e)
    extra = (first - p.check) if n else Cost(0.0, 0.0)
    return p.exit_at(e, L, n, backfill) + extra


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(aot.MODEL_SHAPES))
    ap.add_argument("--targets", nargs="+", default=["tpu:v5e", "tpu:v6e", "cuda:h100"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--context", type=int, default=512, help="tokens each row attends to")
    ap.add_argument("--out", default="runs/roofline.md")
    args = ap.parse_args(argv)
    W = -(-args.context // PAGE)
    base_ec = aot.shipped_exit_config()
    lines = []
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    cpu = next((ln.split(":", 1)[1].strip() for ln in cpu.splitlines()
                if ln.startswith("Model name")), platform.processor())
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines.append(f"Command: `python -m bench.roofline {' '.join(argv or sys.argv[1:])}`, "
                 f"{stamp}, host CPU {cpu} (the compiles run here; the times are predictions "
                 f"for the targets), JAX {jax.__version__}, bf16, context {args.context} "
                 f"tokens a row (W={W} pages of {PAGE}).\n")
    t_start = time.perf_counter()
    checks_lines, tables = [], []
    for model in args.models:
        cfg = aot.shape_config(model)
        L = cfg.n_layers
        ec = aot.scaled_exit_config(base_ec, L, SHIPPED_LAYERS)
        checked = checked_layers(ec, L)
        for tname in args.targets:
            target = aot.parse_target(tname)
            chips = [target.chip] + ([aot.CHIPS["h200"]] if tname.startswith("cuda") else [])
            rows = {}
            for B in args.batches:
                t0 = time.perf_counter()
                try:
                    p, first, step = pieces(cfg, ec, B, W, target)
                except Exception as e:  # e.g. the model does not fit one chip's HBM
                    msg = " ".join(str(e).split())[:160]
                    print(f"{model} {target.name} B={B}: FAILED {msg}", file=sys.stderr,
                          flush=True)
                    checks_lines.append(f"| {model} | {target.name} | {B} | failed: {msg} "
                                        f"| | | | | | |")
                    continue
                rows[B] = (p, first, step)
                comp = p.full_depth(L)
                an = L * analytic_layer_bytes(cfg, B, W)
                checks_lines.append(
                    f"| {model} | {target.name} | {B} | {p.layer.bytes / 1e6:.1f} | "
                    f"{analytic_layer_bytes(cfg, B, W) / 1e6:.1f} | "
                    f"{p.layer.bytes * L / an - 1:+.1%} | {comp.bytes / 1e6:.1f} | "
                    f"{step.bytes / 1e6:.1f} | {comp.flops / 1e9:.2f} | "
                    f"{step.flops / 1e9:.2f} |")
                print(f"{model} {target.name} B={B}: pieces in {time.perf_counter() - t0:.0f}s"
                      f"; layer bytes {p.layer.bytes / 1e6:.1f} MB (analytic "
                      f"{analytic_layer_bytes(cfg, B, W) / 1e6:.1f}); composed full step "
                      f"{comp.bytes / 1e6:.1f} MB vs compiled {step.bytes / 1e6:.1f} MB",
                      file=sys.stderr, flush=True)
            for chip in chips:
                if rows:
                    tables.append(_table(model, target, chip, cfg, ec, checked, rows, W))
    lines.append("### Predicted decode step (roofline) and early-exit speed-up\n")
    lines.append("Speed-up = full-depth step / early-exit step, both predicted. Forced: every "
                 "row leaves at that layer (a check at each exit layer up to it). Shipped "
                 "histograms: the SmolLM2 heads' batch-1 row histograms (threshold 0.985; "
                 "instructions / HumanEval / everyday chat), at the same fractions of depth "
                 "for the other shapes (no heads exist for them: a what-if). deferred: the "
                 "pending token runs the skipped layers in the next step, so every layer is "
                 "paid every step; propagate: the skipped layers are K/V projections only.\n")
    lines += tables
    lines.append("### Cross-checks\n")
    lines.append("Layer bytes (XLA) against the analytic count (one layer's weights + the "
                 "K/V of B rows x W pages), and the composed full-depth step (fixed + L x "
                 "layer) against the compiled full-depth step (one `fori_loop` over L layers; "
                 "XLA's cost analysis counts the loop body once unless it knows the trip "
                 "count).\n")
    lines.append("| model | target | batch | layer MB (XLA) | layer MB (analytic) | "
                 "L x layer vs analytic | composed step MB | compiled step MB | composed "
                 "GFLOP | compiled GFLOP |")
    lines.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    lines += checks_lines
    lines.append(f"\n(all compiles: {time.perf_counter() - t_start:.0f} s)")
    text = "\n".join(lines) + "\n"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)
    return 0


def _table(model, target, chip, cfg, ec, checked, rows, W: int) -> str:
    L = cfg.n_layers
    half, tq = L // 2, (3 * L) // 4
    how = "compiled" if target.compiles else "lowered"
    out = [f"**{model}** ({L} layers) on **{chip.name}** ({how} for {target.name}; "
           f"{chip.source})\n",
           "| batch | full depth ms (XLA counts) | bound | full depth ms (analytic bytes) | "
           "forced L/2 propagate | forced 3L/4 propagate | forced L/2 deferred | "
           "shipped hist. propagate (instr / code / chat) | "
           "shipped hist. deferred (instr / code / chat) |",
           "|---:|---:|---|---:|---:|---:|---:|---|---|"]
    for B, (p, first, _) in rows.items():
        full = p.full_depth(L)
        t_full = seconds(full, chip.peak_flops, chip.hbm_bytes_per_s)
        bound = "memory" if full.bytes / chip.hbm_bytes_per_s >= \
            full.flops / chip.peak_flops else "compute"

        def speed(c: Cost) -> str:
            return f"{t_full / seconds(c, chip.peak_flops, chip.hbm_bytes_per_s):.2f}x"

        def forced(e, bf):
            return speed(_step_cost(p, first, e, L, checked, bf))

        def hist(bf):
            if B != 1:
                return "n/a (batch 1 histograms)"
            parts = []
            for h in SHIPPED.values():
                sh = scaled_histogram(h, L)
                tot = sum(sh.values())
                c = Cost(0.0, 0.0)
                for e, n in sh.items():
                    c = c + (n / tot) * _step_cost(p, first, e, L, checked, bf)
                parts.append(speed(c))
            return " / ".join(parts)

        an = L * analytic_layer_bytes(cfg, B, W) + cfg.vocab_size * cfg.d_model * \
            cfg.jnp_dtype.itemsize  # + the LM head
        t_an = max(an / chip.hbm_bytes_per_s, full.flops / chip.peak_flops)
        out.append(f"| {B} | {t_full * 1e3:.3f} | {bound} | {t_an * 1e3:.3f} | "
                   f"{forced(half, 'propagate')} | "
                   f"{forced(tq, 'propagate')} | {forced(half, 'deferred')} | "
                   f"{hist('propagate')} | {hist('deferred')} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    sys.exit(main())
