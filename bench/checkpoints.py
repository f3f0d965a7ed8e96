"""An EE-LLM checkpoint end to end: written, loaded, served with its own exits.

    python -m bench.checkpoints --shape 1b                 # a 1B-shaped model (random weights)
    python -m bench.checkpoints --shape tiny --new-tokens 4 --batches 1   # smoke test

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

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bench import common

SHAPES = {
    # Llama-3.2-1B's dimensions with Llama 2's 32,000-token vocabulary (EE-Tuning's models)
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, vocab_size=32000),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=256),
}


def hf_config(shape: str) -> dict:
    return dict(SHAPES[shape], architectures=["LlamaForCausalLM"], model_type="llama",
                rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=4096,
                tie_word_embeddings=False, hidden_act="silu", torch_dtype="float16",
                bos_token_id=None, eos_token_id=None)


def random_state(c: dict, seed: int = 0) -> dict[str, np.ndarray]:
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


def write(folder: Path, shape: str) -> tuple[Path, Path]:
    """(hf folder, megatron folder) under `folder`, written unless already there."""
    from ee_jax.models.safetensors_io import save_file
    from ee_jax.testing import write_megatron

    hf, meg = folder / "hf", folder / "megatron"
    if (hf / "config.json").is_file() and (meg / "latest_checkpointed_iteration.txt").is_file():
        return hf, meg
    c = hf_config(shape)
    common.log(f"writing a {shape}-shaped model (random weights) to {folder}")
    state = random_state(c)
    hf.mkdir(parents=True, exist_ok=True)
    save_file(state, hf / "model.safetensors", metadata={"format": "pt"})
    (hf / "config.json").write_text(json.dumps(c, indent=2) + "\n")
    L = c["num_hidden_layers"]
    write_megatron(meg, c, state, exit_layer_nums=(L // 4, L // 2), use_exit_norm=True,
                   use_exit_mlp=True, untie_exit_output_weights=True)
    return hf, meg


LOADER = r"""
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


def load_once(who: str, path: Path, dtype: str) -> dict:
    out = subprocess.run([sys.executable, "-c", LOADER, who, str(path), dtype],
                         capture_output=True,
                         text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    if out.returncode:
        raise RuntimeError(f"{who} load failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def bench_load(hf: Path, meg: Path, rounds: int, dtype: str) -> list[str]:
    load_once("ee-jax", meg, dtype), load_once("transformers", hf, dtype)  # page cache warm
    runs: dict[str, list[dict]] = {"ee-jax": [], "transformers": []}
    for r in range(rounds):
        for who, path in (("ee-jax", meg), ("transformers", hf)):
            runs[who].append(load_once(who, path, dtype))
            common.log(f"load round {r + 1}/{rounds} {who}: {runs[who][-1]['time']:.1f} s")
    size = {"ee-jax": folder_bytes(meg), "transformers": folder_bytes(hf)}
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


def bench_serve(meg: Path, batches: list[int], new_tokens: int, threshold: float) -> list[str]:
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
             "| batch | full depth tok/s | exits tok/s | ratio | exit histogram (layer: rows) "
             "| compile s |", "|---|---|---|---|---|---|"]
    for b in batches:
        prompts = common.random_prompts(model.config.vocab_size, b, 32, 33, seed=b)
        params = greedy(new_tokens, ignore_eos=True)
        full = common.make_llm(model, None, None, b, 32 + new_tokens + 16)
        exits = common.make_llm(model, ec, heads, b, 32 + new_tokens + 16,
                                exit_control=ControllerConfig(mode="exits"))
        wf, mf = common.warm_and_serve(full, prompts, params)
        we, me = common.warm_and_serve(exits, prompts, params)
        common.check_lengths(mf, new_tokens), common.check_lengths(me, new_tokens)
        summary = common.exit_summary(me.stats, model.config, ec)
        lines.append(f"| {b} | {mf.e2e_tps():.1f} | {me.e2e_tps():.1f} | "
                     f"{me.e2e_tps() / mf.e2e_tps():.2f}x | {{{summary['row_hist']}}} | "
                     f"{wf.compile_time:.0f} / {we.compile_time:.0f} |")
        common.log(lines[-1])
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.checkpoints",
                                description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="1b")
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
    hf, meg = write(folder, args.shape)
    out = [common.report_header("python -m bench.checkpoints " + " ".join(argv or sys.argv[1:]))]
    if not args.skip_load:
        out += ["", "### Loading", "", *bench_load(hf, meg, args.rounds, args.load_dtype)]
    if not args.skip_serve:
        served = bench_serve(meg, args.batches, args.new_tokens, args.threshold)
        out += ["", "### Served with its own exits", "", *served]
    print("\n".join(out))
    common.log(f"done in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
