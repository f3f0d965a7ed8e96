"""Timed decode speed of the shipped exit heads against full depth (whether the exits pay as
served, not only teacher-forced), on the three workloads the teacher-forced evaluation uses.

    python -m bench.shipped_exits --out docs/benchmarks.md
    python -m bench.shipped_exits --tiny --prompts 2 --new-tokens 6 --repeats 1   # smoke test

Method, in one process, per workload and (batch, policy):

1. Reference: the engine built with `early_exit=False` (the fastest full-depth program: no
   exit checks compiled in) generates each prompt's greedy answer (--new-tokens at most,
   stopping at EOS as a user's request would).
2. Both engines then decode the same sequences, the reference tokens forced
   (`SamplingParams.forced_tokens`), so their speeds compare like for like; the exit engine's
   own predictions give the teacher-forced (TF) agreement with full depth.
3. Warm-up: one pass each (compile time reported apart). Then --repeats rounds with the two
   engines interleaved, the order alternating; decode tokens/s is the engine's own (decode
   steps' time), and the ratio is of the medians. Every pass records the share of the CPU
   other processes used meanwhile (contention): on a shared machine the ratio is the figure
   to read, and the per-round ratios show its spread.
4. Exit figures of the exit engine: mean executed layers per decoded row, the row exit
   histogram and the ideal with head and check costs ((L + head) / (layers + checks + exit
   head), the engine's cost model).

Workloads: held-out instructions (`data.instructions("eval")`, chat template), HumanEval
prompts (raw), everyday chat (`prompts.GENERAL_CHAT`, chat template).

--maps-f32: beside each back-fill with maps (learned, deferred_learned), the same exit engine
with its maps cast to f32 (they are held in bf16 as loaded, `backfill_maps.MAP_DTYPE`), in
the same interleaved rounds:

    python -m bench.shipped_exits --workloads instructions --batch-runs 1:all
        --backfills deferred_learned --maps-f32 --prompts 12 --new-tokens 32 --repeats 6

`--out FILE` (re)writes the section between this benchmark's marks in FILE with the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import (
    agreement,
    exit_summary,
    forced_params,
    log,
    make_llm,
    report_header,
    serve,
    write_marked,
)
from ee_jax.models.exits.config import BACKFILLS, uses_maps

MARK = ("<!-- bench.shipped_exits:begin -->", "<!-- bench.shipped_exits:end -->")
WORKLOADS = ("instructions", "humaneval", "chat")


def workload_prompts(model, kind: str, n: int) -> list[list[int]]:
    from ee_jax.evaluation import prompts as P

    tok = model.tokenizer
    if kind == "instructions":
        return P.chat_prompts(tok, P.held_out_instructions(n))
    if kind == "humaneval":
        return P.humaneval_prompts(tok, n)
    if kind == "chat":
        return P.chat_prompts(tok, P.GENERAL_CHAT[:n])
    raise SystemExit(f"unknown workload {kind!r}; choose from {WORKLOADS}")


def tiny_setup(n: int):
    """A 4-layer random model, random prompts and untrained candidate heads (smoke test)."""
    from ee_jax.models import llama
    from ee_jax.models.exits import backfill_maps
    from ee_jax.models.exits import heads as exit_heads
    from ee_jax.models.exits.config import ExitConfig
    from ee_jax.models.loading import LoadedModel
    from ee_jax.testing import tiny_config

    cfg = tiny_config(eos_token_ids=(), max_position=2048)
    params = llama.init_params(cfg, jax.random.PRNGKey(0), scale=0.4)
    ec = ExitConfig(exit_layers=(1, 2, 3), head="mlp", adapter_rank=8,
                    measure="candidates", candidates=4, threshold=0.5)
    heads = exit_heads.init_heads(cfg, ec, params, jax.random.PRNGKey(1))
    heads = heads.replace(backfill=backfill_maps.zero_maps(cfg, ec.exit_layers))  # = propagate
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, cfg.vocab_size, int(rng.integers(10, 30))).tolist()
               for _ in range(n)]
    return LoadedModel(cfg, params, None, "tiny"), ec, heads, prompts


def split_agreement(outs, refs, n_layers: int) -> tuple[float, float, int]:
    """(TF agreement of the tokens that ran full depth, of the tokens that left early, number
    of early tokens). A full-depth token can still differ from the reference: the tokens
    before it that left early have back-filled keys and values in their skipped layers."""
    full, early = [], []
    for o, r in zip(outs, refs, strict=True):
        for p, f, e in zip(o.predicted_token_ids[1:], r[1:], o.exit_layers[1:], strict=True):
            (full if e >= n_layers else early).append(p == f)
    mean = lambda xs: float(np.mean(xs)) if xs else float("nan")  # noqa: E731
    return mean(full), mean(early), len(early)


def honest_ideal(cfg, ec, heads, stats) -> float:
    """The step-level ideal of the run (`EngineStats.ideal_speedup_with_head`): what its
    decode steps really ran under ec's back-fill, memory-bound at batch 1 (this CPU),
    compute-bound above."""
    from ee_jax.models.exits import backfill_maps

    rank = backfill_maps.rank_of(heads.backfill) if heads.backfill is not None else 0
    return stats.ideal_speedup_with_head(cfg, ec, memory_bound_batch=1, maps_rank=rank)


def verified_ideal(cfg, ec, stats) -> float:
    """The honest ideal of a verified-exits run (`exit_cost.verified_speedup`): its decode
    steps' layers, checks and heads per emitted token, memory-bound (riding queries free),
    against full depth's steps of as many rows."""
    from ee_jax.models.exits.cost import cost_model, verified_speedup

    rows = stats.num_decode_rows / max(1, stats.num_decode_steps)
    return verified_speedup(cost_model(cfg, ec), ec, stats.step_exit_counts,
                            stats.num_decode_tokens, batch=rows)


def compare(model, ec, heads, prompts, batch: int, new_tokens: int, repeats: int,
            backfills: tuple[str, ...], overhead: bool = False, default: bool = True,
            verify: tuple[tuple[int, float, str | None], ...] = (), verify_auto: bool = False,
            maps_f32: bool = False, temperature: float = 0.0) -> dict:
    """Full depth vs an exit engine per back-fill (the exit program always: controller mode
    "exits") on `prompts` at max_num_seqs=batch, all in the same interleaved rounds; with
    `default`, also the engine as a user gets it (the heads' back-fill, controller "auto"
    from the shipped calibration's prior: full depth wherever checks do not pay); with
    `overhead`, the exit engine at threshold 1.0 (every check runs, no row leaves: what the
    checks and the exit loop cost); per (max_draft, threshold, sampling rule or None: the
    config's) in `verify`, verified exits (`ExitConfig.verified`), which serve the prompts
    freely, greedy: lossless, their tokens must be the references (`agree` is then the share
    of sequences identical to them); `temperature` > 0: the verified engines and full depth
    serve seeded samples at it instead (full depth's are the references; rule "rejection"
    keeps the distribution, not the seeded tokens), full depth's speed from those;
    `verify_auto`: those under the controller as a user gets it ("auto", the heads' prior)
    instead of the exit program always; `maps_f32`: beside each back-fill with maps, the
    same engine with the maps cast to f32."""
    from ee_jax.serving.controller import ControllerConfig
    from ee_jax.serving.params import greedy

    L = model.config.n_layers
    max_len = -(-(max(map(len, prompts)) + new_tokens + 16) // 16) * 16
    full = make_llm(model, None, None, batch, max_len)
    refs = [o.token_ids for o in serve(full, prompts, greedy(new_tokens)).outputs]
    forced = ControllerConfig(mode="exits")
    ecs = {f"exits {bf}": dataclasses.replace(ec, backfill=bf) for bf in backfills}
    engines = {"full depth": full}
    engines.update({k: make_llm(model, e, heads, batch, max_len, exit_control=forced)
                    for k, e in ecs.items()})
    if maps_f32 and heads.backfill is not None:
        f32 = heads.replace(backfill=jax.tree.map(lambda v: jnp.asarray(v, jnp.float32),
                                                  heads.backfill))
        for bf in filter(uses_maps, backfills):
            ecs[f"exits {bf}, maps f32"] = ecs[f"exits {bf}"]
            engines[f"exits {bf}, maps f32"] = make_llm(model, ecs[f"exits {bf}"], f32, batch,
                                                        max_len, exit_control=forced)
    if default:
        ecs["default (auto)"] = ec
        engines["default (auto)"] = make_llm(  # as LLM() serves the shipped heads
            model, ec, heads, batch, max_len,
            exit_control=ControllerConfig(prior=model.shipped_exit_prior(ec) or None))
    verified = {}
    for d, t, rule in verify:
        name = (f"verified, max_draft {d}, threshold {t}" + (f", {rule}" if rule else "")
                + (" (auto)" if verify_auto else ""))
        ecs[name] = verified[name] = dataclasses.replace(ec, threshold=t).verified(d, rule)
        control = (ControllerConfig(prior=model.shipped_exit_prior(ecs[name]) or None)
                   if verify_auto else forced)
        engines[name] = make_llm(model, ecs[name], heads, batch, max_len, exit_control=control)
    if overhead:
        engines["checks only"] = make_llm(model, dataclasses.replace(ec, threshold=1.0), heads,
                                          batch, max_len, exit_control=forced)
    params = forced_params(refs)
    free = [greedy(len(r)) for r in refs]  # verified engines: the same tokens, unforced
    if temperature > 0:
        from ee_jax.serving.params import SamplingParams

        free = [SamplingParams(temperature=temperature, seed=i, max_tokens=new_tokens)
                for i in range(len(prompts))]
        vrefs = [o.token_ids for o in serve(full, prompts, free).outputs]
        verified["full depth"] = None  # serves `free` too
    else:
        vrefs = refs
    res = {k: dict(tps=[], contention=[], compile=0.0) for k in engines}
    for name, llm in engines.items():  # warm-up: every program these sequences need
        s = serve(llm, prompts, free if name in verified else params)
        res[name]["compile"] = s.compile_time
    for rep in range(repeats):
        order = list(engines) if rep % 2 == 0 else list(reversed(engines))  # interleaved
        tps = {}
        for name in order:
            s = serve(engines[name], prompts, free if name in verified else params)
            r = res[name]
            tps[name] = s.stats.decode_tokens_per_s
            r["tps"].append(tps[name])
            r["contention"].append(s.contention)
            if name in ecs and rep == 0:
                ex = exit_summary(s.stats, model.config, ecs[name])
                r.update(mean=ex["mean_layers"], hist=ex["row_hist"],
                         ideal=honest_ideal(model.config, ecs[name], heads, s.stats))
                if verified.get(name) is not None:  # lossless: the references' tokens
                    same = [o.token_ids == ref for o, ref in zip(s.outputs, vrefs, strict=True)]
                    r.update(agree=float(np.mean(same)), split=(float("nan"),) * 2 + (0,),
                             accept=s.stats.acceptance_rate, drafted=s.stats.num_drafted,
                             ideal=verified_ideal(model.config, ecs[name], s.stats))
                else:
                    r.update(agree=agreement(s.outputs, refs),
                             split=split_agreement(s.outputs, refs, L))
                ctl = engines[name].engine.controller
                r["program"] = ctl.summary() if ctl is not None else "-"
        log(f"    round {rep + 1}: " + ", ".join(f"{k} {v:.1f}" for k, v in tps.items())
            + " tok/s")
    for r in res.values():
        r["median"] = statistics.median(r["tps"])
        r["ratios"] = [a / b for a, b in zip(r["tps"], res["full depth"]["tps"], strict=True)]
    base = res["full depth"]["median"]
    checks = res.get("checks only", {}).get("median", float("nan"))
    contention = max(c for r in res.values() for c in r["contention"])
    return dict(full=base, checks_only=checks / base, contention=contention,
                tokens=sum(map(len, refs)), prompts=len(prompts),
                compile={k: r["compile"] for k, r in res.items()},
                engines={k: dict(tps=res[k]["median"], ratio=res[k]["median"] / base,
                                 ratios=res[k]["ratios"], mean=res[k].get("mean", L),
                                 hist=res[k].get("hist", ""), ideal=res[k].get("ideal", 1.0),
                                 agree=res[k].get("agree", 1.0), program=res[k].get("program"),
                                 accept=res[k].get("accept"), drafted=res[k].get("drafted"),
                                 split=res[k].get("split", (1.0, 1.0, 0))) for k in ecs})


def render(ctx) -> str:
    """The table with the command, date and machine on one line above and one line of legend
    below: the section `--out` writes."""
    out = [f"{report_header(ctx['command'])}. Weights: {ctx['weights']}. Exits: {ctx['heads']}. "
           f"{ctx['n_prompts']} prompts a workload at batch 1 (2 x batch above), full depth's "
           f"greedy answer ({ctx['new_tokens']} tokens at most) forced on every engine; "
           f"median of {ctx['repeats']} interleaved rounds after a warm-up pass. Baseline: the "
           f"engine built with `early_exit=False`."
           + (f" Full depth and the verified engines: seeded samples at temperature "
              f"{ctx['temperature']} (full depth's the references), not forced."
              if ctx.get("temperature") else ""), "",
           "| workload | batch, policy | engine | tokens | tok/s (full depth) | ratio (rounds) "
           "| TF agreement (full-depth tokens / early tokens) | mean layers / row | honest "
           "ideal | max contention | row exit histogram (layer:rows) |",
           "|---|---|---|---:|---:|---|---|---:|---:|---:|---|"]
    for (w, b, pol), r in ctx["rows"]:
        for name, e in r["engines"].items():
            rounds = ", ".join(f"{x:.2f}" for x in e["ratios"])
            quality = (f"{e['agree']:.3f} ({e['split'][0]:.3f} / {e['split'][1]:.3f})"
                       if e.get("accept") is None else
                       f"identical: {e['agree']:.3f} of sequences; acceptance "
                       f"{e['accept']:.3f} of {e['drafted']} drafts")
            out.append(f"| {w} | {b}, {pol} | {name} | {r['tokens']} | {e['tps']:.1f} "
                       f"({r['full']:.1f}) | **{e['ratio']:.2f}x** ({rounds}) | {quality} | "
                       f"{e['mean']:.2f} | {e['ideal']:.2f}x | {100 * r['contention']:.0f}% | "
                       f"{e['hist']} |")
        co = r["checks_only"]
        if co == co:
            out.append(f"| {w} | {b}, {pol} | checks only (threshold 1.0) | {r['tokens']} | "
                       f"- | {co:.2f}x | - | - | - | - | - |")
        progs = [f"{n}: {e['program']}" for n, e in r["engines"].items()
                 if (n.startswith("default") or n.endswith("(auto)")) and e.get("program")]
        if progs:
            out.append(f"| {w} | {b}, {pol} | (program) | | | {'; '.join(progs)} | | | | | |")
    out += ["", "Ratio: decode tok/s (the engines' own decode-step time) over full depth's, "
            "medians, each round's in brackets. `exits X`: the exit program always (controller "
            "\"exits\"), back-fill X; `default (auto)`: as shipped (the controller runs full "
            "depth where checks do not pay); `verified, ...`: lossless, served unforced "
            "(identical: the share of sequences equal to full depth's). TF agreement: the "
            "predicted token equals the forced full-depth one. Honest ideal: "
            "`exit_cost.step_speedup` of the histogram (memory-bound at batch 1, compute-bound "
            "above; deferred's pending tokens ride along; verified: "
            "`exit_cost.verified_speedup`). Contention: the largest share of "
            "the CPU other processes used in a measured pass."]
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m bench.shipped_exits",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--exit-heads", type=Path, default=None,
                   help="folder of exit heads (default: the heads shipped for --model)")
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    p.add_argument("--prompts", type=int, default=8, help="prompts per workload at batch 1")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch-runs", nargs="+", default=["1:all", "8:per_row"],
                   help="batch:policy (batch 8 uses 2 x 8 prompts)")
    p.add_argument("--backfills", nargs="*", default=["deferred", "propagate", "learned"],
                   choices=BACKFILLS,
                   help="back-fills timed side by side (learned needs fitted maps); none: "
                   "only the engine as shipped (`default (auto)`) against full depth")
    p.add_argument("--threshold", type=float, default=None,
                   help="serve the heads at this threshold instead of their own")
    p.add_argument("--overhead", action="store_true",
                   help="also the exit engine at threshold 1.0 (checks run, no exit)")
    p.add_argument("--verify", nargs="*", default=[],
                   metavar="MAX_DRAFT:THRESHOLD[:coupled|rejection]",
                   help="also verified exits (lossless, served unforced) at these settings, "
                   "e.g. 4:0.9 8:0.5 4:0.9:rejection (the rule for sampled drafts)")
    p.add_argument("--verify-temperature", type=float, default=0.0,
                   help="> 0: full depth and the --verify engines serve seeded samples at "
                   "this temperature (not greedy), full depth's the references; pair with "
                   "--backfills (none), as the lossy engines stay forced greedy")
    p.add_argument("--verify-auto", action="store_true",
                   help="--verify engines under the controller (auto, the heads' prior), as "
                   "a user gets them, not the exit program always")
    p.add_argument("--maps-f32", action="store_true",
                   help="beside each back-fill with maps, the same engine with its maps in f32")
    p.add_argument("--tiny", action="store_true", help="smoke test: a 4-layer random model")
    p.add_argument("--out", type=Path, default=None,
                   help="markdown file whose bench.shipped_exits section is (re)written")
    args = p.parse_args(argv)
    runs = []
    for spec in args.batch_runs:
        b, _, pol = spec.partition(":")
        runs.append((int(b), pol or "all"))
    if args.tiny:
        model, ec, heads, tiny_prompts = tiny_setup(2 * max(r[0] for r in runs))
        weights = "tiny random (4 layers, f32)"
        what = "untrained candidate heads, zero back-fill maps"
        args.workloads = ["random"]
    else:
        from ee_jax.models.exits.checkpoint import load_exit_heads
        from ee_jax.models.loading import load_model

        model = load_model(args.model, dtype="float32", progress=False)
        weights = f"{args.model} (f32)"
        if args.exit_heads is not None:
            ec, heads = load_exit_heads(args.exit_heads, model.config)
            what = f"heads from {args.exit_heads}"
        else:
            ec, heads = model.shipped_exit_heads()
            what = f"heads shipped for {args.model}"
    if args.threshold is not None:
        ec = dataclasses.replace(ec, threshold=args.threshold)
        what += f" (threshold set to {args.threshold} by --threshold)"
    what += (f": {ec.head} head, measure {ec.measure}, exits {ec.exit_layers[0]}-"
             f"{ec.exit_layers[-1]} ({len(ec.exit_layers)}), threshold {ec.threshold} "
             f"(target agreement {ec.target_agreement})")
    ctx = dict(command="python -m bench.shipped_exits " + " ".join(argv), weights=weights,
               heads=what, n_prompts=args.prompts,
               new_tokens=args.new_tokens, repeats=args.repeats, rows=[],
               temperature=args.verify_temperature)
    for w in args.workloads:
        for b, pol in runs:
            n = args.prompts if b == 1 else 2 * b
            prompts = tiny_prompts[:n] if args.tiny else workload_prompts(model, w, n)
            run_ec = dataclasses.replace(ec, policy=pol)
            log(f"{w}: batch {b}, policy {pol}, back-fills {args.backfills}, "
                f"{len(prompts)} prompts")
            verify = tuple((int(v[0]), float(v[1]), v[2] if len(v) > 2 else None)
                           for v in (spec.split(":") for spec in args.verify))
            r = compare(model, run_ec, heads, prompts, b, args.new_tokens, args.repeats,
                        tuple(args.backfills), args.overhead, verify=verify,
                        verify_auto=args.verify_auto, maps_f32=args.maps_f32,
                        temperature=args.verify_temperature)
            ctx["rows"].append(((w, b, pol), r))
            for name, e in r["engines"].items():
                acc = (f", acceptance {e['accept']:.3f} of {e['drafted']} drafts"
                       if e.get("accept") is not None else "")
                log(f"  {w} batch {b} {pol} {name}: {e['ratio']:.2f}x, TF {e['agree']:.3f}, "
                    f"mean layers {e['mean']:.2f}, honest ideal {e['ideal']:.2f}x{acc}")
            text = render(ctx)
            if args.out:  # after every row: a long run leaves what it has
                write_marked(args.out, text, MARK)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
