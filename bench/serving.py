"""Serving throughput: ee-jax at full depth against Hugging Face transformers `generate` on the
same f32 weights (the bar a serving engine must clear before its exits matter).

    python -m bench.serving --batches 1 8 32 --new-tokens 128 --out docs/benchmarks.md
    python -m bench.serving --quick                      # smoke test: batch 1 and 2, 8 tokens
    python -m bench.serving --random tiny --quick        # no model file: a tiny random Llama

Method (docs/architecture.md section 7): everything in one process; for each batch size,
ee-jax is warmed up on the very prompts it is then measured on (so every program is compiled;
compile time is reported apart), transformers gets a short warm-up too, then the two are
measured interleaved (ours, theirs, ours, theirs, ...) and the median of the repetitions is
reported.

* Baseline: the engine is built with `early_exit=False` (full depth: the fastest full-depth
  program it has; `LLM(model)` alone would serve the shipped exit heads). The exit-layer
  histogram of every run is checked to be all-L.
* Prompts: the first B HumanEval prompts (raw text, tokenized by ee-jax's tokenizer) whose
  length is within [--min-prompt, --max-prompt] tokens (`--prompts demo|chat`: the demo or
  chat prompts in the chat template). Both engines get the same token ids.
* Workload: greedy, exactly --new-tokens new tokens per sequence (ee-jax: `ignore_eos`;
  transformers: `min_new_tokens`, which masks EOS until then, so greedy agreement is compared
  only up to the first EOS ee-jax emits).
* End-to-end tokens/s = B * new_tokens / wall time of the whole call (prefill, decode, host
  work). Decode tokens/s = B * (new_tokens - 1) / the time from the moment every sequence has
  its first token to the last token, by the same clock on both sides (ee-jax: the return of
  the engine step that produced a token; transformers: a logits processor's call after each
  forward). Host work between steps is in it on both sides. ee-jax's own stats (time inside
  its decode steps) give the "step (measured)" column.
* Host time per decode step: one more ee-jax pass per batch with the runner's step
  synchronised (`bench.common.serve(split_host=True)`): host = the wall time of
  `engine.step()` outside the runner's step, device = inside it; median over the decode steps.
  Beside it the unsynchronised ms/step of the measured calls.
* Batch-1 bandwidth: bytes one decode step must read (every weight once, the tied head
  included, plus the K/V of the page-bucketed context) / measured step time, against the
  copy bandwidth numpy gets on this machine.
* Contention: CPU time burnt by other processes during each measured call (from /proc/stat),
  as a share of all cores; anything above a few percent means the figure is pessimistic.
* `--random tiny|smollm2`: a transformers Llama with random weights (that shape) saved and
  loaded by ee-jax's Hugging Face loader: the same weights on both sides, no model file.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.common import (
    HFRun,
    Served,
    best_time,
    check_lengths,
    copy_bandwidth,
    cpu_flags,
    cpu_model,
    exit_summary,
    fmt,
    hf_from_gguf,
    hf_random_pair,
    hf_runner,
    humaneval_prompts,
    load_f32,
    load_prompts,
    log,
    median,
    num_cpus,
    sequence_agreement,
    serve,
    stop_ids,
    wait_for_idle,
    write_marked,
)

MARK = ("<!-- bench.serving:begin -->", "<!-- bench.serving:end -->")
# Issue 13's performance bar: full-depth decode and end-to-end tokens/s over transformers'.
DECODE_BARS = {1: 2.0, 8: 1.5, 32: 1.5}
E2E_BAR = 1.3
HOST_BAR = (8, 0.10)  # host time per decode step under 10% of the step at batch 8


def run_eejax(llm, prompts: list[list[int]], new_tokens: int, **kw) -> Served:
    from ee_jax.serving.params import greedy

    served = serve(llm, prompts, greedy(new_tokens, ignore_eos=True), **kw)
    check_lengths(served, new_tokens)
    return served


# --------------------------------------------------------------------------- cheap profile


def profile_floors(cfg, params, batches: list[int], repeats: int = 5) -> dict:
    """Lower bounds for one full-depth decode step, measured with XLA on this machine:

    * `matmul_gflops`: throughput of a 1024^3 f32 matmul (the compute roofline);
    * `read_gbs`: a jitted reduction over every weight (the bandwidth XLA actually gets);
    * `dense[B]`: the decode step minus attention and the paged cache (norms, projections,
      RoPE, MLP, head, argmax) with the same `fori_loop` over stacked layers as the engine;
    * `head[B]`: final norm + tied LM head + argmax alone.
    """
    import jax
    import jax.numpy as jnp

    from ee_jax.models import llama

    def best(fn, *a):
        return best_time(fn, *a, repeats=repeats)

    out: dict = {"dense": {}, "head": {}}
    n = 1024
    a = jnp.ones((n, n), jnp.float32)
    mm = jax.jit(lambda x, y: x @ y)
    out["matmul_gflops"] = 2 * n**3 / best(mm, a, a) / 1e9

    leaves = jax.tree.leaves(params)
    nbytes = sum(x.nbytes for x in leaves)
    readall = jax.jit(lambda ps: sum(jnp.sum(x) for x in ps))
    out["read_gbs"] = nbytes / best(readall, leaves) / 1e9

    def attend(q, k, v):  # no attention: hand q through (same shape as the output)
        return q, None

    def dense_step(params, tokens, layers):
        B = tokens.shape[0]
        positions = jnp.zeros((B, 1), jnp.int32)
        x = llama.embed(params, tokens, cfg)
        if layers:
            def body(i, x):
                return llama.decoder_layer(llama.layer_params(params, i), x, positions, cfg,
                                           attend)[0]
            x = jax.lax.fori_loop(0, cfg.n_layers, body, x)
        logits = llama.final_head(params, x[:, 0], cfg)
        return jnp.argmax(logits, axis=-1)

    fn = jax.jit(dense_step, static_argnums=(2,))
    for B in batches:
        tokens = jnp.ones((B, 1), jnp.int32)
        out["dense"][B] = best(fn, params, tokens, True)
        out["head"][B] = best(fn, params, tokens, False)
    return out


def decode_step_bytes(cfg, params, sched_cfg, prompt_len: int, new_tokens: int) -> float:
    """Mean bytes a batch-1 decode step must read: every weight once (the tied head is the
    embedding, counted once) + K and V of every layer over the page-bucketed context."""
    import jax

    weights = sum(x.nbytes for x in jax.tree.leaves(params))
    itemsize = np.dtype(cfg.dtype).itemsize
    per_token = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * itemsize
    bucket = getattr(sched_cfg, "page_bucket", lambda n: -(-n // sched_cfg.page_size))
    kv = [bucket(prompt_len + j) * sched_cfg.page_size * per_token
          for j in range(1, new_tokens)]
    return weights + (float(np.mean(kv)) if kv else 0.0)


def matmul_flops_per_token(cfg) -> float:
    """Multiply-adds x 2 of the weight matmuls for one token (attention over keys excluded)."""
    D, F = cfg.d_model, cfg.ffn_dim
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    per_layer = D * q + 2 * D * kv + q * D + 3 * D * F
    return 2.0 * (cfg.n_layers * per_layer + D * cfg.vocab_size)


# --------------------------------------------------------------------------- report




# --------------------------------------------------------------------------- report


def _bar(ratio: float, bar: float | None, clean: bool) -> str:
    if not bar:
        return "-"
    if not clean:
        return f"{bar:.1f}x: not judged (contended)"
    return f"{bar:.1f}x: {'met' if ratio >= bar else 'missed'}"


def render(ctx: dict) -> str:
    L = []
    a = L.append
    a(f"## Serving throughput: ee-jax at full depth vs transformers ({ctx['model_name']})")
    a("")
    a(f"Written by `bench/serving.py` on {ctx['date']}. Method: docs/architecture.md section 7 "
      "and the docstring of `bench/serving.py` (one process, warm-up first, ee-jax and "
      "transformers "
      f"interleaved, median of {ctx['reps']} repetitions each; compile time apart).")
    a("")
    a("**Full-depth decoding.** The engine is built with `early_exit=False` (the baseline early "
      f"exit is measured against): exit-layer histogram (rows) {ctx['exit_hist']} (mean "
      f"executed layers {ctx['mean_layers']:.1f} of {ctx['n_layers']}).")
    a("")
    a("- Command: `" + ctx["command"] + "`")
    a(f"- Machine: {ctx['cpu']} ({ctx['flags']}), {ctx['ncpu']} cores, "
      f"{ctx['mem_gib']:.0f} GiB RAM; {ctx['platform']}")
    a(f"- Versions: python {ctx['python']}, jax {ctx['jax']} (jaxlib {ctx['jaxlib']}), "
      f"torch {ctx['torch']}, transformers {ctx['transformers']}, numpy {np.__version__}")
    a(f"- Threads: torch intra-op {ctx['torch_threads']}, inter-op "
      f"{ctx['torch_interop']}; XLA CPU uses its own pool over all {ctx['ncpu']} cores "
      f"(XLA_FLAGS={ctx['xla_flags']!r}); transformers attention: `{ctx['attn_impl']}`")
    a(f"- Model: `{ctx['model_source']}` ({ctx['weights']}), {ctx['weight_mb']:.0f} MB of "
      f"weights as ee-jax holds them; ee-jax engine {ctx['engine_cfg']}")
    a(f"- Workload: greedy, {ctx['new_tokens']} new tokens per sequence (forced), prompts = "
      f"{ctx['prompt_desc']}, same token ids for both engines")
    a("")
    a("| batch | prompt tokens mean (min-max) | ee-jax e2e tok/s | ee-jax decode tok/s | "
      "ee-jax prefill s | HF e2e tok/s | HF decode tok/s | HF prefill s | ratio e2e | "
      "ratio decode | bar (decode) | bar (e2e) | greedy agreement | max contention |")
    a("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|---:|")
    for r in ctx["rows"]:
        a(f"| {r['batch']} | {r['plen_mean']:.0f} ({r['plen_min']}-{r['plen_max']}) | "
          f"{fmt(r['ours_e2e'])} | {fmt(r['ours_decode'])} | {fmt(r['ours_prefill'], 2)} | "
          f"{fmt(r['hf_e2e'])} | {fmt(r['hf_decode'])} | {fmt(r['hf_prefill'], 2)} | "
          f"{r['ratio_e2e']:.2f}x | {r['ratio_decode']:.2f}x | "
          f"{_bar(r['ratio_decode'], DECODE_BARS.get(r['batch']), r['all_clean'])} | "
          f"{_bar(r['ratio_e2e'], E2E_BAR, r['all_clean'])} | "
          f"{r['agree']}/{r['batch']} identical (prefix {100 * r['agree_frac']:.0f}%"
          f"{', ' + str(r['stopped']) + ' hit EOS' if r['stopped'] else ''}) | "
          f"{100 * r['contention']:.0f}% ({r['n_used']} of {r['n_pairs']} pairs"
          f"{'' if r['all_clean'] else ', all contended'}) |")
    a("")
    a("Ratios are ee-jax over transformers (higher is better for ee-jax). \"Decode\" counts "
      "the B x (new tokens - 1) tokens produced once every sequence has its first token, over "
      "the clock time from then to the last token (the same clock on both sides); \"e2e\" is "
      "every generated token over the whole call. "
      "Contention: CPU time used by other processes during a measured call, as a share of all "
      "cores: the worst call among the pairs the medians use; a pair with a contended call is "
      f"measured again (up to {ctx['extra_reps']} extra pairs) and left out when uncontended "
      "pairs exist.")
    a("")
    a("### Host time per decode step")
    a("")
    a("A separate ee-jax pass per batch with the runner's step synchronised: device = time "
      "inside the runner's step (dispatch + device work), host = the rest of `engine.step()` "
      "(schedule, input packing, output processing); medians over the decode steps. "
      "\"Step (measured)\" is the unsynchronised ms/step of the measured calls; the last "
      "column is the engine's own `EngineStats.host_time` per step (all steps) of those calls. "
      f"Bar: host under {100 * HOST_BAR[1]:.0f}% of the step at batch {HOST_BAR[0]}.")
    a("")
    a("| batch | step (measured) ms | device ms | host ms | host / step | bar | "
      "engine's own host ms/step |")
    a("|---:|---:|---:|---:|---:|---|---:|")
    for r in ctx["rows"]:
        host, dev = r["host_ms"], r["device_ms"]
        share = host / (host + dev) if host == host and dev == dev else float("nan")
        bar = ("-" if r["batch"] != HOST_BAR[0] else
               f"{100 * HOST_BAR[1]:.0f}%: {'met' if share < HOST_BAR[1] else 'missed'}")
        a(f"| {r['batch']} | {1e3 * r['ours_step']:.1f} | {fmt(dev)} | {fmt(host, 2)} | "
          f"{fmt(100 * share)}% | {bar} | {fmt(r['engine_host_ms'], 2)} |")
    a("")
    a("Compile time (ee-jax warm-up, not in the figures above):")
    a("")
    for r in ctx["rows"]:
        a(f"- batch {r['batch']}: {r['compile_time']:.1f} s for {r['num_compiles']} "
          f"new programs")
    bw = ctx.get("bandwidth")
    if bw:
        a("")
        a("### Batch-1 memory bandwidth")
        a("")
        a(f"- Bytes per decode step: {bw['step_bytes'] / 1e6:.1f} MB (weights "
          f"{ctx['weight_mb']:.1f} MB, + K/V of the page-bucketed context, mean "
          f"{bw['kv_mb']:.1f} MB)")
        a(f"- Measured ee-jax decode step at batch 1: {1e3 * bw['step_s']:.1f} ms -> "
          f"{bw['achieved_gbs']:.1f} GB/s")
        a(f"- numpy copy bandwidth (512 MiB, best of 5, read + write counted): "
          f"{bw['copy_gbs']:.1f} GB/s")
        a(f"- **Fraction of the bandwidth limit: {100 * bw['fraction']:.0f}%** "
          f"(transformers at batch 1: {bw['hf_step_ms']:.1f} ms/step, "
          f"{100 * bw['hf_fraction']:.0f}%)")
    prof = ctx.get("profile")
    if prof:
        a("")
        a("### Where the decode step's time goes (cheap profile)")
        a("")
        a(f"Measured with XLA on this machine: f32 matmul {prof['matmul_gflops']:.0f} GFLOP/s "
          f"(1024^3); a jitted read of every weight {prof['read_gbs']:.1f} GB/s. "
          "Roofline = max(weight bytes / that read bandwidth, weight-matmul FLOPs / that "
          "matmul throughput). \"Dense\" is the decode step without attention and without "
          "the paged cache (norms, projections, RoPE, MLP, head, argmax) through a "
          "stacked-layer `fori_loop`; \"head\" is final norm + head + argmax alone; "
          "\"attention + cache\" is the measured ee-jax step minus the dense step (K/V "
          "scatter, page gather, attention, step I/O).")
        a("")
        a("| batch | roofline ms | ee-jax step ms | = layers w/o attention ms | + head ms | "
          "+ attention + cache ms | HF step ms |")
        a("|---:|---:|---:|---:|---:|---:|---:|")
        for r in ctx["rows"]:
            B = r["batch"]
            if B not in prof["dense"]:
                continue
            roof = max(ctx["weight_mb"] * 1e6 / (prof["read_gbs"] * 1e9),
                       B * ctx["flops_per_token"] / (prof["matmul_gflops"] * 1e9))
            dense, head = prof["dense"][B], prof["head"][B]
            a(f"| {B} | {1e3 * roof:.1f} | {1e3 * r['ours_step']:.1f} | "
              f"{1e3 * (dense - head):.1f} | {1e3 * head:.1f} | "
              f"{1e3 * (r['ours_step'] - dense):.1f} | {1e3 * r['hf_step']:.1f} |")
    a("")
    a("<details><summary>Every measured call</summary>")
    a("")
    for r in ctx["rows"]:
        a(f"- batch {r['batch']} (ee-jax s, transformers s, contention during each): " + "; ".join(
            f"{o:.2f} / {h:.2f} ({100 * co:.0f}% / {100 * ch:.0f}%)"
            for o, h, co, ch in r["calls"]))
    a("")
    a("</details>")
    return "\n".join(L) + "\n"


# --------------------------------------------------------------------------- main


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench.serving", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--random", choices=("tiny", "smollm2"), default=None,
                   help="random transformers Llama of this shape, loaded by both engines")
    p.add_argument("--prompts", choices=("humaneval", "demo", "chat"), default="humaneval")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=2, help="measured calls per engine and batch")
    p.add_argument("--min-prompt", type=int, default=128)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: cores)")
    p.add_argument("--max-contention", type=float, default=0.10,
                   help="a call during which other processes used more than this share of the "
                        "machine is repeated (its pair is measured again)")
    p.add_argument("--extra-reps", type=int, default=2,
                   help="at most this many extra pairs per batch to replace contended ones")
    p.add_argument("--wait-idle", type=float, default=120.0,
                   help="before each pair, wait up to this many seconds for the machine to be "
                        "idle (0: do not wait)")
    p.add_argument("--no-profile", action="store_true", help="skip the dense-floor profile")
    p.add_argument("--dense-weights", action="store_true",
                   help="ee-jax holds every weight as a dense f32 array (default: a GGUF's "
                   "block-quantized layer weights stay in their blocks, as ee-jax serves them)")
    p.add_argument("--no-host-split", action="store_true",
                   help="skip the synchronised pass that splits host and device time")
    p.add_argument("--out", type=Path, default=None,
                   help="markdown file whose bench.serving section is (re)written")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: batches 1 2, 8 new tokens, no idle wait or re-measuring, "
                        "no profile (overrides those options)")
    args = p.parse_args(argv)
    if args.quick:
        args.batches, args.new_tokens, args.wait_idle, args.extra_reps = [1, 2], 8, 0.0, 0
        args.reps, args.no_profile = 1, True
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    t_start = time.perf_counter()
    ncpu = num_cpus()

    import jax
    import jaxlib
    import torch
    import transformers

    from ee_jax.models import quant
    from ee_jax.serving.llm import LLM

    torch.set_num_threads(args.threads or ncpu)
    log(f"{cpu_model()}, {ncpu} cores; torch threads {torch.get_num_threads()}")

    if args.wait_idle:
        wait_for_idle(args.wait_idle, args.max_contention)
    copy_bw = copy_bandwidth()
    log(f"numpy copy: {copy_bw / 1e9:.1f} GB/s")

    tmp = None
    if args.random:
        tmp = tempfile.TemporaryDirectory(prefix="bench-serving-")
        log(f"random {args.random} Llama (transformers init), saved and loaded by ee-jax ...")
        m, hf = hf_random_pair(Path(tmp.name), args.random)
        model_name, weights = f"random {args.random} Llama", "random f32, one checkpoint"
    else:
        log(f"loading {args.model} for ee-jax and for transformers ...")
        m, hf = load_f32(args.model, blocks=not args.dense_weights), hf_from_gguf(args.model)
        model_name = args.model
        weights = ("GGUF dequantized to float32 arrays by both loaders" if args.dense_weights
                   or not quant.has_blocks(m.params) else
                   "one GGUF: transformers dequantizes it to float32 arrays; ee-jax keeps its "
                   "Q4_1 layer weights in their blocks and dequantizes them inside each step "
                   "to the same f32 values, bit for bit (`--dense-weights`: f32 arrays on both "
                   "sides); f32 arithmetic on both sides")
    cfg = m.config
    max_b = max(args.batches)
    engine_kw = dict(max_num_seqs=max(32, max_b), max_model_len=1024, page_size=16,
                     max_num_batched_tokens=max(32, max_b) * 512)
    llm = LLM(m, early_exit=False, progress=False, **engine_kw)  # the full-depth baseline
    runner = hf_runner(hf, m)
    stops = set(stop_ids(m))

    if args.prompts == "humaneval":
        eligible = [ids for _, ids in humaneval_prompts(m.tokenizer, args.min_prompt,
                                                        args.max_prompt)]
        if len(eligible) < max_b:
            raise SystemExit(f"only {len(eligible)} HumanEval prompts have {args.min_prompt}-"
                             f"{args.max_prompt} tokens; need {max_b}")
        prompt_desc = (f"the first B HumanEval prompts of {args.min_prompt}-{args.max_prompt} "
                       f"tokens ({len(eligible)} of 164 qualify)")
    else:
        eligible = load_prompts(args.prompts, m.tokenizer, max_b)
        prompt_desc = f"the {args.prompts} prompts in the chat template (cycled to B)"
    log(f"prompts: {prompt_desc}")

    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(m.params))

    def report(rows, bandwidth=None, profile=None) -> str:
        hists = sorted(set(exit_rows.values()))
        ctx = dict(
            date=datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), reps=args.reps,
            n_layers=cfg.n_layers, command=("python -m bench.serving " + " ".join(argv)).strip(),
            cpu=cpu_model(), flags=cpu_flags(), ncpu=ncpu,
            mem_gib=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30,
            platform=platform.platform(), python=platform.python_version(), jax=jax.__version__,
            jaxlib=jaxlib.__version__, torch=torch.__version__,
            transformers=transformers.__version__,
            torch_threads=torch.get_num_threads(), torch_interop=torch.get_num_interop_threads(),
            xla_flags=os.environ.get("XLA_FLAGS", ""),
            attn_impl=getattr(hf.config, "_attn_implementation", "?"), model_source=m.source,
            model_name=model_name, weights=weights, weight_mb=weight_bytes / 1e6,
            engine_cfg=", ".join(f"{k}={v}" for k, v in engine_kw.items()) + ", early_exit=False",
            new_tokens=args.new_tokens, prompt_desc=prompt_desc, rows=rows, bandwidth=bandwidth,
            profile=profile, flops_per_token=matmul_flops_per_token(cfg),
            extra_reps=args.extra_reps, mean_layers=float(np.mean(mean_layers)),
            exit_hist="; ".join(f"batch {b}: {h}" for b, h in exit_rows.items())
            if len(hists) > 1 else f"{{{hists[0]}}} at every batch")
        return render(ctx)

    rows, exit_rows, mean_layers = [], {}, []
    for B in args.batches:
        prompts = eligible[:B]
        lens = [len(p) for p in prompts]
        log(f"batch {B}: prompts {min(lens)}-{max(lens)} tokens; ee-jax warm-up (compiles) ...")
        warm = run_eejax(llm, prompts, args.new_tokens)
        log(f"batch {B}: compiled {warm.num_compiles} programs in {warm.compile_time:.1f} s; "
            f"transformers warm-up ...")
        runner.run(prompts, 2)
        pairs: list[tuple[Served, HFRun]] = []
        clean = []
        while len(clean) < args.reps and len(pairs) < args.reps + args.extra_reps:
            if args.wait_idle:
                wait_for_idle(args.wait_idle, args.max_contention)
            rep = len(pairs) + 1
            o = run_eejax(llm, prompts, args.new_tokens)
            recompiled = f", {o.num_compiles} compiles!" if o.num_compiles else ""
            log(f"batch {B} call {rep}: ee-jax {o.wall:.2f} s ({o.e2e_tps():.1f} tok/s e2e, "
                f"{o.decode_tps_wall():.1f} decode{recompiled}), contention "
                f"{100 * o.contention:.0f}%")
            h = runner.run(prompts, args.new_tokens)
            log(f"batch {B} call {rep}: transformers {h.wall:.2f} s ({h.e2e_tps():.1f} tok/s "
                f"e2e, {h.decode_tps:.1f} decode), contention {100 * h.contention:.0f}%")
            pairs.append((o, h))
            if max(o.contention, h.contention) <= args.max_contention:
                clean.append((o, h))
        host_ms = device_ms = float("nan")
        if not args.no_host_split:
            split = run_eejax(llm, prompts, args.new_tokens, split_host=True)
            host, dev = split.host_per_decode_step()
            host_ms, device_ms = 1e3 * host, 1e3 * dev
            log(f"batch {B}: host {host_ms:.2f} ms + device {device_ms:.1f} ms per decode step")
        # Medians over the uncontended pairs when there are any, else over all (flagged).
        used = clean or pairs
        ours, theirs = [o for o, _ in used], [h for _, h in used]
        toks = [[list(x.token_ids) for x in o.outputs] for o in ours]
        same, frac, stopped = sequence_agreement(toks[-1], theirs[-1].tokens, stops)
        if any(t != toks[0] for t in toks):
            log(f"WARNING: batch {B}: ee-jax's greedy tokens differ between repetitions")
        summary = exit_summary(ours[-1].stats, cfg)
        exit_rows[B] = summary["row_hist"]
        mean_layers.append(summary["mean_layers"])
        row = dict(
            batch=B, plen_mean=float(np.mean(lens)), plen_min=min(lens), plen_max=max(lens),
            ours_e2e=median([o.e2e_tps() for o in ours]),
            ours_decode=median([o.decode_tps_wall() for o in ours]),
            ours_prefill=median([o.stats.prefill_time for o in ours]),
            ours_step=median([o.decode_step_time for o in ours]),
            hf_e2e=median([h.e2e_tps() for h in theirs]),
            hf_decode=median([h.decode_tps for h in theirs]),
            hf_prefill=median([h.prefill_time for h in theirs]),
            hf_step=median([h.decode_step_time for h in theirs]),
            agree=same, agree_frac=frac, stopped=stopped,
            contention=max(x.contention for x in ours + theirs),
            n_used=len(used), n_pairs=len(pairs), all_clean=bool(clean),
            calls=[(o.wall, h.wall, o.contention, h.contention) for o, h in pairs],
            compile_time=warm.compile_time, num_compiles=warm.num_compiles,
            host_ms=host_ms, device_ms=device_ms,
            engine_host_ms=median([1e3 * getattr(o.stats, "host_time", float("nan"))
                                   / max(1, o.stats.num_steps) for o in ours]))
        row["ratio_e2e"] = row["ours_e2e"] / row["hf_e2e"]
        row["ratio_decode"] = row["ours_decode"] / row["hf_decode"]
        log(f"batch {B}: ee-jax/transformers e2e {row['ratio_e2e']:.2f}x, decode "
            f"{row['ratio_decode']:.2f}x; greedy agreement {same}/{B}; exits {{{exit_rows[B]}}}")
        rows.append(row)
        if args.out:  # after every batch size: a long run leaves what it has
            write_marked(args.out, report(rows), MARK)

    # Batch-1 bandwidth (the first batch-1 row; otherwise the smallest batch, labelled so).
    r1 = next((r for r in rows if r["batch"] == 1), rows[0])
    plen = r1["plen_min"] if r1["batch"] == 1 else int(r1["plen_mean"])
    step_bytes = decode_step_bytes(cfg, m.params, llm.engine.scheduler.config, plen,
                                   args.new_tokens)
    achieved = step_bytes / r1["ours_step"]
    bandwidth = dict(step_bytes=step_bytes, kv_mb=(step_bytes - weight_bytes) / 1e6,
                     step_s=r1["ours_step"], achieved_gbs=achieved / 1e9,
                     copy_gbs=copy_bw / 1e9, fraction=achieved / copy_bw,
                     hf_step_ms=1e3 * r1["hf_step"],
                     hf_fraction=step_bytes / r1["hf_step"] / copy_bw)

    profile = None
    if not args.no_profile:
        if args.wait_idle:
            wait_for_idle(args.wait_idle, args.max_contention)
        log("profile: matmul / read / dense-floor microbenchmarks ...")
        profile = profile_floors(cfg, m.params, args.batches)
        log(f"profile: {profile}")

    section = report(rows, bandwidth, profile)
    print(section)
    if args.out:
        write_marked(args.out, section, MARK)
        log(f"wrote {args.out}")
    if tmp is not None:
        tmp.cleanup()
    log(f"done in {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
