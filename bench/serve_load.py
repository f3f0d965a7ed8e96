"""Load on the live HTTP server: N concurrent streaming clients at a sweep of request rates.

    python -m bench.serve_load                          # SmolLM2, full depth vs early exit
    python -m bench.serve_load --random --requests 16 --rates 4 inf --max-tokens 8   # smoke

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
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import time

import httpx
from tqdm.auto import tqdm

from ee_jax.serving.server.run import free_port

MODES = {"full": "full depth (--no-early-exit: the full-depth program)",
         "early": "early exit (shipped heads; --random: untrained, layers 1,2,3, threshold 0)"}


def log(msg: str) -> None:
    print(f"[serve_load {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def chats(n: int) -> list[list[dict]]:
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


def percentile(xs: list[float], q: float) -> float:
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
        deadline = time.monotonic() + args.start_timeout
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"serve_load: the server exited ({self.proc.returncode})")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise SystemExit("serve_load: the server did not come up in time")
            time.sleep(0.5)

    def metrics(self) -> dict[str, float]:
        from prometheus_client.parser import text_string_to_metric_families

        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(httpx.get(self.url + "/metrics").text):
            for s in fam.samples:
                if not s.labels:
                    out[s.name] = s.value
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


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


def summarize(results: list[Result]) -> dict:
    ok = [r for r in results if r.ok]
    tokens = sum(r.tokens for r in ok)
    span = (max(r.done for r in ok) - min(r.sent for r in ok)) if ok else math.nan
    ttft = [r.first - r.sent for r in ok if r.first is not None]
    itl = [x for r in ok for x in r.itls]
    exits = [r.mean_exit for r in ok if r.mean_exit is not None]
    return {"completed": len(ok), "errors": len(results) - len(ok),
            "tok_per_s": tokens / span if ok else 0.0, "req_per_s": len(ok) / span if ok else 0.0,
            "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
            "itl_p50": percentile(itl, 50), "itl_p99": percentile(itl, 99),
            "mean_exit_layer": statistics.mean(exits) if exits else math.nan,
            "first_error": next((r.error for r in results if not r.ok), None)}


# ----------------------------------------------------------------------------- offline


def offline(args, mode: str, prompts: list[list[dict]]) -> dict:
    """LLM.generate on the same chats and parameters (warm-up call first, then one timed)."""
    from ee_jax.random_model import random_model
    from ee_jax.serving.llm import LLM
    from ee_jax.serving.params import SamplingParams

    kw = dict(max_num_seqs=args.clients, max_model_len=args.max_model_len, progress=False)
    if mode == "full":
        kw["early_exit"] = False
    elif args.random:
        from ee_jax.models.exit_config import ExitConfig

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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--random", action="store_true", help="tiny random model (smoke run)")
    p.add_argument("--modes", nargs="+", default=["full", "early"], choices=list(MODES))
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
    prompts = chats(args.requests)
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
                row = {"mode": mode, "rate": rate, **summarize(res),
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
            offline_rows[mode] = offline(args, mode, prompts)
            log(f"{mode}: LLM.generate {offline_rows[mode]['tok_per_s']:.1f} tok/s")
    print(report(args, rows, offline_rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "offline": offline_rows}, f, indent=1)
    return 0 if all(r["errors"] == 0 for r in rows) else 1


def report(args, rows: list[dict], offline_rows: dict) -> str:
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


if __name__ == "__main__":
    sys.exit(main())
