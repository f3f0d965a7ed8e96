"""Teacher-forced (TF) evaluation of exit heads on the model's own full-depth answers, with
the heads' and checks' costs counted (an exit that saves layers but pays a head and checks
at every exit below it must be counted whole, or the speed-up is flattered).

    python -m ee_jax.evaluation.teacher_forced --heads runs/tune-smollm2-135m-v2/exit_heads \
        --out docs/eval/issue12

Workloads: held-out instructions ("eval" split), HumanEval prompts (code completion), and
`prompts.GENERAL_CHAT` (everyday chat the tuning never touches). The model answers each at
full depth (greedy, cached as JSON lines); then every answer position is scored as served:
the exit taken by the decision rule at a threshold, its token against full depth's (TF
agreement), its executed layers, and the ideal speed-up (L + head) / (layers + checks + head)
from `exit_cost.cost_model`. Prompt positions do not count (they are not served tokens).

What it does not see: a served token that left at layer e leaves back-filled keys and values in
layers e+1..L (`docs/architecture.md`, "holes in the KV cache"), and the tokens after it attend
to those. Here every context is full depth, so a token that runs every layer always agrees; as
served it need not (`bench/shipped_exits.py` measures TF agreement through the engine, split
into full-depth and early tokens). Read these figures as an upper bound on served agreement.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

from ee_jax.evaluation import prompts as P
from ee_jax.evaluation.layerwise import ExitPredictions, exit_predictions
from ee_jax.evaluation.simulate import simulate_exits
from ee_jax.models.exits import cost as exit_cost
from ee_jax.models.exits.checkpoint import load_exit_heads
from ee_jax.models.loading import load_model
from ee_jax.training.selfgen import self_generate

SKETCH = {21: 0.67, 24: 0.79, 27: 0.84}  # per-exit agreement of the planning sketch


def _log(msg: str) -> None:
    print(f"[tf-eval {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def workload_items(n_instructions: int, n_humaneval: int) -> dict[str, list[tuple[str, str]]]:
    return {"held-out instructions": [("chat", s) for s in
                                      P.held_out_instructions(n_instructions)],
            "HumanEval": [("code", p["prompt"]) for p in P.humaneval_problems(n_humaneval)],
            "general chat (never tuned on)": [("chat", s) for s in P.GENERAL_CHAT]}


def answers(model, items: list[tuple[str, str]], cache: Path, max_tokens: int
            ) -> tuple[list[list[int]], list[int]]:
    """(prompt + full-depth answer ids, index of the first position predicting the answer)."""
    seqs = self_generate(model, items, max_tokens=max_tokens, batch=48, cache=cache)
    tok = model.tokenizer
    starts = []
    for (kind, text), ids in zip(items, seqs, strict=True):
        prompt = (P.chat_prompts(tok, [text])[0] if kind == "chat" else list(tok.encode(text)))
        n = len(prompt) if ids[:len(prompt)] == prompt else 1
        starts.append(max(n - 1, 0))
    return seqs, starts


def oracle_counts(pred: ExitPredictions) -> dict[int, int]:
    """Exit histogram of the oracle: each token at its first exit agreeing with full depth."""
    any_ok = pred.agree.any(axis=0)
    first = pred.agree.argmax(axis=0)
    layers = np.where(any_ok, np.asarray(pred.exit_layers)[first], pred.n_layers)
    v, c = np.unique(layers, return_counts=True)
    return {int(a): int(b) for a, b in zip(v, c, strict=True)}


def evaluate_heads(model, variants: dict, workloads: dict, thresholds: dict, *,
                   cache: Path, max_tokens: int = 96, seq_len: int = 256,
                   dump: Path | None = None) -> dict:
    """variants {name: (ExitConfig, heads)}; thresholds {name: [thresholds]}. dump: a folder
    for the raw per-exit confidence and agreement arrays (re-simulate any threshold)."""
    cfg, params = model.config, model.params
    out: dict = {"workloads": {}}
    for wname, items in workloads.items():
        seqs, starts = answers(model, items, cache, max_tokens)
        n_tok = sum(len(s) - k for s, k in zip(seqs, starts, strict=True))
        _log(f"{wname}: {len(seqs)} answers, {n_tok} scored positions")
        preds = exit_predictions(cfg, params, seqs, variants, seq_len=seq_len, rows=2,
                                 progress=False, desc=wname, score_from=starts)
        res: dict = {"prompts": len(seqs), "scored_tokens": int(n_tok), "variants": {}}
        if dump is not None:
            dump.mkdir(parents=True, exist_ok=True)
            np.savez_compressed(dump / f"{wname.split()[0].lower()}.npz", **{
                f"{v}_{k}": getattr(p, k) for v, p in preds.items()
                for k in ("confidence", "agree")})
        answer_tokens = np.concatenate([np.asarray(s[k + 1:]) for s, k in
                                        zip(seqs, starts, strict=True)])
        for vname, pred in preds.items():
            ec, heads = variants[vname]
            cost = exit_cost.cost_model(cfg, ec)
            sims = simulate_exits(pred, thresholds[vname], cost=cost)
            oracle = oracle_counts(pred)
            v: dict = {
                "per_exit_agreement": dict(zip(map(int, pred.exit_layers),
                                               pred.agreement().round(4).tolist(),
                                               strict=True)),
                "oracle_mean_layers": float(sum(k * c for k, c in oracle.items())
                                            / max(1, pred.num_tokens)),
                "oracle_ideal_with_head": cost.ideal_speedup(oracle),
                "simulated": [dataclasses.asdict(s) for s in sims]}
            if heads.vocab is not None:
                v["subset_coverage_of_answers"] = float(
                    np.isin(answer_tokens, np.asarray(heads.vocab)).mean())
            res["variants"][vname] = v
            for s in sims:
                _log(f"  {vname} @ {s.threshold}: TF {s.agreement:.3f}, layers "
                     f"{s.mean_layers:.2f}, ideal {s.ideal_speedup:.3f}x, with head "
                     f"{s.ideal_with_head:.3f}x")
        out["workloads"][wname] = res
    return out


def resimulate(res: dict, dump: Path, variants: dict, thresholds: dict, cfg) -> dict:
    """A saved evaluation (`res`, its `--dump` folder) at other thresholds: the same heads'
    per-exit confidences and agreements, re-read, not recomputed (a threshold changes
    nothing upstream of `simulate_exits`). variants {name: ExitConfig}."""
    import copy

    out = copy.deepcopy(res)
    for wname, w in out["workloads"].items():
        z = np.load(dump / f"{wname.split()[0].lower()}.npz")
        for vname, v in w["variants"].items():
            if vname not in thresholds:
                continue
            ec = variants[vname]
            pred = ExitPredictions(ec, cfg.n_layers, z[f"{vname}_confidence"],
                                   z[f"{vname}_agree"])
            sims = simulate_exits(pred, thresholds[vname], cost=exit_cost.cost_model(cfg, ec))
            v["simulated"] = [dataclasses.asdict(s) for s in sims]
            for s in sims:
                _log(f"  {wname} {vname} @ {s.threshold}: TF {s.agreement:.3f}, layers "
                     f"{s.mean_layers:.2f}, with head {s.ideal_with_head:.3f}x")
    return out


def to_markdown(res: dict) -> str:
    lines = [f"# Teacher-forced exits on the model's own answers ({res['date']})", "",
             f"Command: `{res['command']}`", "", *(
                 [res["note"], ""] if res.get("note") else []),
             "TF agreement: share of answer tokens whose exit token equals full depth's, "
             "context always the full-depth answer. Ideal with head: (L + final head) / "
             "(layers + checks + exit head), in layer-equivalents (`exit_cost.cost_model`).", ""]
    for wname, w in res["workloads"].items():
        lines += [f"## {wname} ({w['prompts']} prompts, {w['scored_tokens']} answer tokens)",
                  "", "| heads | threshold | TF agreement | mean layers | ideal L/layers | "
                  "ideal with head | exit histogram (layer:tokens) |",
                  "|---|---|---|---|---|---|---|"]
        for vname, v in w["variants"].items():
            for s in v["simulated"]:
                hist = " ".join(f"{k}:{c}" for k, c in sorted(s["exit_counts"].items(),
                                                              key=lambda kc: int(kc[0])))
                lines.append(f"| {vname} | {s['threshold']:g} | {s['agreement']:.3f} | "
                             f"{s['mean_layers']:.2f} | {s['ideal_speedup']:.3f}x | "
                             f"{s['ideal_with_head']:.3f}x | {hist} |")
        lines += ["", "| heads | per-exit agreement with full depth | oracle mean layers | "
                  "oracle ideal with head | subset coverage |", "|---|---|---|---|---|"]
        for vname, v in w["variants"].items():
            ag = " ".join(f"{k}:{a:.2f}" for k, a in v["per_exit_agreement"].items())
            cov = v.get("subset_coverage_of_answers")
            lines.append(f"| {vname} | {ag} | {v['oracle_mean_layers']:.2f} | "
                         f"{v['oracle_ideal_with_head']:.3f}x | "
                         f"{'-' if cov is None else f'{cov:.3f}'} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def _write(out: Path, res: dict) -> int:
    """results.json and results.md of one evaluation (or re-simulation) in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / "results.md").write_text(to_markdown(res))
    _log(f"wrote {out / 'results.md'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", required=True, help="folder of the exit heads to evaluate")
    ap.add_argument("--baseline", default="shipped",
                    help="'shipped' (the model's shipped heads), a folder, or 'none'")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--instructions", type=int, default=48)
    ap.add_argument("--humaneval", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--workloads", nargs="*", default=None,
                    help="first words of the workloads to run (held-out, HumanEval, general)")
    ap.add_argument("--thresholds", type=float, nargs="*", default=None,
                    help="thresholds for the new heads (default: calibrated, and nearby)")
    ap.add_argument("--cache", default="runs/eval-v2/selfgen.jsonl")
    ap.add_argument("--out", default="docs/eval/issue12")
    ap.add_argument("--dump", default="runs/eval-v2/predictions",
                    help="folder for raw per-exit predictions ('' for none)")
    ap.add_argument("--resimulate", default=None, metavar="RESULTS_JSON",
                    help="re-simulate a saved evaluation (its results.json; --dump: its "
                         "predictions) at --thresholds with --heads' config, no forward pass")
    a = ap.parse_args(argv)
    command = "python -m ee_jax.evaluation.teacher_forced " + " ".join(argv or sys.argv[1:])
    if a.resimulate:
        old = json.loads(Path(a.resimulate).read_text())
        cfg = load_model(a.model, dtype="float32", progress=False).config
        ec, _ = load_exit_heads(a.heads, cfg)
        thr = sorted({ec.threshold, *(a.thresholds or ())})
        res = resimulate(old, Path(a.dump), {"new": ec}, {"new": thr}, cfg)
        res.update(date=time.strftime("%Y-%m-%d %H:%M"), command=command, heads=str(a.heads),
                   calibrated_threshold=ec.threshold, target_agreement=ec.target_agreement,
                   note=f"Re-simulated from the per-exit predictions of `{old['command']}` "
                        f"({old['date']}; the same heads, so the same confidences): only the "
                        f"thresholds are new. The baseline rows are that run's.")
        return _write(Path(a.out), res)

    model = load_model(a.model, dtype="float32", progress=False)
    ec, heads = load_exit_heads(a.heads, model.config)
    variants = {"new": (ec, heads)}
    thr = a.thresholds or sorted({ec.threshold, *(t for t in (0.5, 0.6, 0.7, 0.8, 0.9)
                                                  if t != ec.threshold)})
    thresholds = {"new": [t for t in thr if np.isfinite(t)]}
    if a.baseline != "none":
        base = (model.shipped_exit_heads() if a.baseline == "shipped"
                else load_exit_heads(a.baseline, model.config))
        if base is not None:
            variants["baseline"] = base
            thresholds["baseline"] = [0.8, 0.9]
    work = workload_items(a.instructions, a.humaneval)
    if a.workloads:
        work = {k: v for k, v in work.items() if k.split()[0] in a.workloads}
    res = evaluate_heads(model, variants, work,
                         thresholds, cache=Path(a.cache), max_tokens=a.max_tokens,
                         dump=Path(a.dump) if a.dump else None)
    res.update(date=time.strftime("%Y-%m-%d %H:%M"), command="python -m "
               "ee_jax.evaluation.teacher_forced " + " ".join(argv or sys.argv[1:]),
               heads=str(a.heads), calibrated_threshold=ec.threshold,
               target_agreement=ec.target_agreement)
    return _write(Path(a.out), res)


if __name__ == "__main__":
    raise SystemExit(main())
