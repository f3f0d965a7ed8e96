"""Stage 1 of the issue-12 step-4 experiment (scratch, not shipped): candidate features and
labels of the shipped heads, in sequence order, for training, calibration and evaluation.

Writes runs/step4/feats.npz with, per set S: S_f [E, W, T, 9] f16, S_a [E, W, T] bool,
S_m [W, T] bool (scored), S_c [W] cluster id (row or sequence).
"""
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, ".")
from ee_jax.evaluation import prompts as P
from ee_jax.evaluation.teacher_forced import answers
from ee_jax.models.loading import load_model
from ee_jax.training import cached as C
from ee_jax.training import data
from ee_jax.training.selfgen import self_generate
from ee_jax.training.tune import calibration_rows
from ee_jax.training.tune_config import TuneConfig

T = 256
OUT = Path("runs/step4")


def log(m):
    print(f"[step4 {time.strftime('%H:%M:%S')}] {m}", file=sys.stderr, flush=True)


def feats_of(model, ec, heads, rows):
    cfg, params = model.config, model.params
    cache = C.cache_states(cfg, params, rows, ec.exit_layers, 1, progress=False)
    hs = cache["hs"].transpose(0, 2, 1, 3).reshape(rows.size, len(ec.exit_layers), -1)
    f, a = C.decision_data(cfg, ec, params, heads, hs, rows.reshape(-1),
                           cache["top"][..., 0].reshape(-1), progress=False)
    W = len(rows)
    return f.reshape(f.shape[0], W, T, -1).astype(np.float16), a.reshape(a.shape[0], W, T)


def windows(seqs, starts):
    """Each sequence cut into windows of T (a fresh context each, as the TF evaluation does),
    the last one padded; scored = positions predicting an answer token."""
    rows, masks, cl = [], [], []
    for i, (s, k) in enumerate(zip(seqs, starts, strict=True)):
        for w0 in range(0, len(s) - 1, T):
            piece = s[w0:w0 + T]
            r = np.zeros(T, np.int32)
            r[:len(piece)] = piece
            m = np.zeros(T, bool)
            for j in range(len(piece)):
                pos = w0 + j
                m[j] = k <= pos < len(s) - 1
            rows.append(r)
            masks.append(m)
            cl.append(i)
    return np.stack(rows), np.stack(masks), np.asarray(cl)


def main():
    model = load_model("smollm2-135m-instruct", dtype="float32", progress=False)
    ec, heads = model.shipped_exit_heads()
    tc = TuneConfig.from_yaml("configs/tune-smollm2-135m-subset.yaml")
    out = {}
    # training sample: the first 48 packed training rows (already shuffled), every position
    z = np.load("runs/tune-smollm2-135m-v2/data-55326b3b1e5a.npz")
    rows = z["train"][:48]
    log("train rows")
    out["train_f"], out["train_a"] = feats_of(model, ec, heads, rows)
    out["train_m"] = np.ones(rows.shape, bool)
    out["train_c"] = np.arange(len(rows))
    # everyday "train" half: the model's own answers, packed
    items = [("chat", s) for s in data.everyday_requests("train")]
    log(f"everyday train: {len(items)} answers")
    gen = self_generate(model, items, max_tokens=96, batch=48,
                        cache=OUT / "selfgen.jsonl", progress=False)
    sep = model.config.eos_token_ids[0]
    rows = data.pack(gen, T, sep)
    out["everyday_f"], out["everyday_a"] = feats_of(model, ec, heads, rows)
    out["everyday_m"] = np.ones(rows.shape, bool)
    out["everyday_c"] = np.arange(len(rows))
    # calibration groups (cached self-generation)
    for g, (rows, scored) in calibration_rows(tc, model, progress=False).items():
        log(f"calib {g}")
        out[f"cal-{g}_f"], out[f"cal-{g}_a"] = feats_of(model, ec, heads, rows)
        out[f"cal-{g}_m"] = scored
        out[f"cal-{g}_c"] = np.arange(len(rows))
    # evaluation workloads, as the TF evaluation cuts them
    work = {"instructions": [("chat", s) for s in P.held_out_instructions(48)],
            "humaneval": [("code", p["prompt"]) for p in P.humaneval_problems(48)],
            "chat": [("chat", s) for s in P.GENERAL_CHAT]}
    for w, its in work.items():
        seqs, starts = answers(model, its, Path("runs/eval-v2/selfgen.jsonl"), 96)
        rows, masks, cl = windows(seqs, starts)
        log(f"eval {w}: {len(rows)} windows, {masks.sum()} scored")
        out[f"eval-{w}_f"], out[f"eval-{w}_a"] = feats_of(model, ec, heads, rows)
        out[f"eval-{w}_m"] = masks
        out[f"eval-{w}_c"] = cl
    np.savez_compressed(OUT / "feats.npz", **out)
    log("done")


if __name__ == "__main__":
    main()
