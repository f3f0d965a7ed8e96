"""The persistent batch: each running request's step inputs kept in a fixed slot on the host.

vLLM's `InputBatch`, in our terms. A request gets a slot the first time a step schedules it
and keeps it until it finishes, is aborted or is preempted. The slot holds what does not
change from step to step (seed, temperature, top-k, top-p, exit threshold), its page table
(pages appended as the request grows) and a mirror of its progress: tokens computed, tokens
in all, tokens sampled, and where its last sampled token is on the device (the row of the
step that sampled it). `prepare` turns a `Schedule` into a `StepBatch` and advances the
mirror as the launch will advance the request.

A decode step's inputs are then gathers from the slot arrays: positions, kv_lens, page
tables, sampling knobs and src_row for every row at once; the host touches a request's
tokens only where the device does not hold its input token (the host read it already, or it
was a forced token), and the page table only where a row crossed a page. A prefill or mixed
step writes its rows' query blocks row by row (chunks differ every step) and takes the rest
from the slots.

`build_from_scratch` is the per-row build the engine used before: the oracle the tests
compare `prepare` against, field by field.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from ee_jax.serving.block_manager import BlockManager
from ee_jax.serving.kv_cache import NULL_PAGE
from ee_jax.serving.model_runner import QUERY_BLOCK, StepBatch, StepShape, query_blocks
from ee_jax.serving.scheduler import Schedule, ScheduledRow, Sequence

PENDING = -1  # a sampled token the host has not read yet (overlapped steps)


# The slots' state: one int32 row per field and one column per slot (float knobs bit-cast),
# so a step gathers its rows' columns at once and the sampling knobs' rows are the
# StepBatch's arrays as they are.
(_COMPUTED,  # tokens whose K/V are in the cache (or being written)
 _CAPACITY,  # tokens the slot's pages hold: page_size x pages in its table
 _SRC,  # the row of its last token in the step that sampled it ...
 _AT,  # ... and that step's launch number (-1: the host has the token)
 _FORCED,  # teacher forcing: the host knows every token at launch
 _TOKENS,  # prompt + sampled tokens, PENDING ones included
 _SAMPLED,  # tokens sampled so far: the next sample's index
 _SEED, _TOP_K, _TEMPERATURE, _TOP_P, _THRESHOLD,
 _DEC_ROW,  # its row in the last decode step that ran it ...
 _DEC_AT,  # ... and that step's launch number (-1: none; back-fill "deferred")
 ) = range(14)
_NUM_FIELDS = 14
_PAD = 0  # slot 0 holds a padding row's inputs; requests take slots 1, 2, ...
_NONE = np.zeros(0, np.int32)  # a decode step's (empty) query-block arrays


def _column(*, computed=0, capacity=0, src=-1, at=-1, forced=False, tokens=0, sampled=0, seed=0,
            top_k=0, temperature=0.0, top_p=1.0, threshold=0.0, dec_row=-1, dec_at=-1
            ) -> np.ndarray:
    """One slot's state (the defaults: a padding row's inputs, as `StepBatch.empty`)."""
    floats = np.array([temperature, top_p, threshold], np.float32).view(np.int32)
    return np.array([computed, capacity, src, at, forced, tokens, sampled, seed, top_k,
                     *floats, dec_row, dec_at], np.int32)


class InputBatch:
    """Per-request step inputs in slots, updated in place; `prepare` builds each step.

    Args:
      blocks: the engine's BlockManager (page tables are copied from it as they grow).
      max_num_seqs: slots to start with (more are added if ever needed).
      default_threshold: the exit threshold of a request that sets none.
    """

    def __init__(self, blocks: BlockManager, max_num_seqs: int, default_threshold: float):
        self.blocks = blocks
        self.default_threshold = float(default_threshold)
        self._slot: dict[int, int] = {}  # seq_id -> slot
        self._free: list[int] = []  # free slots, the lowest last
        self.state = _column()[:, None]  # [fields, 1 + slots]
        self.page_table = np.full((1, blocks.max_pages_per_seq), NULL_PAGE, np.int32)  # [S, W]
        self.num_launches = 0  # steps prepared so far (each is launched)
        self.last_decode = -1  # the launch number of the latest decode step
        self._pages_held = 0  # pages in the slots' tables; the BlockManager counts the same
        self._untracked_pages = 0  # pages the BlockManager holds for requests without a slot
        self._resize(1 + max(1, max_num_seqs))

    def _resize(self, n: int) -> None:
        """n slots, the padding slot included; the old ones keep their contents."""
        old = self.state.shape[1]
        state = np.repeat(_column()[:, None], n, axis=1)
        state[:, :old] = self.state
        table = np.full((n, self.blocks.max_pages_per_seq), NULL_PAGE, np.int32)
        table[:old] = self.page_table
        self.state, self.page_table = state, table
        self._free = sorted(self._free + list(range(old, n)), reverse=True)

    # -- requests in and out -----------------------------------------------------------

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._slot

    def __len__(self) -> int:
        return len(self._slot)

    def add(self, seq: Sequence) -> int:
        """Give `seq` a slot (or refresh its slot) from its state now; returns the slot."""
        s = self._slot.get(seq.seq_id)
        if s is None:
            if not self._free:
                self._resize(2 * self.state.shape[1])
            s = self._free.pop()
            self._slot[seq.seq_id] = s
        p = seq.params
        src = at = -1
        if seq.output_token_ids and seq.output_token_ids[-1] == PENDING:
            src, at = seq.inflight_row, self.num_launches - 1  # the step in flight's token
        self.state[:, s] = _column(
            computed=seq.num_computed, capacity=self.state[_CAPACITY, s], src=src, at=at,
            forced=bool(p.forced_tokens), tokens=seq.num_tokens,
            sampled=len(seq.output_token_ids), seed=seq.seed, top_k=p.top_k,
            temperature=p.temperature, top_p=p.top_p,
            threshold=(p.exit_threshold if p.exit_threshold is not None
                       else self.default_threshold))
        self._set_pages(s, self.blocks.page_table(seq.seq_id)
                        if seq.seq_id in self.blocks else [])
        return s

    def rollback(self, seq_id: int, n: int) -> None:
        """Verified exits: the request's last `n` tokens were dropped (rejected drafts): its
        slot's counts go back as its own did; the rest of the slot stands."""
        s = self._slot.get(seq_id)
        if s is not None:
            self.state[[_COMPUTED, _TOKENS, _SAMPLED], s] -= n

    def remove(self, seq_id: int) -> None:
        """The request finished, was aborted or preempted: free its slot (no-op if none)."""
        s = self._slot.pop(seq_id, None)
        if s is None:
            return
        self._set_pages(s, [])
        self._free.append(s)
        self._free.sort(reverse=True)

    def _set_pages(self, s: int, table: list[int], have: int | None = None) -> None:
        """The slot's page table is `table`, of which the first `have` pages are there
        already (None: rewrite it whole)."""
        held = int(self.state[_CAPACITY, s]) // self.blocks.page_size
        if have is None:
            self.page_table[s, len(table):held] = NULL_PAGE
            have = 0
        self.page_table[s, have:len(table)] = table[have:]
        self.state[_CAPACITY, s] = len(table) * self.blocks.page_size
        self._pages_held += len(table) - held

    def _sync_pages(self) -> None:
        """Every slot's table from the BlockManager again: pages changed in a way the steps'
        lengths do not show (more pages than a row's kv_len needs, a preemption the schedule
        did not report). A slot whose request holds no pages any more is freed."""
        for seq_id, s in list(self._slot.items()):
            if seq_id in self.blocks:
                self._set_pages(s, self.blocks.page_table(seq_id))
            else:
                self.remove(seq_id)
        self._untracked_pages = self.blocks.num_used_pages - self._pages_held

    # -- one step ----------------------------------------------------------------------

    def prepare(self, schedule: Schedule, *, latest_unread: bool) -> StepBatch:
        """The step's inputs; the slots advance as the launch will advance the requests.

        latest_unread: whether the host has not read the latest launched step's tokens yet
        (overlapped steps): a decode row whose token that step sampled then reads it from
        the device (src_row); otherwise the host has it."""
        for seq in schedule.preempted:
            self.remove(seq.seq_id)
        rows, shape = schedule.rows, schedule.shape
        n, B = len(rows), shape.batch
        slot = self._slot
        slots = [slot.get(row.seq.seq_id, -1) for row in rows]
        if -1 in slots:  # first scheduled: a new slot
            slots = [self.add(row.seq) if s < 0 else s
                     for s, row in zip(slots, rows, strict=True)]
        idx = np.array(slots + [_PAD] * (B - n), np.intp)  # [B]
        if schedule.kind == "decode":
            g = self.state[:, idx]  # [fields, B], a copy
            tokens, positions, kv, src = self._decode_rows(rows, g, latest_unread)
            blocks = _NONE, _NONE, _NONE
        else:
            tokens, positions, kv, src, blocks = self._prefill_rows(rows, idx, shape)
            g = self.state[:, idx]
        # Pages: a row that crossed into a new page takes the new pages from the BlockManager.
        for r in (kv > g[_CAPACITY]).nonzero()[0]:
            s = idx[r]
            self._set_pages(s, self.blocks.page_table(rows[r].seq.seq_id),
                            have=int(self.state[_CAPACITY, s]) // self.blocks.page_size)
        if self.blocks.num_used_pages != self._pages_held + self._untracked_pages:
            self._sync_pages()
        b = StepBatch(shape, tokens, positions, *blocks,
                      page_table=self.page_table[idx, :shape.pages], kv_lens=kv,
                      seeds=g[_SEED], sample_idx=g[_SAMPLED], top_k=g[_TOP_K],
                      temperature=g[_TEMPERATURE].view(np.float32),
                      top_p=g[_TOP_P].view(np.float32),
                      threshold=g[_THRESHOLD].view(np.float32), src_row=src,
                      pend_row=np.where((g[_DEC_AT] == self.last_decode) & (g[_DEC_AT] >= 0)
                                        & (schedule.kind == "decode"), g[_DEC_ROW], -1
                                        ).astype(np.int32))
        # Advance as `LLMEngine._launch` advances the requests: K/V up to kv_len; a row
        # that reaches its request's last token samples the next one, at this row.
        new = self.state[:, idx[:n]]  # a copy, with the pages just taken
        new[_COMPUTED] = kv[:n]
        samples = new[_COMPUTED] == new[_TOKENS]
        new[_TOKENS:_SAMPLED + 1] += samples
        np.copyto(new[_SRC], np.arange(n, dtype=np.int32), where=samples)
        np.copyto(new[_AT], self.num_launches, where=samples > new[_FORCED])  # not forced
        new[_DEC_ROW] = np.arange(n, dtype=np.int32)
        new[_DEC_AT] = self.num_launches if schedule.kind == "decode" else -1
        if schedule.kind == "decode":
            self.last_decode = self.num_launches
        self.state[:, idx[:n]] = new
        self.num_launches += 1
        return b

    def _decode_rows(self, rows: list[ScheduledRow], g: np.ndarray, latest_unread: bool):
        """tokens, positions, kv_lens and src_row of a decode step: one token a row, at the
        request's next position. A row whose input token the latest step sampled, not read
        yet, takes it from the device; the others' tokens come from the host."""
        n, B = len(rows), g.shape[1]
        start = g[_COMPUTED]
        kv = start + 1
        kv[n:] = 0
        tokens = np.zeros((B, 1), np.int32)
        src = np.full(B, -1, np.int32)
        host: Iterable[int] = range(n)
        if latest_unread:
            on_device = (g[_TOKENS] == kv) & (g[_AT] == self.num_launches - 1)
            src = np.where(on_device, g[_SRC], src)
            host = (~on_device[:n]).nonzero()[0]
        for r in host:  # read by the host already, forced, or a prompt token (a row a
            seq = rows[r].seq  # decode step took at the page pool's limit)
            tok = seq.token_at(int(start[r]))
            if tok == PENDING:  # cannot happen while the slots mirror the requests
                src[r], tok = seq.inflight_row, 0
            tokens[r, 0] = tok
        return tokens, start.reshape(B, 1), kv, src

    def _prefill_rows(self, rows: list[ScheduledRow], idx: np.ndarray, shape: StepShape):
        """tokens, positions, kv_lens, src_row and the query blocks of a prefill step: each
        row's last token in its own slot, the rest of its chunk in query blocks
        (architecture.md section 5), row by row."""
        B, N = shape.batch, shape.block_tokens
        tokens, positions = np.zeros((B, 1), np.int32), np.zeros((B, 1), np.int32)
        kv, src = np.zeros(B, np.int32), np.full(B, -1, np.int32)
        block_tokens, block_positions = np.zeros(N, np.int32), np.zeros(N, np.int32)
        block_rows = np.full(N // QUERY_BLOCK, -1, np.int32)
        off = 0  # next free query block
        for r, row in enumerate(rows):
            seq, n, start = row.seq, row.num_tokens, row.start
            if start != self.state[_COMPUTED, idx[r]]:  # recomputed after a preemption the
                self.add(seq)  # schedule did not report: the slot starts again
            toks = seq.tokens(start, start + n)
            if n == 1 and toks[0] == PENDING:
                src[r] = seq.inflight_row  # still on the device: the step reads it there
                toks = [0]
            tokens[r, 0] = toks[-1]
            positions[r, 0] = start + n - 1
            if n > 1:  # the rest in query blocks; a block's tail is padding beyond kv_len
                nb = query_blocks(n)
                lo, hi = off * QUERY_BLOCK, (off + nb) * QUERY_BLOCK
                block_tokens[lo:lo + n - 1] = toks[:-1]
                block_positions[lo:hi] = start + n  # padding: never written or read
                block_positions[lo:lo + n - 1] = np.arange(start, start + n - 1)
                block_rows[off:off + nb] = r
                off += nb
            kv[r] = start + n
        return tokens, positions, kv, src, (block_tokens, block_positions, block_rows)


def build_from_scratch(schedule: Schedule, blocks: BlockManager, default_threshold: float,
                       previous: list[Schedule] | None = None) -> StepBatch:
    """The step's inputs built row by row from the requests and the BlockManager alone (the
    engine's build before the persistent batch): the oracle `InputBatch.prepare` is tested
    against. Call it before the step is launched; `previous`: the schedules launched before
    it, oldest first (pend_row: a row's place in the latest decode step, unless a prefill
    step ran it since)."""
    b = StepBatch.empty(schedule.shape)
    since: set[int] = set()  # sequences a prefill step ran since the latest decode step
    for prev in reversed(previous or [] if schedule.kind == "decode" else []):
        if prev.kind == "decode":
            before = {id(row.seq): r for r, row in enumerate(prev.rows)}
            for r, row in enumerate(schedule.rows):
                if id(row.seq) not in since:
                    b.pend_row[r] = before.get(id(row.seq), -1)
            break
        since.update(id(row.seq) for row in prev.rows)
    W = schedule.shape.pages
    off = 0  # next free query block
    for r, row in enumerate(schedule.rows):
        seq, n, start = row.seq, row.num_tokens, row.start
        toks = seq.tokens(start, start + n)
        if n == 1 and toks[0] == PENDING:
            b.src_row[r] = seq.inflight_row  # still on the device: the step reads it there
            toks = [0]
        b.tokens[r, 0] = toks[-1]
        b.positions[r, 0] = start + n - 1
        if n > 1:  # the rest in query blocks; a block's tail is padding beyond kv_len
            nb = query_blocks(n)
            lo, hi = off * QUERY_BLOCK, (off + nb) * QUERY_BLOCK
            b.block_tokens[lo:lo + n - 1] = toks[:-1]
            b.block_positions[lo:hi] = start + n  # padding: never written or read
            b.block_positions[lo:lo + n - 1] = np.arange(start, start + n - 1)
            b.block_rows[off:off + nb] = r
            off += nb
        table = blocks.page_table(seq.seq_id)[:W]
        b.page_table[r, :len(table)] = table
        b.kv_lens[r] = start + n
        b.seeds[r] = seq.seed
        b.sample_idx[r] = len(seq.output_token_ids)
        p = seq.params
        b.temperature[r] = p.temperature
        b.top_k[r] = p.top_k
        b.top_p[r] = p.top_p
        b.threshold[r] = (p.exit_threshold if p.exit_threshold is not None
                          else default_threshold)
    return b
