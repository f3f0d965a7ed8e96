"""The `ee-jax` command line.

Building the parser imports no JAX (`ee-jax --help` answers at once): each subcommand imports
its layer when it runs, and the package namespaces import on first use (`ee_jax.lazy`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

from ee_jax.errors import EEJaxError
from ee_jax.models.exits.config import (
    BACKFILLS,
    HEADS,
    MEASURES,
    POLICIES,
    SERVING_POLICY,
    VERIFY_SAMPLINGS,
    ExitConfig,
)

# Choices of modules that import JAX, which building the parser must not (tests/test_config.py
# holds them equal to their sources): "auto" and `attention_kernels.BACKENDS`;
# `controller.MODES`; the exit policies `ee-jax compile` builds programs for, `aot.POLICIES`.
ATTENTION = ("auto", "reference", "xla", "pallas_gpu", "pallas_tpu")
CONTROL_MODES = ("auto", "exits", "full")
AOT_POLICIES = ("all", "per_row")
LAYER_LAYOUTS = ("auto", "stacked", "per_layer")  # "auto" and `llama.LAYOUTS`


def _read_prompts(args) -> list[dict]:
    """Each prompt as {"prompt": str} or {"messages": [...]}, from args, .txt or .jsonl."""
    items: list[dict] = [{"prompt": p} for p in args.prompt or []]
    if args.prompts_file:
        path = Path(args.prompts_file)
        if not path.exists():
            raise SystemExit(f"ee-jax: prompts file not found: {path}")
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".jsonl":
            for n, line in enumerate(text.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise SystemExit(f"ee-jax: {path}:{n}: not valid JSON ({e})") from e
                if isinstance(obj, str):
                    obj = {"prompt": obj}
                if "prompt" not in obj and "messages" not in obj:
                    raise SystemExit(f"ee-jax: {path}:{n}: expected a \"prompt\" or "
                                     f"\"messages\" field")
                items.append(obj)
        else:
            items += [{"prompt": line} for line in text.splitlines() if line.strip()]
    if not items:
        raise SystemExit("ee-jax: no prompts: use --prompt TEXT or --prompts-file FILE")
    return items


def _generate(args) -> int:
    from ee_jax.serving.llm import LLM
    from ee_jax.serving.params import SamplingParams
    from ee_jax.serving.stats import exit_summary, format_exit_summary

    items = _read_prompts(args)
    _join_processes(args)
    t0 = time.perf_counter()
    model = _load_model(args)
    llm = LLM(model, **_llm_kwargs(args, model))
    llm.load_time = time.perf_counter() - t0
    if _follower(llm):
        return 0
    _precompile(args, llm)
    tok = llm.tokenizer
    prompts = []
    for it in items:
        if "messages" in it:
            prompts.append(tok.apply_chat_template(it["messages"], add_generation_prompt=True))
        elif args.chat and tok is not None and tok.chat_template:
            prompts.append(tok.apply_chat_template([{"role": "user", "content": it["prompt"]}],
                                                   add_generation_prompt=True))
        else:
            prompts.append(it["prompt"])
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                        top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                        stop=tuple(args.stop or ()))
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=not args.quiet)
    wall = time.perf_counter() - t0
    llm.engine.stop_followers()

    for it, out in zip(items, outs, strict=True):
        if args.json:
            print(json.dumps({"prompt": it.get("prompt", it.get("messages")),
                              "text": out.text, "token_ids": out.token_ids,
                              "finish_reason": out.finish_reason, "error": out.error}))
        else:
            shown = it.get("prompt") or it["messages"][-1]["content"]
            print(f"### {shown}")
            print(out.text if out.error is None else f"[error] {out.error}")
            print()
    s = llm.engine.stats
    gen = sum(len(o.token_ids) for o in outs)
    bpp = llm.engine.kv_cache_bytes / llm.engine.blocks.num_pages
    print("--- summary", file=sys.stderr)
    print(f"requests {len(outs)} ({sum(o.error is not None for o in outs)} errors), "
          f"generated {gen} tokens in {wall:.2f}s wall (compile included) -> "
          f"{gen / wall:.1f} tok/s",
          file=sys.stderr)
    for line in _timing_lines(s, outs):
        print(line, file=sys.stderr)
    print(f"compile {s.compile_time:.2f}s for {s.num_compiles} programs (apart from the "
          f"above); load {llm.load_time:.1f}s; host time "
          f"{1000 * s.host_time / max(1, s.num_steps):.1f} ms/step", file=sys.stderr)
    print(f"pages: max used {s.max_pages_used} of {llm.engine.blocks.num_pages} "
          f"({s.max_pages_used * bpp / 2**20:.1f} MiB of KV), preemptions {s.num_preemptions}",
          file=sys.stderr)
    ec = llm.engine.exit_config
    if ec is not None:
        cfg = llm.model.config
        print(format_exit_summary(exit_summary(s, cfg, ec), cfg, ec), file=sys.stderr)
        if llm.engine.controller is not None:  # None: exits disabled (policy "never")
            print(f"exit program per batch size: {llm.engine.controller.summary()}",
                  file=sys.stderr)
        if ec.verify:
            rate = s.acceptance_rate
            print(f"verified exits (max_draft {ec.max_draft}): {s.num_drafted} drafts, "
                  f"{s.num_accepted} confirmed (acceptance "
                  f"{'-' if rate is None else f'{rate:.3f}'}), {s.num_verify_steps} verify "
                  f"steps; every emitted token is full depth's", file=sys.stderr)
    return 0 if all(o.error is None for o in outs) else 1


def _timing_lines(s, outs) -> list[str]:
    """Decode speed and time to first token as a warm server gives them: steps that compiled
    a program are left out (and counted), so a mid-run compile does not pass for slow decoding
    (`EngineStats.decode_step_time`); time to first token over the requests that waited on
    no compile (`RequestMetrics.compile_wait` == 0)."""
    warm_steps = s.num_decode_steps - s.num_decode_compiles
    lines = [f"decode {s.decode_tokens_per_s:.1f} tok/s, {1000 * s.decode_step_time:.1f} "
             f"ms/step over {warm_steps} steps ({s.num_decode_compiles} that compiled left "
             f"out); prefill {s.num_prompt_tokens} tokens in {s.num_prefill_steps} steps"]
    done = [o.metrics for o in outs if o.metrics and o.metrics.first_token_time is not None]
    if done:
        # Warm: the requests that waited on no compile. (A request that did wait cannot be
        # corrected by subtracting its compiling steps: on CPU such a step also ran its own
        # prefill, so the difference reads ~0.)
        warm = [m.time_to_first_token for m in done if m.compile_wait == 0]
        every = statistics.mean(m.time_to_first_token for m in done)
        waited = len(done) - len(warm)
        if warm:
            lines.append(
                f"time to first token: mean {statistics.mean(warm):.3f}s, median "
                f"{statistics.median(warm):.3f}s over the {len(warm)} requests that waited on "
                f"no compile ({waited} of {len(done)} waited on one; with them: mean "
                f"{every:.3f}s)")
        else:
            lines.append(
                f"time to first token: every request ({len(done)}) waited on a compile, mean "
                f"{every:.3f}s with it; --precompile all measures a warm server's")
    return lines


def _engine_kwargs(args) -> dict:
    """`EngineConfig.make`'s knobs from the flags a command has (`compile` has those that
    shape programs; the others keep the config's defaults)."""
    from ee_jax.serving.controller import ControllerConfig

    kw = {k: getattr(args, k) for k in ("max_num_seqs", "max_model_len", "page_size",
                                        "num_pages", "mesh", "attention", "async_scheduling",
                                        "mixed_steps", "layer_layout") if hasattr(args, k)}
    if hasattr(args, "exit_control"):
        kw["exit_control"] = ControllerConfig(mode=args.exit_control)
    return kw


def _llm_kwargs(args, model) -> dict:
    """LLM's keyword arguments from the flags: the engine's and the exits' (the exit
    controller starts from the heads' calibration, `ControllerConfig.prior`)."""
    kw = {**_engine_kwargs(args), **_exit_kwargs(args, model)}
    prior = kw.pop("exit_prior", None)
    if prior:
        kw["exit_control"] = dataclasses.replace(kw["exit_control"], prior=prior)
    return kw


def _join_processes(args) -> None:
    """Several processes (--num-processes or EE_JAX_* variables): join the job first."""
    from ee_jax.serving import distributed

    dc = distributed.DistributedConfig.from_env(
        coordinator_address=args.coordinator, num_processes=args.num_processes,
        process_id=args.process_id)
    if dc.num_processes and dc.num_processes > 1:
        distributed.initialize(dc)


def _follower(llm) -> bool:
    """On a follower process: run the leader's steps until it stops; True if so."""
    from ee_jax.serving import distributed

    if distributed.is_multiprocess() and not distributed.is_leader():
        llm.engine.follow()
        return True
    return False


def _precompile(args, llm) -> None:
    from ee_jax.serving.compilation import program_cache_dir

    if args.precompile != "none":
        kinds = ("decode",) if args.precompile == "decode" else ("decode", "prefill")
        s = llm.engine.stats
        loaded0, t0 = s.num_programs_loaded, s.compile_time
        n = llm.engine.precompile(kinds, progress=not args.quiet,
                                  program_cache=program_cache_dir())
        loaded = s.num_programs_loaded - loaded0
        print(f"ee-jax: {n} step programs ready ({args.precompile}) in "
              f"{s.compile_time - t0:.1f}s: {n - loaded} compiled, {loaded} loaded from the "
              f"program cache", file=sys.stderr)


def _convert(args) -> int:
    from ee_jax.models.convert import convert

    convert(args.src, args.out, dtype=args.dtype, tokenizer=args.tokenizer,
            overwrite=args.overwrite, progress=not args.quiet)
    return 0


def _load_model(args):
    """The model named by --model; "random" is a tiny random model with a byte tokenizer (for
    trying the server or the CLI without a model file)."""
    from ee_jax.models.loading import load_model

    if args.model == "random":
        from ee_jax.models.loading import quantize_model
        from ee_jax.random_model import random_model

        return quantize_model(random_model(), args.quantize)
    return load_model(args.model, dtype=args.dtype, quantize=args.quantize,
                      progress=not args.quiet, tokenizer=args.tokenizer)


def _check_model(args) -> None:
    """What can be checked of --model, --quantize and --exit-heads without loading anything:
    `serve` checks it before it listens, so a mistyped name ends the command at once instead
    of failing behind an open port."""
    from ee_jax.models import quant, registry

    quant.check_quantize(args.quantize)
    if args.model != "random":
        registry.resolve_model(args.model)
    if args.exit_heads and not Path(args.exit_heads).is_dir():
        raise FileNotFoundError(f"--exit-heads {args.exit_heads}: no such folder")


def _serve(args) -> int:
    """Listen at once, then load, build and warm up the engine behind the open port: /health
    says how far it got, /ready answers 200 once it serves (`serving.server.startup`)."""
    from ee_jax.serving import distributed
    from ee_jax.serving.compilation import program_cache_dir
    from ee_jax.serving.llm import LLM
    from ee_jax.serving.server import ServerConfig, Startup, listen, serve

    config = ServerConfig(
        host=args.host, port=args.port, model_name=args.served_model_name or args.model,
        api_key=args.api_key, max_body_bytes=args.max_body_bytes,
        max_prompt_tokens=args.max_prompt_tokens, log_level=args.log_level,
        startup_wait=args.startup_wait, keep_alive=args.keep_alive)
    if args.host not in ("127.0.0.1", "localhost", "::1") and args.api_key is None:
        print(f"ee-jax: warning: serving on {args.host} without --api-key: anyone who can "
              f"reach this port can use the model", file=sys.stderr)
    _check_model(args)
    _join_processes(args)
    if distributed.is_multiprocess() and not distributed.is_leader():
        model = _load_model(args)  # another process serves HTTP; this one runs its steps
        LLM(model, **_llm_kwargs(args, model)).engine.follow()
        return 0

    def build():
        model = _load_model(args)
        return LLM(model, **_llm_kwargs(args, model)).engine

    def announce(engine) -> None:
        ec = engine.exit_config
        depth = f"early exit: {ec.policy}, threshold {ec.threshold}" if ec else "full depth"
        print(f"ee-jax: serving {config.model_name!r} on http://{config.host}:{config.port}/v1 "
              f"({depth}); Ctrl-C stops", file=sys.stderr)

    kinds = {"none": (), "decode": ("decode",), "all": ("decode", "prefill")}[args.precompile]
    startup = Startup(build, precompile=kinds, program_cache=program_cache_dir(),
                      log=not args.quiet, on_ready=announce)
    sock = listen(config.host, config.port)
    print(f"ee-jax: listening on http://{config.host}:{config.port} while the model loads "
          f"(/health says how far; /ready answers 200 once it serves)", file=sys.stderr)
    try:
        serve(startup, config, sock)
    finally:
        if startup.engine is not None:
            startup.engine.stop_followers()
    return 1 if startup.state == "failed" else 0  # (its error was printed when it failed)


def _exit_kwargs(args, model) -> dict:
    """ExitConfig and heads from the --exit-* flags. Default: the heads shipped for a registry
    model (SmolLM2); --exit-heads loads others; --exit-layers builds untrained norm heads."""
    from ee_jax.models.exits.checkpoint import load_exit_heads, load_exit_prior

    if not args.early_exit:
        return {"early_exit": False}
    overrides = {k: v for k, v in (("threshold", args.exit_threshold),
                                   ("policy", args.exit_policy),
                                   ("backfill", args.backfill)) if v is not None}
    overrides.setdefault("policy", SERVING_POLICY)  # the one serving default (LLM's too)
    layers = (tuple(int(x) for x in args.exit_layers.split(",") if x.strip())
              if args.exit_layers else None)
    trained = None
    if args.exit_heads:
        trained = load_exit_heads(args.exit_heads, model.config, layers)
    elif layers is None:
        trained = model.shipped_exit_heads()
    if trained is not None:
        ec, heads = trained  # (the runner gathers the subset's LM-head rows once)
        ec = _verified(dataclasses.replace(ec, **overrides), args)
        prior = (load_exit_prior(args.exit_heads, model.config, ec) if args.exit_heads
                 else model.shipped_exit_prior(ec))
        return {"exit_config": ec, "exit_heads": heads, "exit_prior": prior}
    if layers is None:
        return {"early_exit": False}  # no trained heads and no exit layers: full depth
    ec = ExitConfig(exit_layers=layers, head=args.exit_head, measure=args.confidence,
                    force_exit_layer=args.draft_layer, **overrides)
    return {"exit_config": _verified(ec, args)}


def _verified(ec: ExitConfig, args) -> ExitConfig:
    """--verify-exits / --max-draft / --draft-layer on top of the heads' config."""
    if args.draft_layer is not None and not args.exit_layers:
        raise SystemExit("--draft-layer needs --exit-layers naming it (untrained norm heads, "
                         "e.g. a LayerSkip checkpoint: --exit-layers 8 --draft-layer 8)")
    if not args.verify_exits:
        for flag, value in (("--max-draft", args.max_draft),
                            ("--verify-sampling", args.verify_sampling)):
            if value is not None:
                raise SystemExit(f"{flag} needs --verify-exits")
        return ec
    if args.backfill not in (None, "deferred"):
        raise SystemExit(f"--verify-exits writes exact K/V by riding along (backfill "
                         f"deferred); drop --backfill {args.backfill}")
    return ec.verified(args.max_draft, args.verify_sampling)


def _tune(args) -> int:
    from ee_jax.training.tune import tune
    from ee_jax.training.tune_config import TuneConfig

    tc = TuneConfig.from_yaml(args.config, max_steps=args.max_steps, work_dir=args.work_dir,
                              output=args.output)
    res = tune(tc, progress=not args.quiet)
    print(json.dumps({"output": str(res.output), "steps": res.steps,
                      "minutes": round(res.seconds / 60, 1),
                      "held_out_agreement": dict(zip(res.exit_config.exit_layers,
                                                     res.eval_metrics.get("agree", []),
                                                     strict=False))}))
    return 0


def _fit_backfill(args) -> int:
    import shlex

    from ee_jax.models.loading import load_model
    from ee_jax.training.tune import refit_backfill_maps
    from ee_jax.training.tune_config import TuneConfig

    tc = TuneConfig.from_yaml(args.config)
    model = load_model(tc.model, dtype="float32", progress=not args.quiet)
    res = refit_backfill_maps(tc, model, args.heads or tc.output, tuple(args.prompts),
                              args.rank, args.ridge, progress=not args.quiet,
                              command="ee-jax fit-backfill " + shlex.join(args.argv),
                              finetune_epochs=args.finetune_epochs,
                              finetune_lr=args.finetune_lr,
                              finetune_thresholds=args.finetune_thresholds)
    print(json.dumps(res))
    return 0


def _calibrate(args) -> int:
    """Re-pick the threshold of saved heads on the preset's calibration answers (the heads'
    arrays stay as they are); --served measures served agreement instead."""
    import shlex

    from ee_jax.models.exits.checkpoint import load_exit_heads
    from ee_jax.models.exits.threshold import CalibrationTable
    from ee_jax.models.loading import load_model
    from ee_jax.training.calibrate import served_calibration, ship_calibration
    from ee_jax.training.tune import calibrate_heads, calibration_answers, served_tables
    from ee_jax.training.tune_config import TuneConfig

    if (args.tables or args.ship) and not args.served:
        raise ValueError("calibrate: --tables and --ship go with --served")
    tc = TuneConfig.from_yaml(args.config, target_agreement=args.target_agreement)
    heads_dir = args.heads or tc.output
    if not args.served:
        model = load_model(tc.model, dtype="float32", progress=False)
        cal = calibrate_heads(tc, model, heads_dir)
        print(json.dumps({"threshold": cal["threshold"],
                          "target_agreement": cal["target_agreement"],
                          "delta": cal["delta"], "n": cal["n"],
                          "groups": {k: {"n": g["n"], "threshold": g["threshold"]}
                                     for k, g in cal.get("groups", {}).items()}}))
        return 0
    command = "ee-jax calibrate " + shlex.join(args.argv)
    if args.tables:
        saved = json.loads(Path(args.tables).read_text())
        tables = {g: CalibrationTable.from_json(t) for g, t in saved["groups"].items()}
        command += f" (tables made by: {saved.get('command', 'unrecorded')})"
        backfill = saved.get("backfill")
    else:
        model = load_model(tc.model, dtype="float32", progress=False)
        ec, heads = load_exit_heads(heads_dir, model.config)
        if args.backfill:
            ec = dataclasses.replace(ec, backfill=args.backfill)
        tables = served_tables(model, ec, heads, calibration_answers(tc, model),
                               args.thresholds, batch=args.batch)
        backfill = ec.backfill
    res = served_calibration(tables, tc.exit_config.target_agreement, tc.calib_delta, command,
                             backfill)
    if not args.tables:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    if args.ship:
        ship_calibration(heads_dir, res)
    for g, t in tables.items():
        print(g, "n", t.n, " ".join(f"{th}:{e / t.n:.4f}/{m:.2f}" for th, e, m in
                                   zip(t.thresholds, t.errors, t.mean_layers, strict=True)))
    print(json.dumps({k: res[k] for k in ("threshold", "picks", "target_agreement")}))
    return 0


def _eval(args) -> int:
    from ee_jax.evaluation.evaluate import evaluate

    evaluate(_eval_options(args))
    return 0


def _eval_options(args):
    """EvalOptions from the `eval` flags, with the full command that reproduces the run."""
    from ee_jax.evaluation.evaluate import EvalOptions, default_policies

    policies = tuple(args.policies or default_policies())
    command = ["ee-jax eval", f"--model {args.model}", f"--dtype {args.dtype}",
               f"--max-tokens {args.max_tokens}", "--batches " + " ".join(map(str, args.batches)),
               "--thresholds " + " ".join(f"{t:g}" for t in args.thresholds),
               "--policies " + " ".join(policies), "--workloads " + " ".join(args.workloads),
               f"--dense-tokens {args.dense_tokens}", f"--out-dir {args.out_dir}"]
    command += [f"--exit-heads {args.exit_heads}"] * bool(args.exit_heads)
    command += [f"--limit {args.limit}"] * (args.limit is not None)
    command += [f"--round-size {args.round_size}"] * (args.round_size is not None)
    for flag in ("ignore_eos", "skip_dense", "skip_e2e", "no_nll"):
        command += [f"--{flag.replace('_', '-')}"] * bool(getattr(args, flag))
    return EvalOptions(
        model=args.model, dtype=args.dtype, exit_heads=args.exit_heads, limit=args.limit,
        max_tokens=args.max_tokens, batches=tuple(args.batches),
        thresholds=tuple(args.thresholds), policies=policies, workloads=tuple(args.workloads),
        ignore_eos=args.ignore_eos, round_size=args.round_size,
        dense_tokens=args.dense_tokens, skip_dense=args.skip_dense, skip_e2e=args.skip_e2e,
        nll=not args.no_nll, out_dir=args.out_dir, progress=not args.quiet,
        command=" ".join(command))


def _compile(args) -> int:
    """Every step program the engine would run on --target, compiled (TPU, CPU; CUDA with
    the cuda-aot extra) or lowered (CUDA without it) here, one row each; then whether the
    config fits the target's memory."""
    from tqdm.auto import tqdm

    from ee_jax.serving.aot import compile as aot
    from ee_jax.serving.aot import roofline
    from ee_jax.serving.plan import EngineConfig

    target = aot.parse_target(args.target)
    dtype = args.dtype or ("float32" if target.platform == "cpu" else "bfloat16")
    cfg, ec = aot.plan_model(args.model, dtype)
    if not args.early_exit:
        ec = None
    elif ec is not None and args.exit_policy:
        ec = dataclasses.replace(ec, policy=args.exit_policy)
    if ec is not None and args.verify_exits:
        ec = ec.verified(args.max_draft, args.verify_sampling)
    config = EngineConfig.make(**_engine_kwargs(args))
    kinds = ("decode",) if args.decode_only else ("decode", "prefill")
    blocks = aot.plan_blocks(args.model, args.quantize, file_blocks=not args.dense_weights)
    plan = aot.Plan.make(cfg, target, config, ec, every_policy=args.every_policy, kinds=kinds,
                         blocks=blocks)
    verb = "compiling" if target.compiles else "lowering"
    engine = plan.engine
    print(f"ee-jax compile: {len(plan)} step programs of {args.model} ({cfg.dtype}) for "
          f"{target.name} ({target.num_devices} device(s), mesh {engine.mesh or 'none'}), "
          f"attention {engine.attention}, KV pool {engine.num_pages} pages of "
          f"{engine.page_size}, layers {engine.layer_layout}, weights "
          + (", ".join(f"{k} {v}" for k, v in sorted(blocks.items())) + " in GGUF blocks"
             if blocks else cfg.dtype), file=sys.stderr)
    chip = target.chip or (aot.host_chip() if target.platform == "cpu" else None)
    head = f"{'program':<24} {'kind':<7} {'batch':>5} {'tokens':>6} {'pages':>5} " \
           f"{'seconds':>7} {'memory GiB':>10} {'MB read':>9} {'by hand':>8} " \
           f"{'roofline ms':>11} {'copies':>6}  note"
    print(head)
    rows, t0 = [], time.perf_counter()
    total = dict(seconds=0.0, read=0.0, hand=0.0, ms=0.0, copies=0)

    def roof(t) -> float | None:
        if t is None or chip is None:
            return None
        return 1e3 * roofline.seconds(roofline.Cost(t.flops, t.bytes), chip.peak_flops,
                                      chip.hbm_bytes_per_s)

    for row in tqdm(plan.compile(), total=len(plan), desc=verb, unit="program",
                    file=sys.stderr, disable=args.quiet, leave=False):
        rows.append(row)
        s, t = row.shape, row.traffic
        mem = "-" if row.device_bytes is None else f"{row.device_bytes / 2**30:.3f}"
        hand = plan.hand_bytes(s)
        ms = roof(t)
        read = "-" if t is None else f"{'>' if t.unknown_loops else ''}{t.bytes / 1e6:.1f}"
        total["seconds"] += row.seconds
        total["hand"] += hand
        if t is not None:
            total["read"] += t.bytes
            total["copies"] += t.weight_copies
            total["ms"] += ms or 0.0
        note = row.error or ("" if target.compiles else "lowered (exported for cuda)")
        line = f"{row.variant:<24} {s.kind:<7} {s.batch:>5} {s.tokens:>6} {s.pages:>5} " \
               f"{row.seconds:>7.1f} {mem:>10} {read:>9} {hand / 1e6:>8.1f} " \
               f"{'-' if ms is None else f'{ms:.3f}':>11} " \
               f"{'-' if t is None else t.weight_copies:>6}  {note}"
        tqdm.write(line, file=sys.stdout)
    print(f"{'total':<24} {'':<7} {'':>5} {'':>6} {'':>5} {total['seconds']:>7.1f} "
          f"{'':>10} {total['read'] / 1e6:>9.1f} {total['hand'] / 1e6:>8.1f} "
          f"{total['ms']:>11.3f} {total['copies']:>6}")
    failed = [r for r in rows if r.error]
    print(f"ee-jax compile: {len(rows) - len(failed)} of {len(rows)} programs "
          f"{'compiled' if target.compiles else 'lowered'} in {time.perf_counter() - t0:.0f} s"
          + (f"; {len(failed)} FAILED" if failed else ""))
    if any(r.traffic is not None for r in rows):
        print("  MB read: what the program moves as it runs, from its optimised HLO "
              "(`aot.traffic`: a loop's body times its trips, an in-place cache write by its "
              "updates; '>': a loop whose trips the data decide, an exit program's layers or "
              "the XLA attention's page blocks, counted once: a lower bound). By hand: every "
              "weight once, the rows' K/V pages and this step's K/V (`roofline.step_bytes`, "
              "at full depth). Roofline: max(flops / peak, MB read / bandwidth) on "
              f"{chip.name if chip else '-'}"
              + (f" ({chip.source}: {chip.peak_flops / 1e9:.0f} GFLOP/s, "
                 f"{chip.hbm_bytes_per_s / 1e9:.1f} GB/s)" if chip else "")
              + ". Copies: slices copied out of a stacked buffer before use (a layer's "
              "weights, an exit's head, rows' maps; in any branch; docs/roofline.md "
              "\"CUDA\").")
    mem = aot.memory(plan, rows)
    if mem is not None:
        print(f"memory per chip ({chip.name}): {mem.verdict()}")
    return 1 if failed or (mem is not None and not mem.fits) else 0


def _add_compile_parser(sub) -> None:
    c = sub.add_parser("compile", help="compile every step program for a TPU or a CUDA GPU "
                       "(ahead of time, on any machine; CUDA lowered only without the "
                       "cuda-aot extra); memory and roofline")
    c.add_argument("--target", default="tpu:v5e", help="tpu:v5e (one chip, as Colab), "
                   "tpu:v5e:2x2, tpu:v6e[:XxY], cuda[:h100|h200] (compiled in the cuda-aot "
                   "venv, requirements-cuda-aot.txt with JAX_PLATFORMS=cpu; else lowered), cpu")
    c.add_argument("--model", default="smollm2-135m-instruct", help="registry name, .gguf "
                   "file (its header only), or a shape without weights: random:smollm2-135m, "
                   "random:llama-3.2-1b, random:llama-3.1-8b")
    c.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="the model's dtype (default: what the engine serves there, bfloat16 "
                   "on TPU and GPU, float32 on CPU, whose compiler converts bf16 weights to "
                   "f32 every step)")
    c.add_argument("--max-num-seqs", type=int, default=32)
    c.add_argument("--max-model-len", type=int, default=2048)
    c.add_argument("--page-size", type=int, default=16)
    c.add_argument("--num-pages", type=int, default=None)
    c.add_argument("--mesh", default=None, help="e.g. tp=4 (needs that many chips)")
    c.add_argument("--attention", default="auto", choices=ATTENTION,
                   help="auto (pallas_tpu on TPU, pallas_gpu on CUDA; reference under a mesh) "
                   "or a backend")
    c.add_argument("--dense-weights", action="store_true",
                   help="a GGUF's weights dense in --dtype (default: in the file's blocks, as "
                   "the engine serves them)")
    c.add_argument("--layer-layout", default="auto", choices=LAYER_LAYOUTS,
                   help="how the steps hold the layers' weights: auto (per_layer on CUDA, "
                   "stacked on TPU and CPU), stacked or per_layer")
    c.add_argument("--quantize", default=None, choices=["int4"],
                   help="int4: the layer matmul weights in Q4_1 blocks of 32, as "
                   "load_model(quantize='int4') holds them (int8 is not planned ahead yet)")
    c.add_argument("--early-exit", action=argparse.BooleanOptionalAction, default=True,
                   help="also the exit programs (the shipped heads' config, scaled to a "
                   "random shape's depth)")
    c.add_argument("--exit-policy", choices=AOT_POLICIES, default=SERVING_POLICY)
    c.add_argument("--every-policy", action="store_true", help="exit programs under every "
                   "policy (all, per_row) and back-fill mode (deferred, propagate), and per_row "
                   "under the back-fills with fitted maps (learned, deferred_learned)")
    c.add_argument("--verify-exits", action="store_true", help="the exit programs as verified "
                   "exits (the run of drafts riding along, the final head over it)")
    c.add_argument("--max-draft", type=int, default=None, help="--verify-exits: drafts a run "
                   "(default: the exit config's)")
    c.add_argument("--verify-sampling", choices=VERIFY_SAMPLINGS, default=None,
                   help="--verify-exits: how sampled drafts are checked (default: the exit "
                   "config's)")
    c.add_argument("--decode-only", action="store_true", help="no prefill programs")
    c.add_argument("--quiet", action="store_true", help="no progress bar")
    c.set_defaults(func=_compile)


def _add_eval_parser(sub) -> None:
    v = sub.add_parser("eval", help="measure early exit's speed and quality; writes "
                       "eval.md and plots into --out-dir")
    v.add_argument("--model", default="smollm2-135m-instruct",
                   help="registry name, .gguf file, HF folder or ee-jax checkpoint")
    v.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    v.add_argument("--exit-heads", default=None, help="folder of tuned exit heads "
                   "(default: the heads shipped with the model)")
    v.add_argument("--limit", type=int, default=None, help="prompts per workload (default: "
                   "all 164 HumanEval prompts, as many instructions)")
    v.add_argument("--max-tokens", type=int, default=128, help="new tokens per prompt")
    v.add_argument("--batches", type=int, nargs="+", default=[1, 8],
                   help="batch sizes (max_num_seqs) to serve at")
    v.add_argument("--thresholds", type=float, nargs="+", default=[0.6, 0.7, 0.8, 0.9, 0.95],
                   help="exit thresholds (per request; also the simulation's)")
    v.add_argument("--policies", nargs="+", default=None,
                   help="exit policies to sweep (default: all, quorum, and per_row where the "
                   "engine has it)")
    v.add_argument("--workloads", nargs="+", default=["humaneval", "instructions"],
                   choices=["humaneval", "instructions"])
    v.add_argument("--ignore-eos", action="store_true",
                   help="always generate --max-tokens tokens")
    v.add_argument("--round-size", type=int, default=None,
                   help="prompts per interleaving round (default 4 x batch, at least 8)")
    v.add_argument("--dense-tokens", type=int, default=16384,
                   help="held-out tokens per corpus for the per-layer measurements")
    v.add_argument("--skip-dense", action="store_true", help="no per-layer measurements")
    v.add_argument("--skip-e2e", action="store_true", help="no end-to-end sweep")
    v.add_argument("--no-nll", action="store_true", help="skip the full model's NLL")
    v.add_argument("--out-dir", default="docs")
    v.add_argument("--quiet", action="store_true", help="no progress bars")
    v.set_defaults(func=_eval)


def _add_engine_args(g: argparse.ArgumentParser) -> None:
    """Model dtype, KV cache and early-exit flags (generate and serve)."""
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    g.add_argument("--tokenizer", default=None, help="a tokenizer.json (or its folder, chat "
                   "template beside it) instead of the model's own: a Megatron (EE-LLM) "
                   "checkpoint holds none")
    g.add_argument("--quantize", default=None, choices=["int8", "int4"],
                   help="weight-only layer weights: int8 (per-output-channel scales) or int4 "
                   "(GGUF Q4_1 blocks of 32 inputs, an f16 scale and offset each); the "
                   "embedding, LM head and exit heads stay in --dtype")
    g.add_argument("--max-num-seqs", type=int, default=32)
    g.add_argument("--max-model-len", type=int, default=2048)
    g.add_argument("--page-size", type=int, default=16)
    g.add_argument("--num-pages", type=int, default=None)
    d = g.add_argument_group("devices and compilation")
    d.add_argument("--mesh", default=None, help="shard over devices, e.g. 'tp=4,dp=2' (tensor "
                   "parallel over heads, MLP and vocabulary; data parallel over rows)")
    d.add_argument("--attention", default="auto", choices=ATTENTION,
                   help="attention backend: auto (by platform; reference under a mesh) or a "
                   "backend")
    d.add_argument("--layer-layout", default="auto", choices=LAYER_LAYOUTS,
                   help="how the steps hold the layers' weights: auto (per_layer on GPU, whose "
                   "compiler copies a stacked weight's layer out before using it; stacked on "
                   "TPU and CPU), stacked or per_layer")
    d.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="launch step n+1 before reading step n's tokens (default on)")
    d.add_argument("--mixed-steps", action=argparse.BooleanOptionalAction, default=True,
                   help="decode rows join prefill steps (at full depth) instead of waiting "
                   "(default on; --no-mixed-steps: decode rows wait for separate steps)")
    d.add_argument("--precompile", choices=["none", "decode", "all"], default="none",
                   help="compile every step shape the engine can meet before serving "
                   "(serve: default all, the smallest batch bucket's before it serves and the "
                   "others while it is idle; programs come from the persistent compilation "
                   "cache, $EE_JAX_COMPILATION_CACHE or ~/.cache/ee-jax/xla, once compiled)")
    d.add_argument("--coordinator", default=None, help="several hosts: the coordinator's "
                   "host:port (or EE_JAX_COORDINATOR); run the same command on every host")
    d.add_argument("--num-processes", type=int, default=None, help="several hosts: how many "
                   "processes (or EE_JAX_NUM_PROCESSES)")
    d.add_argument("--process-id", type=int, default=None, help="several hosts: this "
                   "process's id, 0 = the leader (or EE_JAX_PROCESS_ID)")
    e = g.add_argument_group("early exit")
    e.add_argument("--early-exit", action=argparse.BooleanOptionalAction, default=True,
                   help="early exit with the model's shipped heads (default on where a model "
                   "ships them); --no-early-exit runs every token at full depth")
    e.add_argument("--exit-layers", help="comma-separated exit layers (layers run before the "
                   "exit), e.g. 8,12,16,20,24: untrained norm heads there, unless "
                   "--exit-heads gives trained ones for exactly these layers")
    e.add_argument("--exit-threshold", type=float, default=None,
                   help="confidence needed to exit, in [0, 1] (default: the heads' own; "
                   f"untrained heads {ExitConfig.threshold})")
    e.add_argument("--exit-policy", choices=POLICIES,
                   default=None, help="per_row (default): each row exits at its own first "
                   "confident exit; all: the batch exits when every row is confident")
    e.add_argument("--backfill", choices=BACKFILLS, default=None,
                   help="what a skipped layer's keys/values hold (default: the heads' own): "
                   "learned (fitted maps, shipped with the heads) saves the layers at near "
                   "deferred's fidelity; deferred_learned completes exactly what the next "
                   "step runs anyway and uses the maps for the rest; see docs/early_exit.md")
    e.add_argument("--verify-exits", action=argparse.BooleanOptionalAction, default=False,
                   help="lossless early exit: a token that exits is a draft, checked by the "
                   "layers it skipped; only what the full model confirms is emitted (the "
                   "output is --no-early-exit's; the threshold only sets the speed)")
    e.add_argument("--max-draft", type=int, default=None,
                   help="--verify-exits: the longest run of drafts before it is verified "
                   f"(default: the exit config's, {ExitConfig.max_draft})")
    e.add_argument("--verify-sampling", choices=VERIFY_SAMPLINGS, default=None,
                   help="--verify-exits, temperature > 0: coupled (default) keeps a draft "
                   "where it equals the full model's sample under the request's key (seeded "
                   "outputs are --no-early-exit's, whatever shares the batch); rejection is "
                   "standard speculative sampling (min(1, p/q): more drafts kept, the same "
                   "distribution, different seeded tokens)")
    e.add_argument("--draft-layer", type=int, default=None,
                   help="draft every token at this exit (of --exit-layers), whatever its "
                   "confidence: LayerSkip's self-speculation (with --verify-exits "
                   "--max-draft N for its num_speculations N)")
    e.add_argument("--exit-control", choices=CONTROL_MODES, default="auto",
                   help="auto (default): per batch size, run the exit program only where the "
                   "cost model says its checks pay, else full depth; exits: always the exit "
                   "program; full: never")
    e.add_argument("--confidence", default=ExitConfig.measure, choices=MEASURES,
                   help="with --exit-layers: the confidence measure of the untrained heads "
                   "(trained heads bring their own)")
    e.add_argument("--exit-head", default=ExitConfig.head, choices=HEADS,
                   help="with --exit-layers: the untrained heads' type (a branch copies its "
                   "layer's MLP, as EE-Tuning starts its exits)")
    e.add_argument("--exit-heads", help="folder of trained exit heads (ee-jax tune); its exit "
                   "config is used, --exit-threshold/--exit-policy override; default: the "
                   "heads shipped with the model")


def _add_serve_parser(sub) -> None:
    v = sub.add_parser("serve", help="serve the model over HTTP with the OpenAI API "
                       "(/v1/completions, /v1/chat/completions, /metrics)")
    v.add_argument("--model", default="smollm2-135m-instruct",
                   help="registry name, .gguf file, HF folder, ee-jax checkpoint, or 'random' "
                   "(a tiny random model, for trying the server)")
    v.add_argument("--host", default="127.0.0.1", help="address to bind (default: this "
                   "machine only; 0.0.0.0 exposes the server, use --api-key then)")
    v.add_argument("--port", type=int, default=8000)
    v.add_argument("--api-key", default=os.environ.get("EE_JAX_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $EE_JAX_API_KEY)")
    v.add_argument("--served-model-name", default=None,
                   help="the model id clients send (default: --model)")
    v.add_argument("--max-body-bytes", type=int, default=1 << 20,
                   help="larger request bodies get 413 (default 1 MiB)")
    v.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="longer prompts get 400 (default max_model_len - 1)")
    v.add_argument("--startup-wait", type=float, default=120.0, metavar="SECONDS",
                   help="the server listens at once and loads the model behind the port: a "
                   "request that comes meanwhile waits this long for it, then gets 503 with "
                   "Retry-After (default 120; 0: at once)")
    v.add_argument("--keep-alive", type=float, default=75.0, metavar="SECONDS",
                   help="how long an idle client connection stays open (default 75: longer "
                   "than client pools keep one, so none reuses a connection being closed)")
    v.add_argument("--log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug"])
    v.add_argument("--quiet", action="store_true", help="no loading progress")
    _add_engine_args(v)
    v.add_argument("--no-precompile", dest="precompile", action="store_const", const="none",
                   help="serve once the model is loaded; each step shape compiles when first "
                   "met (default: the smallest batch bucket's programs before serving, the "
                   "others while the engine is idle)")
    v.set_defaults(func=_serve, precompile="all")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ee-jax", description="Serve early-exit LLMs with JAX.")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text for a batch of prompts")
    g.add_argument("--model", default="smollm2-135m-instruct",
                   help="registry name, .gguf file, HF folder or ee-jax checkpoint")
    g.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    g.add_argument("--prompts-file", help=".txt (one prompt a line) or .jsonl "
                   "({\"prompt\": ...} or {\"messages\": [...]})")
    g.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="wrap plain prompts in the model's chat template (default on)")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    _add_engine_args(g)
    g.add_argument("--json", action="store_true", help="print one JSON object per output")
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    g.set_defaults(func=_generate)

    c = sub.add_parser("convert", help="write a model (an EE-LLM Megatron checkpoint) as a "
                       "folder ee-jax serves without torch: HF safetensors + its exit heads")
    c.add_argument("src", help="the model: an EE-LLM / EE-Tuning Megatron checkpoint folder "
                   "(or anything --model takes)")
    c.add_argument("out", help="the folder to write")
    c.add_argument("--tokenizer", default=None, help="a tokenizer.json or its folder, copied "
                   "in (with its chat template)")
    c.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="of the written weights (float32 keeps EE-LLM's fp16/fp32 exact)")
    c.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT")
    c.add_argument("--quiet", action="store_true", help="no progress")
    c.set_defaults(func=_convert)

    t = sub.add_parser("tune", help="train exit heads on a frozen model (EE-Tuning)")
    t.add_argument("--config", required=True, help="YAML preset, e.g. "
                   "configs/tune-smollm2-135m.yaml")
    t.add_argument("--max-steps", type=int, default=None, help="stop after this many steps")
    t.add_argument("--work-dir", default=None, help="data cache, loss log, checkpoints "
                   "(resumed from when present)")
    t.add_argument("--output", default=None, help="folder for the trained heads")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    t.set_defaults(func=_tune)
    c = sub.add_parser("calibrate", help="re-pick the threshold of tuned exit heads on the "
                       "preset's calibration answers (Learn-then-Test); the heads stay as "
                       "they are")
    c.add_argument("--config", required=True, help="the heads' YAML tuning preset")
    c.add_argument("--heads", help="heads folder (default: the preset's output)")
    c.add_argument("--target-agreement", type=float,
                   help="agreement with full depth to certify (default: the preset's)")
    c.add_argument("--served", action="store_true",
                   help="calibrate on served agreement (the engine, forced answers)")
    c.add_argument("--thresholds", type=float, nargs="+",
                   default=[0.995, 0.99, 0.985, 0.98, 0.975, 0.97, 0.96],
                   help="with --served: the thresholds to serve at")
    c.add_argument("--batch", type=int, default=32, help="with --served: rows per step")
    c.add_argument("--out", default="runs/served_calibration.json",
                   help="with --served: where the served tables go")
    c.add_argument("--tables", help="with --served: served tables written before (an --out "
                   "file); re-pick from them instead of decoding")
    c.add_argument("--backfill", choices=BACKFILLS, help="with --served: serve the answers "
                   "with this back-fill (default: the heads' own)")
    c.add_argument("--ship", action="store_true", help="with --served: write the pick into "
                   "the heads folder (calibration.json and exit_config.json's threshold)")
    c.set_defaults(func=_calibrate)
    f = sub.add_parser("fit-backfill", help="fit the learned back-fill maps of tuned exit "
                       "heads afresh, on the model's own answers to training prompts; the "
                       "heads and threshold stay as they are")
    f.add_argument("--config", required=True, help="the heads' YAML tuning preset")
    f.add_argument("--heads", help="heads folder (default: the preset's output)")
    f.add_argument("--prompts", type=int, nargs=3, default=[96, 48, 96],
                   metavar=("INSTRUCTIONS", "CODE", "EVERYDAY"),
                   help="training prompts per group whose answers the maps are fitted on")
    f.add_argument("--rank", type=int, default=48)
    f.add_argument("--ridge", type=float, default=1e-3)
    f.add_argument("--finetune-epochs", type=int, default=0, help="then fine-tune the maps "
                   "through the served loss for this many epochs (ee_jax.training."
                   "backfill_tune; 0: the closed-form fit only)")
    f.add_argument("--finetune-lr", type=float, default=3e-4)
    f.add_argument("--finetune-thresholds", type=float, nargs="+", default=None,
                   help="exit plans to fine-tune on (default: the heads' threshold +-0.015)")
    f.add_argument("--quiet", action="store_true", help="no progress bar")
    f.set_defaults(func=_fit_backfill)
    _add_eval_parser(sub)
    _add_serve_parser(sub)
    _add_compile_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Every mistake ends in one line on stderr and exit status 2 (argparse's own usage
    errors too); a traceback means a bug in ee-jax."""
    args = build_parser().parse_args(argv)
    from ee_jax.serving.compilation import (  # JAX: only once a command runs
        compilation_cache_from_env,
        enable_compilation_cache,
        quiet_libtpu,
    )

    # libtpu installed (the tpu-aot extra) on a host without a TPU: JAX's start-up probes it
    # and it would warn about host bounds and worker hostnames (`compilation.quiet_libtpu`).
    quiet_libtpu()
    args.argv = sys.argv[2:] if argv is None else list(argv)[1:]  # after the subcommand
    # Process-wide JAX settings are the entry point's to make, not a library constructor's:
    # the persistent compilation cache ($EE_JAX_COMPILATION_CACHE, "" turns it off). Not for
    # `compile`: a program built for a topology this host lacks cannot be loaded back here
    # (libtpu: "PjRtCompiler must be constructed with a Client"), and it times compiles.
    if args.func is not _compile:
        enable_compilation_cache(compilation_cache_from_env())
    try:
        return args.func(args)
    except (EEJaxError, ValueError, OSError) as e:  # bad knobs, files, ports
        message = " ".join(str(e).split()) or type(e).__name__
        print(f"ee-jax: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("ee-jax: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
