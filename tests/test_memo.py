"""vescale.memo.Memo: the bounded decision table every cache family stores its entries in."""

from __future__ import annotations

import threading

from vescale.memo import Memo


def test_entries_are_kept_until_the_limit_empties_the_table():
    memo = Memo("test", 3)
    for n in range(3):
        assert memo.put(n, f"decision {n}") == f"decision {n}"
    assert len(memo) == 3 and memo.get(2) == "decision 2" and 0 in memo
    memo.put(3, "decision 3")  # the fourth: the table empties, then keeps it
    assert len(memo) == 1 and memo.get(0) is None and memo.get(3) == "decision 3"


def test_get_or_make_makes_once():
    memo, made = Memo("test", 8), []
    for _ in range(3):
        assert memo.get_or_make("key", lambda: made.append(1) or "value") == "value"
    assert made == [1]


def test_a_key_that_does_not_hash_is_decided_every_time_and_never_stored():
    memo, made = Memo("test", 8), []
    unhashable = ([1, 2],)  # symbolic sizes while tracing do not hash either
    for _ in range(2):
        assert memo.get_or_make(unhashable, lambda: made.append(1) or "value") == "value"
    assert made == [1, 1] and len(memo) == 0 and memo.get(unhashable, "default") == "default"


def test_writers_on_many_threads_never_exceed_the_limit():
    memo = Memo("test", 64)

    def write(base):
        for i in range(2000):
            memo.put((base, i), i)
            assert len(memo) <= 64

    threads = [threading.Thread(target=write, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert 0 < len(memo) <= 64
