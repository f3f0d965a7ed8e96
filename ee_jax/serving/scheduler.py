"""Iteration-level (continuous) batching: which sequences run in the next step.

Every step is either a prefill step (rows process a chunk of several tokens) or a decode
step (every row processes exactly one token and samples). A sequence is simply "tokens
[num_computed, num_tokens) still need their K/V": a fresh prompt, the rest of a chunked
prompt, a preempted sequence being recomputed, or the last sampled token of a decoding
sequence are all the same thing, which keeps this module small.

Policy (vLLM's v0 defaults): prefill first, first-come first-served, admission by free
pages and a token budget; when decode runs out of pages the newest running sequence is
preempted (its pages freed, recomputed later, nothing lost).
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any, Literal

from ee_jax.serving.attention_kernels import follows_lengths
from ee_jax.serving.block_manager import BlockManager
from ee_jax.serving.model_runner import QUERY_BLOCK, StepShape, query_blocks
from ee_jax.serving.params import RequestMetrics, SamplingParams

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def default_batch_buckets(platform: str | None = None) -> tuple[int, ...]:
    """The batch buckets steps pad their rows to, on `platform` (None: any).

    On GPU the smallest is 2 rows: XLA's GPU compiler rewrites a one-row product
    [1, D] x [D, F] into a multiply that writes the whole [D, F] product and a column
    reduction that reads it back (its dot strength reduction; no flag turns it off), so a
    one-row decode step moves ~3x its projections' weights; two rows compile to a GEMM that
    reads them once (docs/roofline.md, `bench.roofline dots`). The padded row attends to no key.
    """
    if platform is not None and platform.lower() in GPU_PLATFORMS:
        return tuple(b for b in BATCH_BUCKETS if b >= 2)
    return BATCH_BUCKETS


@dataclasses.dataclass
class Sequence:
    """Host state of one request."""

    request_id: str
    seq_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    metrics: RequestMetrics
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    exit_layers: list[int] = dataclasses.field(default_factory=list)
    predicted_token_ids: list[int] = dataclasses.field(default_factory=list)  # teacher forcing
    num_computed: int = 0  # tokens whose K/V are in the cache (or are being written)
    # Overlapped steps: the sampled token is PENDING in output_token_ids until the host has
    # read it; a sequence that will have reached its length limit once it is read is not
    # scheduled again (it finishes then).
    awaiting_finish: bool = False
    inflight_row: int = -1  # its row in the in-flight step (where its PENDING token is)
    # verified exits: the last num_draft of output_token_ids are drafts the full model has
    # not confirmed yet (their K/V incomplete above their exits: the device's run of the row)
    num_draft: int = 0
    # verified exits, overlapped steps: exit steps launched for it and not read yet, each of
    # which may have drafted (what it did is known once read); `epoch` counts its
    # preemptions with such a step in flight, whose result is then dropped (`drop_drafts`)
    drafting: int = 0
    epoch: int = 0
    text: str = ""
    detokenizer: Any = None
    finish_reason: str | None = None
    error: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_pending(self) -> int:
        return self.num_tokens - self.num_computed

    def token_at(self, i: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    def tokens(self, start: int, stop: int) -> list[int]:
        return [self.token_at(i) for i in range(start, stop)]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def drop_drafts(self) -> None:
        """Forget the unconfirmed drafts (never emitted: nothing a client saw changes), and
        the token of an exit step in flight (its result will be dropped: `epoch`; what it
        would have confirmed is recomputed, the same tokens)."""
        keep = len(self.output_token_ids) - self.num_draft - self.drafting
        del self.output_token_ids[keep:]
        self.num_draft = 0
        if self.drafting:
            self.drafting, self.awaiting_finish = 0, False
            self.epoch += 1


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """What steps the scheduler forms: how many rows, how long, in which padded shapes (the
    engine's config holds one, `EngineConfig.scheduler`). Two fields are the platform's and
    the attention backend's to decide where left None; the engine plan fills them in
    (`plan.engine_plan`), and a config used without one reads them as noted."""

    max_num_seqs: int = 32  # requests running at once (rows of a step, at most)
    max_model_len: int = 2048  # tokens of one request, prompt and output together
    page_size: int = 16  # tokens a KV page holds
    max_num_batched_tokens: int = 2048  # prefill token budget per step
    max_prefill_chunk: int = 512  # longest chunk of one prompt per step (power of two)
    # Rows a step pads to, ascending. None: the platform's (`default_batch_buckets`: from 2
    # rows on GPU, where XLA's one-row products read their weights ~3x); unplanned, every
    # one of BATCH_BUCKETS.
    batch_buckets: tuple[int, ...] | None = None
    min_page_bucket: int = 4  # decode steps' narrowest page table
    # Decode page tables take widths on a ladder (`_next_bucket`, from min_page_bucket), for
    # attention whose cost follows the table's width; False: pages_per_seq alone, for
    # attention whose cost follows the rows' lengths (`attention_kernels.follows_lengths`),
    # so decode needs one program per batch bucket, not one per width too. None: as the
    # attention backend asks (the engine plan decides); unplanned, the ladder.
    decode_page_ladder: bool | None = None
    # Prefill (and mixed) steps: few shapes, so precompiling them all is cheap (arrivals
    # form prefill and mixed steps of any row count, length and furthest position, which no
    # warm-up by example meets). A step of N packed tokens pads its rows to at least
    # N / prefill_row_tokens (a padded row costs about 2-3 tokens of the step: its slot in
    # the dense layers and the LM head; its attention sees no key), so a step's rows take
    # few batch buckets; None: every batch bucket. Cost: measured with the prefill benchmark
    # at ed116cf (`--policies`; docs/architecture.md section 3).
    prefill_row_tokens: int | None = 64
    # Prefill steps' page-table widths, capped at pages_per_seq (None: pages_per_seq alone).
    prefill_page_buckets: tuple[int, ...] | None = None
    # Decode rows ride along in a prefill step (at full depth, one token each, within the
    # token budget), so a running request never waits behind a long prompt. With ragged
    # prefill a decode row costs one token of the step, not a padded chunk.
    mixed_steps: bool = True

    def __post_init__(self):
        if self.max_prefill_chunk & (self.max_prefill_chunk - 1):
            raise ValueError(f"max_prefill_chunk must be a power of two, got "
                             f"{self.max_prefill_chunk}")
        if self.max_num_seqs > max(self.buckets):
            raise ValueError(f"max_num_seqs ({self.max_num_seqs}) exceeds the largest batch "
                             f"bucket ({max(self.buckets)})")
        if self.max_num_batched_tokens < 1 or self.max_model_len < 2:
            raise ValueError("max_num_batched_tokens and max_model_len must be positive")
        if self.prefill_row_tokens is not None and self.prefill_row_tokens < 1:
            raise ValueError(f"prefill_row_tokens must be positive or None, got "
                             f"{self.prefill_row_tokens}")
        if self.prefill_page_buckets is not None and min(self.prefill_page_buckets, default=0) < 1:
            raise ValueError(f"prefill_page_buckets must be positive widths, got "
                             f"{self.prefill_page_buckets}")

    def planned(self, platform: str, attention: str) -> SchedulerConfig:
        """This config for steps built for `platform` under attention backend `attention`:
        the fields left None take the platform's batch buckets and, for decode page tables,
        one width where the backend's cost follows the rows' lengths, else the ladder."""
        ladder = self.decode_page_ladder
        return dataclasses.replace(
            self, batch_buckets=self.batch_buckets or default_batch_buckets(platform),
            decode_page_ladder=not follows_lengths(attention, platform) if ladder is None
            else ladder)

    @property
    def buckets(self) -> tuple[int, ...]:
        """The batch buckets steps pad to: `batch_buckets`, or unplanned BATCH_BUCKETS."""
        return self.batch_buckets or default_batch_buckets()

    @property
    def pages_per_seq(self) -> int:
        return math.ceil(self.max_model_len / self.page_size)

    def batch_bucket(self, n: int) -> int:
        return min(b for b in self.buckets if b >= n)

    def prefill_batch(self, rows: int, tokens: int) -> int:
        """B of a prefill step of `rows` rows and `tokens` packed tokens: the batch bucket of
        at least tokens / prefill_row_tokens rows (at most max_num_seqs)."""
        if self.prefill_row_tokens is not None:
            rows = max(rows, min(self.max_num_seqs, -(-tokens // self.prefill_row_tokens)))
        return self.batch_bucket(rows)

    def prefill_tokens(self, blocks: int) -> int:
        """N of a prefill step whose rows take `blocks` query blocks: the blocks' bucket in
        tokens (at least one block, so that every prefill step has the same layout). Above
        1,024 tokens the buckets are a quarter octave apart (`_fine_bucket`): padding there
        is most of a step's waste, and few batch and page buckets reach it."""
        blocks = max(1, blocks)
        if blocks * QUERY_BLOCK > 1024:
            return QUERY_BLOCK * _fine_bucket(blocks)
        return QUERY_BLOCK * _next_bucket(blocks)

    def page_bucket(self, num_tokens: int, kind: str = "decode") -> int:
        """Page-table width of a step whose furthest row ends at `num_tokens`: decode steps
        round up to `_next_bucket` (at least min_page_bucket; pages_per_seq alone without
        `decode_page_ladder`), prefill steps to
        `prefill_page_buckets` (default: pages_per_seq alone); at most pages_per_seq."""
        pages = math.ceil(num_tokens / self.page_size)
        if kind == "decode" and self.decode_page_ladder is False:
            return self.pages_per_seq
        if kind == "decode":
            return min(self.pages_per_seq, max(self.min_page_bucket, _next_bucket(pages)))
        return min([w for w in self.prefill_page_buckets or () if w >= pages]
                   + [self.pages_per_seq])

    def step_shapes(self, kinds: tuple[str, ...] = ("decode", "prefill")) -> list[StepShape]:
        """Every step shape `Scheduler` can produce under this config (what `precompile`
        compiles): decode steps by batch and page bucket; prefill steps by batch
        (`prefill_batch`), packed tokens (query blocks) and page bucket, where the rows'
        chunks fit the token budget and the longest chunk fits the page bucket."""
        def firsts(bucket, hi: int) -> dict[int, int]:  # bucket -> smallest n mapping to it
            out: dict[int, int] = {}
            for n in range(1, hi + 1):
                out.setdefault(bucket(n), n)
            return out

        batches = firsts(self.batch_bucket, self.max_num_seqs)
        shapes = []
        if "decode" in kinds:
            pages = firsts(self.page_bucket, self.max_model_len)
            shapes += [StepShape(b, 1, w, kind="decode") for b in batches for w in pages]
        if "prefill" in kinds:
            # the furthest position a page bucket reaches
            pages = firsts(lambda n: self.page_bucket(n, "prefill"), self.max_model_len)
            reach = {w: min(w * self.page_size, self.max_model_len) for w in pages}
            budget = self.max_num_batched_tokens
            cap = query_blocks(min(self.max_prefill_chunk, budget))  # blocks of one row
            seen = set()
            for r in range(1, min(self.max_num_seqs, budget) + 1):
                for nb in range(r * cap + 1):
                    # nb blocks over r rows take the fewest tokens, and the shortest longest
                    # chunk, spread over k = min(r, nb) rows: a row of b >= 1 blocks has at
                    # least (b - 1) Q + 2 tokens, a row of none 1.
                    k = min(r, nb)
                    if (nb - k) * QUERY_BLOCK + k + r > budget:
                        break
                    longest = (-(-nb // k) - 1) * QUERY_BLOCK + 2 if nb else 1
                    for w, end in reach.items():
                        if end >= longest:
                            n = self.prefill_tokens(nb)
                            seen.add(StepShape(self.prefill_batch(r, n), n,
                                               w, kind="prefill"))
            shapes += sorted(seen, key=lambda s: (s.batch, s.tokens, s.pages))
        return shapes


def _next_bucket(n: int) -> int:
    """Smallest of 1, 2, 3, 4, 6, 8, 12, 16, 24, ... (powers of two and 1.5x them) >= n.

    Padding wastes at most a third of the work (powers of two alone: half), for about
    twice as many compiled shapes — still a handful per batch size.
    """
    p = 1 << max(0, (n - 1).bit_length())
    return p * 3 // 4 if p >= 4 and p * 3 // 4 >= n else p


def _fine_bucket(n: int) -> int:
    """Smallest of p, 1.25p, 1.5p, 1.75p (p a power of two) >= n: at most a fifth padding."""
    if n <= 4:
        return n
    p = 1 << ((n - 1).bit_length() - 1)  # the largest power of two below n
    return next(p * m // 4 for m in (5, 6, 7, 8) if p * m // 4 >= n)


@dataclasses.dataclass
class ScheduledRow:
    seq: Sequence
    start: int  # first position processed
    num_tokens: int  # tokens processed this step

    @property
    def samples(self) -> bool:
        """Only a row that reaches the sequence's last token produces a new token."""
        return self.start + self.num_tokens == self.seq.num_tokens


@dataclasses.dataclass
class Schedule:
    kind: Literal["prefill", "decode"]
    rows: list[ScheduledRow]
    shape: StepShape
    preempted: list[Sequence]


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager):
        self.config = config
        self.blocks = blocks
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []  # in admission order (oldest first)
        self._unreported: list[Sequence] = []  # preempted, not yet on a returned Schedule

    # -- bookkeeping -------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def has_schedulable(self) -> bool:
        return bool(self.waiting) or any(not s.awaiting_finish for s in self.running)

    def release(self, seq: Sequence) -> None:
        """Finished or aborted: give its pages back and forget it."""
        if seq in self.running:
            self.running.remove(seq)
            self.blocks.free(seq.seq_id)
        elif seq in self.waiting:
            self.waiting.remove(seq)
            if seq.seq_id in self.blocks:
                self.blocks.free(seq.seq_id)

    def _preempt(self, seq: Sequence) -> None:
        seq.drop_drafts()  # recomputed from its confirmed tokens
        self.running.remove(seq)
        self.blocks.free(seq.seq_id)
        seq.num_computed = 0
        seq.metrics.num_preemptions += 1
        self.waiting.appendleft(seq)

    # -- the decision ------------------------------------------------------------------

    def schedule(self) -> Schedule | None:
        """The next step, or None. Preemptions made while finding a step that then had no
        rows ride on the next step returned, so none goes unreported."""
        schedule = self._schedule_prefill() or self._schedule_decode()
        if schedule is not None and self._unreported:
            schedule.preempted = self._unreported + schedule.preempted
            self._unreported = []
        return schedule

    def _schedule_prefill(self) -> Schedule | None:
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        max_rows = cfg.max_num_seqs
        rows: list[ScheduledRow] = []
        # Sequences already running with a prompt chunk still to go come first.
        for seq in self.running:
            if len(rows) >= max_rows or budget <= 0:
                break
            if seq.awaiting_finish:
                continue
            # A prompt token never goes to a decode step: decode may exit early, prefill
            # always runs at full depth.
            if seq.num_pending > 1 or seq.num_computed < len(seq.prompt_token_ids):
                n = min(seq.num_pending, cfg.max_prefill_chunk, budget)
                if not self.blocks.can_append(seq.seq_id, seq.num_computed + n):
                    continue
                self.blocks.ensure_capacity(seq.seq_id, seq.num_computed + n)
                rows.append(ScheduledRow(seq, seq.num_computed, n))
                budget -= n
        # Then admit waiting sequences, strictly first come first served.
        while self.waiting and len(rows) < max_rows and budget > 0 \
                and len(self.running) < cfg.max_num_seqs:
            seq = self.waiting[0]
            n = min(seq.num_pending, cfg.max_prefill_chunk, budget)
            if not self.blocks.can_allocate(seq.num_computed + n):
                break
            self.blocks.allocate(seq.seq_id, seq.num_computed + n)
            self.waiting.popleft()
            self.running.append(seq)
            rows.append(ScheduledRow(seq, seq.num_computed, n))
            budget -= n
        if rows and cfg.mixed_steps:
            taken = {id(r.seq) for r in rows}
            for seq in self.running:
                if len(rows) >= max_rows or budget <= 0:
                    break
                # a row with drafts waits: a prefill step runs it at full depth, which
                # cannot complete (or verify) its run
                if (id(seq) in taken or seq.awaiting_finish or seq.num_pending != 1
                        or seq.num_draft or seq.drafting
                        or seq.num_computed < len(seq.prompt_token_ids)
                        or not self.blocks.can_append(seq.seq_id, seq.num_tokens)):
                    continue
                self.blocks.ensure_capacity(seq.seq_id, seq.num_tokens)
                rows.append(ScheduledRow(seq, seq.num_computed, 1))
                budget -= 1
        if not rows:
            return None
        tokens = cfg.prefill_tokens(sum(query_blocks(r.num_tokens) for r in rows))
        shape = StepShape(cfg.prefill_batch(len(rows), tokens), tokens,
                          cfg.page_bucket(max(r.start + r.num_tokens for r in rows), "prefill"),
                          kind="prefill")
        return Schedule("prefill", rows, shape, [])

    def _schedule_decode(self) -> Schedule | None:
        preempted: list[Sequence] = []
        rows: list[ScheduledRow] = []
        for seq in list(self.running):
            if seq not in self.running or seq.awaiting_finish:  # preempted below to make
                continue  # room for an older one; or finishing once its last token is read
            while not self.blocks.can_append(seq.seq_id, seq.num_tokens):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq in self.running:
                self.blocks.ensure_capacity(seq.seq_id, seq.num_tokens)
                if seq.num_pending > 1 or seq.num_computed < len(seq.prompt_token_ids):
                    continue  # its prompt chunk (pages now held) runs in a prefill step:
                    #           a prompt token never goes to a decode step, which may exit
                rows.append(ScheduledRow(seq, seq.num_computed, 1))
        if not rows:
            schedule = self._schedule_prefill() if preempted or self.running else None
            if schedule is not None:
                schedule.preempted = preempted + schedule.preempted
            else:
                self._unreported += preempted
            return schedule
        shape = StepShape(self.config.batch_bucket(len(rows)), 1,
                          self.config.page_bucket(max(r.seq.num_tokens for r in rows)),
                          kind="decode")
        return Schedule("decode", rows, shape, preempted)
