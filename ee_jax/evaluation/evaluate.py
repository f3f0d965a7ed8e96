"""`ee-jax eval`: everything the evaluation measures, from one set of options.

    1. per exit layer on held-out text, untrained vs tuned heads (ee_jax.evaluation.layerwise)
    2. teacher-forced simulation of batch-1 exits (ee_jax.evaluation.simulate)
    3. end to end with the serving engine (ee_jax.evaluation.sweep)
and writes the report (ee_jax.evaluation.report).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from ee_jax.evaluation import prompts as P
from ee_jax.evaluation.layerwise import exit_predictions
from ee_jax.evaluation.nll import FullModelNLL
from ee_jax.evaluation.report import EvalReport, write_report
from ee_jax.evaluation.simulate import simulate_exits
from ee_jax.evaluation.sweep import run_sweep
from ee_jax.models import registry
from ee_jax.models.exits import heads as exit_heads
from ee_jax.models.exits.checkpoint import load_exit_heads
from ee_jax.models.exits.config import POLICIES, ExitConfig, every
from ee_jax.models.loading import LoadedModel, load_model

WORKLOADS = ("humaneval", "instructions")


def default_policies() -> tuple[str, ...]:
    return tuple(p for p in ("all", "quorum", "per_row") if p in POLICIES)


@dataclasses.dataclass(frozen=True)
class EvalOptions:
    model: str = "smollm2-135m-instruct"
    dtype: str = "float32"
    exit_heads: str | None = None  # None: the model's shipped heads, if it has any
    limit: int | None = None  # prompts per workload (None: all 164 HumanEval, as many instr.)
    max_tokens: int = 128
    batches: tuple[int, ...] = (1, 8)
    thresholds: tuple[float, ...] = (0.6, 0.7, 0.8, 0.9, 0.95)
    policies: tuple[str, ...] = dataclasses.field(default_factory=default_policies)
    workloads: tuple[str, ...] = WORKLOADS
    ignore_eos: bool = False
    round_size: int | None = None
    dense_tokens: int = 16384  # held-out tokens per corpus for the per-layer measurements
    dense_seq_len: int = 256
    dense_rows: int = 2
    skip_dense: bool = False
    skip_e2e: bool = False
    nll: bool = True
    out_dir: str = "docs"
    progress: bool = True
    command: str = "ee-jax eval"


def log(msg: str) -> None:
    print(f"[eval {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def shipped_heads(model: LoadedModel) -> tuple[str, ExitConfig, object] | None:
    """The heads shipped for a registry model: (description, ExitConfig, heads), or None."""
    shipped = model.shipped_exit_heads()
    if shipped is None:
        return None
    return (f"shipped with {model.name} ({registry.shipped_exit_heads(model.name)})",
            *shipped)


def evaluate(opts: EvalOptions, *, model: LoadedModel | None = None,
             heads: tuple[str, ExitConfig, object] | None = None,
             workloads: Mapping[str, Sequence[Sequence[int]]] | None = None,
             corpora: Mapping[str, Sequence[Sequence[int]]] | None = None,
             engine_kwargs: Mapping | None = None) -> EvalReport:
    """Run the evaluation and write the report into opts.out_dir.

    model, heads ((description, ExitConfig, heads)), workloads (prompt token ids per name)
    and corpora (held-out token ids per name) default to what `opts` names; tests pass
    their own.
    """
    if model is None:
        model = load_model(opts.model, dtype=opts.dtype, progress=opts.progress)
    cfg, params, tok = model.config, model.params, model.tokenizer
    if heads is None and opts.exit_heads:
        heads = (str(opts.exit_heads), *load_exit_heads(opts.exit_heads, cfg))
    if heads is None:
        heads = shipped_heads(model)
    notes = []
    has_tuned = heads is not None
    if not has_tuned:
        ec = ExitConfig(exit_layers=every(cfg.n_layers, max(1, cfg.n_layers // 8)))
        heads = ("none (untrained heads)", ec, exit_heads.init_heads(cfg, ec, params))
        notes.append("No tuned heads given or shipped: the end-to-end rows use untrained "
                     "heads, and there are no tuned columns.")
        log(notes[-1])
    desc, ec, tuned = heads
    exit_heads.check_heads(cfg, ec, tuned)
    report = EvalReport(command=opts.command, date=time.strftime("%Y-%m-%d %H:%M"),
                        model=f"{opts.model} ({model.source})", heads=desc, exit_config=ec,
                        n_layers=cfg.n_layers, notes=notes)

    if workloads is None:
        workloads = _default_workloads(opts, tok)
    if not opts.skip_e2e:
        log(f"end to end: {', '.join(f'{w} ({len(p)} prompts)' for w, p in workloads.items())}"
            f"; batches {list(opts.batches)}, policies {list(opts.policies)}, thresholds "
            f"{list(opts.thresholds)}, {opts.max_tokens} tokens max")
        res = run_sweep(cfg, params, workloads, ec, tuned, batches=opts.batches,
                        thresholds=opts.thresholds, policies=opts.policies,
                        max_tokens=opts.max_tokens, ignore_eos=opts.ignore_eos,
                        round_size=opts.round_size, tokenizer=tok,
                        engine_kwargs=engine_kwargs,
                        nll=FullModelNLL(cfg, params) if opts.nll else None,
                        progress=opts.progress, log=log)
        report.sweep = res.rows
        if corpora is None and "instructions" in res.prompts:
            b = opts.batches[0]
            answers = [p + r for p, r in zip(res.prompts["instructions"],
                                             res.reference[("instructions", b)], strict=True)]
            corpora = {**_default_corpora(opts, tok), "instructions + full-depth answers":
                       P.cap_tokens(answers, opts.dense_tokens)}

    if not opts.skip_dense:
        if corpora is None:
            corpora = _default_corpora(opts, tok)
        untrained_ec = ExitConfig(exit_layers=ec.exit_layers, head="norm", measure="max_prob",
                                  min_exit_layer=ec.min_exit_layer)
        variants = {"untrained": (untrained_ec, exit_heads.init_heads(cfg, untrained_ec, params))}
        if has_tuned:
            variants["tuned"] = (ec, tuned)
        for name, seqs in corpora.items():
            log(f"per-layer: {name}, {sum(map(len, seqs))} tokens")
            preds = exit_predictions(cfg, params, seqs, variants, seq_len=opts.dense_seq_len,
                                     rows=opts.dense_rows, progress=opts.progress, desc=name)
            report.layers[name] = preds
            report.simulations[name] = {v: simulate_exits(p, opts.thresholds)
                                        for v, p in preds.items()}
            for v, p in preds.items():
                log(f"  {v}: agreement by layer " + " ".join(
                    f"{e}:{a:.2f}" for e, a in zip(p.exit_layers, p.agreement(), strict=True)))

    paths = write_report(report, Path(opts.out_dir))
    log("wrote " + ", ".join(map(str, paths)))
    return report


def _default_workloads(opts: EvalOptions, tok) -> dict[str, list[list[int]]]:
    if tok is None:
        raise ValueError("this model has no tokenizer: pass workloads as token ids")
    out = {}
    if "humaneval" in opts.workloads:
        out["humaneval"] = P.humaneval_prompts(tok, opts.limit)
    if "instructions" in opts.workloads:
        n = opts.limit if opts.limit is not None else len(P.humaneval_problems())
        out["instructions"] = P.chat_prompts(tok, P.held_out_instructions(n))
    unknown = set(opts.workloads) - set(WORKLOADS)
    if unknown:
        raise ValueError(f"unknown workloads {sorted(unknown)}; choose from {WORKLOADS}")
    return out


def _default_corpora(opts: EvalOptions, tok) -> dict[str, list[list[int]]]:
    if tok is None:
        raise ValueError("this model has no tokenizer: pass corpora as token ids")
    n = opts.dense_tokens
    return {"HumanEval prompt + canonical solution": P.cap_tokens(P.humaneval_text(tok), n),
            "stdlib sources (eval split)": P.cap_tokens(P.stdlib_text(tok, n), n)}
