"""Where exits pay: a roofline from the compiler's own counts (no accelerator is at hand, so
the compiled programs' flops and bytes stand in for a measured step time).

For each model shape and target, the decode step's pieces are compiled (TPU, ahead of time
on this host, with memory-space assignment off so that the bytes are HBM bytes: see
TPU_COUNT_OPTIONS; CUDA, by XLA's GPU compiler without a GPU, in the cuda-aot venv: `make
roofline`, its GEMMs counted in one pass, CUDA_COUNT_OPTIONS, and a step of one row at the
engine's smallest GPU bucket, two rows) or, for CUDA without that compiler, lowered (the HLO
before optimisation, unfused) on their own, and XLA's cost analysis gives their flops and
bytes: one decoder layer (unstacked weights) whose attention reads the rows' K/V given as an
input of the read size, plus this token's K/V write counted by hand (XLA counts an in-place
scatter by its pool, and a page gather by its relayout copies: both replaced, see `pieces`);
on TPU and CUDA, where the engine attends with a Pallas kernel XLA cannot see into,
attention's core counted as the kernel moves it (the rows' pages once, q and the output) in
place of the XLA stand-in's own count; the fixed part (embed); the final head and the exit
head (each with the greedy pick); an exit check (first and later); one layer's back-fill
(`llama.kv_project`). `ee_jax.serving.aot.roofline` prices what a step runs of each
(`exit_cost.step_work`, weighted by an exit histogram) and predicts max(flops / peak, bytes
/ bandwidth) with published peaks.

On TPU every piece runs with the weights and the KV pool in the entry layouts the compiled
full-depth step at the largest batch picks (`step_formats`: Layout.AUTO, settled), the exit
heads in those the checks pick: the layouts an engine allocating its arrays so would hold,
one per array for every batch (XLA's default layouts copied whole tables and the pool per
step: `ee_jax.serving.layouts`).

Cross-checks printed beside the tables: each shape's composed bytes against the analytic
count (weights once + the K/V the rows read + this token's K/V), with a verdict and the
relayout copies the compiler planned (real traffic the hand count leaves out); XLA's bytes
per piece against a hand count; the composed step against the compiled full-depth step
(`step.model_step` under `FullDepth`: one fori_loop, its body counted once); and on this
CPU, pieces compiled for it against measured full-depth step times (`--cpu`).

    python -m bench.roofline                       # writes runs/roofline.md (and prints it)
    python -m bench.roofline --models smollm2-135m --targets tpu:v5e --batches 1 8

Modes, other questions asked of compiled programs (`python -m bench.roofline MODE --help`):

    JAX_PLATFORMS=cpu .venv-cuda-aot/bin/python -m bench.roofline dots
    JAX_PLATFORMS=cpu .venv-cuda-aot/bin/python -m bench.roofline weight-slices --batches 8
    python -m bench.roofline compile-time
    python -m bench.roofline block-storage

block-storage: one SmolLM2 projection (1536 x 576) from Q4 blocks, dequantized and multiplied
in one program compiled for TPU v5e (`aot.traffic`'s bytes against the file's 0.5 byte a
weight plus f16 scales): the packed u8 bytes as `quant.BlockQ` holds them on TPU and GPU,
`jnp.int4` / `jnp.uint4` values, int8 one a byte; which storage XLA TPU reads as it is.

dots: decode-sized projections x [B, D] @ w [D, F] in bf16 compiled for an H100 (XLA's GPU
compiler, the cuda-aot venv): XLA's bytes against the operands' and the output's, for
SmolLM2's and Llama-3.2-1B's projection shapes at B = 1, 2, 8, 32 rows, as written (`x @ w`,
XLA's default tiling: a compile without a GPU cannot autotune), with GEMMs in one pass
(CUDA_COUNT_OPTIONS, split_k 1) and at one row accumulated in f32 (`preferred_element_type`),
with the fusions XLA made: why the engine's GPU buckets start at two rows
(`scheduler.default_batch_buckets`) and why the roofline counts one-pass GEMMs.

weight-slices: what a GPU step pays for layer weights stacked [L, ...]: the full-depth decode
step compiled for an H100 three ways, XLA's bytes (`aot.cost_of`, GEMMs in one pass) and the
weight copies in the compiled module: stacked, `fori_loop` (the engine's program; the body
counted once, so compare it with fixed + one pool layer); stacked, a Python loop (static
layer index); unstacked (each layer's weights an argument, a Python loop); and the engine's
program under XLA options that might avoid the copies (`SLICE_OPTIONS`): GEMMs by cuBLAS
(whose calls the cost analysis does not count: its MB is the rest), dynamic-slice fusion (a
library GEMM addressing a slice in place), XLA's own full unrolling of the loop. Against the
pieces the roofline composes (fixed + L pool layers, the pool layer as the step runs it).

compile-time: how long XLA takes to compile a tiny engine's step programs under this
process's XLA_FLAGS and JAX settings, the measurement behind the test suite's compile
settings (docs/testing.md). A 4-layer random model (`ee_jax.testing.tiny_model`) served full
depth (`early_exit=False`, the baseline engine) with 8 sequences in 4 batch buckets and
16-token prefill chunks, greedy, --new-tokens each; JAX's own compile events
(`jax.monitoring`) summed: backend compile (XLA), lowering to MLIR, tracing; printed with the
run's wall and process CPU time and a checksum of the tokens (the settings must not change
them). One process reads XLA_FLAGS once: run each setting in its own process, interleaved,
more than once:

    python -m bench.roofline compile-time                                  # XLA's defaults
    XLA_FLAGS=--xla_cpu_use_fusion_emitters=false python -m bench.roofline compile-time
    JAX_DISABLE_MOST_OPTIMIZATIONS=1 python -m bench.roofline compile-time # -O0, as the suite
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import functools
import os
import re
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import (
    best_time,
    copy_bandwidth,
    cpu_model,
    log,
    median,
    num_cpus,
    other_load,
    smollm2_shaped_random,
    step_case,
    time_steps,
)
from ee_jax.models import llama
from ee_jax.models.exits import backfill_maps
from ee_jax.models.exits import checks as exit_checks
from ee_jax.models.exits import heads as exit_heads
from ee_jax.models.exits.cost import Count, step_work
from ee_jax.serving import attention_kernels, hlo, layouts
from ee_jax.serving.aot import compile as aot
from ee_jax.serving.aot.roofline import (
    Cost,
    Pieces,
    layer_weight_bytes,
    per_unit,
    seconds,
    step_bytes,
)
from ee_jax.serving.attention import AttentionMetadata
from ee_jax.serving.kv_cache import KERNEL_BACKENDS, KVCache, cache_shape, pad_head_dim, write_layer
from ee_jax.serving.paged_model import attend, paged_layer
from ee_jax.serving.plan import EngineConfig, EnginePlan, engine_plan
from ee_jax.serving.step import FullDepth, model_step

PAGE = 16
# Row exit histograms of the shipped SmolLM2 default at batch 1 (back-fill deferred_learned,
# threshold 0.975; layer: rows, 30 = full depth): the "exits deferred_learned" rows' histogram
# column of
#   python -m bench.shipped_exits --workloads instructions humaneval chat --batch-runs 1:all \
#       --backfills deferred_learned --maps-f32 --prompts 12 --new-tokens 32 --repeats 6
# (the first round's, full depth's tokens forced: no timing enters it). Rerun it, and this
# benchmark, when the shipped heads change.
SHIPPED = {
    "instructions": {16: 22, 17: 8, 18: 20, 19: 14, 20: 15, 21: 9, 22: 5, 23: 3, 24: 8, 25: 6,
                     26: 4, 27: 6, 28: 6, 29: 10, 30: 234},
    "HumanEval": {16: 12, 17: 10, 18: 22, 19: 10, 20: 8, 21: 11, 22: 6, 23: 5, 24: 11, 25: 5,
                  26: 9, 27: 5, 28: 13, 29: 12, 30: 233},
    "everyday chat": {16: 16, 17: 4, 18: 4, 19: 12, 20: 6, 21: 14, 22: 6, 23: 3, 24: 4, 25: 8,
                      26: 4, 27: 4, 28: 7, 29: 10, 30: 270},
}
SHIPPED_LAYERS = 30
# Verified exits, the shipped heads as drafts (policy all, max_draft 4, threshold 0.975) at
# batch 1: decode steps by exit layer (30: a verify step) and the tokens they emitted, the
# "verified, max_draft 4" rows of docs/benchmarks.md "Verified exits" (every sequence full
# depth's), from
#   python -m bench.shipped_exits --workloads instructions humaneval chat --repeats 5 \
#       --batch-runs 1:all --backfills --verify 4:0.975 2:0.975
SHIPPED_VERIFIED = {
    "instructions": ({16: 29, 17: 16, 18: 22, 19: 19, 20: 15, 21: 14, 22: 5, 23: 4, 24: 11,
                      25: 8, 26: 5, 27: 9, 28: 9, 29: 14, 30: 299}, 478),
    "HumanEval": ({16: 17, 17: 9, 18: 22, 19: 22, 20: 11, 21: 11, 22: 8, 23: 6, 24: 12, 25: 12,
                   26: 9, 27: 8, 28: 16, 29: 11, 30: 327}, 494),
    "everyday chat": ({16: 17, 17: 6, 18: 5, 19: 13, 20: 6, 21: 18, 22: 8, 23: 11, 24: 3,
                       25: 13, 26: 4, 27: 4, 28: 9, 29: 13, 30: 368}, 489),
}


def scaled_histogram(hist: dict[int, int], n_layers: int) -> dict[int, float]:
    """A histogram over SHIPPED_LAYERS moved to `n_layers` at the same fractions of depth."""
    out: dict[int, float] = {}
    for e, n in hist.items():
        k = n_layers if e >= SHIPPED_LAYERS else \
            max(1, min(n_layers - 1, round(e * n_layers / SHIPPED_LAYERS)))
        out[k] = out.get(k, 0) + n
    return out


def _place(tree, target: aot.Target):
    """Abstract leaves on the target's first device (a leaf that has a sharding, and with it
    maybe a layout: `layouts.place`, keeps it)."""
    devices = aot.target_devices(target)
    s = jax.sharding.SingleDeviceSharding(devices[0]) if devices else None
    return jax.tree.map(lambda a: a if getattr(a, "sharding", None) is not None else
                        jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree)


# XLA's TPU cost analysis counts every memory level: with memory-space assignment (MSA) on,
# a weight staged into VMEM is counted on its copy out of HBM, its write into VMEM and the
# matmul's read of it (x @ w, w 576 x 1536 bf16, batch 8: 8.9 MB counted for 1.8 MB moved).
# Compiled with MSA off every operand is read from HBM once (1.80 MB): the count a roofline
# over HBM bandwidth needs. The programs otherwise compile the same (fusions, layouts).
TPU_COUNT_OPTIONS = {"xla_msa_enable": False}
# A CUDA compile without a GPU cannot autotune, and XLA's default tiling of a small-M GEMM
# splits K (8 ways for [32, 576] x [576, 576]) with f32 partial sums [8, M, N] written and
# read back: 1.4x the operands' bytes at batch 8, 1.6-2.6x at 32 (`bench.roofline dots`). One
# pass (split_k 1, among a device autotuner's candidates) reads every weight once, the
# count a roofline over HBM bandwidth needs; what a device's autotuner picks is for a device
# to say (bench/device.sh).
CUDA_COUNT_OPTIONS = {"xla_gpu_experimental_force_split_k": 1}
COUNT_OPTIONS = {"tpu": TPU_COUNT_OPTIONS, "cuda": CUDA_COUNT_OPTIONS}


def cost(fn, args, target: aot.Target, donate: tuple[int, ...] = (),
         auto: tuple[int, ...] = (), out=None) -> Cost:
    """XLA's flops and bytes of fn(*args): compiled for TPU (HBM bytes: MSA off), CPU or
    CUDA (the cuda-aot extra), else lowered for CUDA (the HLO before optimisation: unfused)."""
    return cost_and_copies(fn, args, target, donate, auto, out)[0]


def copy_bytes(hlo_text: str) -> float:
    """Bytes the top-level `copy` instructions of a compiled module move (read + write of
    each's logical shape, `layouts.copies`): the relayouts the compiler planned (e.g. a
    weight transposed to suit the matmul it feeds), real traffic a hand count of weights and
    K/V leaves out."""
    return sum(2 * hlo.shape_bytes(dt, shape)
               for dt, shape in layouts.copies(hlo_text))


def compile_for(fn, args, target: aot.Target, donate: tuple[int, ...] = (),
                auto: tuple[int, ...] = (), out=None):
    """fn(*args) compiled for `target` (TPU: counted with MSA off; CUDA: GEMMs in one
    pass, `COUNT_OPTIONS`); on TPU the args at `auto`
    in the entry layouts XLA picks, the others as placed, the outputs in `out` (formats: a
    donated cache must come back in its own) (`layouts.lower`)."""
    opts = COUNT_OPTIONS.get(target.platform, {})
    placed = _place(args, target)
    if target.platform == "tpu":
        lowered = layouts.lower(fn, placed, auto, donate_argnums=donate, out_shardings=out)
    else:
        lowered = jax.jit(fn, donate_argnums=donate).lower(*placed)
    return lowered.compile(compiler_options=opts)


def cost_and_copies(fn, args, target: aot.Target, donate: tuple[int, ...] = (),
                    auto: tuple[int, ...] = (), out=None) -> tuple[Cost, float]:
    """(XLA's counts, the bytes of its relayout copies; 0 where only lowered)."""
    jitted = jax.jit(fn, donate_argnums=donate)
    if target.compiles:
        compiled = compile_for(fn, args, target, donate, auto, out)
        flops, nbytes = aot.cost_of(compiled)
        return Cost(flops, nbytes), copy_bytes(compiled.as_text())
    ca = jitted.trace(*args).lower(lowering_platforms=("cuda",)).cost_analysis()
    return Cost(float(ca["flops"]), float(ca["bytes accessed"])), 0.0


def sds(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))


def meta_for(B: int, W: int) -> AttentionMetadata:
    return AttentionMetadata(sds((B, 1), jnp.int32), sds((B, W), jnp.int32),
                             sds((B,), jnp.int32))


def attend_rows(q, k, v, meta: AttentionMetadata, cfg):
    """Attention of q [B, 1, H, hd] over the rows' own keys and values k, v [B, K, T, hd'],
    kv heads first as the paged kernels read their pages ([K, pages, page_size, hd]): what a
    kernel reads, the pages' contents, no pool. hd' is the stored head_dim (q padded with
    zeros to it, as `paged_model.attend` does over a padded TPU cache). Scores and softmax in
    f32, as the kernels compute them."""
    B, T, H, hd = q.shape
    K = k.shape[1]
    G = H // K
    qh = pad_head_dim(q, k.shape[-1]).reshape(B, T, K, G, -1)
    s = jnp.einsum("btkgd,bksd->bkgts", qh, k, preferred_element_type=jnp.float32)
    s = s * cfg.attn_scale
    if cfg.attn_logit_softcap is not None:
        s = jnp.tanh(s / cfg.attn_logit_softcap) * cfg.attn_logit_softcap
    key_pos = jnp.arange(k.shape[2], dtype=jnp.int32)
    mask = llama.attention_weights_mask(meta.positions, key_pos,
                                        key_pos[None, :] < meta.kv_lens[:, None])  # [B, T, S]
    s = jnp.where(mask[:, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    out = jnp.einsum("bkgts,bksd->btkgd", p.astype(v.dtype), v,
                     preferred_element_type=jnp.float32)
    return out.reshape(B, T, H, -1)[..., :hd].astype(q.dtype)


@dataclasses.dataclass(frozen=True)
class Hand:
    """Bytes one piece must move at least (bf16/f32 itemsize of the model), by hand."""

    weights: float  # every weight the piece uses, once
    kv_read: float  # the keys and values the rows attend to
    kv_write: float  # this step's K/V
    other: float = 0.0  # activations in and out

    @property
    def total(self) -> float:
        return self.weights + self.kv_read + self.kv_write + self.other


@functools.cache
def engine_of(cfg, target: aot.Target) -> EnginePlan:
    """The plan of an engine of `cfg` with the default knobs on the target (`plan.engine_plan`):
    the batch buckets, the attention backend and the pool's layout the roofline models."""
    return engine_plan(cfg, EngineConfig(), target.platform)


def kv_head_dim(cfg, target: aot.Target) -> int:
    """The head_dim the target's cache is stored at (`kv_cache.storage_head_dim`: 128 for
    SmolLM2's 64 on TPU), what its K/V reads and writes move."""
    return engine_of(cfg, target).kv_shape[-1]


def hand_layer(cfg, B: int, W: int, kv_itemsize: int | None = None,
               kv_hd: int | None = None) -> Hand:
    """One decode layer: its weights once, the K/V of B rows x W pages (whole pages, as every
    backend reads them; kv_hd: the stored head_dim, default the model's), this token's K/V
    written, x in and out."""
    it = cfg.jnp_dtype.itemsize
    kit = kv_itemsize or it
    kv = cfg.n_kv_heads * (kv_hd or cfg.head_dim)
    return Hand(layer_weight_bytes(cfg), 2 * B * W * PAGE * kv * kit, 2 * B * kv * kit,
                2 * B * cfg.d_model * it)


def hand_fixed(cfg, B: int) -> Hand:
    """Embedding rows of B tokens, final norm, the LM head (the tied embedding read whole)."""
    it = cfg.jnp_dtype.itemsize
    head = cfg.vocab_size * cfg.d_model * it
    return Hand(head + cfg.d_model * it, 0.0, 0.0, B * cfg.d_model * it)


def analytic_step(cfg, B: int, W: int, kv_itemsize: int | None = None,
                  kv_hd: int | None = None) -> float:
    """The bytes a full-depth decode step must move (`roofline.step_bytes`, the one hand
    count `ee-jax compile` reports too)."""
    return step_bytes(cfg, B, W, PAGE, kv_itemsize=kv_itemsize, kv_hd=kv_hd)


POOL = "layer over the pool (as the step runs it)"
FIXED = "fixed (embedding) + final head"
LAYER = "layer (K/V as input)"
STAND_IN = "layer, attention by the XLA stand-in"


@dataclasses.dataclass
class Measured:
    """What `pieces` found at one batch: the composition's pieces, the compiled full-depth
    step, and XLA's raw counts of the parts (for the breakdown)."""

    pieces: Pieces
    step: Cost | str  # the compiled full-depth step, or why it failed
    parts: dict[str, tuple[Cost, float]]  # name -> (XLA's count, hand bytes)
    copies: dict[str, float]  # piece -> bytes of its relayout copies (compiled only)


def full_step_fn(cfg):
    """The compiled full-depth step as the bench builds it: the greedy tokens and the cache
    (donated: argument 1), attention "reference" over the pool."""
    return lambda p, c, t, m, th: _argmax_and_cache(
        model_step(p, None, c, t, m, th, cfg, FullDepth(), "reference"))


def step_args(cfg, B: int, W: int, kv_dtype=None, platform: str = "cpu") -> tuple:
    """Abstract arguments of `full_step_fn` at batch B over W pages a row (a pool of
    B * W + 1 pages, stored as on `platform`)."""
    kdt = jnp.dtype(kv_dtype or cfg.jnp_dtype)
    cache = KVCache(*(sds(cache_shape(cfg, B * W + 1, PAGE, platform), kdt) for _ in range(2)))
    return (aot.abstract_params(cfg), cache, sds((B, 1), jnp.int32), meta_for(B, W),
            sds((B,), jnp.float32))


@functools.cache
def step_formats(cfg, B: int, W: int, target: aot.Target, kv_dtype=None):
    """(params formats, cache formats): the entry layouts the compiled full-depth step at
    batch B picks (`layouts.pick`), what an engine allocating its weights and pool so
    would hold; from the one-layer step (the same ranks) where the whole step does not
    compile (does not fit one chip). None off TPU (CPU and CUDA: no layouts here)."""
    if target.platform != "tpu":
        return None

    def picked(c):
        opts = TPU_COUNT_OPTIONS
        args = step_args(c, B, W, kv_dtype, target.platform)
        return layouts.pick(full_step_fn(c), _place(args, target),
                            (0, 1), donate_argnums=(1,), returned={1: 1},
                            compile=lambda lo: lo.compile(compiler_options=opts))

    try:
        return picked(cfg)
    except Exception:  # e.g. RESOURCE_EXHAUSTED: the layer's layouts are the step's
        fp, fc = picked(dataclasses.replace(cfg, n_layers=1))
        layered = jax.tree.map(layouts.layer_axis_major, fp.layers)
        return fp.replace(layers=layered), jax.tree.map(layouts.layer_axis_major, fc)


def _out(fmts, n: int):
    """Output formats of a program returning (n leading outputs, the cache): the cache in
    its entry format (donated: it comes back where it went in); None off TPU."""
    if fmts is None:
        return None
    dev = jax.tree.leaves(fmts[1])[0].sharding
    return (*(dev,) * n, fmts[1])


def pieces(cfg, ec, B: int, W: int, target: aot.Target, kv_dtype=None,
           step: bool = True, pin: int | None = None, rows: int | None = None) -> Measured:
    """The pieces of a decode step at batch bucket B over W pages a row, `rows` of them real
    (default B; the others padding, whose attention reads no key: on GPU a step of one row
    runs at bucket 2, `scheduler.default_batch_buckets`) (ec None: no checks; step False:
    the compiled full-depth step is not built).

    layer(B) = XLA's count of one decoder layer (unstacked weights) whose attention reads the
    rows' K/V given as an input of the read size [B, W*16, K, hd], plus this token's K/V
    write counted by hand: XLA counts an in-place scatter into the pool as (a multiple of) the
    pool (`write_count_example`), and a page gather as its relayout copies, so both are
    replaced, never added to. Where the engine's attention is a Pallas kernel (TPU and CUDA,
    `engine_of`) the stand-in attention's own count (`attend_rows` compiled alone: its f32
    scores and softmax passes go through HBM) is replaced by the kernel's traffic, the rows'
    pages read once plus q and the output; the stand-in layer stays in `parts` (STAND_IN)
    for comparison.

    On TPU the weights and the pool are in the entry layouts the compiled full-depth step at
    batch `pin` (default B) picks (`step_formats`: an engine holds one layout per array, so
    pin the largest bucket for every batch), every piece compiled against them (a layer's
    weights: the stacked ones' layout without the layer axis), and the exit heads in the
    layouts a first and a later check together pick."""
    dt = cfg.jnp_dtype
    it = dt.itemsize
    kdt = jnp.dtype(kv_dtype or dt)
    T = W * PAGE
    cfg1 = dataclasses.replace(cfg, n_layers=1)
    meta = meta_for(B, W)
    x = sds((B, 1, cfg.d_model), dt)
    pos = sds((B, 1), jnp.int32)
    kv_hd = kv_head_dim(cfg, target)
    kv = sds((B, cfg.n_kv_heads, T, kv_hd), kdt)  # heads first, as the kernels read
    fmts = step_formats(cfg, pin or B, W, target, kv_dtype)
    params, cache, *rest = step_args(cfg, B, W, kv_dtype, target.platform)
    # one layer's weights: the stacked ones' layouts without the layer axis; the pool
    # layer's (n_layers=1) params and cache: the stacked ones' layouts as they are
    lp = jax.eval_shape(lambda p: llama.layer_params(p, 0), params)
    p1, c1 = step_args(cfg1, B, W, kv_dtype, target.platform)[:2]
    if fmts is not None:
        fp, fc = fmts
        params, cache, p1, c1 = (layouts.place(params, fp), layouts.place(cache, fc),
                                 layouts.place(p1, fp), layouts.place(c1, fc))
        lp = layouts.place(lp, jax.tree.map(layouts.unstacked, fp.layers))
    compiled: Cost | str = Cost(0.0, 0.0)
    step_copies = 0.0
    if step:  # as the step runs: the cache donated, attention "reference" over the pool
        try:
            compiled, step_copies = cost_and_copies(full_step_fn(cfg), (params, cache, *rest),
                                                    target, donate=(1,), out=_out(fmts, 1))
        except Exception as e:  # e.g. the whole step does not fit one chip: the pieces do
            compiled = " ".join(str(e).split())[:120]

    def layer_fn(lp, x, pos, k, v, m):
        return llama.decoder_layer(lp, x, pos, cfg1,
                                   lambda q, _k, _v: (attend_rows(q, k, v, m, cfg), None))[0]

    hl = hand_layer(cfg, B, W, kdt.itemsize, kv_hd)
    kv_read = hand_layer(cfg, rows or B, W, kdt.itemsize, kv_hd).kv_read  # the real rows'
    stand_in, layer_copies = cost_and_copies(layer_fn, (lp, x, pos, kv, kv, meta), target)
    # Attention's core as the kernels move it: XLA cannot count inside a Mosaic (or Triton)
    # call, and the XLA stand-in writes its f32 scores and softmax passes to HBM, which a
    # kernel keeps on chip. So the layer is the stand-in layer less the stand-in's own count
    # (compiled alone) plus what the kernel reads and writes: the rows' pages once, q, out.
    # On CPU the engine attends with XLA (the `xla` backend): the stand-in stays.
    q = sds((B, 1, cfg.n_heads, cfg.head_dim), dt)
    attn = cost(lambda q, k, v, m: attend_rows(q, k, v, m, cfg), (q, kv, kv, meta), target)
    kernel = Cost(attn.flops, kv_read + 2 * B * cfg.n_heads * kv_hd * it)
    kernels = engine_of(cfg, target).attention in KERNEL_BACKENDS
    layer_xla = stand_in - attn + kernel if kernels else stand_in
    layer = layer_xla + Cost(0.0, hl.kv_write)
    # deferred's pending token as a second query a row: what it adds to the layer, plus its
    # own read of the row's K/V (the kernels take each query as a row) and its K/V write
    meta2 = AttentionMetadata(sds((B, 2), jnp.int32), meta.page_table, meta.kv_lens)
    layer2 = cost(layer_fn, (lp, sds((B, 2, cfg.d_model), dt), sds((B, 2), jnp.int32), kv, kv,
                             meta2), target)
    ride = layer2 - layer_xla + Cost(0.0, kv_read + hl.kv_write)

    # The fixed part: the embedding lookup of B tokens counted by hand (B rows) plus the
    # relayout copies its compile holds: XLA's CPU cost analysis counts a B >= 2 row gather by
    # the whole table (SmolLM2 f32, batch 8: 113 MB for 18 kB), while on TPU a copy of the
    # table before the gather is real. The final head on the last hidden state with the
    # greedy pick (XLA's count) is a piece of its own: a step whose rows all left skips it.
    final_head = cost(lambda p, x: jnp.argmax(llama.final_head(p, x, cfg), axis=-1),
                      (params, sds((B, cfg.d_model), dt)), target)
    tokens = sds((B, 1), jnp.int32)
    _, fixed_copies = cost_and_copies(lambda p, t: llama.embed(p, t, cfg), (params, tokens),
                                      target)
    fixed = Cost(0.0, B * cfg.d_model * it + fixed_copies)
    fill = cost(lambda lp, h, pos: llama.kv_project(lp, h, pos, cfg1), (lp, x, pos), target) \
        + Cost(0.0, hl.kv_write)
    first = later = exit_head = Cost(0.0, 0.0)
    first_copies = later_copies = 0.0
    if ec is not None:
        heads = jax.eval_shape(lambda p, h: exit_heads.with_vocab_rows(p, h, cfg),
                               aot.abstract_params(cfg), exit_heads.head_shapes(cfg, ec))
        h = sds((B, cfg.d_model), dt)
        state = jax.eval_shape(lambda x: exit_checks.init_check_state(x, ec), h)

        def check_fn(first):
            return lambda p, hd, x, s: exit_checks.check_confidence(p, hd, 0, x, s, cfg, ec,
                                                                    first=first)[0]

        def both(p, hd, x, s):  # as a step runs them: the heads' one layout serves both
            _, _, s = exit_checks.check_confidence(p, hd, 0, x, s, cfg, ec, first=True)
            return (exit_checks.check_confidence(p, hd, 1, x, s, cfg, ec, first=False)[0],)

        if target.platform == "tpu":
            opts = TPU_COUNT_OPTIONS
            fh, = layouts.pick(both, _place((params, heads, h, state), target), (1,),
                               compile=lambda lo: lo.compile(compiler_options=opts))
            heads = layouts.place(heads, fh)
        first, first_copies = cost_and_copies(check_fn(True), (params, heads, h, state),
                                              target)
        later, later_copies = cost_and_copies(check_fn(False), (params, heads, h, state),
                                              target)
        exit_head = cost(exit_head_fn(cfg), (params, heads, sds((B,), jnp.int32), h), target)
        if heads.vocab is not None:  # the subset's logits scattered into [B, V] f32, then picked
            exit_head = exit_head + Cost(0.0, 2 * B * cfg.vocab_size * 4)
    maps = Cost(0.0, 0.0)
    maps_hand = 0.0
    maps_did = Count(1, 1)  # what the maps piece computed (below)
    if ec is not None:  # the fitted maps' correction of the rows that left: all real rows
        # (padding never leaves: at a GPU batch of 1 the two-row step's `lax.cond` runs its
        # one-row branch, which is this program; XLA's count of the cond would be its
        # costlier branch, the one not run)
        R = rows or B
        mshape = backfill_maps.map_shapes(cfg, ec.exit_layers, backfill_maps.DEFAULT_RANK)
        gather = backfill_maps.gathers(target.platform, B)  # as the step decides
        maps = cost(lambda m, s, h, p: backfill_maps.kv_correction(m, s, h, p, cfg, gather),
                    (mshape, sds((R,), jnp.int32), sds((R, 1, cfg.d_model), dt),
                     sds((R, 1), jnp.int32)), target)
        span = cfg.n_layers - ec.exit_layers[0]
        # each row's maps for every layer above the first exit, and the corrections out (f32)
        maps_hand = R * (sum(int(np.prod(a.shape[1:])) * a.dtype.itemsize
                             for a in jax.tree.leaves(mshape))
                         + span * 2 * backfill_maps.kv_dim(cfg) * 4)
        # the correction of R rows leaving at the first exit (one query each), counted as
        # the step counts it (XLA counts kv_correction's lax.cond by its all-rows branch)
        learned = dataclasses.replace(ec, backfill="learned", policy="per_row")
        maps_did = step_work(learned, cfg.n_layers, [learned.first_exit] * R, bucket=R,
                             platform=target.platform).maps
    pool_layer = Cost(0.0, 0.0)
    if step:  # the step's own layer: attention "reference" over the pool, the cache donated
        pool_layer = cost(lambda p, x, c, m: paged_layer(p, 0, x, c, m, cfg1, "reference"),
                          (p1, x, c1, meta), target, donate=(2,), out=_out(fmts, 1))
    parts = {LAYER: (layer_xla, hl.total - hl.kv_write - hl.kv_read + kv_read),
             STAND_IN: (stand_in, hl.total - hl.kv_write),
             "attention stand-in alone": (attn, kernel.bytes),
             POOL: (pool_layer, hl.total),
             FIXED: (fixed + final_head, hand_fixed(cfg, B).total),
             "fill (kv_project)": (fill - Cost(0.0, hl.kv_write),
                                   2 * cfg.d_model * cfg.n_kv_heads * cfg.head_dim * it
                                   + cfg.d_model * it * (1 + B)
                                   + 2 * B * cfg.n_kv_heads * kv_hd * it)}
    if ec is not None:
        parts["maps (learned correction)"] = (maps, maps_hand)
    copies = {"layer": layer_copies, "fixed": fixed_copies, "first check": first_copies,
              "later check": later_copies, "step": step_copies}
    one = Count(1, B)  # a piece compiled at batch B: one pass over its weights, B rows
    p = Pieces(fixed, *(per_unit(c, one) for c in (layer, first, later, exit_head, final_head,
                                                    fill, ride)), maps=per_unit(maps, maps_did))
    return Measured(p, compiled, parts, copies)


def exit_head_fn(cfg):
    """The exit head a step runs for its rows that left, with the greedy pick: each row's
    exit hidden state (`exit_heads.exit_hidden`, vmapped over rows as `row_exit_logits` does)
    through the exit vocabulary's rows of the LM head. Not `row_exit_logits` itself: XLA
    counts a `lax.cond` by its dearer branch, there the final head a step of leaving rows
    skips. With a subset, its logits' scatter into the whole vocabulary is left to the
    caller's hand count: XLA's TPU count of that scatter is 36x the array (56.7 MB at batch
    8 for a 1.6 MB [8, V] f32)."""
    def f(p, hd, slots, x):
        hn = jax.vmap(lambda s, h: exit_heads.exit_hidden(hd, s, h, cfg))(slots, x)
        if "vocab" not in hd:
            return jnp.argmax(llama.unembed(p, hn, cfg), axis=-1)
        return jnp.argmax(exit_heads.unembed_rows(p, hn, hd.vocab, cfg, hd.vocab_rows),
                          axis=-1)
    return f


def _mb(c: Cost | str) -> str:
    return c if isinstance(c, str) else f"{c.bytes / 1e6:.1f}"


def _argmax_and_cache(out):
    """The step's greedy tokens and its cache (returned, so the donated cache is aliased)."""
    return out[0].logits.argmax(-1), out[1]


def write_count_example(target: aot.Target) -> tuple[float, float, float]:
    """(the counted bytes of writing one token's K/V into a donated pool, the bytes written,
    the pool's bytes): XLA's cost analysis counts an in-place scatter by its operand, not its
    update (on CPU and CUDA `aot.cost_of` takes the excess off)."""
    cfg = aot.shape_config("smollm2-135m")
    c1 = dataclasses.replace(cfg, n_layers=1)
    B, P = 8, 8 * 32 + 1
    pool = KVCache(*(sds(cache_shape(c1, P, PAGE), cfg.jnp_dtype) for _ in range(2)))
    kv = sds((B, cfg.n_kv_heads, cfg.head_dim), cfg.jnp_dtype)
    idx = sds((B,), jnp.int32)
    c = cost(lambda c, pg, of, k, v: write_layer(c, 0, pg, of, k, v), (pool, idx, idx, kv, kv),
             target, donate=(0,))
    it = cfg.jnp_dtype.itemsize
    kvb = cfg.n_kv_heads * cfg.head_dim * it
    return c.bytes, 2 * B * kvb, 2 * P * PAGE * kvb


def padding_bytes(target: aot.Target, B: int, W: int) -> dict[str, float]:
    """SmolLM2's attention (head_dim 64) at batch B: the bytes XLA counts for the XLA
    attention path over the paged pool (what pallas_tpu falls back to), the floor (the rows'
    K/V read once), and the K/V a kernel over a cache padded to head_dim 128 reads (the
    kernel is a custom call XLA cannot count: by hand, twice the floor)."""
    cfg = aot.shape_config("smollm2-135m")
    c1 = dataclasses.replace(cfg, n_layers=1)
    P = B * W + 1
    dt = cfg.jnp_dtype
    pool = KVCache(*(sds(cache_shape(c1, P, PAGE), dt) for _ in range(2)))
    q = sds((B, 1, cfg.n_heads, cfg.head_dim), dt)
    meta = meta_for(B, W)
    out = {}
    for name in ("xla", "reference"):
        out[name] = cost(lambda c, q, m, f=attention_kernels.BACKENDS[name]:
                         f(q, c, 0, m, scale=cfg.attn_scale), (pool, q, meta), target).bytes
    hl = hand_layer(cfg, B, W)
    out["floor"] = hl.kv_read
    out["padded"] = 2 * hl.kv_read
    return out


def cpu_peaks() -> dict[str, float]:
    """This CPU's peaks, measured: a 2048^2 matmul's FLOP/s in f32 and bf16 (best of 5 after
    a warm call), and a 512 MiB numpy copy's bytes/s (read + write)."""
    out = {}
    n = 2048
    for dt in ("float32", "bfloat16"):
        a = jnp.ones((n, n), dt)
        out[dt] = 2 * n**3 / best_time(jax.jit(jnp.matmul), a, a)
    out["bytes"] = copy_bandwidth()
    return out


def cpu_crosscheck(batches, W: int, rounds: int) -> list[str]:
    """The roofline on this CPU: pieces compiled for it (SmolLM2's shape, f32 and bf16 as
    `make run` may serve it) against measured full-depth step times (`bench.common`'s step
    timer, a `ModelRunner` with no exit config: the program `early_exit=False` serves)."""
    from ee_jax.models.llama import cast_params

    target = aot.parse_target("cpu")
    peaks = cpu_peaks()
    log(f"CPU peaks: {peaks['float32'] / 1e9:.1f} GFLOP/s f32, {peaks['bfloat16'] / 1e9:.1f} "
        f"bf16, copy {peaks['bytes'] / 1e9:.2f} GB/s")
    cfg32, params32 = smollm2_shaped_random()
    lines = [f"CPU peaks (measured here): matmul 2048^2 {peaks['float32'] / 1e9:.1f} GFLOP/s "
             f"f32, {peaks['bfloat16'] / 1e9:.1f} GFLOP/s bf16; numpy copy "
             f"{peaks['bytes'] / 1e9:.2f} GB/s (read + write).\n",
             "| dtype | batch | layer MB XLA / hand | fixed MB XLA / hand | composed GFLOP | "
             "composed MB | analytic MB | predicted ms (bound) | measured ms (median, full "
             "depth) | measured / predicted | other load |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for dtype in ("float32", "bfloat16"):
        cfg = dataclasses.replace(cfg32, dtype=dtype)
        params = params32 if dtype == "float32" else cast_params(params32, dtype)
        kv = engine_of(cfg, target).kv_dtype  # a 16-bit cache is held in f32 on CPU
        cases, pred = {}, {}
        for B in batches:
            m = pieces(cfg, None, B, W, target, kv_dtype=kv, step=False)  # full depth only
            full = m.pieces.full_depth(cfg.n_layers, B)
            peak = peaks[dtype]
            t = seconds(full, peak, peaks["bytes"])
            bound = "memory" if full.bytes / peaks["bytes"] >= full.flops / peak else "compute"
            hl = hand_layer(cfg, B, W, jnp.dtype(kv).itemsize)
            pieces_txt = (f"{m.parts[LAYER][0].bytes / 1e6:.2f} / "
                          f"{(hl.total - hl.kv_write) / 1e6:.2f} | "
                          f"{m.parts[FIXED][0].bytes / 1e6:.1f} / "
                          f"{hand_fixed(cfg, B).total / 1e6:.1f}")
            pred[B] = (full, t, bound, analytic_step(cfg, B, W, jnp.dtype(kv).itemsize),
                       pieces_txt)
            cases[B] = step_case(cfg, params, B, W * PAGE - 1)
        for B in batches:  # one timer per batch: full depth only, so no ratio to pair
            load = other_load(1.0)
            times = time_steps({"full": cases[B]}, rounds)["full"]
            ms = 1e3 * median(times.wall)
            full, t, bound, an, pieces_txt = pred[B]
            lines.append(f"| {dtype} | {B} | {pieces_txt} | {full.flops / 1e9:.2f} | "
                         f"{full.bytes / 1e6:.1f} | {an / 1e6:.1f} | {t * 1e3:.2f} ({bound}) | "
                         f"{ms:.2f} | {ms / (t * 1e3):.2f}x | {load:.0%} |")
            log(lines[-1])
    return lines


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] and argv[0] in MODES:
        return MODES[argv[0]](argv[1:])
    ap = argparse.ArgumentParser(prog="python -m bench.roofline",
                                 description=__doc__.split("\n\n")[0],
                                 epilog=f"modes: {', '.join(MODES)} (MODE --help)")
    ap.add_argument("--models", nargs="+", default=list(aot.MODEL_SHAPES))
    ap.add_argument("--targets", nargs="+", default=["tpu:v5e", "tpu:v6e", "cuda:h100"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--context", type=int, default=512, help="tokens each row attends to")
    ap.add_argument("--cpu", choices=("yes", "no", "only"), default="yes",
                    help="the CPU cross-check (SmolLM2 f32/bf16, batch 1 and 8, timed)")
    ap.add_argument("--rounds", type=int, default=5, help="CPU cross-check timing rounds")
    ap.add_argument("--out", default="runs/roofline.md")
    args = ap.parse_args(argv)
    W = -(-args.context // PAGE)
    base_ec = aot.shipped_exit_config()
    lines = []
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines.append(f"Command: `python -m bench.roofline {' '.join(argv)}`, "
                 f"{stamp}, host CPU {cpu_model()} ({num_cpus()} cores; the compiles run "
                 f"here, the accelerator times are predictions), JAX {jax.__version__}, bf16, "
                 f"context {args.context} tokens a row (W={W} pages of {PAGE}).\n")
    t_start = time.perf_counter()
    checks_lines, tables, parts_lines = [], [], []
    for model in args.models if args.cpu != "only" else []:
        cfg = aot.shape_config(model)
        L = cfg.n_layers
        ec = aot.scaled_exit_config(base_ec, L, SHIPPED_LAYERS)
        for tname in args.targets:
            target = aot.parse_target(tname)
            if target.chip is None:
                raise SystemExit(f"--targets {tname}: no published peaks; this CPU's roofline "
                                 f"is the cross-check (--cpu only)")
            chips = [target.chip] + ([aot.CHIPS["h200"]] if tname.startswith("cuda") else [])
            rows = {}
            for B in args.batches:
                t0 = time.perf_counter()
                bucket = bucket_of(B, cfg, target)
                try:
                    m = pieces(cfg, ec, bucket, W, target, pin=max(args.batches), rows=B)
                except Exception as e:  # e.g. the model does not fit one chip's HBM
                    msg = " ".join(str(e).split())[:160]
                    log(f"{model} {target.name} B={B}: FAILED {msg}")
                    checks_lines.append(f"| {model} | {target.name} | "
                                        f"{batch_label(B, cfg, target)} | failed: {msg} "
                                        f"| | | | | | | |")
                    continue
                rows[B] = m
                comp = m.pieces.full_depth(L, bucket)
                # the step with the stand-in's own attention count instead of the kernel's
                alt = comp + L * (m.parts[STAND_IN][0] - m.parts[LAYER][0])
                copies = m.copies["fixed"] + L * m.copies["layer"]
                an = analytic_step(cfg, B, W, kv_hd=kv_head_dim(cfg, target))
                verdict = "within 10 %" if abs(comp.bytes / an - 1) <= 0.10 else "NOT within 10 %"
                sc = m.copies["step"]
                step_copies = f" (copies {sc / 1e6:.1f})" if sc >= 5e4 else ""
                checks_lines.append(
                    f"| {model} | {target.name} | {batch_label(B, cfg, target)} | "
                    f"{comp.bytes / 1e6:.1f} | "
                    f"{an / 1e6:.1f} | {comp.bytes / an - 1:+.1%} {verdict} | "
                    f"{copies / 1e6:.1f} | {(comp.bytes - copies) / an - 1:+.1%} | "
                    f"{_mb(m.step)}{step_copies} | "
                    f"{(m.parts[FIXED][0] + m.parts[POOL][0]).bytes / 1e6:.1f} | "
                    f"{alt.bytes / 1e6:.1f} ({alt.bytes / an - 1:+.1%}) |")
                for name, (c, hand) in m.parts.items():
                    cp = m.copies.get(name.split(" (")[0], 0.0)
                    parts_lines.append(f"| {model} | {target.name} | "
                                       f"{batch_label(B, cfg, target)} | {name} | "
                                       f"{c.bytes / 1e6:.2f} | {cp / 1e6:.2f} | "
                                       f"{hand / 1e6:.2f} | {c.bytes / hand:.2f}x |")
                for name, c in (("first check", m.pieces.first_check),
                                ("later check", m.pieces.later_check),
                                ("exit head", m.pieces.exit_head)):
                    parts_lines.append(f"| {model} | {target.name} | "
                                       f"{batch_label(B, cfg, target)} | {name} | "
                                       f"{c.bytes / 1e6:.2f} | "
                                       f"{m.copies.get(name, 0.0) / 1e6:.2f} | | |")
                log(f"{model} {target.name} B={B}: pieces in {time.perf_counter() - t0:.0f}s; "
                    f"composed full step {comp.bytes / 1e6:.1f} MB vs analytic {an / 1e6:.1f} "
                    f"MB ({comp.bytes / an - 1:+.1%}: {verdict}); compiled step (loop body "
                    f"once) {_mb(m.step)} MB")
            for chip in chips:
                if rows:
                    tables.append(_table(model, target, chip, cfg, ec, rows, W))
    if tables:
        lines.append("### Predicted decode step (roofline) and early-exit speed-up\n")
        lines += [TABLE_HEAD, *tables]
        lines.append("\nChips: " + "; ".join(f"{c.name}: {c.source}" for c in aot.CHIPS.values())
                     + "\n")
        lines.append("### Bytes: composed step against the analytic count\n")
        lines.append("Composed full-depth step (fixed + final head + L x layer) against the "
                     "analytic bytes (every weight once + the rows' K/V read + this token's K/V "
                     "written); and the compiled full-depth step (one `fori_loop`: XLA counts "
                     "its body once) beside fixed + final head + 1 layer over the pool (the "
                     "step's own layer: XLA's counts of its page gather and K/V scatter "
                     "included).\n")
        lines.append("| model | target | batch | composed MB | analytic MB | composed vs "
                     "analytic | of which relayout copies MB | composed less copies vs "
                     "analytic | compiled step MB | fixed + 1 pool layer MB | composed with "
                     "the XLA stand-in's attention MB (vs analytic) |")
        lines.append("|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|")
        lines += checks_lines
        lines.append("\n### Pieces: XLA's bytes against the hand count\n")
        lines.append("| model | target | batch | piece | XLA MB | of which copies MB | "
                     "hand MB | ratio |")
        lines.append("|---|---|---:|---|---:|---:|---:|---:|")
        lines += parts_lines
        ex = [(t, write_count_example(aot.parse_target(t))) for t in args.targets
              if aot.parse_target(t).compiles]
        for t, (xla, written, pool) in ex:
            lines.append(f"\nK/V write of 8 tokens into a donated pool (SmolLM2 layer, 257 "
                         f"pages), {t}: counted {xla / 1e6:.2f} MB (`aot.cost_of`: XLA's own "
                         f"count on TPU, less `aot.indexed_excess` on CPU and CUDA); written "
                         f"{written / 1e3:.1f} kB; the pool is {pool / 1e6:.2f} MB.")
        if any(aot.parse_target(t).platform == "tpu" for t in args.targets):
            t = aot.parse_target(next(t for t in args.targets if t.startswith("tpu")))
            for B in (1, 8):
                pb = padding_bytes(t, B, W)
                lines.append(f"\nhead_dim padding, SmolLM2 attention, {t.name}, batch {B}: "
                             f"XLA path over the pool {pb['xla'] / 1e6:.2f} MB (reference "
                             f"{pb['reference'] / 1e6:.2f} MB, XLA's counts); floor (the rows' "
                             f"K/V once) {pb['floor'] / 1e6:.2f} MB; a kernel over a cache "
                             f"padded to 128 reads {pb['padded'] / 1e6:.2f} MB.")
    if args.cpu != "no":
        lines.append("\n### CPU cross-check\n")
        lines += cpu_crosscheck([1, 8], W, args.rounds)
    lines.append(f"\n(all compiles and timings: {time.perf_counter() - t_start:.0f} s)")
    text = "\n".join(lines) + "\n"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)
    return 0


TABLE_HEAD = ("| model | chip (program) | batch | full depth ms | bound | full depth ms (analytic "
              "bytes) | forced L/2 propagate | forced 3L/4 propagate | "
              "shipped hist. propagate (instr / code / chat) | shipped hist. learned | "
              "shipped hist. deferred | shipped hist. deferred_learned | verified, measured "
              "steps (lossless) |\n"
              "|---|---|---:|---:|---|---:|---:|---:|---|---|---|---|---|")


def bucket_of(B: int, cfg, target: aot.Target) -> int:
    """The batch bucket the engine pads B rows to on the target (GPU: two rows for one)."""
    return engine_of(cfg, target).scheduler.batch_bucket(B)


def batch_label(B: int, cfg, target: aot.Target) -> str:
    bucket = bucket_of(B, cfg, target)
    return str(B) if bucket == B else f"{B} ({bucket} rows)"


def _table(model, target, chip, cfg, ec, rows, W: int) -> str:
    """Rows of the prediction table for one model on one chip."""
    L = cfg.n_layers
    half, tq = L // 2, (3 * L) // 4
    how = "compiled" if target.compiles else "lowered"
    out = []
    for B, m in rows.items():
        p = m.pieces
        bucket = bucket_of(B, cfg, target)
        full = p.full_depth(L, bucket)
        t_full = seconds(full, chip.peak_flops, chip.hbm_bytes_per_s)
        bound = "memory" if full.bytes / chip.hbm_bytes_per_s >= \
            full.flops / chip.peak_flops else "compute"

        def speed(c: Cost) -> str:
            return f"{t_full / seconds(c, chip.peak_flops, chip.hbm_bytes_per_s):.2f}x"

        def forced(e, bf):  # every row leaves at e (deferred: its pending token too)
            work = step_work(dataclasses.replace(ec, backfill=bf), L, [e] * B, [e] * B,
                             bucket, target.platform)
            return speed(p.price(work))

        def hist(bf):
            if B != 1:
                return "n/a"
            parts = [speed(p.expected(scaled_histogram(h, L), dataclasses.replace(ec, backfill=bf),
                                      L, bucket, target.platform))
                     for h in SHIPPED.values()]
            return " / ".join(parts)

        def verified():  # the measured steps priced on this chip: emitted tokens at full
            # depth's step time over the steps' (drafts riding: their flops, no weight bytes)
            if B != 1:
                return "n/a"
            ecv = dataclasses.replace(ec, policy="all").verified(4)
            parts = []
            for steps, emitted in SHIPPED_VERIFIED.values():
                t = sum(n * seconds(p.price(step_work(ecv, L, [e], None, bucket,
                                                      target.platform)),
                                    chip.peak_flops, chip.hbm_bytes_per_s)
                        for e, n in scaled_histogram(steps, L).items())
                parts.append(f"{emitted * t_full / t:.2f}x")
            return " / ".join(parts)

        t_an = max(analytic_step(cfg, B, W, kv_hd=kv_head_dim(cfg, target)) / chip.hbm_bytes_per_s,
                   full.flops / chip.peak_flops)
        out.append(f"| {model} | {chip.name} ({how}) | {batch_label(B, cfg, target)} | "
                   f"{t_full * 1e3:.3f} | {bound} | "
                   f"{t_an * 1e3:.3f} | "
                   f"{forced(half, 'propagate')} | "
                   f"{forced(tq, 'propagate')} | "
                   f"{hist('propagate')} | {hist('learned')} | {hist('deferred')} | "
                   f"{hist('deferred_learned')} | {verified()} |")
    return "\n".join(out)


# --------------------------------------------------------------------------- modes


def cuda_h100() -> aot.Target:
    """The H100 target, compiled for by XLA's GPU compiler without a GPU (the cuda-aot venv)."""
    if not aot.cuda_compiles():
        raise SystemExit("needs XLA's GPU compiler: the cuda-aot venv (requirements-cuda-aot.txt, "
                         "`make roofline`), run with JAX_PLATFORMS=cpu")
    return aot.parse_target("cuda:h100")


def compile_with(fn, args, target: aot.Target, options: dict, donate: tuple[int, ...] = ()):
    """fn(*args) compiled for `target` under exactly these XLA options (`compile_for` adds
    the count options; the modes choose their own)."""
    return jax.jit(fn, donate_argnums=donate).lower(*_place(args, target)).compile(
        compiler_options=options)


DOT_SHAPES = ["576x576", "576x192", "576x1536", "1536x576",  # SmolLM2
              "2048x2048", "2048x512", "2048x8192", "8192x2048"]  # Llama-3.2-1B
DOT_VARIANTS = {  # name: (fn, compiler options, compiled at one row only)
    "x @ w": (lambda x, w: x @ w, {}, False),
    "one-pass GEMM (split_k 1)": (lambda x, w: x @ w, CUDA_COUNT_OPTIONS, False),
    "f32 accumulation": (lambda x, w: jnp.matmul(x, w, preferred_element_type=jnp.float32)
                         .astype(jnp.bfloat16), {}, True),
}


def dots_main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.roofline dots",
                                 description="decode-sized projections compiled for an H100: "
                                 "XLA's bytes against the operands' (module docstring)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 8, 32])
    ap.add_argument("--shapes", nargs="+", default=DOT_SHAPES, metavar="DxF")
    args = ap.parse_args(argv)
    target = cuda_h100()
    print("XLA's bytes / (x + w + out bytes), and the fusions of the compiled module\n")
    print("| rows | D x F | " + " | ".join(DOT_VARIANTS) + " |\n|---:|---|"
          + "---|" * len(DOT_VARIANTS))
    for rows in args.rows:
        for shape in args.shapes:
            d, f = (int(n) for n in shape.split("x"))
            x, w = sds((rows, d), jnp.bfloat16), sds((d, f), jnp.bfloat16)
            operands = 2 * (d * f + rows * d + rows * f)
            cells = []
            for fn, opts, one_row in DOT_VARIANTS.values():
                if one_row and rows != 1:
                    cells.append("")
                    continue
                c = compile_with(fn, (x, w), target, opts)
                fusions = [i.name for i in hlo.entry(c.as_text()) if i.op == "fusion"]
                cells.append(f"{aot.cost_of(c)[1] / operands:.2f}x ({', '.join(fusions)})")
            print(f"| {rows} | {d} x {f} | " + " | ".join(cells) + " |", flush=True)
    return 0


def slice_fusions(text: str) -> tuple[int, int]:
    """(dynamic-slice copy fusions, static slice fusions) called in a compiled module."""
    calls = [m.group(1) for body in hlo.computations(text).values()
             for i in hlo.instructions(body) if i.op == "fusion"
             for m in [re.search(r"calls=%([\w.\-]+)", i.rest)] if m]
    return (sum("dynamic_slice" in c for c in calls),
            sum("slice" in c and "dynamic" not in c for c in calls))


def stacked_python_loop(cfg):
    """The full-depth step over stacked weights, a Python loop (a static layer index)."""
    def step(params, cache, tokens, meta, _th):
        x = llama.embed(params, tokens, cfg)
        for i in range(cfg.n_layers):
            x, cache = paged_layer(params, i, x, cache, meta, cfg, "reference")
        return jnp.argmax(llama.final_head(params, x[:, 0], cfg), -1), cache
    return step


def unstacked_python_loop(cfg):
    """The full-depth step with each layer's weights an argument of its own, a Python loop."""
    def step(rest, layers, cache, tokens, meta):
        x = llama.embed(rest, tokens, cfg)
        for i, lp in enumerate(layers):
            def layer_attend(q, k, v, i=i, c=cache):
                return attend(q, k, v, c, i, meta, cfg, "reference")

            x, cache = llama.decoder_layer(lp, x, meta.token_positions, cfg, layer_attend)
        return jnp.argmax(llama.final_head(rest, x[:, 0], cfg), -1), cache
    return step


SLICE_OPTIONS = {  # the engine's program (stacked, fori_loop) under these XLA GPU options
    "stacked, fori_loop, GEMMs by cuBLAS": {"xla_gpu_enable_triton_gemm": False},
    "stacked, fori_loop, dynamic-slice fusion": {"xla_gpu_enable_dynamic_slice_fusion": True},
    "stacked, fori_loop, cuBLAS + dynamic-slice fusion": {
        "xla_gpu_enable_triton_gemm": False, "xla_gpu_enable_dynamic_slice_fusion": True},
    "stacked, fori_loop, XLA's full unrolling": {
        "xla_gpu_enable_while_loop_unrolling": "WHILE_LOOP_UNROLLING_FULL_UNROLL"},
}


def weight_slices_main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.roofline weight-slices",
                                 description="the full-depth step compiled for an H100 over "
                                 "stacked and unstacked layer weights (module docstring)")
    ap.add_argument("--model", default="smollm2-135m", choices=list(aot.MODEL_SHAPES))
    ap.add_argument("--batches", type=int, nargs="+", default=[8])
    ap.add_argument("--context", type=int, default=512)
    args = ap.parse_args(argv)
    target = cuda_h100()
    cfg = aot.shape_config(args.model)
    W, L = -(-args.context // PAGE), cfg.n_layers
    print(f"| {args.model} batch | program | XLA MB | dynamic-slice copies | static slice "
          f"fusions | pieces MB |\n|---:|---|---:|---:|---:|---:|")
    for B in args.batches:
        m = pieces(cfg, None, B, W, target, step=True)
        fixed = m.pieces.fixed.bytes + m.pieces.final_head.bytes  # embedding + final head
        pool_layer = m.parts[POOL][0].bytes
        args_ = step_args(cfg, B, W, None, "cuda")
        params, cache, tokens, meta, _ = args_
        rest = params.replace(layers=llama.LayerParams())  # the weights besides the layers
        layers = [jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype),
                               params.layers) for _ in range(L)]
        runs = [("stacked, fori_loop (body once)", full_step_fn(cfg), args_, 1, {},
                 fixed + pool_layer),
                ("stacked, Python loop", stacked_python_loop(cfg), args_, 1, {},
                 fixed + L * pool_layer),
                ("unstacked, Python loop", unstacked_python_loop(cfg),
                 (rest, layers, cache, tokens, meta), 2, {}, fixed + L * pool_layer)]
        runs += [(name, full_step_fn(cfg), args_, 1, opts, None)
                 for name, opts in SLICE_OPTIONS.items()]
        for name, fn, a, donate, opts, want in runs:
            try:
                c = compile_with(fn, a, target, {**CUDA_COUNT_OPTIONS, **opts}, (donate,))
            except Exception as e:  # e.g. an option XLA cannot compile without a GPU
                print(f"| {B} | {name} | fails: {' '.join(str(e).split())[:90]} | | | |")
                continue
            ds, st = slice_fusions(c.as_text())
            print(f"| {B} | {name} | {aot.cost_of(c)[1] / 1e6:.1f} | {ds} | {st} | "
                  f"{'' if want is None else f'{want / 1e6:.1f}'} |", flush=True)
    return 0


COMPILE_EVENTS = {"backend": "/jax/core/compile/backend_compile_duration",
                  "lowering": "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "tracing": "/jax/core/compile/jaxpr_trace_duration"}


def compile_time_main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.roofline compile-time",
                                 description="how long XLA takes to compile a tiny engine's "
                                 "step programs under this process's settings (module "
                                 "docstring)")
    ap.add_argument("--new-tokens", type=int, default=12)
    args = ap.parse_args(argv)
    seconds_by: collections.Counter = collections.Counter()
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **_: seconds_by.update({event: duration}))

    from ee_jax.models.loading import LoadedModel
    from ee_jax.serving.llm import LLM
    from ee_jax.serving.params import greedy
    from ee_jax.testing import tiny_model

    cfg, params = tiny_model(seed=3, eos_token_ids=())
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (5, 17, 1, 33, 9, 24)]
    cpu0, t0 = time.process_time(), time.perf_counter()
    llm = LLM(LoadedModel(cfg, params, None, "tiny"), early_exit=False, max_num_seqs=8,
              max_model_len=128, page_size=4, num_pages=200, max_prefill_chunk=16,
              max_num_batched_tokens=48, batch_buckets=(1, 2, 4, 8), progress=False)
    outs = llm.generate(prompts, greedy(args.new_tokens), use_tqdm=False)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    compiled = " ".join(f"{k} {seconds_by[v]:.2f} s" for k, v in COMPILE_EVENTS.items())
    env = {k: os.environ.get(k, "") for k in ("XLA_FLAGS", "JAX_DISABLE_MOST_OPTIMIZATIONS")}
    print(f"CPU: {cpu_model()}; {env}")
    print(f"compile: {compiled}; run {wall:.2f} s wall, {cpu:.2f} s process CPU; "
          f"token checksum {sum(sum(o.token_ids) for o in outs)}")
    return 0


def block_storage_main(argv=None) -> int:
    from ee_jax.serving.aot import traffic

    ap = argparse.ArgumentParser(prog="python -m bench.roofline block-storage",
                                 description="a Q4 projection's storage compiled for TPU v5e "
                                 "(module docstring)")
    ap.add_argument("--rows", type=int, nargs="+", default=[2, 8])
    ap.add_argument("--shape", default="1536x576", metavar="OUTxIN")
    args = ap.parse_args(argv)
    O, I = (int(n) for n in args.shape.split("x"))
    target = aot.parse_target("tpu:v5e")
    s = jax.sharding.SingleDeviceSharding(aot.target_devices(target)[0])
    want = O * I / 2 + O * I / 32 * 2
    storages = {"packed uint8 (BlockQ)": (jnp.uint8, True), "jnp.int4": (jnp.int4, False),
                "jnp.uint4": (jnp.uint4, False), "int8, one a byte": (jnp.int8, False)}
    print(f"| rows | storage | kB moved | / file's {want / 1e3:.0f} kB |\n|---:|---|---:|---:|")
    for B in args.rows:
        for name, (dt, packed) in storages.items():
            q = jax.ShapeDtypeStruct((O, I // 2) if packed else (O, I), dt, sharding=s)
            sc = jax.ShapeDtypeStruct((O, I // 32), jnp.float16, sharding=s)
            x = jax.ShapeDtypeStruct((B, I), jnp.bfloat16, sharding=s)

            def f(q, sc, x, packed=packed):
                v = jnp.stack([q & 15, q >> 4], -1).reshape(O, I) if packed else q
                w = (v.astype(jnp.float32).reshape(O, I // 32, 32)
                     * sc.astype(jnp.float32)[..., None]).reshape(O, I)
                return x @ w.astype(jnp.bfloat16).T

            moved = traffic.count(jax.jit(f).lower(q, sc, x).compile().as_text()).bytes
            print(f"| {B} | {name} | {moved / 1e3:.0f} | {moved / want:.2f}x |", flush=True)
    return 0


MODES = {"dots": dots_main, "weight-slices": weight_slices_main,
         "block-storage": block_storage_main, "compile-time": compile_time_main}


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    sys.exit(main())
