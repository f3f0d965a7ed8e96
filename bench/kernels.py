"""Kernels, each apart from the engine: attention backends, weight-only int8, the
collectives of the tensor-parallel step program, and the KV pool's layout in the compiled
step programs.

    python -m bench.kernels attention [--backends reference xla] [--batches 1 8 32]
    python -m bench.kernels int8 [--random] [--batches 1 8] [--prompts 8] [--new-tokens 32]
    python -m bench.kernels blocks [--model smollm2-135m-instruct] [--batches 1 8 32]
    python -m bench.kernels llama-cpp [--threads 2] [--context 255]   # needs llama-cpp-python
    python -m bench.kernels q4-unpack [--rows 1 2 8] [--rounds 3]
    python -m bench.kernels collectives [--batch 8] [--tp 1 2 4 8]
    python -m bench.kernels kv-layout [--model random:smollm2-135m] [--target tpu:v5e]
    JAX_PLATFORMS=cpu .venv-cuda-aot/bin/python -m bench.kernels kv-layout --target cuda:h100

attention: SmolLM2-135M's attention shapes (9 query / 3 kv heads of 64, page size 16),
random f32 data; rows hold about 250 tokens (220-280) in a bucket of 32 pages (512 keys),
distinct random pages, the rest of each row's table the null page. One jitted call runs the
backend `--layers` times in a `fori_loop` with a traced layer index (the cache holds 2
layers; layer = i % 2), each call's output feeding the next query so nothing is hoisted:
that is the attention share of one decode step. Backends are timed interleaved after a warm-
up (compile apart): median and best of `--repeats` rounds, each round the mean of `--steps`
calls (on a shared machine the best round is the steadier figure). `layout_copy` times a
lower bound of the Pallas wrappers' per-layer copy of our [L, P, S, K, hd] cache into the
kernels' [K, P, S, hd] layout (here the B * pages table entries: the pool is one page
larger), which grows with the page bucket, not with what the rows hold.

int8: Variants of one model (SmolLM2-135M-Instruct, or `--random` same-shape random weights):
f32; bf16; int8 layer weights with f32 activations ("int8"); int8 layer weights with bf16
activations and the rest in bf16 ("int8+bf16"). The int8 weights are quantized from f32
(per output channel); embedding, tied head and norms stay in the variant's dtype.

  1. weights: bytes of the parameters, and of the layer weights a full-depth decode step
     reads (the head is read once more per token: its bytes are listed apart);
  2. decode speed: full-depth decode step time at batch 1 and 8 with a context of
     `--context` tokens (`bench.common.time_steps`; the variants of one activation dtype
     timed together -- f32 with int8, bf16 with int8+bf16: on CPU a step that follows a
     bf16 step measured up to 1.7x slower; the least over `--rounds` rounds of the mean of
     `--repeats` steps, as load from other processes only ever adds time; compile time
     apart) -> tokens/s = batch / step;
  3. quality, each variant's engine at full depth on the same chat prompts:
     teacher-forced agreement (the f32 greedy continuation is forced; the share of positions
     where the variant's greedy choice equals f32's), greedy sequences identical to f32's,
     and the full f32 model's NLL (nats/token) of the variant's own greedy output
     (ee_jax.evaluation.nll): lower is text the f32 model finds likelier.

With `--random` the quality columns compare random models (near-uniform outputs): only
the weights and speed columns mean anything there.

blocks: a GGUF model's weights (SmolLM2: Q4_1 layers, a Q8_0 tied head) held as the file's
blocks against dequantized to f32, and each block storage choice: the head as a Q8_0 table
or in f32; Q4 layer weights one value a byte (what CPU holds: `quant.for_platform`) or two a
byte (the file's bytes, what TPU and GPU hold). Weight bytes a full-depth decode step reads
and its time (`speed` above); the same weights bit for bit, so the same tokens.

q4-unpack: how XLA's CPU backend runs a product with Q4_1 blocks for each way of holding the
4-bit values: one a byte (what CPU holds), or packed two a byte in the file's order (a
block's inputs 0-15 low nibbles, 16-31 high: unpacked by a concatenate, as TPU and GPU read
them; or by one shift of the byte broadcast over the two halves), or packed planar (byte j
of a row holds input j and input j + in/2: each half a plain elementwise function of the
bytes). One jitted call runs SmolLM2's up projection ([rows, 576] x [576, 1536], random
blocks) for 30 layers of a stacked weight in a `fori_loop`; the least of `--rounds` rounds
of the mean of `--repeats` calls, each form's MiB of weights beside its time.

llama-cpp: ee-jax against llama.cpp (llama-cpp-python, built from source for this CPU) on
the same GGUF file at batch 1: ms a decoded token and the weight bytes each reads a token.

collectives: simulated CPU devices give no speed figure; what they do give is the program
XLA would run.
For tp = 1, 2, 4, 8 this compiles one full-depth decode step of a SmolLM2-shaped model
(random weights; heads 9 -> a 16-head variant so tp=8 divides) and counts, from the
optimized HLO, the collectives per layer and the bytes they move, against the minimum a
Megatron-style layer needs: two all-reduces of [B, D] (after the attention output
projection and after the MLP down projection).

kv-layout: the KV pool's layout on TPU (or CUDA, in the cuda-aot venv), compiled ahead of time
on this CPU: the engine's decode steps (`aot.Plan`, the target's attention kernel) reading a
head-major pool ([K, L, P, S, hd], the engine's layout where a kernel reads it: `kv_cache`
docstring) against a layer-major one ([L, P, S, K, hd], copied into the kernel's layout every
layer: `attention_kernels.layer_pages`). Per program, at the fewest and the most pages a row:
XLA's bytes accessed (a `while_loop` body counted once: one layer, the head and what the step
does once), temporaries and arguments from the memory analysis, and the copies, transposes,
gathers and dynamic slices of at least a quarter of the pool in the compiled HLO.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import (
    cpu_model,
    load_f32,
    load_prompts,
    log,
    num_cpus,
    other_load,
    smollm2_shaped_config,
    smollm2_shaped_random,
    step_case,
    time_steps,
)
from ee_jax.serving.attention import AttentionMetadata
from ee_jax.serving.attention_kernels import layer_pages
from ee_jax.serving.kv_cache import NULL_PAGE, KVCache

# --------------------------------------------------------------------------- attention

H, K, HD, S = 9, 3, 64, 16


def make_inputs(batch: int, tokens: int, pages: int, lo: int, hi: int, dtype, seed: int = 0):
    """q [B, T, H, hd], a 2-layer cache with distinct random pages per row, the metadata."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(lo, hi + 1, size=batch).astype(np.int32)
    lens = np.minimum(lens, pages * S)
    num_pages = 1 + batch * pages
    pool = rng.permutation(np.arange(1, num_pages))
    table = np.full((batch, pages), NULL_PAGE, np.int32)
    for b, n in enumerate(lens):
        need = -(-int(n) // S)
        table[b, :need], pool = pool[:need], pool[need:]
    shape = (2, num_pages, S, K, HD)
    cache = KVCache(jnp.asarray(rng.standard_normal(shape), dtype),
                    jnp.asarray(rng.standard_normal(shape), dtype))
    positions = np.maximum(lens[:, None] - tokens + np.arange(tokens), 0).astype(np.int32)
    meta = AttentionMetadata(jnp.asarray(positions), jnp.asarray(table), jnp.asarray(lens))
    q = jnp.asarray(rng.standard_normal((batch, tokens, H, HD)), dtype)
    return q, cache, meta


def layout_copy(q, cache, layer, meta, **_):
    """Not a backend: what the Pallas wrappers' per-layer slice + transpose of our cache into
    the kernels' [K, P, S, hd] layout costs at least. The wrappers materialise it (a kernel
    operand); here it is summed, which XLA fuses into one read of those pages, so this is a
    lower bound (a copy reads and writes them)."""
    k, v, _ = layer_pages(cache, layer, meta.page_table)
    return q + 1e-9 * (jnp.sum(k) + jnp.sum(v))


def attention_choices() -> dict:
    """The backends by name, and two comparisons that are not backends."""
    from ee_jax.serving.attention_kernels import BACKENDS

    return {**BACKENDS, "layout_copy": layout_copy,
            # xla as one loop over every row up to the longest (before rows were sorted
            # into row blocks, see `attention_kernels._ROW_BLOCKS`): the blocks' gain
            "xla_unblocked": functools.partial(BACKENDS["xla"], row_block=1 << 30)}


def step_fn(backend, layers: int):
    """jit(q, cache, meta) -> q after `layers` chained attention calls, layer index traced."""

    def run(q, cache, meta):
        def body(i, x):
            # The layer index depends on the data, so XLA cannot unroll the loop and share
            # work between the calls on the same layer.
            layer = (i + (x[0, 0, 0, 0] > 1e30).astype(jnp.int32)) % 2
            out = backend(x, cache, layer, meta, scale=HD ** -0.5)
            return x + 1e-3 * out

        return jax.lax.fori_loop(0, layers, body, q)

    return jax.jit(run)


def attention_args(p) -> None:
    p.add_argument("--backends", nargs="+", default=["reference", "xla"],
                   choices=list(attention_choices()))
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--tokens", type=int, default=1, help="queries per row (1: decode)")
    p.add_argument("--pages", type=int, default=32, help="page-table bucket W")
    p.add_argument("--lens", nargs=2, type=int, default=[220, 280], help="row lengths lo hi")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dtype", default="float32")


def attention(args) -> None:
    print(f"jax {jax.__version__} {jax.devices()[0].platform}; H={H} K={K} hd={HD} S={S} "
          f"W={args.pages} lens {args.lens[0]}-{args.lens[1]} T={args.tokens} "
          f"{args.layers} layers {args.dtype}", flush=True)
    for batch in args.batches:
        q, cache, meta = make_inputs(batch, args.tokens, args.pages, *args.lens,
                                     jnp.dtype(args.dtype))
        fns = {}
        for name in args.backends:
            fns[name] = step_fn(attention_choices()[name], args.layers)
            t0 = time.perf_counter()
            jax.block_until_ready(fns[name](q, cache, meta))
            print(f"  B={batch} {name}: compile+first {time.perf_counter() - t0:.2f} s",
                  flush=True)
        times: dict[str, list[float]] = {n: [] for n in fns}
        for _ in range(args.repeats):
            for name, fn in fns.items():  # interleaved
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    out = fn(q, cache, meta)
                jax.block_until_ready(out)
                times[name].append((time.perf_counter() - t0) / args.steps)
        med = {n: statistics.median(ts) for n, ts in times.items()}
        best = {n: min(ts) for n, ts in times.items()}
        parts = []
        for name in fns:
            ratio = ""
            if "reference" in fns and name != "reference":
                ratio = (f" ({med['reference'] / med[name]:.2f}x ref median, "
                         f"{best['reference'] / best[name]:.2f}x best)")
            parts.append(f"{name} {med[name] * 1e3:.2f} ms (best {best[name] * 1e3:.2f}){ratio}")
        print(f"B={batch}: per step of {args.layers} layers: " + "; ".join(parts), flush=True)


# --------------------------------------------------------------------------- int8


def variants(cfg, params) -> dict:
    """name -> (config, params) of the four variants, all made from the f32 params."""
    import jax.numpy as jnp

    from ee_jax.models.llama import cast_params
    from ee_jax.models.quant import quantize_params

    bf16 = cfg.replace(dtype="bfloat16")
    q = quantize_params(params, "int8")
    return {"f32": (cfg, params),
            "bf16": (bf16, cast_params(params, jnp.bfloat16)),
            "int8": (cfg, q),
            "int8+bf16": (bf16, cast_params(q, jnp.bfloat16))}


def weight_bytes(params) -> tuple[int, int, int]:
    """(all params, layer weights a decode step reads, the LM head / tied embedding)."""
    from ee_jax.models.quant import QUANTIZED_KEYS, param_bytes

    layers = sum(param_bytes(params.weight(k)) for k in QUANTIZED_KEYS)
    head = param_bytes(params.embed if params.lm_head is None else params.lm_head)
    return param_bytes(params), layers, head


def speed(models: dict, batches, context: int, repeats: int, rounds: int) -> dict:
    """(name, batch) -> full-depth decode step seconds (the least over rounds of the mean
    of `repeats` steps)."""
    out = {}
    for B in batches:
        for dtype in sorted({cfg.dtype for cfg, _ in models.values()}):
            group = {k: v for k, v in models.items() if v[0].dtype == dtype}
            log(f"speed: batch {B}, context {context}: compiling {list(group)}")
            cases = {name: step_case(cfg, params, B, context)
                     for name, (cfg, params) in group.items()}
            for name, t in time_steps(cases, rounds, repeats, seed=B).items():
                out[name, B] = min(t.wall)
            del cases
    return out


def quality(models: dict, prompts, new_tokens: int, f32_cfg, f32_params) -> dict:
    """name -> teacher-forced agreement, identical sequences, NLL of its greedy output."""
    from ee_jax.evaluation.nll import FullModelNLL
    from ee_jax.models.loading import LoadedModel
    from ee_jax.serving.llm import LLM
    from ee_jax.serving.params import SamplingParams

    longest = max(len(p) for p in prompts) + new_tokens + 1
    pages = -(-longest // 16)
    kw = dict(max_num_seqs=len(prompts), max_model_len=pages * 16, page_size=16,
              num_pages=len(prompts) * pages + 1, max_num_batched_tokens=8192,
              batch_buckets=(len(prompts),), early_exit=False, progress=False)
    free = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    scorer = FullModelNLL(f32_cfg, f32_params)
    ref, out = None, {}
    for name, (cfg, params) in models.items():
        log(f"quality: {name}: {len(prompts)} prompts, {new_tokens} tokens")
        llm = LLM(LoadedModel(cfg, params, None, name), **kw)
        tokens = [o.token_ids for o in llm.generate(prompts, free, use_tqdm=False)]
        if ref is None:
            ref = tokens  # f32 comes first
        forced = [SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True,
                                 forced_tokens=tuple(r)) for r in ref]
        pred = [o.predicted_token_ids for o in llm.generate(prompts, forced, use_tqdm=False)]
        agree = np.mean([p == r for ps, rs in zip(pred, ref, strict=True)
                         for p, r in zip(ps, rs, strict=True)])
        same = np.mean([t == r for t, r in zip(tokens, ref, strict=True)])
        nll = np.mean(np.concatenate([scorer(p, t) for p, t in zip(prompts, tokens,
                                                                   strict=True)]))
        out[name] = dict(agree=float(agree), same=float(same), nll=float(nll))
        log(f"  teacher-forced agreement {agree:.3f}, identical {same:.2f}, NLL {nll:.3f}")
        del llm
    return out


def int8_args(p) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--random", action="store_true", help="same-shape random weights")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--context", type=int, default=255)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--skip-bf16", action="store_true",
                   help="leave the bf16 variants out (slow on some CPUs)")


def int8(args) -> None:
    t0 = time.perf_counter()
    if args.random:
        cfg, params = smollm2_shaped_random()
        prompts = load_prompts("random", None, args.prompts, 16, 64, vocab=cfg.vocab_size)
        source = "random SmolLM2-shaped weights"
    else:
        model = load_f32(args.model, blocks=False)  # the f32 reference: dense arrays
        cfg, params = model.config, model.params
        prompts = load_prompts("chat", model.tokenizer, args.prompts)
        source = args.model
    models = variants(cfg, params)
    if args.skip_bf16:
        models = {k: v for k, v in models.items() if "bf16" not in k}
    load = other_load(1.0)  # other processes' busy CPUs while we start timing
    steps = speed(models, args.batches, args.context, args.repeats, args.rounds)
    qual = quality(models, prompts, args.new_tokens, cfg, params)

    cols = [f"step ms / tok/s (B={B})" for B in args.batches]
    print(f"\n{source}, {cpu_model()} ({num_cpus()} CPUs, other processes using "
          f"{100 * load:.0f}% of them as timing started); context {args.context}, "
          f"median of {args.repeats} steps, least of {args.rounds} rounds; "
          f"quality: {len(prompts)} prompts x {args.new_tokens} greedy tokens, full depth; "
          f"{time.perf_counter() - t0:.0f} s in all\n")
    print("| variant | params MiB | layer weights MiB | head MiB | " + " | ".join(cols)
          + " | teacher-forced agreement with f32 | sequences = f32 | f32 NLL of output |")
    print("|" + "---|" * (7 + len(cols)))
    for name, (_, prm) in models.items():
        total, layers, head = (b / 2**20 for b in weight_bytes(prm))
        sp = " | ".join(f"{1000 * steps[name, B]:.1f} / {B / steps[name, B]:.1f}"
                        for B in args.batches)
        q = qual[name]
        print(f"| {name} | {total:.0f} | {layers:.0f} | {head:.0f} | {sp} | {q['agree']:.3f} "
              f"| {q['same']:.2f} | {q['nll']:.3f} |")


# --------------------------------------------------------------------------- blocks


def block_variants(cfg, params) -> dict:
    """name -> (config, params) of a GGUF model's storage choices, all the same weights bit
    for bit."""
    from ee_jax.models import quant

    dense_head = params.replace(embed=quant.dequantize(params.embed))
    packed = jax.tree.map(lambda a: _repack(a) if isinstance(a, quant.BlockQ) else a, params,
                          is_leaf=lambda a: isinstance(a, quant.BlockQ))
    return {"f32 (dequantized)": (cfg, quant.dequantize_params(params)),
            "blocks, f32 head": (cfg, dense_head),
            "blocks (CPU: Q4 one value a byte)": (cfg, params),
            "blocks, Q4 packed (TPU/GPU storage)": (cfg, packed)}


def blocks_args(p) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct", help="a GGUF model")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--context", type=int, default=255)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--rounds", type=int, default=5)


def blocks(args) -> None:
    """A GGUF model's weights held as the file's blocks against dequantized, and each block
    storage choice (the tied head as a Q8_0 table or f32; Q4 layer weights one value a byte,
    as CPU holds them, or packed two a byte, as TPU and GPU do): the weight bytes a
    full-depth decode step reads and its time on this machine (greedy tokens are the same
    for all: tests/test_loaders.py, tests/test_smollm2.py)."""
    from ee_jax.models import quant
    from ee_jax.models.loading import load_model

    model = load_model(args.model, progress=True)
    if not quant.has_blocks(model.params):
        raise SystemExit(f"{args.model} holds no GGUF blocks: `blocks` compares their storage")
    models = block_variants(model.config, model.params)
    load = other_load(1.0)
    saved = quant.UNPACKED_PLATFORMS
    try:  # the runner holds each variant's storage as given (packed on this CPU too)
        quant.UNPACKED_PLATFORMS = ()
        steps = speed(models, args.batches, args.context, args.repeats, args.rounds)
    finally:
        quant.UNPACKED_PLATFORMS = saved
    cols = [f"step ms (B={B})" for B in args.batches]
    print(f"\n{args.model}, {cpu_model()} ({num_cpus()} CPUs, other processes using "
          f"{100 * load:.0f}% of them as timing started); full depth, context {args.context}; "
          f"least over {args.rounds} rounds of the mean of {args.repeats} steps\n")
    print("| storage | params MiB | layer weights MiB | head MiB | " + " | ".join(cols) + " |")
    print("|" + "---|" * (4 + len(cols)))
    for name, (_, prm) in models.items():
        total, layers, head = (b / 2**20 for b in weight_bytes(prm))
        sp = " | ".join(f"{1000 * steps[name, B]:.1f}" for B in args.batches)
        print(f"| {name} | {total:.0f} | {layers:.0f} | {head:.0f} | {sp} |")


def llama_cpp_args(p) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct", help="a GGUF model")
    p.add_argument("--threads", type=int, default=2, help="llama.cpp's threads")
    p.add_argument("--context", type=int, default=255, help="keys a decoded token attends to")
    p.add_argument("--tokens", type=int, default=32, help="tokens llama.cpp decodes a round")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--rounds", type=int, default=5)


def llama_cpp(args) -> None:
    """ee-jax against llama.cpp on the same GGUF file at batch 1: ms per decoded token and
    the weight bytes each reads per token. llama.cpp through llama-cpp-python, built from
    source for this CPU (`CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python`; not
    a dependency); its decode timed one token at a time after a `--context`-token prompt,
    least over rounds of the mean per token. ee-jax: the served full-depth decode step
    (`speed`, batch 1, the same context)."""
    try:
        from llama_cpp import Llama
    except ImportError as e:
        raise SystemExit("bench.kernels llama-cpp needs llama-cpp-python: "
                         'CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python') from e
    from ee_jax.models import quant, registry
    from ee_jax.models.loading import load_model

    kind, path = registry.resolve_model(args.model)
    if kind != "gguf":
        raise SystemExit(f"{args.model} is not a GGUF file: llama.cpp reads GGUF")
    model = load_model(args.model, progress=True)
    load = other_load(1.0)
    ours = speed({"ee-jax": (model.config, model.params)}, [1], args.context, args.repeats,
                 args.rounds)["ee-jax", 1]
    llm = Llama(model_path=str(path), n_threads=args.threads,
                n_ctx=args.context + args.tokens + 8, n_batch=args.context + 8, verbose=False)
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, 1000, args.context)]
    theirs = []
    for r in range(args.rounds):
        llm.reset()
        llm.eval(prompt)
        t0 = time.perf_counter()
        for i in range(args.tokens):
            llm.eval([prompt[i]])
        theirs.append((time.perf_counter() - t0) / args.tokens)
        log(f"llama.cpp round {r + 1}: {1000 * theirs[-1]:.2f} ms a token")
    theirs_s = min(theirs)
    _, layers, head = weight_bytes(model.params)
    file_bytes = sum(int(t.n_bytes) for t in _gguf_tensors(path))
    print(f"\n{args.model}, {cpu_model()} ({num_cpus()} CPUs, other processes using "
          f"{100 * load:.0f}% of them as timing started); batch 1, context {args.context}; "
          f"llama.cpp {args.threads} threads\n")
    print("| engine | ms a token | tokens/s | weight MiB read a token | vs llama.cpp |")
    print("|---|---|---|---|---|")
    print(f"| llama.cpp | {1000 * theirs_s:.2f} | {1 / theirs_s:.1f} | "
          f"{file_bytes / 2**20:.0f} (the file's tensors) | 1.00x |")
    held = "blocks" if quant.has_blocks(model.params) else "dense"
    print(f"| ee-jax (full depth) | {1000 * ours:.2f} | {1 / ours:.1f} | "
          f"{(layers + head) / 2**20:.0f} (layers + head, {held}) | {theirs_s / ours:.2f}x |")


# --------------------------------------------------------------------------- q4-unpack


def q4_unpack_args(p) -> None:
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 8])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)


def q4_forms(w) -> dict:
    """name -> (weight, product x @ w) of each way of holding `w`'s (packed Q4_1) values."""
    from ee_jax.models import quant

    *_, out, half = w.q_t.shape
    inp, nb = 2 * half, w.scale_t.shape[-1]

    def scaled(v, scale, offset):  # [out, n, 32] values -> f32 [out, n * 32]
        t = v.astype(jnp.float32) * scale.astype(jnp.float32)[..., None] + \
            offset.astype(jnp.float32)[..., None]
        return t.reshape(out, -1)

    def shifted(x, w):
        p = w.q_t.reshape(out, nb, 1, quant.BLOCK // 2)
        v = (p >> jnp.array([0, 4], jnp.uint8).reshape(2, 1)) & 0x0F
        return quant.out_major_matmul(x, scaled(v.reshape(out, nb, quant.BLOCK), w.scale_t,
                                                w.offset_t))

    def planar(x, w):  # q_t [out, in/2]: byte j holds input j (low) and j + in/2 (high)
        h = nb // 2
        lo = scaled((w.q_t & 0x0F).reshape(out, h, quant.BLOCK), w.scale_t[..., :h],
                    w.offset_t[..., :h])
        hi = scaled((w.q_t >> 4).reshape(out, h, quant.BLOCK), w.scale_t[..., h:],
                    w.offset_t[..., h:])
        return (quant.out_major_matmul(x[..., :inp // 2], lo)
                + quant.out_major_matmul(x[..., inp // 2:], hi))

    one = quant.unpack(w)
    v = one.q_t.astype(jnp.uint8)  # [L, out, in], values 0-15
    planar_q = (v[..., :inp // 2] | (v[..., inp // 2:] << 4)).astype(jnp.uint8)
    return {"one a byte (CPU)": (one, quant.linear),
            "packed, file order (concatenate)": (w, quant.linear),
            "packed, file order (broadcast shift)": (w, shifted),
            "packed planar": (dataclasses.replace(w, q_t=planar_q), planar)}


def q4_unpack(args) -> None:
    """Each way of holding Q4 values, timed in one process at each row count."""
    from ee_jax.models import quant

    L, D, F = args.layers, 576, 1536
    rng = np.random.default_rng(0)
    w = quant.BlockQ(jnp.asarray(rng.integers(0, 256, (L, F, D // 2), dtype=np.uint8)),
                     jnp.asarray(rng.random((L, F, D // 32)).astype(np.float16)),
                     jnp.asarray(rng.random((L, F, D // 32)).astype(np.float16)),
                     kind="Q4_1", packed=True)
    forms = q4_forms(w)
    load = other_load(1.0)
    times: dict[tuple[str, int], float] = {}
    for rows in args.rows:
        x = jnp.asarray(rng.standard_normal((rows, D)), jnp.float32)
        fns = {}
        for name, (held, product) in forms.items():
            def step(x, held, product=product):
                def layer(i, y):
                    return y + product(x, jax.tree.map(lambda a: a[i], held)).sum()
                return jax.lax.fori_loop(0, L, layer, jnp.float32(0))
            fns[name] = jax.jit(step)
            fns[name](x, held).block_until_ready()  # compile apart
        log(f"q4-unpack: {rows} rows compiled; timing")
        for name, (held, _) in forms.items():
            best = math.inf
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                for _ in range(args.repeats):
                    fns[name](x, held).block_until_ready()
                best = min(best, (time.perf_counter() - t0) / args.repeats)
            times[name, rows] = best
    print(f"\n{cpu_model()} ({num_cpus()} CPUs, other processes using {100 * load:.0f}% of "
          f"them as timing started); [rows, {D}] x [{D}, {F}] Q4_1, {L} layers a call\n")
    base = "one a byte (CPU)"
    print("| storage | weight MiB | " + " | ".join(f"ms ({r} rows)" for r in args.rows) + " |")
    print("|---|---|" + "---|" * len(args.rows))
    for name, (held, _) in forms.items():
        cells = " | ".join(f"{1000 * times[name, r]:.2f} ({times[name, r] / times[base, r]:.1f}x)"
                           for r in args.rows)
        print(f"| {name} | {held.nbytes / 2**20:.1f} | {cells} |")


def _gguf_tensors(path):
    from ee_jax.models.gguf_file import open_reader

    return open_reader(path).tensors


def _repack(w):
    """A Q4 block weight held one value a byte back in the file's two a byte (exact)."""
    import dataclasses

    import jax.numpy as jnp

    if w.packed or w.kind == "Q8_0":
        return w
    q = w.q_t.astype(jnp.int32) + (8 if w.kind == "Q4_0" else 0)
    *lead, out, inp = q.shape
    q = q.reshape(*lead, out, inp // 32, 2, 16)
    return dataclasses.replace(w, packed=True, q_t=(q[..., 0, :] | (q[..., 1, :] << 4)).astype(
        jnp.uint8).reshape(*lead, out, inp // 2))


# --------------------------------------------------------------------------- collectives


def collectives_args(p) -> None:
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--attention", default="auto", help="attention backend (EngineConfig)")
    p.add_argument("--layers", type=int, default=4, help="layers of the shaped model (the "
                   "per-layer count does not depend on it)")


def collectives(args) -> None:
    from ee_jax.models import llama
    from ee_jax.serving.engine import EngineConfig, LLMEngine
    from ee_jax.serving.model_runner import StepShape

    cfg = smollm2_shaped_config(n_layers=args.layers, n_heads=16, n_kv_heads=4)
    params = llama.init_params(cfg, jax.random.PRNGKey(0))
    B, D = args.batch, cfg.d_model
    rows = []
    for tp in args.tp:
        log(f"compiling tp={tp}")
        engine = LLMEngine(cfg, params, None, EngineConfig.make(
            max_num_seqs=B, max_model_len=256, page_size=16, num_pages=B * 16 + 1,
            batch_buckets=(B,), mesh=f"tp={tp}" if tp > 1 else None,
            attention=args.attention))
        runner = engine.runner
        shape = StepShape(B, 1, 16, kind="decode")
        hlo = runner.lower(shape).compile().as_text()
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
    print(f"\ncommand: python -m bench.kernels {' '.join(sys.argv[1:])}")


# --------------------------------------------------------------------------- kv-layout


def kv_layout_args(p) -> None:
    p.add_argument("--model", default="random:smollm2-135m")
    p.add_argument("--target", default="tpu:v5e")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])


def big_ops(hlo_text: str, min_elements: int) -> list[str]:
    """Copies, transposes, gathers and dynamic slices of at least `min_elements`, anywhere in
    a compiled module."""
    from ee_jax.serving import hlo

    ops = ("copy", "transpose", "gather", "dynamic-slice")
    return [f"{i.op} {i.dtype}[{','.join(map(str, i.dims))}]"
            for body in hlo.computations(hlo_text).values() for i in hlo.instructions(body)
            if i.op in ops and i.dims is not None and np.prod(i.dims) >= min_elements]


def kv_layout(args) -> None:
    from ee_jax.serving.aot import compile as aot
    from ee_jax.serving.plan import EngineConfig

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


# --------------------------------------------------------------------------- main


MODES = {"attention": (attention_args, attention), "int8": (int8_args, int8),
         "blocks": (blocks_args, blocks), "llama-cpp": (llama_cpp_args, llama_cpp),
         "q4-unpack": (q4_unpack_args, q4_unpack),
         "collectives": (collectives_args, collectives),
         "kv-layout": (kv_layout_args, kv_layout)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.kernels",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    sub = p.add_subparsers(dest="command", required=True)
    for name, (add_args, _) in MODES.items():
        add_args(sub.add_parser(name))
    args = p.parse_args(argv)
    if args.command == "collectives":  # simulated devices: set before JAX starts its backend
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" --xla_force_host_platform_device_count={max(args.tp)}")
    MODES[args.command][1](args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
