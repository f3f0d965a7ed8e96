"""The model's own answers, generated with our engine at full depth: the text whose final-
layer distribution the exit heads learn to match is the text the model will serve.

Results are cached as JSON lines (one {"kind", "prompt", "ids"} per item) so an interrupted
or repeated tuning run does not generate twice.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ee_jax.models.loading import LoadedModel
from ee_jax.serving.llm import LLM
from ee_jax.serving.params import SamplingParams


def self_generate(model: LoadedModel, items: list[tuple[str, str]], *, max_tokens: int,
                  batch: int, cache: Path | None = None, progress: bool = True
                  ) -> list[list[int]]:
    """items: (kind, text) with kind "chat" (wrapped in the chat template) or "code" (raw).
    Returns prompt + greedy answer token ids per item, in order."""
    done: dict[tuple[str, str], list[int]] = {}
    if cache is not None and cache.exists():
        for line in cache.read_text(encoding="utf-8").splitlines():
            rec = json.loads(line)
            done[(rec["kind"], rec["prompt"])] = rec["ids"]
    todo = [it for it in dict.fromkeys(items) if it not in done]
    if todo:
        tok = model.tokenizer
        prompts = [tok.apply_chat_template([{"role": "user", "content": text}],
                                           add_generation_prompt=True)
                   if kind == "chat" else text for kind, text in todo]
        if progress:
            print(f"[ee-jax] self-generating {len(todo)} answers ({max_tokens} tokens max, "
                  f"batch {batch}); {len(done)} cached", file=sys.stderr)
        llm = LLM(model, early_exit=False, max_num_seqs=batch, max_model_len=1024 + max_tokens,
                  max_prefill_chunk=512, max_num_batched_tokens=4096)
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens),
                            use_tqdm=progress)
        lines = []
        for it, out in zip(todo, outs, strict=True):
            if out.error is not None:  # e.g. a prompt longer than the context: skip it
                continue
            done[it] = list(out.prompt_token_ids) + list(out.token_ids)
            lines.append(json.dumps({"kind": it[0], "prompt": it[1], "ids": done[it]}))
        if cache is not None:
            cache.parent.mkdir(parents=True, exist_ok=True)
            with cache.open("a", encoding="utf-8") as f:
                f.writelines(line + "\n" for line in lines)
    return [done[it] for it in items if it in done]
