"""BlockManager: a stateful model check of the page pool, plus the error paths."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from ee_jax.errors import EEJaxError
from ee_jax.serving.block_manager import BlockManager, OutOfPagesError, SequenceTooLongError


class PagePoolMachine(RuleBasedStateMachine):
    """Drives a BlockManager the way a scheduler does and checks it against a plain model.

    The model: `live` maps each sequence holding pages to its token count; `waiting` holds
    preempted sequences (pages released, tokens to recompute on re-admission).
    """

    def __init__(self):
        super().__init__()
        self.bm: BlockManager | None = None
        self.live: dict[int, int] = {}
        self.waiting: dict[int, int] = {}
        self.next_id = 0

    @initialize(num_pages=st.integers(2, 24), page_size=st.integers(1, 4),
                max_pages_per_seq=st.integers(1, 8), reserved=st.integers(1, 2))
    def setup(self, num_pages, page_size, max_pages_per_seq, reserved):
        num_pages = max(num_pages, reserved + 1)
        self.bm = BlockManager(num_pages, page_size, max_pages_per_seq, reserved_pages=reserved)

    # --------------------------------------------------------------- helpers

    def _tokens(self, data):
        # Mostly lengths that could fit; one draw in five a little past max_model_len.
        max_len = self.bm.max_model_len
        if data.draw(st.integers(0, 4)) == 0:
            return data.draw(st.integers(max_len + 1, max_len + 2 * self.bm.page_size))
        return data.draw(st.integers(0, min(max_len, self.bm.num_usable_pages * self.bm.page_size)))

    def _never_fits(self, tokens):
        pages = math.ceil(tokens / self.bm.page_size)
        return pages > min(self.bm.max_pages_per_seq, self.bm.num_usable_pages)

    def _snapshot(self):
        return ({s: self.bm.page_table(s) for s in self.bm.seq_ids}, self.bm.num_free_pages)

    def _admit(self, seq_id, tokens):
        """allocate() as a scheduler would; returns whether the sequence got its pages."""
        if self._never_fits(tokens):
            event("allocate: too long")
            with pytest.raises(SequenceTooLongError):
                self.bm.can_allocate(tokens)
            with pytest.raises(SequenceTooLongError):
                self.bm.allocate(seq_id, tokens)
            return False
        fits = self.bm.can_allocate(tokens)
        assert fits == (math.ceil(tokens / self.bm.page_size) <= self.bm.num_free_pages)
        if not fits:
            event("allocate: out of pages")
            before = self._snapshot()
            with pytest.raises(OutOfPagesError):
                self.bm.allocate(seq_id, tokens)
            assert self._snapshot() == before
            return False
        table = self.bm.allocate(seq_id, tokens)
        assert table == self.bm.page_table(seq_id)
        self.live[seq_id] = tokens
        return True

    # ----------------------------------------------------------------- rules

    @rule(data=st.data())
    def add(self, data):
        seq_id, self.next_id = self.next_id, self.next_id + 1
        tokens = self._tokens(data)
        if not self._admit(seq_id, tokens):
            assert seq_id not in self.bm

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def grow(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.live)))
        new_total = self.live[seq_id] + data.draw(st.integers(0, 2 * self.bm.page_size + 1))
        before = self._snapshot()
        if self._never_fits(new_total):
            event("grow: too long")
            with pytest.raises(SequenceTooLongError):
                self.bm.can_append(seq_id, new_total)
            with pytest.raises(SequenceTooLongError):
                self.bm.ensure_capacity(seq_id, new_total)
            assert self._snapshot() == before
            return
        extra = math.ceil(new_total / self.bm.page_size) - len(self.bm.page_table(seq_id))
        assert self.bm.can_append(seq_id, new_total) == (extra <= self.bm.num_free_pages)
        if extra > self.bm.num_free_pages:
            event("grow: out of pages")
            with pytest.raises(OutOfPagesError):
                self.bm.ensure_capacity(seq_id, new_total)
            assert self._snapshot() == before
            return
        old_table = self.bm.page_table(seq_id)
        new_pages = self.bm.ensure_capacity(seq_id, new_total)
        assert len(new_pages) == max(extra, 0)
        assert self.bm.page_table(seq_id) == old_table + new_pages  # grows at the end only
        self.live[seq_id] = new_total

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.live)))
        held = len(self.bm.page_table(seq_id))
        free_before = self.bm.num_free_pages
        assert self.bm.free(seq_id) == held
        assert self.bm.num_free_pages == free_before + held
        del self.live[seq_id]
        with pytest.raises(KeyError, match="holds no pages"):
            self.bm.free(seq_id)

    @precondition(lambda self: self.live or self.waiting)
    @rule(data=st.data())
    def abort(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.live) + sorted(self.waiting)))
        if seq_id in self.live:
            self.bm.free(seq_id)
            del self.live[seq_id]
        else:  # a preempted sequence holds no pages: the scheduler just drops it
            with pytest.raises(KeyError):
                self.bm.free(seq_id)
            del self.waiting[seq_id]
        assert seq_id not in self.bm

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def preempt(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.live)))
        self.bm.free(seq_id)
        # Recompute preemption: prompt + generated tokens come back as one new prefill.
        self.waiting[seq_id] = self.live.pop(seq_id)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def readd(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.waiting)))
        if self._admit(seq_id, self.waiting[seq_id]):
            event("readd: admitted")
            del self.waiting[seq_id]

    # ------------------------------------------------------------ invariants

    @invariant()
    def pool_is_consistent(self):
        if self.bm is None:
            return
        bm = self.bm
        bm.check_invariants()
        assert set(bm.seq_ids) == set(self.live)
        held = 0
        for seq_id, tokens in self.live.items():
            table = bm.page_table(seq_id)
            assert len(table) == math.ceil(tokens / bm.page_size)
            assert bm.num_tokens(seq_id) == tokens
            assert all(bm.reserved_pages <= p < bm.num_pages for p in table)
            held += len(table)
        assert bm.num_used_pages == held
        assert bm.num_free_pages + bm.num_used_pages == bm.num_usable_pages
        usage = bm.usage()
        assert (usage.free, usage.used, usage.total) == (
            bm.num_free_pages, bm.num_used_pages, bm.num_usable_pages)
        assert dict(usage.per_seq) == {s: math.ceil(t / bm.page_size)
                                       for s, t in self.live.items()}
        rows = [*sorted(self.live), None]
        arr = bm.page_table_array(rows)
        assert arr.dtype == np.int32 and arr.shape == (len(rows), bm.max_pages_per_seq)
        for r, seq_id in enumerate(rows):
            n = 0 if seq_id is None else len(bm.page_table(seq_id))
            if seq_id is not None:
                assert arr[r, :n].tolist() == bm.page_table(seq_id)
            assert (arr[r, n:] == bm.null_page).all()

    def teardown(self):
        if self.bm is None:
            return
        for seq_id in list(self.live):
            self.bm.free(seq_id)
        self.bm.check_invariants()
        assert len(self.bm) == 0
        assert self.bm.num_free_pages == self.bm.num_usable_pages
        assert self.bm.num_used_pages == 0


TestPagePool = PagePoolMachine.TestCase
TestPagePool.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                 suppress_health_check=[HealthCheck.too_slow])


# ------------------------------------------------------------------ unit tests


@pytest.mark.parametrize("kwargs, field", [
    (dict(num_pages=0, page_size=4, max_pages_per_seq=2), "num_pages"),
    (dict(num_pages=8, page_size=0, max_pages_per_seq=2), "page_size"),
    (dict(num_pages=8, page_size=4, max_pages_per_seq=0), "max_pages_per_seq"),
    (dict(num_pages=8, page_size=4, max_pages_per_seq=2, reserved_pages=0), "reserved_pages"),
    (dict(num_pages=2, page_size=4, max_pages_per_seq=2, reserved_pages=2), "num_pages"),
])
def test_bad_construction_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        BlockManager(**kwargs)


def test_too_long_names_the_limit_and_max_model_len():
    bm = BlockManager(num_pages=64, page_size=16, max_pages_per_seq=4)
    assert bm.max_model_len == 64
    assert bm.can_allocate(64)
    for call in (lambda: bm.can_allocate(65), lambda: bm.allocate(0, 65)):
        with pytest.raises(SequenceTooLongError, match=r"max_pages_per_seq=4.*max_model_len=64"):
            call()
    bm.allocate(1, 60)
    with pytest.raises(SequenceTooLongError, match="max_model_len=64"):
        bm.ensure_capacity(1, 65)
    assert isinstance(SequenceTooLongError("x"), EEJaxError | ValueError)
    bm.check_invariants()


def test_sequence_larger_than_the_pool_is_too_long_not_out_of_pages():
    bm = BlockManager(num_pages=3, page_size=4, max_pages_per_seq=8)  # 2 usable pages
    with pytest.raises(SequenceTooLongError, match="whole pool of 2 usable pages"):
        bm.can_allocate(9)


def test_out_of_pages_changes_nothing():
    bm = BlockManager(num_pages=5, page_size=2, max_pages_per_seq=4)  # 4 usable pages
    bm.allocate(0, 5)  # 3 pages
    table, free = bm.page_table(0), bm.num_free_pages
    assert not bm.can_allocate(3)
    with pytest.raises(OutOfPagesError, match="needs 2 more pages, only 1"):
        bm.allocate(1, 3)
    assert 1 not in bm
    assert bm.page_table(0) == table and bm.num_free_pages == free
    bm.allocate(1, 2)  # the last page
    assert not bm.can_append(0, 7)
    with pytest.raises(OutOfPagesError, match="sequence 0 needs 1 more pages, only 0"):
        bm.ensure_capacity(0, 7)
    assert bm.page_table(0) == table and bm.num_free_pages == 0 and bm.num_tokens(0) == 5
    assert bm.can_append(0, 6)
    assert bm.ensure_capacity(0, 6) == []  # fits in the pages it holds
    assert bm.num_tokens(0) == 6
    bm.check_invariants()


def test_free_unknown_or_twice_raises_key_error():
    bm = BlockManager(num_pages=4, page_size=4, max_pages_per_seq=2)
    with pytest.raises(KeyError, match="sequence 7 holds no pages"):
        bm.free(7)
    bm.allocate(7, 3)
    assert bm.free(7) == 1
    with pytest.raises(KeyError, match="already freed"):
        bm.free(7)
    for call in (bm.page_table, bm.num_tokens, lambda s: bm.ensure_capacity(s, 1),
                 lambda s: bm.can_append(s, 1), lambda s: bm.page_table_array([s])):
        with pytest.raises(KeyError):
            call(7)
    bm.check_invariants()


def test_allocate_live_id_twice_raises():
    bm = BlockManager(num_pages=4, page_size=4, max_pages_per_seq=2)
    bm.allocate(3, 4)
    with pytest.raises(ValueError, match="already holds pages"):
        bm.allocate(3, 4)
    bm.check_invariants()


def test_null_page_never_handed_out():
    bm = BlockManager(num_pages=9, page_size=1, max_pages_per_seq=4, reserved_pages=1)
    pages = [p for s in range(2) for p in bm.allocate(s, 4)]
    assert sorted(pages) == list(range(1, 9)) and bm.num_free_pages == 0
    assert not bm.can_allocate(1)
    bm.free(0)
    bm.allocate(2, 4)
    assert bm.null_page not in bm.page_table(2)
    bm.check_invariants()


def test_page_table_array_pads_with_null_page_and_checks_width():
    bm = BlockManager(num_pages=16, page_size=4, max_pages_per_seq=6)
    bm.allocate(10, 9)   # 3 pages
    bm.allocate(11, 1)   # 1 page
    arr = bm.page_table_array([11, None, 10], width=4)
    assert arr.dtype == np.int32 and arr.shape == (3, 4)
    np.testing.assert_array_equal(arr[0], [*bm.page_table(11), 0, 0, 0])
    np.testing.assert_array_equal(arr[1], [0, 0, 0, 0])
    np.testing.assert_array_equal(arr[2], [*bm.page_table(10), 0])
    assert bm.page_table_array([10]).shape == (1, 6)
    assert bm.page_table_array([]).shape == (0, 6)
    with pytest.raises(ValueError, match="width 2"):
        bm.page_table_array([10], width=2)


def test_pages_needed_and_zero_tokens():
    bm = BlockManager(num_pages=8, page_size=4, max_pages_per_seq=4)
    assert [bm.pages_needed(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    with pytest.raises(ValueError):
        bm.pages_needed(-1)
    assert bm.allocate(0, 0) == []
    assert len(bm.ensure_capacity(0, 1)) == 1
    usage = bm.usage()
    assert (usage.free, usage.used, usage.total, dict(usage.per_seq)) == (6, 1, 7, {0: 1})
    assert usage.utilization == pytest.approx(1 / 7)
    bm.check_invariants()


def test_check_invariants_catches_corruption():
    bm = BlockManager(num_pages=8, page_size=4, max_pages_per_seq=4)
    bm.allocate(0, 8)
    bm.allocate(1, 4)
    bm._tables[1].append(bm._tables[0][0])  # a page shared by two sequences
    with pytest.raises(AssertionError):
        bm.check_invariants()
    bm = BlockManager(num_pages=8, page_size=4, max_pages_per_seq=4)
    bm._free.append(0)  # null page on the free list
    with pytest.raises(AssertionError):
        bm.check_invariants()
    bm = BlockManager(num_pages=8, page_size=4, max_pages_per_seq=4)
    bm.allocate(0, 4)
    bm._free.append(bm._tables[0][0])  # both free and used
    with pytest.raises(AssertionError):
        bm.check_invariants()
    bm = BlockManager(num_pages=8, page_size=4, max_pages_per_seq=4)
    bm._free.pop()  # a leaked page
    with pytest.raises(AssertionError, match="lost"):
        bm.check_invariants()
