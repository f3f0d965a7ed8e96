"""EE-Tuning driver: data -> jitted train steps on the exit heads -> orbax checkpoints ->
heads saved with their ExitConfig (`ee_jax.models.exits.checkpoint`).

    ee-jax tune --config configs/tune-smollm2-135m.yaml

Two methods: "full" (the backbone runs inside every step, KL over the whole vocabulary) and
"cached" (cheap enough for a 2-core CPU: the backbone runs once and its exit states are
cached, KL over a restricted vocabulary per batch, then a vocabulary subset, per-exit decision
MLPs and a threshold calibrated on a held-apart split; `ee_jax.training.cached`).

The backbone's params are an argument of the jitted step, never a closure constant, and
never differentiated: after tuning they are bit-identical to what was loaded.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from ee_jax.errors import EEJaxError
from ee_jax.models.config import ModelConfig
from ee_jax.models.exits import backfill_maps as bm
from ee_jax.models.exits import heads as exit_heads
from ee_jax.models.exits import threshold as exit_threshold
from ee_jax.models.exits.checkpoint import load_exit_heads, save_exit_heads
from ee_jax.models.exits.config import ExitConfig
from ee_jax.models.loading import load_model
from ee_jax.serving.controller import ControllerConfig
from ee_jax.serving.llm import LLM
from ee_jax.serving.params import SamplingParams
from ee_jax.training import backfill_tune, data
from ee_jax.training import cached as C
from ee_jax.training.backfill_fit import fit_from_rows, kv_errors, states_of
from ee_jax.training.losses import LossWeights, exit_losses
from ee_jax.training.selfgen import self_generate
from ee_jax.training.tune_config import TuneConfig, TuneConfigError


def _log(msg: str) -> None:
    print(f"[ee-jax tune] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- optimisation


def make_optimizer(tc: TuneConfig, total_steps: int) -> optax.GradientTransformation:
    """AdamW with linear warm-up and cosine decay, global-norm clipping; weight decay on the
    adapter matrices only (not on norms or the classifier)."""
    warmup = min(tc.warmup_steps, max(total_steps - 1, 0))
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, tc.lr, warmup_steps=warmup, decay_steps=max(total_steps, warmup + 1),
        end_value=tc.lr * 0.1)

    def decay_mask(tree):
        return {k: jax.tree.map(lambda _: k in ("adapter", "mlp"), v) for k, v in tree.items()}

    return optax.chain(optax.clip_by_global_norm(tc.grad_clip),
                       optax.adamw(schedule, weight_decay=tc.weight_decay, mask=decay_mask))


def make_train_step(cfg: ModelConfig, ec: ExitConfig, w: LossWeights,
              opt: optax.GradientTransformation, remat: bool):
    def step(heads, opt_state, params, tokens):
        (loss, m), grads = jax.value_and_grad(exit_losses, has_aux=True)(
            heads, params, tokens, cfg, ec, w, remat)
        updates, opt_state = opt.update(grads, opt_state, heads)
        return optax.apply_updates(heads, updates), opt_state, loss, m

    return jax.jit(step, donate_argnums=(0, 1))


def make_eval_step(cfg: ModelConfig, ec: ExitConfig, w: LossWeights):
    return jax.jit(lambda heads, params, tokens: exit_losses(heads, params, tokens, cfg, ec, w,
                                                             True))


# --------------------------------------------------------------------------- data


def build_data(tc: TuneConfig, model, progress: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(train [N, T], eval [M, T]) int32 token rows, cached in work_dir by a key of the data
    settings. Train: self-generated answers (instructions, everyday requests) and code
    completions + stdlib source;
    eval: held-out stdlib source."""
    work = Path(tc.work_dir)
    cached = work / f"data-{tc.data_key()}.npz"
    if cached.exists():
        z = np.load(cached)
        _log(f"data from {cached}: train {z['train'].shape}, eval {z['eval'].shape}")
        return z["train"], z["eval"]
    tok = model.tokenizer
    sep = (model.config.eos_token_ids or (None,))[0]
    items = ([("chat", s) for s in data.instructions("train", tc.chat_instructions, tc.seed)]
             + [("code", s) for s in data.code_prompts("train", tc.code_prompts, tc.seed)]
             + ([("chat", s) for s in data.everyday_requests("train", tc.everyday_train,
                                                              tc.seed)]
                if tc.everyday_train else []))
    t0 = time.perf_counter()
    gen = self_generate(model, items, max_tokens=tc.gen_max_tokens, batch=tc.gen_batch,
                        cache=work / "selfgen.jsonl", progress=progress) if items else []
    _log(f"self-generated text: {len(gen)} items, {sum(map(len, gen))} tokens "
         f"({time.perf_counter() - t0:.0f}s)")

    def stdlib_ids(split):
        for doc in data.stdlib_documents(split):
            yield tok.encode(doc)

    n_std = tc.stdlib_tokens // tc.seq_len
    std = data.pack(stdlib_ids("train"), tc.seq_len, sep, n_std) if n_std else None
    own = data.pack(gen, tc.seq_len, sep)
    train = np.concatenate([a for a in (own, std) if a is not None and len(a)])
    rng = np.random.default_rng(tc.seed)
    train = train[rng.permutation(len(train))]
    held = data.pack(stdlib_ids("eval"), tc.seq_len, sep, tc.eval_sequences)
    groups = calibration_rows(tc, model, progress)
    work.mkdir(parents=True, exist_ok=True)
    np.savez(cached, train=train, eval=held,
             **{f"calib_{g}": r for g, (r, _) in groups.items()},
             **{f"calib_scored_{g}": m for g, (_, m) in groups.items()})
    _log(f"data: {len(own)} self-generated + {0 if std is None else len(std)} stdlib rows of "
         f"{tc.seq_len} tokens; {len(held)} held-out rows; calibration rows "
         f"{ {g: len(r) for g, (r, _) in groups.items()} } -> {cached}")
    return train, held


CalibSet = dict[str, tuple[np.ndarray, np.ndarray]]  # group -> (rows [N, T], scored [N, T])


def calibration_answers(tc: TuneConfig, model, progress: bool = True
                        ) -> dict[str, list[tuple[list[int], list[int]]]]:
    """The model's own full-depth answers to the "calib" split, per group ("instructions",
    "code", "everyday"): {group: [(prompt ids, answer ids)]}."""
    return split_answers(tc, model, "calib", (tc.calib_instructions, tc.calib_code_prompts,
                                              tc.calib_everyday), progress)


def split_answers(tc: TuneConfig, model, split: str, counts: tuple[int, int, int],
                  progress: bool = True) -> dict[str, list[tuple[list[int], list[int]]]]:
    """The model's own full-depth answers (`tc.gen_max_tokens` at most, cached in work_dir)
    to `counts` = (instructions, code prompts, everyday requests) of `split`, per group:
    {group: [(prompt ids, answer ids)]}."""
    n_instr, n_code, n_every = counts
    wanted = {"instructions": [("chat", s) for s in data.instructions(
                  split, n_instr, tc.seed)] if n_instr else [],
              "code": [("code", s) for s in data.code_prompts(
                  split, n_code, tc.seed)] if n_code else [],
              "everyday": [("chat", s) for s in data.everyday_requests(
                  split, n_every, tc.seed)] if n_every else []}
    wanted = {g: items for g, items in wanted.items() if items}
    if not wanted:
        return {}
    tok = model.tokenizer
    everything = [it for items in wanted.values() for it in items]
    gen = dict(zip(everything, self_generate(
        model, everything, max_tokens=tc.gen_max_tokens, batch=tc.gen_batch,
        cache=Path(tc.work_dir) / "selfgen.jsonl", progress=progress), strict=True))
    out = {}
    for group, items in wanted.items():
        pairs = []
        for kind, text in items:
            ids = list(gen[(kind, text)])
            prompt = list(tok.encode(tok.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True))
                if kind == "chat" else tok.encode(text))
            n = len(prompt) if ids[:len(prompt)] == prompt else 1
            pairs.append((ids[:n], ids[n:]))
        out[group] = pairs
    return out


def calibration_rows(tc: TuneConfig, model, progress: bool = True) -> CalibSet:
    """The calibration answers packed per group: {group: (rows [N, T], scored [N, T] bool)};
    `scored` marks the positions that predict an answer token (what serving emits), not the
    prompt's."""
    sep = (model.config.eos_token_ids or (None,))[0]
    out: CalibSet = {}
    for group, pairs in calibration_answers(tc, model, progress).items():
        seqs = [p + a for p, a in pairs]
        masks = [[int(len(p) - 1 <= j < len(p) + len(a) - 1) for j in range(len(p) + len(a))]
                 for p, a in pairs]
        out[group] = (data.pack(seqs, tc.seq_len, sep),
                      data.pack(masks, tc.seq_len, None if sep is None else 0).astype(bool))
    return out


def served_tables(model, ec: ExitConfig, heads, answers, thresholds, *,
            batch: int = 32, progress: bool = True) -> dict:
    """Calibration tables of served agreement: every answer decoded by the engine with its
    full-depth tokens forced (`SamplingParams.forced_tokens`) once per threshold (a
    per-request `exit_threshold`; policy per_row and no mixed steps, so each row decides
    alone at every token, as at batch 1), an error where the engine's own token differs.
    Unlike the dense tables this counts what back-filled K/V does to later tokens.
    answers: {group: [(prompt, answer)]} -> {group: CalibrationTable} (clusters: answers)."""
    L = model.config.n_layers
    grid = tuple(sorted((float(t) for t in thresholds), reverse=True))
    jobs = [(g, i, t) for g, pairs in answers.items() for i, (_, a) in enumerate(pairs)
            if len(a) > 1 for t in grid]
    longest = max(len(p) + len(a) for pairs in answers.values() for p, a in pairs)
    llm = LLM(model, exit_config=dataclasses.replace(ec, policy="per_row"), exit_heads=heads,
              max_num_seqs=batch, max_model_len=-(-(longest + 16) // 16) * 16,
              max_num_batched_tokens=4096, max_prefill_chunk=512, mixed_steps=False,
              # exits always: the tables measure the exits (the controller could run full depth)
              exit_control=ControllerConfig(mode="exits"),
              progress=False)  # no decode rows inside prefill steps (those run full depth)
    prompts = [answers[g][i][0] for g, i, _ in jobs]
    params = [SamplingParams(temperature=0.0, max_tokens=len(answers[g][i][1]),
                             ignore_eos=True, forced_tokens=tuple(answers[g][i][1]),
                             exit_threshold=t) for g, i, t in jobs]
    outs = llm.generate(prompts, params, use_tqdm=progress)
    acc: dict = {}
    for (g, i, t), o in zip(jobs, outs, strict=True):
        if o.error is not None:
            raise EEJaxError(f"served calibration of {g} answer {i} failed: {o.error}")
        ref = answers[g][i][1]
        wrong = [p != f for p, f in zip(o.predicted_token_ids[1:], ref[1:], strict=True)]
        layers = o.exit_layers[1:]  # [0]: the prefill's token, at full depth
        acc.setdefault(g, {}).setdefault(t, {})[i] = (
            sum(wrong), len(wrong), sum(e < L for e in layers), sum(layers))
    tables = {}
    for g, by_t in acc.items():
        items = sorted(by_t[grid[0]])
        sizes = tuple(by_t[grid[0]][i][1] for i in items)
        n = sum(sizes)
        tables[g] = exit_threshold.CalibrationTable(
            grid, tuple(sum(by_t[t][i][0] for i in items) for t in grid),
            tuple(sum(by_t[t][i][2] for i in items) for t in grid),
            tuple(sum(by_t[t][i][3] for i in items) / n for t in grid), n, sizes,
            tuple(tuple(by_t[t][i][0] for i in items) for t in grid))
    return tables


def _answer_rows(pairs: list[tuple[list[int], list[int]]], max_len: int
                 ) -> tuple[np.ndarray, np.ndarray]:
    """(rows [N, T], scored [N, T]): prompt + answer per row (cut at max_len, right-padded
    with 0), scored where the row holds an answer token's state (the input that produced
    it is the token before: positions n-1 .. end-2, what a served step computes)."""
    T = min(max_len, max(len(p) + len(a) for p, a in pairs))
    rows = np.zeros((len(pairs), T), np.int32)
    scored = np.zeros((len(pairs), T), bool)
    for i, (p, a) in enumerate(pairs):
        ids = (p + a)[:T]
        rows[i, :len(ids)] = ids
        scored[i, max(len(p) - 1, 0):len(ids) - 1] = True
    return rows, scored


def refit_backfill_maps(tc: TuneConfig, model, heads_dir: str | Path,
                        counts: tuple[int, int, int], rank: int, ridge: float,
                        progress: bool = True, command: str | None = None,
                        finetune_epochs: int = 0, finetune_lr: float = 3e-4,
                        finetune_thresholds: tuple[float, ...] | None = None) -> dict:
    """Fit the learned back-fill maps of saved heads afresh (`backfill_fit.MapFitter`) on the
    model's own answers to `counts` = (instructions, code prompts, everyday requests) of the
    training split, answer tokens only; measure held-out K/V error on the calibration
    answers against the heads' present maps and propagate; with `finetune_epochs`, then
    fine-tune them through the served loss (`backfill_tune`) on the same answers, the exits
    the heads take at `finetune_thresholds` (default: their threshold and +-0.015), and
    measure the simulated served loss on the calibration answers; write the new maps into
    the folder (exit_config.json's `backfill_maps` records how). Returns the record."""
    cfg, params = model.config, model.params
    ec, heads = load_exit_heads(heads_dir, cfg)
    if finetune_epochs < 0 or finetune_lr <= 0 or any(
            not 0 < t <= 1 for t in finetune_thresholds or ()):
        raise bm.BackfillMapsError(
            f"fine-tuning needs epochs >= 0, a learning rate > 0 and thresholds in (0, 1], got "
            f"{finetune_epochs}, {finetune_lr}, {finetune_thresholds}")
    train = [pq for g in split_answers(tc, model, "train", counts, progress).values()
             for pq in g]
    rows, scored = _answer_rows(train, tc.seq_len)
    fitter = fit_from_rows(cfg, params, ec.exit_layers, rows, scored, progress=progress)
    maps = fitter.solve(rank, ridge)
    held_pairs = calibration_answers(tc, model, progress)
    held = [pq for g in held_pairs.values() for pq in g]
    hrows, hscored = _answer_rows(held, tc.seq_len)
    first = ec.exit_layers[0]
    states = np.concatenate([np.asarray(states_of(params, jnp.asarray(hrows[i:i + 4]), cfg,
                                                   first))[hscored[i:i + 4]]
                             for i in range(0, len(hrows), 4)])

    def mean_errors(m) -> dict[str, float]:
        errs = np.array(list(kv_errors(cfg, params, ec.exit_layers, m, states).values()))
        return {"K_propagate": round(float(errs[:, 0].mean()), 3),
                "K_learned": round(float(errs[:, 1].mean()), 3),
                "V_propagate": round(float(errs[:, 2].mean()), 3),
                "V_learned": round(float(errs[:, 3].mean()), 3)}

    new = mean_errors(maps)
    old = mean_errors(heads.backfill) if heads.backfill is not None else None
    tuned = None
    if finetune_epochs > 0:
        maps, tuned = _finetune_maps(model, ec, heads, maps, train, held_pairs,
                                     finetune_epochs, finetune_lr, finetune_thresholds, progress)
        new_tuned = mean_errors(maps)
        tuned["held_out_rel_error_mean_after"] = new_tuned
    info = {"rank": rank, "ridge": ridge, "fit_tokens": int(fitter.n),
            "fit_data": f"answer tokens of {tc.model}'s own greedy answers "
                        f"({tc.gen_max_tokens} max) to {counts[0]} training instructions, "
                        f"{counts[2]} everyday requests, {counts[1]} code prompts (training "
                        f"splits)",
            "held_out": f"{len(states)} answer tokens of the calibration split's answers",
            "held_out_rel_error_mean": new,
            "date": time.strftime("%Y-%m-%d")}
    if tuned is not None:
        info["finetuned"] = tuned
    if command:
        info["command"] = command
    bm.save_maps(heads_dir, cfg, ec.exit_layers, maps, info)
    meta_path = Path(heads_dir) / "exit_config.json"
    meta = json.loads(meta_path.read_text())
    meta["backfill_maps"] = {"file": bm.FILE, **info}
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    return {**info, "previous_maps_on_the_same_tokens": old}


def _finetune_maps(model, ec: ExitConfig, heads, maps, train, held_pairs, epochs: int,
                   lr: float, thresholds, progress: bool) -> tuple[bm.Maps, dict]:
    """`backfill_tune.finetune` of ridge `maps` on the `train` answers at `thresholds`, and
    the simulated served loss per calibration group at the heads' threshold before/after."""
    cfg, params = model.config, model.params
    thr = ec.threshold
    thresholds = tuple(thresholds or (round(thr - 0.015, 4), thr,
                                      round(min(thr + 0.015, 0.999), 4)))
    t0 = time.time()
    batches = backfill_tune.make_batches(cfg, params, ec, heads, train, thresholds,
                                         progress=progress)
    held = {g: backfill_tune.make_batches(cfg, params, ec, heads, p, (thr,), progress=progress)
            for g, p in held_pairs.items()}
    before = {g: backfill_tune.evaluate(cfg, params, maps, b, ec.exit_layers)
              for g, b in held.items()}
    maps, history = backfill_tune.finetune(cfg, params, maps, batches, ec.exit_layers,
                                           epochs=epochs, lr=lr, progress=progress)
    after = {g: backfill_tune.evaluate(cfg, params, maps, b, ec.exit_layers)
             for g, b in held.items()}

    def r(d):
        return {g: {k: float(f"{v:.4g}") if isinstance(v, float) else v for k, v in m.items()}
                for g, m in d.items()}

    return maps, {"epochs": epochs, "lr": lr, "thresholds": list(thresholds),
                  "train_batches": len(batches), "threshold_held_out": thr,
                  "train_kl": [float(f"{h['train_kl']:.4g}") for h in history],
                  "served_sim_held_out_before": r(before), "served_sim_held_out_after": r(after),
                  "minutes": round((time.time() - t0) / 60, 1)}


def calibrate_heads(tc: TuneConfig, model, heads_dir: str | Path, progress: bool = True,
                    calib: CalibSet | None = None) -> dict:
    """Refit only the threshold of saved heads (measure "candidates") on the calibration
    answers (`calib`, else the preset's `calibration_rows`), and rewrite their
    exit_config.json and calibration.json; the heads themselves stay as they are."""
    cfg, params = model.config, model.params
    ec, heads = load_exit_heads(heads_dir, cfg)
    if ec.measure != "candidates":
        raise TuneConfigError(f"exit heads in {heads_dir} use measure {ec.measure!r}: only "
                              f"decision MLPs (measure 'candidates') are calibrated here")
    if calib is None:
        calib = calibration_rows(tc, model, progress)
    if not any(bool(m.any()) for _, m in calib.values()):
        raise TuneConfigError("no calibration answers: set calib_instructions, "
                              "calib_code_prompts or calib_everyday in the preset")
    cal = _calibration(cfg, params, ec, heads, calib, tc, progress)
    ec = dataclasses.replace(ec, threshold=cal["threshold"],
                             target_agreement=tc.exit_config.target_agreement)
    record = Path(heads_dir) / "tune_config.json"  # kept: save_exit_heads rewrites the folder
    kept = record.read_text() if record.is_file() else None
    maps_info = json.loads((Path(heads_dir) / "exit_config.json").read_text()).get(
        "backfill_maps")  # how the maps were fitted: kept too
    if maps_info:
        maps_info = {k: v for k, v in maps_info.items() if k != "file"}
    save_exit_heads(heads_dir, cfg, ec, heads, calibration=cal, maps_info=maps_info)
    if kept is not None:
        record.write_text(kept)
    return cal


def _calibration(cfg, params, ec, heads, calib: CalibSet, tc: TuneConfig, progress: bool
                 ) -> dict:
    """Per group: the decision's confidence and correctness at every exit and scored
    position, its table (clustered by packed row: an answer's tokens are correlated) and
    certified threshold; the shipped threshold is the groups' highest
    (`exit_threshold.pick_threshold_groups`). A pooled table is kept for reference."""
    confs, agrees, groups = [], [], {}
    target = tc.exit_config.target_agreement
    for group, (rows, scored) in calib.items():
        if not scored.any():
            continue
        ccache = C.cache_states(cfg, params, rows, ec.exit_layers, 1, progress=progress)
        hs = ccache["hs"].transpose(0, 2, 1, 3).reshape(rows.size, len(ec.exit_layers), -1)
        cf, ca = C.decision_data(cfg, ec, params, heads, hs, rows.reshape(-1),
                                 ccache["top"][..., 0].reshape(-1), progress=progress)
        keep = scored.reshape(-1)
        conf, agree = C.confidences(heads, cf[:, keep]), ca[:, keep]
        rows_of = np.repeat(np.arange(len(rows)), rows.shape[1])[keep]  # cluster: packed row
        table = exit_threshold.calibration_table(conf, agree, ec.exit_layers, cfg.n_layers,
                                                 min_exit_layer=ec.min_exit_layer,
                                                 clusters=rows_of)
        thr = exit_threshold.pick_threshold(table, target, tc.calib_delta)
        groups[group] = {"threshold": thr,
                         "calib_agreement_per_exit": agree.mean(1).round(4).tolist(),
                         **table.to_json()}
        confs.append(conf)
        agrees.append(agree)
        i = table.thresholds.index(thr) if thr in table.thresholds else None
        _log(f"{group}: threshold {thr} certified for TF agreement >= {target} "
             f"with probability >= {1 - tc.calib_delta} on {table.n} answer tokens"
             + ("" if i is None else f" ({table.errors[i]} errors, mean layers "
                f"{table.mean_layers[i]:.2f})"))
    conf, agree = np.concatenate(confs, axis=1), np.concatenate(agrees, axis=1)
    pooled = exit_threshold.calibration_table(conf, agree, ec.exit_layers, cfg.n_layers,
                                              min_exit_layer=ec.min_exit_layer)
    thr = exit_threshold.pick_threshold_groups(
        {g: exit_threshold.CalibrationTable.from_json(v) for g, v in groups.items()},
        target, tc.calib_delta)
    _log(f"calibrated threshold {thr} (the highest of the groups')")
    return {"delta": tc.calib_delta, "target_agreement": target,
            "threshold": thr, "rule": "highest of the groups' Learn-then-Test thresholds",
            "calib_agreement_per_exit": agree.mean(1).round(4).tolist(),
            **pooled.to_json(), "groups": groups}


# --------------------------------------------------------------------------- checkpoints


def _manager(work: Path):
    import orbax.checkpoint as ocp

    return ocp.CheckpointManager(
        (work / "checkpoints").absolute(),
        options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True))


def _restore(mngr, like: dict[str, Any]) -> tuple[int, dict[str, Any]] | None:
    import orbax.checkpoint as ocp

    step = mngr.latest_step()
    if step is None:
        return None
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), like)
    state = mngr.restore(step, args=ocp.args.StandardRestore(abstract))
    return step, state


# --------------------------------------------------------------------------- the run


@dataclasses.dataclass
class TuneResult:
    heads: exit_heads.ExitHeads
    exit_config: ExitConfig
    steps: int
    history: list[dict]
    eval_metrics: dict[str, list[float]]
    output: Path | None
    seconds: float


def tune(tc: TuneConfig, *, model=None, train: np.ndarray | None = None,
         held_out: np.ndarray | None = None, calib: np.ndarray | CalibSet | None = None,
         progress: bool = True, save: bool = True) -> TuneResult:
    """Run (or resume) a tuning run. `model` (a LoadedModel) and the data arrays may be
    given directly (tests); otherwise they come from `tc`."""
    import orbax.checkpoint as ocp
    t_start = time.perf_counter()
    if model is None:
        model = load_model(tc.model, dtype="float32", progress=progress)
    if tc.method == "cached":
        return tune_cached(tc, model, train=train, held_out=held_out, calib=calib,
                           progress=progress, save=save, t_start=t_start)
    cfg, params = model.config, model.params
    ec = tc.exit_config
    ec.validate_for(cfg)
    if train is None:
        train, held_out = build_data(tc, model, progress)
    if len(train) < tc.batch_size:
        raise TuneConfigError(f"only {len(train)} training rows for batch_size "
                              f"{tc.batch_size}: add data or lower batch_size")
    steps_per_epoch = len(train) // tc.batch_size
    total = steps_per_epoch * tc.epochs  # the schedule's length
    stop = total if tc.max_steps is None else min(total, tc.max_steps)  # an early stop only
    opt = make_optimizer(tc, total)
    # optimised as a dict of the parts (what the resume checkpoint holds)
    heads = exit_heads.init_heads(cfg, ec, params, jax.random.PRNGKey(tc.seed)).parts()
    opt_state = opt.init(heads)
    work = Path(tc.work_dir)
    history: list[dict] = []
    start = 0
    mngr = _manager(work) if save else None
    if mngr is not None:
        restored = _restore(mngr, {"heads": heads, "opt_state": opt_state})
        if restored is not None:
            start, state = restored
            heads, opt_state = state["heads"], state["opt_state"]
            _log(f"resuming from step {start} ({work / 'checkpoints'})")
    step_fn = make_train_step(cfg, ec, tc.loss_weights(), opt, tc.remat)
    log_path = work / "loss.jsonl"
    if save:
        work.mkdir(parents=True, exist_ok=True)
    _log(f"{stop} of {total} steps of {tc.batch_size} x {tc.seq_len} tokens on {len(train)} rows; "
         f"exits {list(ec.exit_layers)}, head {ec.head} (r={ec.adapter_rank}), "
         f"measure {ec.measure}")
    bar = tqdm(range(start, stop), desc="tune", unit="step", file=sys.stderr,
               disable=not progress, initial=start, total=stop)
    for step in bar:
        epoch, epoch_step = divmod(step, steps_per_epoch)
        # a fresh order each epoch, reproducible from the seed (so a resumed run matches)
        order = np.random.default_rng(tc.seed + epoch).permutation(len(train))
        rows = order[epoch_step * tc.batch_size:(epoch_step + 1) * tc.batch_size]
        t0 = time.perf_counter()
        heads, opt_state, loss, m = step_fn(heads, opt_state, params,
                                            jnp.asarray(train[rows]))
        loss = float(loss)
        if not math.isfinite(loss):
            raise EEJaxError(f"tuning diverged at step {step} (loss {loss}); lower lr or "
                             f"raise warmup_steps")
        rec = {"step": step + 1, "loss": loss, "seconds": time.perf_counter() - t0,
               **{k: np.asarray(v).round(4).tolist() for k, v in m.items()}}
        history.append(rec)
        bar.set_postfix(loss=f"{loss:.3f}", agree=f"{np.mean(rec['agree']):.3f}")
        if save:
            with log_path.open("a", encoding="utf-8") as f:
                f.write(json.dumps(rec) + "\n")
            if (step + 1) % tc.checkpoint_every == 0 or step + 1 == stop:
                mngr.save(step + 1, args=ocp.args.StandardSave(
                    {"heads": heads, "opt_state": opt_state}))
    bar.close()
    if mngr is not None:
        mngr.wait_until_finished()
        mngr.close()
    eval_metrics = evaluate_heads(cfg, ec, tc.loss_weights(), params, heads, held_out)
    if eval_metrics:
        _log("held-out top-1 agreement with the final layer per exit: " + ", ".join(
            f"{e}:{a:.3f}" for e, a in zip(ec.exit_layers, eval_metrics["agree"],
                                           strict=True)))
    out = None
    if save:
        out = save_exit_heads(tc.output, cfg, ec, heads)
        (Path(tc.output) / "tune_config.json").write_text(
            json.dumps(dataclasses.asdict(tc), indent=2) + "\n")
        _log(f"exit heads -> {out}")
    secs = time.perf_counter() - t_start
    _log(f"done in {secs / 60:.1f} min")
    return TuneResult(exit_heads.as_heads(heads), ec, stop, history, eval_metrics, out, secs)


def evaluate_heads(cfg, ec, w, params, heads, rows: np.ndarray | None,
                   batch: int = 2) -> dict[str, list[float]]:
    """Mean per-exit metrics (kl, ce, agree, ...) over held-out rows."""
    if rows is None or not len(rows):
        return {}
    fn = make_eval_step(cfg, ec, w)
    acc: dict[str, list] = {}
    for i in range(0, len(rows) - batch + 1, batch):
        _, m = fn(heads, params, jnp.asarray(rows[i:i + batch]))
        for k, v in m.items():
            acc.setdefault(k, []).append(np.asarray(v))
    return {k: np.mean(v, axis=0).tolist() for k, v in acc.items()}


def tune_cached(tc: TuneConfig, model, *, train: np.ndarray | None, held_out: np.ndarray | None,
                calib: np.ndarray | CalibSet | None, progress: bool, save: bool,
                t_start: float
                ) -> TuneResult:
    """Method "cached" (`ee_jax.training.cached`): backbone once, heads on the
    cache with restricted-vocabulary KL, then vocabulary subset, decision MLPs and the
    calibrated threshold. No mid-run checkpoints: the cache makes a run short."""
    cfg, params = model.config, model.params
    ec = tc.exit_config
    ec.validate_for(cfg)
    if train is None:
        train, held_out = build_data(tc, model, progress)
        z = np.load(Path(tc.work_dir) / f"data-{tc.data_key()}.npz")
        names = [k.removeprefix("calib_scored_") for k in z.files
                 if k.startswith("calib_scored_")]
        calib = ({g: (z[f"calib_{g}"], z[f"calib_scored_{g}"]) for g in names} if names
                 else {"calib": (z["calib"], z["calib_scored"])} if "calib_scored" in z
                 else calibration_rows(tc, model, progress))
    elif isinstance(calib, np.ndarray):  # rows given directly (tests): every position counts
        calib = {"calib": (calib, np.ones(calib.shape, bool))}
    calib_rows = (np.concatenate([r for r, _ in calib.values()]) if calib
                  else np.zeros((0, tc.seq_len), np.int32))
    if len(train) < tc.batch_size:
        raise TuneConfigError(f"only {len(train)} training rows for batch_size "
                              f"{tc.batch_size}: add data or lower batch_size")
    marks = {}
    t0 = time.perf_counter()
    cache = C.cache_states(cfg, params, train, ec.exit_layers, tc.teacher_topk,
                           progress=progress)
    marks["cache_s"] = time.perf_counter() - t0
    _log(f"cached {train.size} tokens at {len(ec.exit_layers)} exits in "
         f"{marks['cache_s']:.0f}s")
    heads = exit_heads.init_heads(cfg, ec, params, jax.random.PRNGKey(tc.seed))
    fill = C.vocab_subset(train, cache["top"][..., 0], cfg.vocab_size, cfg.vocab_size)
    if ec.vocab_subset:
        ids = fill[:ec.vocab_subset]
        heads = exit_heads.attach_vocab_subset(
            heads, exit_heads.VocabSubset(ids, tc.model, cfg.vocab_size), cfg, tc.model)
        if held_out is not None and len(held_out):
            marks["subset_coverage_held_out"] = C.coverage(ids, held_out)
        if len(calib_rows):
            marks["subset_coverage_calib"] = C.coverage(ids, calib_rows)
        _log(f"vocabulary subset of {len(ids)} ids: coverage {marks}")
    steps = (len(train) // tc.batch_size) * tc.epochs
    opt = make_optimizer(tc, steps)
    t0 = time.perf_counter()
    heads, history = C.train_heads(cfg, ec, tc.loss_weights(), params, heads, cache, opt,
                                   batch=tc.batch_size, epochs=tc.epochs,
                                   kl_vocab=min(tc.kl_vocab, cfg.vocab_size), seed=tc.seed,
                                   fill=fill, rows=train, progress=progress)
    marks["train_s"] = time.perf_counter() - t0
    if save:
        work = Path(tc.work_dir)
        work.mkdir(parents=True, exist_ok=True)
        with (work / "loss.jsonl").open("w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in history)
    maps_info = None
    if tc.backfill_rank:  # before calibration: served calibration may use them
        t0 = time.perf_counter()
        n_rows = max(1, min(len(train), tc.backfill_tokens // train.shape[1]))
        fitter = fit_from_rows(cfg, params, ec.exit_layers, train[:n_rows], progress=progress)
        heads = heads.replace(backfill=fitter.solve(tc.backfill_rank, tc.backfill_ridge))
        marks["backfill_maps_s"] = time.perf_counter() - t0
        maps_info = {"rank": tc.backfill_rank, "ridge": tc.backfill_ridge,
                     "fit_tokens": int(fitter.n), "fit_data": "training rows (dense forward)"}
        _log(f"back-fill maps: rank {tc.backfill_rank} fitted on {fitter.n} tokens")
    calibration = None
    if ec.measure == "candidates":
        t0 = time.perf_counter()
        rng = np.random.default_rng(tc.seed)
        flat = rng.permutation(train.size)[:tc.decision_tokens]
        r, t = np.divmod(flat, train.shape[1])
        feats, agree = C.decision_data(cfg, ec, params, heads, cache["hs"][r, :, t],
                                       train[r, t], cache["top"][r, t, 0], progress=progress)
        del cache
        heads, bce = C.fit_decisions(heads, feats, agree, steps=tc.decision_steps,
                                     seed=tc.seed)
        marks["decision_s"] = time.perf_counter() - t0
        _log("decision MLPs: BCE per exit " + " ".join(f"{b:.3f}" for b in bce)
             + "; agreement per exit " + " ".join(f"{a:.3f}" for a in agree.mean(1)))
        if len(calib_rows):
            calibration = _calibration(cfg, params, ec, heads, calib, tc, progress)
            ec = dataclasses.replace(ec, threshold=calibration["threshold"])
    out = None
    if save:
        extra = {"calibration": calibration, "timings_s": marks}
        out = save_exit_heads(tc.output, cfg, ec, heads, calibration=calibration,
                              maps_info=maps_info)
        (Path(tc.output) / "tune_config.json").write_text(
            json.dumps(dict(dataclasses.asdict(tc), run=extra), indent=2) + "\n")
        _log(f"exit heads -> {out}")
    secs = time.perf_counter() - t_start
    _log(f"done in {secs / 60:.1f} min ({ {k: round(v, 3) for k, v in marks.items()} })")
    last = history[-min(10, len(history)):]
    metrics = {"agree": np.mean([h["agree"] for h in last], axis=0).tolist()} if last else {}
    return TuneResult(heads, ec, len(history), history, metrics, out, secs)
