"""Serving under load: Poisson arrivals through the step-wise engine in this process
(`engine`), and concurrent streaming clients against the live HTTP server (`http`).

    python -m bench.load engine --rates 0.1 0.2 0.4 0.8 --requests 24 --new-tokens 64 --batch 8
    python -m bench.load engine --random --quick          # smoke test: tiny random Llama
    git worktree add /tmp/ee-2fc5161 2fc5161               # an older engine, same benchmark:
    python -m bench.load engine --modes full --tree /tmp/ee-2fc5161 ...
    python -m bench.load http                             # SmolLM2, full depth vs early exit
    python -m bench.load http --random --requests 16 --rates 4 inf --max-tokens 8   # smoke
    python -m bench.load start                            # server start: cold, then warm
    python -m bench.load checkpoint --shape 1b            # an EE-LLM checkpoint: load, serve

`python -m bench.load engine --help` (or `http --help`, `start --help`, `checkpoint --help`)
lists the options. checkpoint: see `CKPT_DOC` below.

engine -- Serving under Poisson arrivals: a request-rate sweep through the step-wise engine.
For each offered rate (requests/s), one arrival schedule (exponential gaps, seeded, cut at
--requests requests or --duration seconds, whichever comes first) is served by every mode:

* `full depth`: the engine built with `early_exit=False` and `mixed_steps=True`: continuous
  batching where running requests' decode rows ride along in prefill steps, requests added
  between steps as they arrive;
* `prefill-first` (mode `full-pf`): the same engine with `mixed_steps=False`: a prefill step
  holds prompt chunks only, so every running request waits while a new prompt is prefilled
  (what mixed steps are measured against: its p99 TTFT and ITL);
* `early exit`: the same engine with the model's shipped exit heads (`--random`: untrained
  heads at layers 1-3, threshold --threshold, default 0: every row leaves at layer 1);
* `static`: transformers-style static batching: when idle, take the requests that have
  arrived (up to --batch), run them to the end, repeat. `--static hf` (default): transformers
  `generate` on the same f32 weights (token times = the end of each forward pass, from a
  logits processor's clock: the same "token is ready" moment the engine's step gives);
  `--static engine`: the full-depth engine admitting a new batch only when idle.

The engine runs in this process (`bench.common.serve`: `add_request` / `step`, arrivals
injected between steps by wall clock). Every engine is compiled first (`--warmup buckets`, the
default: serving batches of 1, 2, 4, ... --batch of the same prompts, then
--warmup-passes unmeasured passes of each rate's own arrivals, which form the mixed and
partial steps the bucket warm-up never meets; `precompile`:
`LLMEngine.precompile()`, every step shape the scheduler can produce: 55 programs at --batch 8
and prompts up to 400 tokens (27 prefill, 28 decode; 161 before prefill steps took one
page-table width and few batch buckets), about 160 CPU s cold on this 2-core CPU and 11 s
from the persistent compilation cache; then `--warmup-passes 0` needs no replay of the
arrivals); compile time is reported apart and the table shows any compile during a run.

The TTFT floor (`--floor`, default on): after the warm-up, each prompt is served alone (two
tokens, nothing else in the engine, the least of two passes) and its first-token time is
that request's floor: the TTFT no scheduler beats on this machine. Each row reports p50/p99
of the floors of its requests and of TTFT minus floor (the request's queueing), so whether a
TTFT bar is reachable at all is a number in the table.
A run stops at --time-limit seconds: unfinished requests are aborted and counted as such.

`--tree DIR` imports `ee_jax` from another checkout (e.g. the commit before an engine change)
and runs the same arrivals through its engine: before/after figures from one benchmark. What
that engine lacks is emulated here (stats snapshots) or not asked of it (`mixed_steps`).

Per run: completed requests, output tokens/s and requests/s over the run, time to first token
(from the request's arrival) and inter-token latency, p50 and p99; for early exit the
rows' exit-layer histogram and the ideal speed-up with the LM head counted. Static batching
"saturates" at the lowest offered rate where it completes under 90% of the offered
requests/s or its p99 TTFT exceeds 4x its p99 at the lowest rate; the engine's p99 TTFT at
that rate is the comparison that matters.

http -- Load on the live HTTP server: N concurrent streaming clients at a sweep of request rates.
Method:
* The script starts `ee-jax serve` itself (a subprocess on 127.0.0.1, a free port), once per
  mode: "full" is `--no-early-exit` (the engine's full-depth program: `early_exit=False`, the
  baseline of docs/architecture.md section 7), "early" the model's shipped exit heads. With
  --random: untrained norm heads at layers 1,2,3 and threshold 0, so every decode step leaves
  at layer 1 (a smoke test of the path, not a speed-up). The server's defaults otherwise, with
  max_num_seqs = --clients.
* Warm-up (not measured): the whole sweep, repeated until a pass compiles no new program (at
  most --warmup-passes), so the batch shapes the measured pass meets are compiled; compiles
  during the measured pass are counted from /metrics and printed beside each row (a row with
  compiles > 0 includes compile time: Poisson arrivals can still form a new batch shape).
  --precompile decode (or all) has the server compile every decode (or every) step shape
  before it serves, which leaves only prefill shapes to the warm-up.
* For each rate (requests/s; "inf" = all at once) --requests chat requests are sent with
  Poisson arrivals (exponential gaps, seeded), at most --clients in flight; each streams
  (`stream: true`, `logprobs: 0` to count tokens per chunk) exactly --max-tokens tokens
  (`ignore_eos`). A rate stops sending after --time-limit seconds; what is in flight then
  gets --time-limit more seconds and is cancelled after (counted as errors).
* Per rate: completed/errors, throughput = generated tokens / (last finish - first send),
  TTFT (send to first token) and ITL (gap between token-bearing chunks / tokens in the chunk)
  p50/p99, mean exit layer (from `usage.early_exit`).
* --offline: after the servers, `LLM.generate` (in this process) on the same chats with the
  same parameters and max_num_seqs, warmed up on them first, timed once per mode: the
  "through the server >= 90% of LLM.generate" bar compares the rate "inf" row to it.

Client and server share the machine: on a 2-core CPU the client's HTTP work takes cycles from
the engine, so the ratio there is pessimistic. "load avg" is the machine's 1-minute load
average after each rate (other processes included): far above the core count means the
figures are contended.

start -- How long `ee-jax serve` (its defaults: the smallest batch bucket's step programs
compiled before it serves, the others while idle) takes from launch until its port answers
(the first /health), until /ready answers 200, until a chat completion sent as soon as the
port answered comes back (it waits for the engine), and until every step program is ready (the
server's "all N step programs ready" line): once with empty caches (a fresh
`EE_JAX_COMPILATION_CACHE` folder: every program compiled), then --restarts times with them
warm (programs loaded from the program cache), with the server's own "ready in ... X compiled,
Y loaded".
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import dataclasses
import itertools
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np
from tqdm.auto import tqdm

from bench import common
from bench.common import (
    HFRunner,
    cpu_model,
    exit_summary,
    fmt,
    hf_from_gguf,
    hf_random_pair,
    hf_runner,
    load_f32,
    load_prompts,
    log,
    percentile,
    serve,
    write_marked,
)
from ee_jax.serving.server.run import free_port

# --------------------------------------------------------------------------- engine: Poisson


MARK = ("<!-- bench.load:begin -->", "<!-- bench.load:end -->")


def arrival_times(rate: float, n: int, duration: float, seed: int) -> list[float]:
    """Poisson process of `rate` per second: at most n arrivals, none after `duration` (at
    least one, at time 0 + its gap)."""
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1.0 / rate, n))
    kept = t[t <= duration]
    return (kept if len(kept) else t[:1]).tolist()


def summarize(mode: str, rate: float, arrivals: list[float], token_times: list[list[float]],
              completed: list[bool], compiles: int = 0, exits: dict | None = None,
              floors: list[float] | None = None) -> dict:
    """One run's figures; times in seconds from the run's start. floors: each request's
    first-token time served alone (`ttft_floors`); TTFT minus it is the request's queueing."""
    n = len(arrivals)
    ends = [t[-1] for t in token_times if t]
    span = (max(ends) - min(arrivals)) if ends else float("nan")
    ttft = [t[0] - a for a, t in zip(arrivals, token_times, strict=True) if t]
    floors = floors[:n] if floors else []
    queue = [t[0] - a - f for a, t, f in zip(arrivals, token_times, floors, strict=True)
             if t] if floors else []
    itl = [b - a for t in token_times for a, b in itertools.pairwise(t)]
    done = sum(completed)
    return dict(mode=mode, rate=rate, n=n, done=done, span=span,
                tok_s=sum(map(len, token_times)) / span if span == span and span else 0.0,
                req_s=done / span if span == span and span else 0.0,
                offered=n / max(arrivals[-1], 1e-9) if n > 1 else rate,
                ttft50=percentile(ttft, 50), ttft99=percentile(ttft, 99),
                itl50=percentile(itl, 50), itl99=percentile(itl, 99),
                floor50=percentile(floors, 50), floor99=percentile(floors, 99),
                queue50=percentile(queue, 50), queue99=percentile(queue, 99),
                compiles=compiles, exits=exits)


# --------------------------------------------------------------------------- the three modes


def ttft_floors(llm, prompts, params, passes: int = 2) -> list[float]:
    """Each prompt's first-token time served alone (nothing else in the engine; arrival to
    the token read on the host, as TTFT is), the least over `passes` passes (the first may
    compile): the TTFT no scheduler can beat on this machine."""
    # Two tokens: the first is read after the next step is launched, as in service.
    two = dataclasses.replace(params, max_tokens=2)
    best = [float("inf")] * len(prompts)
    for _ in range(passes):
        for i, p in enumerate(prompts):
            t = serve(llm, [p], two).token_times[0]
            best[i] = min(best[i], t[0])
    return best


def run_engine(llm, mode, rate, prompts, params, arrivals, args, static: bool = False,
               floors: list[float] | None = None) -> dict:
    """Continuous batching (or static: admit a batch only when the engine is idle)."""
    batch = args.batch

    def admit_static(engine) -> int:
        return 0 if engine.has_unfinished_requests() else batch

    served = serve(llm, prompts, params, arrivals=arrivals, time_limit=args.time_limit,
                   progress=args.progress, admit=admit_static if static else None)
    exits = None
    if llm.engine.exit_config is not None:
        exits = exit_summary(served.stats, llm.model.config, llm.engine.exit_config)
    return summarize(mode, rate, arrivals, served.token_times, served.completed,
                     served.num_compiles, exits, floors)


def run_static_hf(runner: HFRunner, rate, prompts, arrivals, args) -> dict:
    """transformers `generate` in static batches: when idle, every arrived request (up to
    --batch) runs to --new-tokens; token k of a batch is ready at its k-th forward's end."""
    n = len(prompts)
    token_times: list[list[float]] = [[] for _ in range(n)]
    completed = [False] * n
    nxt, last_progress = 0, 0.0
    t0 = time.perf_counter()
    while nxt < n:
        now = time.perf_counter() - t0
        if now > args.time_limit:
            break
        if args.progress and now - last_progress >= args.progress:
            last_progress = now
            log(f"  t={now:.0f}s: {sum(a <= now for a in arrivals)}/{n} arrived, {nxt} done")
        if arrivals[nxt] > now:
            time.sleep(min(arrivals[nxt] - now, args.time_limit - now + 1e-3))
            continue
        take = [i for i in range(nxt, min(n, nxt + args.batch)) if arrivals[i] <= now]
        run = runner.run([prompts[i] for i in take], args.new_tokens)
        for i in take:
            token_times[i] = [t - t0 for t in run.forward_ends]
            completed[i] = True
        nxt = take[-1] + 1
    return summarize(f"static ({'transformers' if args.static == 'hf' else 'engine'})", rate,
                     arrivals, token_times, completed)


def warm_up(llm, prompts, params, batch: int, how: str) -> float:
    """precompile: every step shape the scheduler can produce; buckets: serve batches of 1,
    2, 4, ... `batch` prompts. Returns the compile time."""
    if how == "precompile":
        before = llm.engine.stats.snapshot()
        n = llm.engine.precompile(progress=False)
        log(f"  {n} programs")
        return llm.engine.stats.since(before).compile_time
    sizes = sorted({min(batch, 2**k) for k in range(batch.bit_length() + 1)})
    return sum(serve(llm, prompts[:b], params).compile_time for b in sizes)


# --------------------------------------------------------------------------- report


def saturation_rate(rows: list[dict]) -> float | None:
    """The lowest offered rate at which a mode completes under 90% of the offered requests/s
    or its p99 TTFT exceeds 4x its p99 at the lowest rate."""
    rows = sorted(rows, key=lambda r: r["rate"])
    if not rows:
        return None
    base = rows[0]["ttft99"]
    for r in rows:
        if r["req_s"] < 0.9 * min(r["rate"], r["offered"]) or r["ttft99"] > 4 * base:
            return r["rate"]
    return None


def render(ctx: dict) -> str:
    """The rate table with the command, date and machine on one line above and the reading
    below: the section `--out` writes."""
    out = [f"{common.report_header(ctx['command'])}. {ctx['weights']}; engine {ctx['engine']}. "
           f"Workload: {ctx['workload']}. Static: {ctx['static']}. Warm-up compile: "
           f"{ctx['compile']}.", "",
           "| rate req/s | engine | TTFT p50 s | TTFT p99 s | floor p50 / p99 s | queueing p50 / "
           "p99 s | ITL p50 / p99 ms | compiles in run | exits (rows) |",
           "|---:|---|---:|---:|---|---|---|---:|---|"]
    cut = []
    for r in ctx["rows"]:
        ex = r["exits"]
        ex_s = (f"{{{ex['row_hist']}}}, mean {ex['mean_layers']:.1f}, ideal "
                f"{ex['ideal']:.2f}x" if ex else "-")
        out.append(f"| {r['rate']:g} | {r['mode']} | {r['ttft50']:.2f} | {r['ttft99']:.2f} | "
                   f"{fmt(r['floor50'], 2)} / {fmt(r['floor99'], 2)} | "
                   f"{fmt(r['queue50'], 2)} / {fmt(r['queue99'], 2)} | "
                   f"{1e3 * r['itl50']:.1f} / {1e3 * r['itl99']:.1f} | {r['compiles']} | "
                   f"{ex_s} |")
        if r["done"] < r["n"]:
            cut.append(f"{r['mode']} at {r['rate']:g} req/s {r['done']}/{r['n']}")
    sat = ctx["saturation"]
    read = ("TTFT from the request's arrival; floor: its first-token time served alone after "
            "the warm-up (the TTFT no scheduler beats here); queueing = TTFT - floor; ITL: gaps "
            "between a request's tokens.")
    if cut:
        read += f" Done (the rest cut by the time limit): {'; '.join(cut)}."
    if sat is None:
        read += " Static batching did not saturate at these rates."
    else:
        read += (f" Static batching saturates at {sat:g} req/s (under 90 % of the offered "
                 "requests/s completed, or p99 TTFT over 4x its lowest-rate p99).")
    return "\n".join([*out, "", read]) + "\n"


# --------------------------------------------------------------------------- main


def engine_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench.load engine",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--random", action="store_true",
                   help="a tiny random Llama (transformers init, loaded by both engines)")
    p.add_argument("--prompts", choices=("humaneval", "chat", "demo"), default="humaneval")
    p.add_argument("--min-prompt", type=int, default=64)
    p.add_argument("--max-prompt", type=int, default=400)
    p.add_argument("--rates", type=float, nargs="+", default=[0.1, 0.2, 0.4, 0.8])
    p.add_argument("--requests", type=int, default=24, help="at most this many per run")
    p.add_argument("--duration", type=float, default=120.0,
                   help="no arrival after this many seconds")
    p.add_argument("--time-limit", type=float, default=600.0,
                   help="abort what is unfinished after this many seconds of a run")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=8, help="max_num_seqs; static batch size")
    p.add_argument("--modes", nargs="+", default=["full", "early", "static"],
                   choices=("full", "full-pf", "early", "static"))
    p.add_argument("--static", choices=("hf", "engine"), default="hf")
    p.add_argument("--warmup", choices=("buckets", "precompile"), default="buckets")
    p.add_argument("--warmup-passes", type=int, default=1,
                   help="serve each rate's arrivals this many times unmeasured first, per "
                   "engine mode (the steps arrivals form mid-run, e.g. mixed steps, are "
                   "shapes the bucket warm-up never meets)")
    p.add_argument("--floor", action=argparse.BooleanOptionalAction, default=True,
                   help="time each prompt served alone after the warm-up (its TTFT floor) and "
                   "report TTFT minus it (queueing) beside TTFT")
    p.add_argument("--threshold", type=float, default=None,
                   help="exit threshold (default: the shipped heads' own)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--progress", type=float, default=10.0, help="seconds between progress lines")
    p.add_argument("--out", type=Path, default=None,
                   help="markdown file whose bench.load section is (re)written")
    p.add_argument("--tree", type=Path, default=None,
                   help="import ee_jax from this checkout instead (an older engine)")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: rates 2 8, 6 requests, 8 tokens, batch 2, 60 s limit")
    args = p.parse_args(argv)
    if args.quick:
        args.rates, args.requests, args.new_tokens, args.batch = [2.0, 8.0], 6, 8, 2
        args.time_limit, args.progress = 60.0, 5.0
    if min(args.rates) <= 0:
        p.error("--rates must be positive (requests per second)")
    return args


def _import_from(tree: Path) -> None:
    """Make `import ee_jax` load the checkout at `tree`, and give its engine stats the
    snapshot / since that `bench.common.serve` uses if it predates them."""
    if not (tree / "ee_jax" / "__init__.py").is_file():
        raise SystemExit(f"--tree {tree}: no ee_jax package there")
    if "ee_jax" in sys.modules:
        raise SystemExit("--tree: ee_jax was imported before the tree was set")
    sys.path.insert(0, str(tree.resolve()))
    from ee_jax.serving import engine

    stats = getattr(engine, "EngineStats", None)  # trees before ee_jax/serving/stats.py
    if stats is None:
        from ee_jax.serving.stats import EngineStats as stats
    if not hasattr(stats, "snapshot"):
        def snapshot(self):
            return copy.deepcopy(self)

        def since(self, before):
            out = copy.deepcopy(self)
            for f in dataclasses.fields(stats):
                a, b = getattr(self, f.name), getattr(before, f.name)
                if isinstance(a, dict):
                    setattr(out, f.name, {k: v - b.get(k, 0) for k, v in a.items()})
                elif f.name != "max_pages_used":
                    setattr(out, f.name, a - b)
            return out

        stats.snapshot, stats.since = snapshot, since
    log(f"ee_jax from {tree} ({engine.__file__})")


def _engine_kwargs(**kw) -> dict:
    """Drop knobs the engine under test does not have (an older `--tree`)."""
    from ee_jax.serving.engine import EngineConfig
    from ee_jax.serving.scheduler import SchedulerConfig

    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    if "scheduler" in fields:  # the scheduler's knobs are its config's (`EngineConfig.make`)
        fields |= {f.name for f in dataclasses.fields(SchedulerConfig)}
    return {k: v for k, v in kw.items() if k in fields or k not in ("mixed_steps",)}


def engine_main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = engine_args(argv)
    if args.tree is not None:
        _import_from(args.tree)

    from ee_jax.models.exits.config import ExitConfig
    from ee_jax.serving.llm import LLM
    from ee_jax.serving.params import greedy

    tmp = None
    if args.random:
        tmp = tempfile.TemporaryDirectory(prefix="bench-poisson-")
        m, hf = hf_random_pair(Path(tmp.name), "tiny", seed=args.seed)
        weights = "random tiny Llama (4 layers; transformers init, one checkpoint), f32"
        # Threshold 0 by default: every row leaves at layer 1 (random weights are never
        # confident), so the smoke test runs the exit path, not a speed-up.
        thr = 0.0 if args.threshold is None else args.threshold
        ec = ExitConfig(exit_layers=(1, 2, 3), threshold=thr)
        heads = None
    else:
        m = load_f32(args.model)
        hf = hf_from_gguf(args.model) if "static" in args.modes and args.static == "hf" else None
        blocks = any(type(a).__name__ == "BlockQ" for a in m.params.layers.to_dict().values())
        weights = (f"{args.model} (f32 arithmetic; ee-jax serves the GGUF's Q4_1 layer "
                   "weights in their blocks, dequantized in the step to the same f32 values; "
                   "transformers dequantizes to f32 arrays)" if blocks else
                   f"{args.model} (GGUF dequantized to f32 by both loaders)")
        shipped = m.shipped_exit_heads()
        if shipped is None and "early" in args.modes:
            raise SystemExit(f"{args.model} ships no exit heads: drop 'early' from --modes")
        ec, heads = shipped or (None, None)
    if ec is not None and args.threshold is not None:
        ec = dataclasses.replace(ec, threshold=args.threshold)
    prompts = load_prompts(args.prompts, m.tokenizer, args.requests, args.min_prompt,
                           args.max_prompt)
    lens = [len(p) for p in prompts]
    max_len = -(-(max(lens) + args.new_tokens + 16) // 16) * 16
    kw = dict(max_num_seqs=args.batch, max_model_len=max_len, progress=False)
    params = greedy(args.new_tokens, ignore_eos=True)

    engines: dict[str, object] = {}
    compile_s = {}
    # Full-depth baselines, every scheduling knob that differs written out.
    if "full" in args.modes or ("static" in args.modes and args.static == "engine"):
        engines["full depth"] = LLM(m, early_exit=False, **_engine_kwargs(mixed_steps=True,
                                                                           **kw))
    if "full-pf" in args.modes:
        engines["prefill-first"] = LLM(m, early_exit=False,
                                       **_engine_kwargs(mixed_steps=False, **kw))
    if "early" in args.modes:
        engines["early exit"] = LLM(m, exit_config=ec, exit_heads=heads,
                                    **_engine_kwargs(mixed_steps=True, **kw))
    floors: dict[str, list[float]] = {}
    for name, llm in engines.items():
        log(f"warm-up {name} ({args.warmup})")
        compile_s[name] = warm_up(llm, prompts, params, args.batch, args.warmup)
        if args.floor:
            log(f"  {name}: TTFT floor, each prompt alone ...")
            floors[name] = ttft_floors(llm, prompts, params)
    runner = None
    if "static" in args.modes and args.static == "hf":
        runner = hf_runner(hf, m)
        runner.run(prompts[:1], 2)  # warm-up

    rows = []
    for rate in args.rates:
        arrivals = arrival_times(rate, args.requests, args.duration, args.seed)
        ps = prompts[:len(arrivals)]
        log(f"rate {rate:g} req/s: {len(arrivals)} requests over {arrivals[-1]:.1f} s")
        for mode in args.modes:
            if mode == "static":
                log(f"  static ({args.static}) ...")
                r = (run_static_hf(runner, rate, ps, arrivals, args) if args.static == "hf"
                     else run_engine(engines["full depth"], "static (engine)", rate, ps, params,
                                     arrivals, args, static=True,
                                     floors=floors.get("full depth")))
            else:
                name = {"full": "full depth", "full-pf": "prefill-first"}.get(mode,
                                                                              "early exit")
                for k in range(args.warmup_passes):  # compiles the shapes this schedule forms
                    log(f"  {name}: warm-up pass {k + 1} (not measured) ...")
                    run_engine(engines[name], name, rate, ps, params, arrivals, args)
                log(f"  {name} ...")
                r = run_engine(engines[name], name, rate, ps, params, arrivals, args,
                               floors=floors.get(name))
            log(f"  {r['mode']}: {r['done']}/{r['n']} done, {r['tok_s']:.1f} tok/s, TTFT p50 "
                f"{r['ttft50']:.2f} s p99 {r['ttft99']:.2f} s (floor p99 {r['floor99']:.2f} s, "
                f"queueing p99 {r['queue99']:.2f} s), ITL p50 {1e3 * r['itl50']:.0f} "
                f"ms p99 {1e3 * r['itl99']:.0f} ms")
            rows.append(r)

    static_rows = [r for r in rows if r["mode"].startswith("static")]
    ctx = dict(command="python -m bench.load engine " + " ".join(argv), weights=weights,
               engine=(f"max_num_seqs={args.batch}, max_model_len={max_len}, defaults otherwise"
                       + (f"; ee_jax from --tree {args.tree}" if args.tree else "")),
               workload=(f"{args.prompts} prompts ({min(lens)}-{max(lens)} tokens), greedy, "
                         f"{args.new_tokens} new tokens each (EOS ignored), at most "
                         f"{args.requests} requests or {args.duration:g} s of arrivals per "
                         f"rate, seed {args.seed}, time limit {args.time_limit:g} s"),
               static=(f"transformers generate, batches of up to {args.batch}"
                       if args.static == "hf" else
                       f"the full-depth engine admitting up to {args.batch} when idle"),
               compile=(", ".join(f"{k} {v:.1f} s" for k, v in compile_s.items()) or "-")
               + f" ({args.warmup}; then {args.warmup_passes} unmeasured pass(es) of each "
               f"rate's arrivals per engine mode)",
               rows=rows, saturation=saturation_rate(static_rows))
    text = render(ctx)
    print(text)
    if args.out:
        write_marked(args.out, text, MARK)
        log(f"wrote {args.out}")
    if tmp is not None:
        tmp.cleanup()
    return 0


# --------------------------------------------------------------------------- http: the live server


HTTP_MODES = {"full": "full depth (--no-early-exit: the full-depth program)",
         "early": "early exit (shipped heads; --random: untrained, layers 1,2,3, threshold 0)"}


def http_chats(n: int) -> list[list[dict]]:
    from ee_jax.evaluation.prompts import held_out_instructions

    items = held_out_instructions()
    return [[{"role": "user", "content": items[i % len(items)]}] for i in range(n)]


@dataclasses.dataclass
class Result:
    ok: bool
    sent: float
    first: float | None = None
    done: float | None = None
    tokens: int = 0
    itls: list[float] = dataclasses.field(default_factory=list)
    mean_exit: float | None = None
    error: str | None = None


def nearest_rank(xs: list[float], q: float) -> float:
    if not xs:
        return math.nan
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q / 100 * len(xs)) - 1))]


# ----------------------------------------------------------------------------- server


class Server:
    """`ee-jax serve` in a subprocess; stopped with SIGINT (graceful), then killed."""

    def __init__(self, args, mode: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.name = "bench"
        cmd = [sys.executable, "-m", "ee_jax.cli", "serve", "--quiet",
               "--model", "random" if args.random else args.model, "--port", str(self.port),
               "--served-model-name", self.name, "--max-num-seqs", str(args.clients),
               "--max-model-len", str(args.max_model_len)]
        if args.precompile != "none":
            cmd += ["--precompile", args.precompile]
        if mode == "full":
            cmd.append("--no-early-exit")
        elif args.random:
            cmd += ["--exit-layers", "1,2,3", "--exit-threshold", "0"]
        log(f"starting: {' '.join(cmd[1:])}")
        self.proc = subprocess.Popen(cmd)
        try:
            wait_until(self.proc, self.url + "/ready", args.start_timeout, "bench.load http")
        except SystemExit:
            self.stop()
            raise

    def metrics(self) -> dict[str, float]:
        from prometheus_client.parser import text_string_to_metric_families

        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(httpx.get(self.url + "/metrics").text):
            for s in fam.samples:
                if not s.labels:
                    out[s.name] = s.value
        return out

    def stop(self) -> None:
        stop_server(self.proc)


def wait_until(proc: subprocess.Popen, url: str, timeout: float, who: str,
               answered: bool = False) -> None:
    """Return once GET `url` answers 200 (answered: answers at all, the port is open);
    SystemExit if the server exits or that takes over `timeout` seconds. (`/health` answers
    200 while the server starts; `/ready` once it serves.)"""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"{who}: the server exited ({proc.returncode})")
        try:
            if httpx.get(url, timeout=2).status_code == 200 or answered:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"{who}: the server did not come up in time")
        time.sleep(0.1)


def stop_server(proc: subprocess.Popen) -> None:
    """SIGINT (the server's graceful stop), then kill after 60 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ----------------------------------------------------------------------------- clients


async def one_request(http: httpx.AsyncClient, server: Server, chat: list[dict],
                      max_tokens: int) -> Result:
    body = {"model": server.name, "messages": chat, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "logprobs": True,
            "stream_options": {"include_usage": True}}
    res = Result(ok=False, sent=time.perf_counter())
    last = None
    try:
        async with http.stream("POST", server.url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = chunk["error"]["message"]
                    return res
                if chunk.get("usage"):
                    res.mean_exit = chunk["usage"]["early_exit"]["mean_exit_layer"]
                for c in chunk["choices"]:
                    n = len((c.get("logprobs") or {}).get("content") or [])
                    if not n:
                        continue
                    now = time.perf_counter()
                    if res.first is None:
                        res.first = now
                    elif last is not None:
                        res.itls += [(now - last) / n] * n
                    last = now
                    res.tokens += n
        res.done = time.perf_counter()
        res.ok = res.tokens > 0
    except (httpx.HTTPError, asyncio.CancelledError) as e:
        res.error = type(e).__name__
    return res


async def run_rate(server: Server, prompts: list[list[dict]], rate: float, clients: int,
                   max_tokens: int, time_limit: float, seed: int, desc: str) -> list[Result]:
    rng = random.Random(seed)
    sem = asyncio.Semaphore(clients)
    bar = tqdm(total=len(prompts), desc=desc, unit="req", file=sys.stderr, leave=False)
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients)

    async def guarded(http, chat):
        async with sem:
            try:
                return await one_request(http, server, chat, max_tokens)
            finally:
                bar.update(1)

    async with httpx.AsyncClient(limits=limits, timeout=None) as http:
        tasks, start = [], time.perf_counter()
        for chat in prompts:
            if time.perf_counter() - start > time_limit:
                break
            tasks.append(asyncio.create_task(guarded(http, chat)))
            if math.isfinite(rate):
                await asyncio.sleep(rng.expovariate(rate))
        done, pending = await asyncio.wait(tasks, timeout=time_limit) if tasks else ((), ())
        for t in pending:
            t.cancel()
        results = [t.result() for t in done]
        results += [Result(ok=False, sent=start, error="cancelled at the time limit")
                    for _ in pending]
        results += [Result(ok=False, sent=start, error="not sent (time limit)")
                    for _ in range(len(prompts) - len(tasks))]
    bar.close()
    return results


def http_summarize(results: list[Result]) -> dict:
    ok = [r for r in results if r.ok]
    tokens = sum(r.tokens for r in ok)
    span = (max(r.done for r in ok) - min(r.sent for r in ok)) if ok else math.nan
    ttft = [r.first - r.sent for r in ok if r.first is not None]
    itl = [x for r in ok for x in r.itls]
    exits = [r.mean_exit for r in ok if r.mean_exit is not None]
    return {"completed": len(ok), "errors": len(results) - len(ok),
            "tok_per_s": tokens / span if ok else 0.0, "req_per_s": len(ok) / span if ok else 0.0,
            "ttft_p50": nearest_rank(ttft, 50), "ttft_p99": nearest_rank(ttft, 99),
            "itl_p50": nearest_rank(itl, 50), "itl_p99": nearest_rank(itl, 99),
            "mean_exit_layer": statistics.mean(exits) if exits else math.nan,
            "first_error": next((r.error for r in results if not r.ok), None)}


# ----------------------------------------------------------------------------- offline


def http_offline(args, mode: str, prompts: list[list[dict]]) -> dict:
    """LLM.generate on the same chats and parameters (warm-up call first, then one timed)."""
    from ee_jax.random_model import random_model
    from ee_jax.serving.llm import LLM
    from ee_jax.serving.params import SamplingParams

    kw = dict(max_num_seqs=args.clients, max_model_len=args.max_model_len, progress=False)
    if mode == "full":  # the baseline: full depth, stated
        kw["early_exit"] = False
    # else the engine as shipped (its exit heads and controller), what "early" measures
    elif args.random:
        from ee_jax.models.exits.config import ExitConfig

        kw["exit_config"] = ExitConfig(exit_layers=(1, 2, 3), threshold=0.0)
    llm = LLM(random_model() if args.random else args.model, **kw)
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.chat(prompts, sp, use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.chat(prompts, sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    return {"tok_per_s": sum(len(o.token_ids) for o in outs) / wall, "wall_s": wall,
            "load_avg": os.getloadavg()[0]}


# ----------------------------------------------------------------------------- main


def http_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.load http")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--random", action="store_true", help="tiny random model (smoke run)")
    p.add_argument("--modes", nargs="+", default=["full", "early"], choices=list(HTTP_MODES))
    p.add_argument("--clients", type=int, default=16, help="streams in flight at most "
                   "(and the server's max_num_seqs)")
    p.add_argument("--rates", nargs="+", default=["2", "8", "inf"],
                   help="request rates (req/s, Poisson arrivals); 'inf' = all at once")
    p.add_argument("--requests", type=int, default=64, help="requests per rate")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per request (exactly)")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--time-limit", type=float, default=300.0, help="seconds per rate")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--offline", action="store_true", help="also time LLM.generate on the "
                   "same requests (the 90%% bar)")
    p.add_argument("--precompile", default="none", choices=["none", "decode", "all"],
                   help="the server compiles these step shapes before serving (ee-jax serve "
                   "--precompile); the warm-up passes then meet fewer new shapes")
    p.add_argument("--warmup-passes", type=int, default=3, help="unmeasured passes of the "
                   "sweep first, until one compiles nothing (at most this many)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    rates = [float(r) for r in args.rates]
    if any(not r > 0 for r in rates) or args.clients <= 0 or args.requests <= 0:
        p.error("rates, --clients and --requests must be positive")
    prompts = http_chats(args.requests)
    rows = []
    for mode in args.modes:
        server = Server(args, mode)
        try:
            for n in range(args.warmup_passes):  # compile what the measured pass meets
                before = server.metrics().get("eejax_compiles_total", 0)
                for rate in rates:
                    asyncio.run(run_rate(server, prompts, rate, args.clients, args.max_tokens,
                                         args.time_limit, args.seed, f"warm-up {n + 1}"))
                compiles = server.metrics().get("eejax_compiles_total", 0) - before
                log(f"{mode}: warm-up pass {n + 1} (not measured) compiled {compiles:g} "
                    f"programs")
                if compiles == 0:
                    break
            for rate in rates:
                before = server.metrics()
                res = asyncio.run(run_rate(server, prompts, rate, args.clients,
                                           args.max_tokens, args.time_limit, args.seed,
                                           f"{mode} @ {rate:g} req/s"))
                after = server.metrics()
                row = {"mode": mode, "rate": rate, **http_summarize(res),
                       "load_avg": os.getloadavg()[0],
                       "compiles": after.get("eejax_compiles_total", 0)
                       - before.get("eejax_compiles_total", 0),
                       "server_mean_layers": after.get("eejax_mean_layers_per_token")}
                rows.append(row)
                log(f"{mode} @ {rate:g} req/s: {row['completed']} ok, {row['errors']} errors, "
                    f"{row['tok_per_s']:.1f} tok/s, TTFT p50/p99 {row['ttft_p50']:.3f}/"
                    f"{row['ttft_p99']:.3f} s, ITL p50/p99 {row['itl_p50'] * 1e3:.1f}/"
                    f"{row['itl_p99'] * 1e3:.1f} ms, mean exit layer "
                    f"{row['mean_exit_layer']:.2f}, compiles {row['compiles']:g}")
        finally:
            server.stop()
    offline_rows = {}
    if args.offline:
        for mode in args.modes:
            log(f"{mode}: LLM.generate on the same {args.requests} requests")
            offline_rows[mode] = http_offline(args, mode, prompts)
            log(f"{mode}: LLM.generate {offline_rows[mode]['tok_per_s']:.1f} tok/s")
    print(http_report(args, rows, offline_rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "offline": offline_rows}, f, indent=1)
    return 0 if all(r["errors"] == 0 for r in rows) else 1


def http_report(args, rows: list[dict], offline_rows: dict) -> str:
    lines = [f"model {'random (tiny)' if args.random else args.model}, {args.clients} clients, "
             f"{args.requests} requests per rate, {args.max_tokens} tokens each (ignore_eos), "
             f"max_model_len {args.max_model_len}, precompile {args.precompile}, "
             f"cpu count {os.cpu_count()}", "",
             "| mode | rate (req/s) | ok | errors | tok/s | TTFT p50 / p99 (s) | "
             "ITL p50 / p99 (ms) | mean exit layer | compiles | load avg |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['mode']} | {r['rate']:g} | {r['completed']} | {r['errors']} | "
            f"{r['tok_per_s']:.1f} | {r['ttft_p50']:.3f} / {r['ttft_p99']:.3f} | "
            f"{r['itl_p50'] * 1e3:.1f} / {r['itl_p99'] * 1e3:.1f} | "
            f"{r['mean_exit_layer']:.2f} | {r['compiles']:g} | {r['load_avg']:.1f} |")
    if offline_rows:
        loads = ", ".join(f"{m} {o['load_avg']:.1f}" for m, o in offline_rows.items())
        lines.append(f"\nLLM.generate load avg after its runs: {loads}")
    for mode, off in offline_rows.items():
        top = [r for r in rows if r["mode"] == mode and math.isinf(r["rate"])]
        ratio = top[0]["tok_per_s"] / off["tok_per_s"] if top else math.nan
        lines.append(f"\n{mode}: LLM.generate {off['tok_per_s']:.1f} tok/s; server at rate inf "
                     f"{ratio:.0%} of it (bar: 90%)")
    return "\n".join(lines)


# --------------------------------------------------------------------------- start


def start_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.load start")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--restarts", type=int, default=3, help="warm starts after the cold one")
    p.add_argument("--start-timeout", type=float, default=900.0)
    args = p.parse_args(argv)
    cpu = cpu_model()
    log(f"{cpu}, {os.cpu_count()} cores; model {args.model}")
    with tempfile.TemporaryDirectory(prefix="ee-jax-start-") as cache:
        env = {**os.environ, "EE_JAX_COMPILATION_CACHE": cache}
        rows = []
        for n in range(1 + args.restarts):
            rows.append(_one_start("cold" if n == 0 else "warm", args, env))
            log("{}: port {:.1f} s, ready {:.1f} s, first completion {:.1f} s, all programs "
                "{:.1f} s ({})".format(*rows[-1]))
    print(f"`ee-jax serve --model {args.model}`, seconds from launch; {cpu}, "
          f"{os.cpu_count()} cores, load avg {os.getloadavg()[0]:.1f} at the end\n")
    print("| start | port answers | /ready 200 | first completion | all programs | the server's "
          "own count |\n|---|---:|---:|---:|---:|---|")
    for kind, port_s, ready, first, every, programs in rows:
        print(f"| {kind} | {port_s:.1f} | {ready:.1f} | {first:.1f} | {every:.1f} | "
              f"{programs.removeprefix('ee-jax: ')} |")
    return 0


def _one_start(kind: str, args, env: dict) -> tuple[str, float, float, float, float, str]:
    """Launch `ee-jax serve`, time its port, /ready, a first chat completion (sent once the
    port answers) and its "all N step programs ready" line, then stop it."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "ee_jax.cli", "serve", "--model", args.model,
           "--port", str(port)]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    lines: list[str] = []
    reader = _drain(proc, lines)
    ready: list[float] = []
    try:
        wait_until(proc, url + "/health", args.start_timeout, "bench.load start", answered=True)
        port_s = time.monotonic() - t0
        poller = threading.Thread(target=lambda: (wait_until(
            proc, url + "/ready", args.start_timeout, "bench.load start"),
            ready.append(time.monotonic() - t0)), daemon=True)
        poller.start()
        r = httpx.post(url + "/v1/chat/completions", timeout=args.start_timeout, json={
            "model": args.model, "max_tokens": 16, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]})
        r.raise_for_status()
        first = time.monotonic() - t0
        poller.join(args.start_timeout)
        deadline = t0 + args.start_timeout
        while not any("step programs ready" in ln for ln in lines):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("bench.load start: no 'all N step programs ready' line")
            time.sleep(0.1)
        every = time.monotonic() - t0
    except (SystemExit, httpx.HTTPError):
        print("".join(lines[-10:]), file=sys.stderr)
        raise
    finally:
        stop_server(proc)
        reader.join(5)
    own = next((ln.strip() for ln in lines if "ready in" in ln), "-")
    return kind, port_s, ready[0] if ready else math.nan, first, every, own


def _drain(proc: subprocess.Popen, lines: list[str]):
    """Read the server's output as it comes (a full pipe would stall it)."""
    def run():
        for line in proc.stdout:
            lines.append(line.rsplit("\r", 1)[-1])

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


# --------------------------------------------------------------------------- checkpoint

CKPT_DOC = """An EE-LLM checkpoint end to end: written, loaded, served with its own exits.

    python -m bench.load checkpoint --shape 1b                 # a 1B-shaped model (random weights)
    python -m bench.load checkpoint --shape tiny --new-tokens 4 --batches 1   # smoke test

1. Written: a Llama of the shape with random weights (fp16, as EE-LLM's converter holds
   them), as a Hugging Face folder (config.json + model.safetensors, fp16) and as an EE-Tuning
   Megatron checkpoint of the same weights (`ee_jax.testing.write_megatron`: tensor and
   pipeline parallel 1, exits at L/4 and L/2 with exit norm, branch MLP and their own outputs,
   fp32, as EE-Tuning's `add-exit` MLP recipe) under --folder (kept: reruns reuse it).
2. Loaded: each in a fresh process, page cache warm (one unmeasured load of each first),
   --rounds interleaved: ee-jax `load_model(<megatron folder>, dtype=D)` (backbone and
   exits) against transformers `AutoModelForCausalLM.from_pretrained(<hf folder>,
   torch_dtype=D)` (the backbone only), D = --load-dtype (float32, or float16: the file's).
   Wall time of the call, and peak memory: the load's peak anonymous RSS (`RssAnon`
   sampled every 10 ms, less the process's before the call: the pages of a memory-mapped
   checkpoint are page cache, not the loader's) and the process's high-water RSS
   (`ru_maxrss`, everything), against the checkpoint's bytes on disk (f32 weights are about
   twice an fp16 file).
3. Served: ee-jax at full depth (`early_exit=False`: the baseline) and with the checkpoint's
   own exits (policy per_row, the exit program forced: `exit_control="exits"`, threshold
   --threshold), batch 1 and 8, greedy, --new-tokens each, random prompts; warm-up first,
   then measured; tokens/s, the ratio and the exit histogram. Random weights: the point is
   that it runs, not the speed or where it exits.
"""

CKPT_SHAPES = {
    # Llama-3.2-1B's dimensions with Llama 2's 32,000-token vocabulary (EE-Tuning's models)
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, vocab_size=32000),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=256),
}


def ckpt_hf_config(shape: str) -> dict:
    return dict(CKPT_SHAPES[shape], architectures=["LlamaForCausalLM"], model_type="llama",
                rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=4096,
                tie_word_embeddings=False, hidden_act="silu", torch_dtype="float16",
                bos_token_id=None, eos_token_id=None)


def ckpt_random_state(c: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """HF-named [out, in] weights, normal * 0.02 (norms 1), fp16."""
    rng = np.random.default_rng(seed)
    D, F, V = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    H, G = c["num_attention_heads"], c["num_key_value_heads"]
    hd = D // H

    def w(*shape):
        return (0.02 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float16)

    state = {"model.embed_tokens.weight": w(V, D), "model.norm.weight": np.ones(D, np.float16),
             "lm_head.weight": w(V, D)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        state.update({p + "input_layernorm.weight": np.ones(D, np.float16),
                      p + "post_attention_layernorm.weight": np.ones(D, np.float16),
                      p + "self_attn.q_proj.weight": w(H * hd, D),
                      p + "self_attn.k_proj.weight": w(G * hd, D),
                      p + "self_attn.v_proj.weight": w(G * hd, D),
                      p + "self_attn.o_proj.weight": w(D, H * hd),
                      p + "mlp.gate_proj.weight": w(F, D), p + "mlp.up_proj.weight": w(F, D),
                      p + "mlp.down_proj.weight": w(D, F)})
    return state


def ckpt_write(folder: Path, shape: str) -> tuple[Path, Path]:
    """(hf folder, megatron folder) under `folder`, written unless already there."""
    from ee_jax.models.safetensors_io import save_file
    from ee_jax.testing import write_megatron

    hf, meg = folder / "hf", folder / "megatron"
    if (hf / "config.json").is_file() and (meg / "latest_checkpointed_iteration.txt").is_file():
        return hf, meg
    c = ckpt_hf_config(shape)
    common.log(f"writing a {shape}-shaped model (random weights) to {folder}")
    state = ckpt_random_state(c)
    hf.mkdir(parents=True, exist_ok=True)
    save_file(state, hf / "model.safetensors", metadata={"format": "pt"})
    (hf / "config.json").write_text(json.dumps(c, indent=2) + "\n")
    L = c["num_hidden_layers"]
    write_megatron(meg, c, state, exit_layer_nums=(L // 4, L // 2), use_exit_norm=True,
                   use_exit_mlp=True, untie_exit_output_weights=True)
    return hf, meg


CKPT_LOADER = r"""
import json, os, resource, sys, threading, time
peak = [0]
def sample():
    while True:
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                peak[0] = max(peak[0], int(line.split()[1]) * 1024)
        time.sleep(0.01)
threading.Thread(target=sample, daemon=True).start()
who, path, dtype = sys.argv[1], sys.argv[2], sys.argv[3]
if who == "ee-jax":
    import jax, torch  # imported before the clock starts, as torch below
    from ee_jax.models.loading import load_model
    jax.numpy.zeros(1).block_until_ready()
    time.sleep(0.05)
    base = peak[0]
    t0 = time.perf_counter()
    m = load_model(path, dtype=dtype, progress=False)
    jax.block_until_ready(m.params)
else:
    import torch, transformers
    time.sleep(0.05)
    base = peak[0]
    t0 = time.perf_counter()
    m = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=getattr(torch, dtype))
t = time.perf_counter() - t0
time.sleep(0.05)
print(json.dumps({"time": t, "rss_anon": peak[0] - base,
                  "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def ckpt_load_once(who: str, path: Path, dtype: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CKPT_LOADER, who, str(path), dtype],
                         capture_output=True,
                         text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    if out.returncode:
        raise RuntimeError(f"{who} load failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def ckpt_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def ckpt_bench_load(hf: Path, meg: Path, rounds: int, dtype: str) -> list[str]:
    ckpt_load_once("ee-jax", meg, dtype)  # page cache warm, unmeasured
    ckpt_load_once("transformers", hf, dtype)
    runs: dict[str, list[dict]] = {"ee-jax": [], "transformers": []}
    for r in range(rounds):
        for who, path in (("ee-jax", meg), ("transformers", hf)):
            runs[who].append(ckpt_load_once(who, path, dtype))
            common.log(f"load round {r + 1}/{rounds} {who}: {runs[who][-1]['time']:.1f} s")
    size = {"ee-jax": ckpt_bytes(meg), "transformers": ckpt_bytes(hf)}
    lines = [f"Both loaders to {dtype}.", "",
             "| loader | checkpoint | on disk | load s (median) | load's peak RssAnon "
             "| process peak RSS |",
             "|---|---|---|---|---|---|"]
    for who, what in (("ee-jax", "EE-LLM Megatron (backbone + 2 exits)"),
                      ("transformers", "HF safetensors (backbone)")):
        rs = runs[who]
        t = common.median([r["time"] for r in rs])
        anon = max(r["rss_anon"] for r in rs)
        rss = max(r["maxrss"] for r in rs)
        lines.append(f"| {who} | {what} | {size[who] / 2**30:.2f} GiB | {t:.1f} | "
                     f"{anon / 2**30:.2f} GiB ({anon / size[who]:.2f}x) | "
                     f"{rss / 2**30:.2f} GiB ({rss / size[who]:.2f}x) |")
    ratio = (common.median([r["time"] for r in runs["ee-jax"]])
             / common.median([r["time"] for r in runs["transformers"]]))
    lines.append(f"\nee-jax / transformers load time: {ratio:.2f}x")
    return lines


def ckpt_bench_serve(meg: Path, batches: list[int], new_tokens: int, threshold: float) -> list[str]:
    import dataclasses

    from ee_jax.models.loading import load_model
    from ee_jax.serving.controller import ControllerConfig
    from ee_jax.serving.params import greedy

    model = load_model(str(meg), progress=True)
    ec, heads = model.exits
    ec = dataclasses.replace(ec, policy="per_row", threshold=threshold)
    lines = [f"Exits {list(ec.exit_layers)} (head {ec.head}, own outputs, exit norm), "
             f"threshold {threshold}, policy per_row, greedy, {new_tokens} new tokens, "
             f"prompts of 32 random tokens.", "",
             "| batch | full depth tok/s | exits tok/s | ratio | ideal (heads, checks, back-fill "
             "counted) | rows per exit layer | compile s (full / exits) |",
             "|---|---|---|---|---|---|---|"]
    for b in batches:
        prompts = common.random_prompts(model.config.vocab_size, b, 32, 33, seed=b)
        params = greedy(new_tokens, ignore_eos=True)
        # the baseline, stated: no exit config = early_exit=False (full depth)
        full = common.make_llm(model, None, None, b, 32 + new_tokens + 16)
        exits = common.make_llm(model, ec, heads, b, 32 + new_tokens + 16,
                                exit_control=ControllerConfig(mode="exits"))
        wf, mf = common.warm_and_serve(full, prompts, params)
        we, me = common.warm_and_serve(exits, prompts, params)
        common.check_lengths(mf, new_tokens), common.check_lengths(me, new_tokens)
        summary = common.exit_summary(me.stats, model.config, ec)
        lines.append(f"| {b} | {mf.e2e_tps():.1f} | {me.e2e_tps():.1f} | "
                     f"{me.e2e_tps() / mf.e2e_tps():.2f}x | {summary['ideal']:.2f}x | "
                     f"{{{summary['row_hist']}}} | "
                     f"{wf.compile_time:.0f} / {we.compile_time:.0f} |")
        common.log(lines[-1])
    return lines


def checkpoint_main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.load checkpoint",
                                description=CKPT_DOC.split("\n")[0])
    p.add_argument("--shape", choices=sorted(CKPT_SHAPES), default="1b")
    p.add_argument("--folder", type=Path, default=None,
                   help="where the checkpoints are written (default ~/.cache/ee-jax/bench/"
                   "ee-llm-<shape>)")
    p.add_argument("--rounds", type=int, default=2, help="measured loads of each")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--threshold", type=float, default=0.0005,
                   help="exit confidence (random weights: max_prob sits near 1/vocab)")
    p.add_argument("--load-dtype", choices=("float32", "float16"), default="float32",
                   help="what both loaders load to (float16: the file's own, nothing cast)")
    p.add_argument("--skip-load", action="store_true")
    p.add_argument("--skip-serve", action="store_true")
    args = p.parse_args(argv)
    folder = args.folder or Path.home() / ".cache" / "ee-jax" / "bench" / f"ee-llm-{args.shape}"
    t0 = time.perf_counter()
    hf, meg = ckpt_write(folder, args.shape)
    out = [common.report_header("python -m bench.load checkpoint " + " ".join(argv or []))]
    if not args.skip_load:
        out += ["", "### Loading", "", *ckpt_bench_load(hf, meg, args.rounds, args.load_dtype)]
    if not args.skip_serve:
        served = ckpt_bench_serve(meg, args.batches, args.new_tokens, args.threshold)
        out += ["", "### Served with its own exits", "", *served]
    print("\n".join(out))
    common.log(f"done in {time.perf_counter() - t0:.0f} s")
    return 0


# --------------------------------------------------------------------------- main


MODES = {"engine": engine_main, "http": http_main, "start": start_main,
         "checkpoint": checkpoint_main}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in MODES:
        print(__doc__)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    return MODES[argv[0]](argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
