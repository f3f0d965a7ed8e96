"""Host-side page allocator for the paged KV cache: free list, page tables, accounting.

Pure Python and numpy; nothing here touches JAX. The KV cache holds `num_pages` pages of
`page_size` token slots each. The first `reserved_pages` pages are never handed out: page 0 is
the null page that padding rows (and the unused tail of every page-table row) point at, so a
write from a padding row can never land in a live sequence's page.

A sequence's page table is the ordered list of pages holding its tokens: token `t` lives at
slot `t % page_size` of page `page_table[t // page_size]`. The manager hands out pages as a
sequence grows (`allocate`, then `ensure_capacity` before each step) and takes them back when
it finishes, aborts or is preempted (`free`). Preemption is by recomputation, as in vLLM: the
scheduler picks a victim, frees its pages, and later `allocate`s it again for prompt plus
generated tokens. Every failing call leaves the manager exactly as it was.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

import numpy as np

from ee_jax.errors import EEJaxError


class OutOfPagesError(EEJaxError, RuntimeError):
    """Not enough free pages right now; free or preempt a sequence and retry."""


class SequenceTooLongError(EEJaxError, ValueError):
    """A sequence that can never fit: more pages than one page table (or the pool) holds."""


@dataclasses.dataclass(frozen=True)
class BlockUsage:
    """A snapshot of the page pool for the scheduler and for stats."""

    free: int                        # pages ready to hand out
    used: int                        # pages held by live sequences
    total: int                       # usable pages (reserved null page(s) excluded)
    per_seq: Mapping[int, int]       # seq_id -> pages held

    @property
    def utilization(self) -> float:
        return self.used / self.total


class BlockManager:
    """Free list and per-sequence page tables over a fixed pool of KV-cache pages.

    Args:
      num_pages: pages in the KV cache arrays, reserved ones included.
      page_size: token slots per page.
      max_pages_per_seq: width of a page-table row; bounds a sequence at
        `max_pages_per_seq * page_size` tokens (`max_model_len`).
      reserved_pages: leading pages never handed out; page 0 is the null page.
    """

    def __init__(self, num_pages: int, page_size: int, max_pages_per_seq: int,
                 reserved_pages: int = 1):
        for name, value, low in (("num_pages", num_pages, 1), ("page_size", page_size, 1),
                                 ("max_pages_per_seq", max_pages_per_seq, 1),
                                 ("reserved_pages", reserved_pages, 1)):
            if not isinstance(value, int | np.integer) or value < low:
                raise ValueError(f"BlockManager.{name} must be an int >= {low}, got {value!r}")
        if num_pages <= reserved_pages:
            raise ValueError(
                f"BlockManager.num_pages ({num_pages}) must exceed reserved_pages "
                f"({reserved_pages}): no page would be left to hand out")
        self.num_pages = int(num_pages)
        self.page_size = int(page_size)
        self.max_pages_per_seq = int(max_pages_per_seq)
        self.reserved_pages = int(reserved_pages)
        # A stack: pop() hands out the lowest page first on a fresh pool; freed pages are
        # reused first (LIFO), which keeps the working set of pages small.
        self._free: list[int] = list(range(self.num_pages - 1, self.reserved_pages - 1, -1))
        self._tables: dict[int, list[int]] = {}
        self._num_tokens: dict[int, int] = {}

    # ----------------------------------------------------------------- sizes

    @property
    def null_page(self) -> int:
        """The page padding rows and unused page-table entries point at."""
        return 0

    @property
    def max_model_len(self) -> int:
        """Most tokens (prompt + generated) one sequence can hold."""
        return self.max_pages_per_seq * self.page_size

    @property
    def num_usable_pages(self) -> int:
        return self.num_pages - self.reserved_pages

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_used_pages(self) -> int:
        return self.num_usable_pages - len(self._free)

    def pages_needed(self, num_tokens: int) -> int:
        """Pages that hold `num_tokens` tokens: ceil(num_tokens / page_size)."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return -(-int(num_tokens) // self.page_size)

    # ------------------------------------------------------------- sequences

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._tables

    def __len__(self) -> int:
        return len(self._tables)

    @property
    def seq_ids(self) -> list[int]:
        return list(self._tables)

    def num_tokens(self, seq_id: int) -> int:
        """Tokens the sequence's pages were last sized for."""
        self._require(seq_id)
        return self._num_tokens[seq_id]

    def capacity(self, seq_id: int) -> int:
        """Token slots the sequence's pages hold (a multiple of page_size)."""
        return len(self._require(seq_id)) * self.page_size

    def page_table(self, seq_id: int) -> list[int]:
        """The sequence's pages in token order (a copy)."""
        return list(self._require(seq_id))

    def page_table_array(self, seq_ids: Iterable[int | None], width: int | None = None
                         ) -> np.ndarray:
        """Page tables of `seq_ids` as one int32 array [len(seq_ids), width].

        Unused entries, and whole rows whose id is None (batch padding), hold the null page.
        `width` defaults to max_pages_per_seq.
        """
        width = self.max_pages_per_seq if width is None else int(width)
        seq_ids = list(seq_ids)
        out = np.full((len(seq_ids), width), self.null_page, dtype=np.int32)
        for row, seq_id in enumerate(seq_ids):
            if seq_id is None:
                continue
            table = self._require(seq_id)
            if len(table) > width:
                raise ValueError(
                    f"sequence {seq_id} holds {len(table)} pages, more than the page-table "
                    f"width {width}")
            out[row, :len(table)] = table
        return out

    # ------------------------------------------------------- allocate / free

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether a new sequence of `num_tokens` tokens fits in the free pages now.

        Raises SequenceTooLongError if it can never fit, so a scheduler does not wait forever.
        """
        return self._check_length(num_tokens) <= len(self._free)

    def allocate(self, seq_id: int, num_tokens: int) -> list[int]:
        """Give a new sequence the pages for its first `num_tokens` tokens; returns its table.

        Raises ValueError if `seq_id` is live, SequenceTooLongError if it can never fit,
        OutOfPagesError if the free pages do not suffice now (nothing changes then).
        """
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id} already holds pages; free it before "
                             "allocating it again")
        needed = self._check_length(num_tokens)
        self._take(needed, seq_id)
        self._tables[seq_id] = [self._free.pop() for _ in range(needed)]
        self._num_tokens[seq_id] = int(num_tokens)
        return list(self._tables[seq_id])

    def can_append(self, seq_id: int, new_total_tokens: int) -> bool:
        """Whether the sequence can grow to `new_total_tokens` tokens with the free pages now.

        Raises KeyError for an unknown sequence, SequenceTooLongError if it can never fit.
        """
        return self._extra_pages(seq_id, new_total_tokens) <= len(self._free)

    def ensure_capacity(self, seq_id: int, new_total_tokens: int) -> list[int]:
        """Grow the sequence's pages to hold `new_total_tokens` tokens; returns the new pages.

        A no-op (returns []) when its pages already suffice; pages are never taken back here.
        Raises KeyError, SequenceTooLongError, or OutOfPagesError (nothing changes then).
        """
        extra = self._extra_pages(seq_id, new_total_tokens)
        self._take(extra, seq_id)
        new_pages = [self._free.pop() for _ in range(extra)]
        self._tables[seq_id].extend(new_pages)
        self._num_tokens[seq_id] = max(self._num_tokens[seq_id], int(new_total_tokens))
        return new_pages

    def free(self, seq_id: int) -> int:
        """Release all pages of a finished, aborted or preempted sequence; returns how many.

        Raises KeyError for an id that holds no pages (unknown, or already freed).
        """
        table = self._require(seq_id)
        del self._tables[seq_id]
        del self._num_tokens[seq_id]
        # Reversed so the sequence's first page is the next handed out.
        self._free.extend(reversed(table))
        return len(table)

    def usage(self) -> BlockUsage:
        return BlockUsage(free=self.num_free_pages, used=self.num_used_pages,
                          total=self.num_usable_pages,
                          per_seq={s: len(t) for s, t in self._tables.items()})

    # ------------------------------------------------------------ invariants

    def check_invariants(self) -> None:
        """Raise AssertionError if the pool is inconsistent (used by tests)."""
        usable = set(range(self.reserved_pages, self.num_pages))
        free = self._free
        assert len(free) == len(set(free)), "a page appears twice in the free list"
        seen: dict[int, int] = {}
        for seq_id, table in self._tables.items():
            for page in table:
                assert page not in seen, (
                    f"page {page} is in the tables of sequences {seen[page]} and {seq_id}")
                seen[page] = seq_id
            assert len(table) == self.pages_needed(self._num_tokens[seq_id]), (
                f"sequence {seq_id} holds {len(table)} pages for "
                f"{self._num_tokens[seq_id]} tokens")
            assert len(table) <= self.max_pages_per_seq, (
                f"sequence {seq_id} holds {len(table)} > max_pages_per_seq pages")
        used, free_set = set(seen), set(free)
        assert not used & free_set, f"pages both free and used: {sorted(used & free_set)}"
        assert (used | free_set) <= usable, (
            f"reserved or out-of-range pages handed out: {sorted((used | free_set) - usable)}")
        assert len(used) + len(free_set) == self.num_usable_pages, (
            f"{len(used)} used + {len(free_set)} free != {self.num_usable_pages} usable pages "
            f"(lost: {sorted(usable - used - free_set)})")
        assert set(self._num_tokens) == set(self._tables)

    # --------------------------------------------------------------- private

    def _require(self, seq_id: int) -> list[int]:
        try:
            return self._tables[seq_id]
        except KeyError:
            raise KeyError(
                f"sequence {seq_id} holds no pages (never allocated, or already freed)"
            ) from None

    def _check_length(self, num_tokens: int) -> int:
        needed = self.pages_needed(num_tokens)
        if needed > self.max_pages_per_seq:
            raise SequenceTooLongError(
                f"{num_tokens} tokens need {needed} pages of {self.page_size}, more than "
                f"max_pages_per_seq={self.max_pages_per_seq} (max_model_len="
                f"{self.max_model_len} tokens)")
        if needed > self.num_usable_pages:
            raise SequenceTooLongError(
                f"{num_tokens} tokens need {needed} pages of {self.page_size}, more than the "
                f"whole pool of {self.num_usable_pages} usable pages (num_pages="
                f"{self.num_pages}, reserved_pages={self.reserved_pages})")
        return needed

    def _extra_pages(self, seq_id: int, new_total_tokens: int) -> int:
        have = len(self._require(seq_id))
        return max(0, self._check_length(new_total_tokens) - have)

    def _take(self, needed: int, seq_id: int) -> None:
        if needed > len(self._free):
            raise OutOfPagesError(
                f"sequence {seq_id} needs {needed} more pages, only {len(self._free)} of "
                f"{self.num_usable_pages} are free; free or preempt a sequence first")
