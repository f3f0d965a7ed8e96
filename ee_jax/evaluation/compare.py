"""Comparing a generated token sequence with a reference (the full-depth output).

All three take sequences of any hashable items: token ids, or `text.split()` for
whitespace tokens.

* prefix agreement: tokens before the first difference, over the reference's length;
* match rate: positions where both have the same token, over the longer length (a token
  past the end of the other sequence counts as a mismatch);
* ROUGE-L: the F-measure of the longest common subsequence (Lin, 2004; beta = 1).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

Tokens = Sequence[Hashable]


def common_prefix(a: Tokens, b: Tokens) -> int:
    """Number of leading positions where a and b agree."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def prefix_agreement(out: Tokens, ref: Tokens) -> float:
    return common_prefix(out, ref) / len(ref) if ref else float(not out)


def num_matches(a: Tokens, b: Tokens) -> int:
    """Positions i < min(len) with a[i] == b[i]."""
    return sum(x == y for x, y in zip(a, b, strict=False))


def match_rate(out: Tokens, ref: Tokens) -> float:
    n = max(len(out), len(ref))
    return num_matches(out, ref) / n if n else 1.0


def lcs_length(a: Tokens, b: Tokens) -> int:
    """Length of the longest common subsequence: the textbook O(len(a) * len(b)) dynamic
    programme, one row at a time."""
    if len(a) < len(b):
        a, b = b, a
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def rouge_l(out: Tokens, ref: Tokens) -> float:
    """ROUGE-L F-measure: 2PR / (P + R) with P = LCS / len(out), R = LCS / len(ref).
    Two empty sequences agree fully (1.0); one empty sequence scores 0."""
    if not out or not ref:
        return float(not out and not ref)
    lcs = lcs_length(out, ref)
    if lcs == 0:
        return 0.0
    p, r = lcs / len(out), lcs / len(ref)
    return 2 * p * r / (p + r)
