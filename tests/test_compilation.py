"""`compilation.pipelined`: lowering in order on the calling thread, finishing (XLA's compile)
on worker threads at once, results in order, errors passed on."""

from __future__ import annotations

import threading

import pytest

from ee_jax.serving.compilation import pipelined


def test_results_in_order_lowered_here_finished_at_once():
    caller = threading.get_ident()
    lowered_on, started = [], threading.Barrier(2, timeout=10)

    def lower(x):
        lowered_on.append(threading.get_ident())
        return x * 10

    def finish(y):
        if y < 20:  # the first two finish only once both have started: they ran at once
            started.wait()
        return y + 1

    assert list(pipelined(range(5), lower, finish, workers=2)) == [1, 11, 21, 31, 41]
    assert lowered_on == [caller] * 5


def test_a_failed_finish_reaches_the_caller():
    def finish(y):
        if y == 2:
            raise ValueError("program 2 does not compile")
        return y

    got = []
    with pytest.raises(ValueError, match="program 2"):
        for r in pipelined(range(4), lambda x: x, finish, workers=2):
            got.append(r)
    assert got == [0, 1]
