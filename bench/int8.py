"""Weight-only int8 against f32 and bf16, in one run (issue 14, part 5).

    python -m bench.int8 [--random] [--batches 1 8] [--prompts 8] [--new-tokens 32]

Variants of one model (SmolLM2-135M-Instruct, or `--random` same-shape random weights):
f32; bf16; int8 layer weights with f32 activations ("int8"); int8 layer weights with bf16
activations and the rest in bf16 ("int8+bf16"). The int8 weights are quantized from f32
(per output channel); embedding, tied head and norms stay in the variant's dtype.

  1. weights: bytes of the parameters, and of the layer weights a full-depth decode step
     reads (the head is read once more per token: its bytes are listed apart);
  2. decode speed: full-depth decode step time at batch 1 and 8 with a context of
     `--context` tokens (ModelRunner steps; the variants of one activation dtype timed
     round-robin so drift hits them alike -- f32 with int8, bf16 with int8+bf16: on CPU a
     step that follows a bf16 step measured up to 1.7x slower; the median of `--repeats`
     steps, the least over `--rounds` rounds, as load from other processes only ever adds
     time; compile time apart) -> tokens/s = batch / step;
  3. quality, each variant's engine at full depth on the same chat prompts:
     teacher-forced agreement (the f32 greedy continuation is forced; the share of positions
     where the variant's greedy choice equals f32's), greedy sequences identical to f32's,
     and the full f32 model's NLL (nats/token) of the variant's own greedy output
     (ee_jax.evaluation.nll): lower is text the f32 model finds likelier.

With `--random` the quality columns compare random models (near-uniform outputs): only
the weights and speed columns mean anything there.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from bench.common import (
    cpu_model,
    load_f32,
    load_prompts,
    log,
    num_cpus,
    other_load,
    smollm2_shaped_random,
)
from bench.early_exit import step_runner, time_steps


def variants(cfg, params) -> dict:
    """name -> (config, params) of the four variants, all made from the f32 params."""
    import jax.numpy as jnp

    from ee_jax.models.llama import cast_params
    from ee_jax.models.quant import quantize_params

    bf16 = cfg.replace(dtype="bfloat16")
    q = quantize_params(params, "int8")
    return {"f32": (cfg, params),
            "bf16": (bf16, cast_params(params, jnp.bfloat16)),
            "int8": (cfg, q),
            "int8+bf16": (bf16, cast_params(q, jnp.bfloat16))}


def weight_bytes(params) -> tuple[int, int, int]:
    """(all params, layer weights a decode step reads, the LM head / tied embedding)."""
    from ee_jax.models.quant import QUANTIZED_KEYS, param_bytes

    layers = sum(param_bytes(params["layers"][k]) for k in QUANTIZED_KEYS)
    head = param_bytes(params.get("lm_head", params["embed"]))
    return param_bytes(params), layers, head


def speed(models: dict, batches, context: int, repeats: int, rounds: int) -> dict:
    """(name, batch) -> full-depth decode step seconds (least over rounds of the median)."""
    out = {}
    for B in batches:
        for dtype in sorted({cfg.dtype for cfg, _ in models.values()}):
            group = {k: v for k, v in models.items() if v[0].dtype == dtype}
            log(f"speed: batch {B}, context {context}: compiling {list(group)}")
            pairs = {name: step_runner(cfg, params, B, context)
                     for name, (cfg, params) in group.items()}
            for _ in range(rounds):
                t = time_steps(pairs, repeats)
                log("  " + ", ".join(f"{k} {1000 * v:.1f} ms" for k, v in t.items()))
                for k, v in t.items():
                    out[k, B] = min(v, out.get((k, B), float("inf")))
            del pairs
    return out


def quality(models: dict, prompts, new_tokens: int, f32_cfg, f32_params) -> dict:
    """name -> teacher-forced agreement, identical sequences, NLL of its greedy output."""
    from ee_jax.evaluation.nll import FullModelNLL
    from ee_jax.models.loading import LoadedModel
    from ee_jax.serving.llm import LLM
    from ee_jax.serving.params import SamplingParams

    longest = max(len(p) for p in prompts) + new_tokens + 1
    pages = -(-longest // 16)
    kw = dict(max_num_seqs=len(prompts), max_model_len=pages * 16, page_size=16,
              num_pages=len(prompts) * pages + 1, max_num_batched_tokens=8192,
              batch_buckets=(len(prompts),), early_exit=False, progress=False)
    free = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    scorer = FullModelNLL(f32_cfg, f32_params)
    ref, out = None, {}
    for name, (cfg, params) in models.items():
        log(f"quality: {name}: {len(prompts)} prompts, {new_tokens} tokens")
        llm = LLM(LoadedModel(cfg, params, None, name), **kw)
        tokens = [o.token_ids for o in llm.generate(prompts, free, use_tqdm=False)]
        if ref is None:
            ref = tokens  # f32 comes first
        forced = [SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True,
                                 forced_tokens=tuple(r)) for r in ref]
        pred = [o.predicted_token_ids for o in llm.generate(prompts, forced, use_tqdm=False)]
        agree = np.mean([p == r for ps, rs in zip(pred, ref, strict=True)
                         for p, r in zip(ps, rs, strict=True)])
        same = np.mean([t == r for t, r in zip(tokens, ref, strict=True)])
        nll = np.mean(np.concatenate([scorer(p, t) for p, t in zip(prompts, tokens,
                                                                   strict=True)]))
        out[name] = dict(agree=float(agree), same=float(same), nll=float(nll))
        log(f"  teacher-forced agreement {agree:.3f}, identical {same:.2f}, NLL {nll:.3f}")
        del llm
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.int8")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--random", action="store_true", help="same-shape random weights")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--context", type=int, default=255)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--skip-bf16", action="store_true",
                   help="leave the bf16 variants out (slow on some CPUs)")
    args = p.parse_args(argv)

    t0 = time.perf_counter()
    if args.random:
        cfg, params = smollm2_shaped_random()
        prompts = load_prompts("random", None, args.prompts, 16, 64, vocab=cfg.vocab_size)
        source = "random SmolLM2-shaped weights"
    else:
        model = load_f32(args.model, blocks=False)  # the f32 reference: dense arrays
        cfg, params = model.config, model.params
        prompts = load_prompts("chat", model.tokenizer, args.prompts)
        source = args.model
    models = variants(cfg, params)
    if args.skip_bf16:
        models = {k: v for k, v in models.items() if "bf16" not in k}
    load = other_load(1.0)  # other processes' busy CPUs while we start timing
    steps = speed(models, args.batches, args.context, args.repeats, args.rounds)
    qual = quality(models, prompts, args.new_tokens, cfg, params)

    cols = [f"step ms / tok/s (B={B})" for B in args.batches]
    print(f"\n{source}, {cpu_model()} ({num_cpus()} CPUs, other processes using "
          f"{100 * load:.0f}% of them as timing started); context {args.context}, "
          f"median of {args.repeats} steps, least of {args.rounds} rounds; "
          f"quality: {len(prompts)} prompts x {args.new_tokens} greedy tokens, full depth; "
          f"{time.perf_counter() - t0:.0f} s in all\n")
    print("| variant | params MiB | layer weights MiB | head MiB | " + " | ".join(cols)
          + " | teacher-forced agreement with f32 | sequences = f32 | f32 NLL of output |")
    print("|" + "---|" * (7 + len(cols)))
    for name, (_, prm) in models.items():
        total, layers, head = (b / 2**20 for b in weight_bytes(prm))
        sp = " | ".join(f"{1000 * steps[name, B]:.1f} / {B / steps[name, B]:.1f}"
                        for B in args.batches)
        q = qual[name]
        print(f"| {name} | {total:.0f} | {layers:.0f} | {head:.0f} | {sp} | {q['agree']:.3f} "
              f"| {q['same']:.2f} | {q['nll']:.3f} |")


if __name__ == "__main__":
    main()
