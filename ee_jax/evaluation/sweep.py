"""End-to-end sweep: the serving engine with early exits against itself at full depth.

For each batch size, one engine per policy (thresholds vary per request through
`SamplingParams(exit_threshold=...)`, so one compiled set serves them all) and one at full
depth (policy "never"), in the same process. Prompts go in rounds; each round runs full
depth first and then every (policy, threshold), so drift in machine speed hits all alike.
Every engine is warmed up first; steps that compile are excluded from the timings (the
engine's own accounting) and compile time is reported apart.

Per configuration (greedy decoding):
* speedup: its decode tokens/s over full depth's (same batch, same prompts);
* mean layers: layers executed per generated token (under all/quorum every row of a step
  runs the batch's exit layer; under per_row each row its own), and the ideal speedup
  L / mean; the exit-layer histograms per decode step and per decode token; at batch 1
  only the first policy runs (with one row every batch rule is the same);
* free-running quality against the full-depth output of the same prompt: agreeing prefix
  (tokens before the first difference / full-depth length), match rate (equal positions /
  longer length), ROUGE-L F (on token ids), identical sequences, and the full model's mean
  NLL of the generated tokens (token-weighted);
* teacher-forced agreement: the engine is fed the full-depth tokens (`forced_tokens`) and
  what it predicted at each decode step is compared with them; the first token comes from
  the prefill (always full depth) and is not counted.
Token-weighted means pool all tokens of all prompts; ROUGE-L is averaged over prompts.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
from collections import Counter
from collections.abc import Callable, Mapping, Sequence

import numpy as np
from tqdm.auto import tqdm

from ee_jax.evaluation import compare
from ee_jax.models.config import ModelConfig
from ee_jax.models.exits.config import ExitConfig
from ee_jax.serving.controller import ControllerConfig
from ee_jax.serving.engine import EngineConfig, LLMEngine
from ee_jax.serving.params import RequestOutput, SamplingParams, greedy

FULL = "full depth"


@dataclasses.dataclass
class SweepRow:
    """One (workload, batch, policy, threshold); policy FULL for the full-depth engine."""

    workload: str
    batch: int
    policy: str
    threshold: float | None
    num_prompts: int = 0
    num_tokens: int = 0  # generated, free running
    decode_tokens_per_s: float = 0.0
    speedup: float = 1.0
    mean_layers: float = 0.0  # executed layers per generated token
    ideal_speedup: float = 1.0
    step_exit_counts: dict[int, int] = dataclasses.field(default_factory=dict)
    token_exit_counts: dict[int, int] = dataclasses.field(default_factory=dict)
    tf_agreement: float = 1.0
    prefix_agreement: float = 1.0
    match_rate: float = 1.0
    rouge_l: float = 1.0
    identical: float = 1.0
    nll: float = float("nan")
    compile_time: float = 0.0  # all its engine compiled (shared by thresholds and workloads)

    @property
    def label(self) -> str:
        return FULL if self.policy == FULL else f"{self.policy} @ {self.threshold:g}"

    @property
    def mean_token_layers(self) -> float:
        n = sum(self.token_exit_counts.values())
        return sum(k * v for k, v in self.token_exit_counts.items()) / n if n else 0.0

    def histogram(self, steps: bool = True) -> str:
        counts = self.step_exit_counts if steps else self.token_exit_counts
        return " ".join(f"{k}:{v}" for k, v in sorted(counts.items()))


@dataclasses.dataclass
class SweepResult:
    rows: list[SweepRow]
    # Full-depth outputs per (workload, batch): token ids per prompt, in prompt order.
    reference: dict[tuple[str, int], list[list[int]]]
    prompts: dict[str, list[list[int]]]


@dataclasses.dataclass
class _Acc:
    """Free-running speed and outputs of one configuration, summed over rounds."""

    decode_time: float = 0.0
    decode_tokens: int = 0
    decode_steps: int = 0
    layers_run: int = 0
    step_exits: Counter = dataclasses.field(default_factory=Counter)
    token_exits: Counter = dataclasses.field(default_factory=Counter)
    outputs: list[list[int]] = dataclasses.field(default_factory=list)
    tf_right: int = 0
    tf_total: int = 0


_ids = itertools.count()


def drive(engine: LLMEngine, prompts: Sequence[Sequence[int]],
          params: Sequence[SamplingParams]) -> list[RequestOutput]:
    """Serve the prompts to completion; outputs in prompt order."""
    rids = [f"eval-{next(_ids)}" for _ in prompts]
    for rid, p, sp in zip(rids, prompts, params, strict=True):
        engine.add_request(rid, list(p), sp)
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    bad = [o.error for o in done.values() if o.error]
    if bad:
        raise RuntimeError(f"requests failed during the evaluation: {bad[:3]}")
    return [done[rid] for rid in rids]


def _timed(engine: LLMEngine, acc: _Acc, prompts, params) -> list[RequestOutput]:
    s = engine.stats
    before = (s.decode_time, s.num_decode_tokens, s.num_decode_steps, s.decode_layers_run,
              dict(s.step_exit_counts))
    outs = drive(engine, prompts, params)
    # Time and tokens leave out steps that compiled (the engine's accounting); layers and
    # the histogram count every decode step.
    acc.decode_time += s.decode_time - before[0]
    acc.decode_tokens += s.num_decode_tokens - before[1]
    acc.decode_steps += s.num_decode_steps - before[2]
    acc.layers_run += s.decode_layers_run - before[3]
    acc.step_exits.update({k: v - before[4].get(k, 0) for k, v in s.step_exit_counts.items()
                           if v - before[4].get(k, 0)})
    for o in outs:
        acc.token_exits.update(o.exit_layers[1:])  # decode tokens (the first is prefill's)
        acc.outputs.append(list(o.token_ids))
    return outs


def run_sweep(cfg: ModelConfig, params, workloads: Mapping[str, Sequence[Sequence[int]]],
              exit_config: ExitConfig, heads, *, batches: Sequence[int] = (1, 8),
              thresholds: Sequence[float] = (0.8, 0.9), policies: Sequence[str] = ("all",),
              max_tokens: int = 128, ignore_eos: bool = False, round_size: int | None = None,
              tokenizer=None, engine_kwargs: Mapping | None = None,
              nll: Callable[[Sequence[int], Sequence[int]], np.ndarray] | None = None,
              progress: bool = True, log: Callable[[str], None] | None = None) -> SweepResult:
    """Serve every workload {name: prompts as token ids} at every batch size, at full depth
    and under every (policy, threshold); see the module docstring for what is measured.
    `nll(prompt, generated)` -> per-token NLL (e.g. `FullModelNLL`); skipped when None."""
    log = log or (lambda msg: None)
    exit_config.validate_for(cfg)
    prompts = {w: [list(p) for p in ps] for w, ps in workloads.items() if ps}
    longest = max(len(p) for ps in prompts.values() for p in ps)
    rows: list[SweepRow] = []
    reference: dict[tuple[str, int], list[list[int]]] = {}

    def settings_at(B):  # with one row every batch rule is the same: run the first only
        return [(pol, thr) for pol in (policies[:1] if B == 1 else policies)
                for thr in thresholds]

    n_req = sum(map(len, prompts.values())) * sum(1 + 2 * len(settings_at(B))
                                                   for B in batches)
    log(f"{n_req} requests of up to {max_tokens} tokens in all (full depth, then each "
        f"configuration free-running and teacher-forced)")
    for B in batches:
        settings = settings_at(B)
        pols = list(dict.fromkeys(pol for pol, _ in settings))
        # exits always: the sweep measures each exit setting (the controller could run full depth)
        kw = dict(max_num_seqs=B, max_model_len=_round_up(longest + max_tokens + 1, 16),
                  exit_control=ControllerConfig(mode="exits"))
        kw.update(engine_kwargs or {})
        econf = EngineConfig.make(**kw)
        log(f"batch {B}: building {1 + len(pols)} engines (full depth + {', '.join(pols)})")
        engines = {FULL: LLMEngine(cfg, params, tokenizer, econf,
                                   dataclasses.replace(exit_config, policy="never"), heads)}
        for pol in pols:
            engines[pol] = LLMEngine(cfg, params, tokenizer, econf,
                                     dataclasses.replace(exit_config, policy=pol), heads)
        for name, eng in engines.items():  # warm-up: compiles the common programs
            for ps in prompts.values():
                drive(eng, ps[:B], [greedy(4, exit_threshold=thresholds[0] if thresholds
                                           else None)] * len(ps[:B]))
            log(f"  warm-up {name}: {eng.stats.num_compiles} programs, "
                f"{eng.stats.compile_time:.1f}s compile")
        for w, ps in prompts.items():
            accs = {FULL: _Acc(), **{s: _Acc() for s in settings}}
            size = round_size or max(4 * B, 8)
            rounds = [ps[i:i + size] for i in range(0, len(ps), size)]
            bar = tqdm(total=len(rounds) * (1 + len(settings)), desc=f"{w} batch {B}",
                       unit="config", file=sys.stderr, disable=not progress, leave=False)
            for rnd in rounds:
                sp = greedy(max_tokens, ignore_eos=ignore_eos)
                refs = [o.token_ids for o in _timed(engines[FULL], accs[FULL], rnd,
                                                    [sp] * len(rnd))]
                bar.update(1)
                for pol, thr in settings:
                    acc = accs[(pol, thr)]
                    sp = greedy(max_tokens, ignore_eos=ignore_eos, exit_threshold=thr)
                    _timed(engines[pol], acc, rnd, [sp] * len(rnd))
                    forced = [greedy(len(r), ignore_eos=ignore_eos, exit_threshold=thr,
                                     forced_tokens=tuple(r)) for r in refs]
                    for o, r in zip(drive(engines[pol], rnd, forced), refs, strict=True):
                        pred = o.predicted_token_ids or []
                        acc.tf_right += compare.num_matches(pred[1:], r[1:])
                        acc.tf_total += len(r) - 1
                    bar.update(1)
            bar.close()
            ref = accs[FULL].outputs
            reference[(w, B)] = ref
            full_tps = _tps(accs[FULL])
            for key, acc in accs.items():
                pol, thr = (FULL, None) if key == FULL else key
                row = _row(w, B, pol, thr, acc, ref, cfg.n_layers, full_tps)
                if nll is not None:
                    row.nll = _mean_nll(nll, ps, acc.outputs, progress, f"NLL {row.label}")
                rows.append(row)
                log(f"  {w} batch {B} {row.label}: {row.decode_tokens_per_s:.1f} tok/s "
                    f"({row.speedup:.2f}x), mean layers {row.mean_layers:.1f}, tf agreement "
                    f"{row.tf_agreement:.3f}, ROUGE-L {row.rouge_l:.3f}, NLL {row.nll:.3f}")
        for row in rows:  # every program the engine compiled, over all workloads
            if row.batch == B:
                row.compile_time = engines[row.policy].stats.compile_time
        del engines
    return SweepResult(rows, reference, prompts)


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def _tps(acc: _Acc) -> float:
    return acc.decode_tokens / acc.decode_time if acc.decode_time else 0.0


def _row(w, B, pol, thr, acc: _Acc, ref, L, full_tps) -> SweepRow:
    outs = acc.outputs
    n_ref = sum(len(r) for r in ref)
    # Executed layers per generated token (= per decode step under the batch-wide rules;
    # per row under per_row).
    n_tok = sum(acc.token_exits.values())
    mean = (sum(k * v for k, v in acc.token_exits.items()) / n_tok if n_tok else float(L))
    pairs = list(zip(outs, ref, strict=True))
    return SweepRow(
        workload=w, batch=B, policy=pol, threshold=thr, num_prompts=len(outs),
        num_tokens=sum(len(o) for o in outs), decode_tokens_per_s=_tps(acc),
        speedup=_tps(acc) / full_tps if full_tps else float("nan"),
        mean_layers=mean, ideal_speedup=L / mean if mean else 1.0,
        step_exit_counts=dict(acc.step_exits), token_exit_counts=dict(acc.token_exits),
        tf_agreement=acc.tf_right / acc.tf_total if acc.tf_total else 1.0,
        prefix_agreement=sum(compare.common_prefix(o, r) for o, r in pairs) / max(1, n_ref),
        match_rate=(sum(compare.num_matches(o, r) for o, r in pairs)
                    / max(1, sum(max(len(o), len(r)) for o, r in pairs))),
        rouge_l=float(np.mean([compare.rouge_l(o, r) for o, r in pairs])) if pairs else 1.0,
        identical=float(np.mean([o == r for o, r in pairs])) if pairs else 1.0)


def _mean_nll(nll, prompts, outputs, progress, desc) -> float:
    total, n = 0.0, 0
    for p, o in tqdm(list(zip(prompts, outputs, strict=True)), desc=desc, unit="seq",
                     file=sys.stderr, disable=not progress, leave=False):
        v = nll(p, o)
        total += float(np.sum(v))
        n += len(v)
    return total / n if n else float("nan")
