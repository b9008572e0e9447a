"""OrderBoard slots on their own (one process playing rank 0 of 2): a reader never takes a slot whose
generation is new but whose header words are not (what a weakly ordered host can show), and takes it as
soon as the whole slot is there."""
import threading

import pytest

from moonep.errors import MoonepError
from moonep.transport import order_board
from moonep.transport.order_board import _check, OrderBoard


@pytest.fixture(autouse=True)
def _verify(monkeypatch):
    monkeypatch.setattr(order_board, "VERIFY", True)  # as on a weakly ordered host


def _rank0_of_two(timeout):
    names = {}

    def gather(obj):
        names.setdefault("name", obj)
        return [names["name"], None]

    return OrderBoard(0, 2, gather, timeout)


def test_torn_slot_is_not_taken_then_whole_slot_is():
    b = _rank0_of_two(timeout=5.0)
    try:
        half = b.table[1]  # generation 1 lives in half 1
        old = [11, 0, 1, 1]
        half[1, 1:5] = old
        half[1, 5] = _check([-1] + old)  # last use of the slot: generation -1
        half[1, 0] = 1                   # the new generation is visible, its header and check are not yet
        out = {}
        t = threading.Thread(target=lambda: out.setdefault("got", b.exchange([11, 0, 1, 1])))
        t.start()
        t.join(0.3)
        assert t.is_alive(), f"took a torn slot: {out}"
        new = [11, 0, 2, 1]
        half[1, 1:5] = new
        half[1, 5] = _check([1] + new)
        t.join(5)
        assert out["got"] == [[11, 0, 1, 1], new]
    finally:
        b.close()


def test_torn_slot_times_out_naming_the_peer():
    b = _rank0_of_two(timeout=0.3)
    try:
        b.table[1][1, 0] = 1  # generation only
        with pytest.raises(MoonepError, match="rank 1 did not start"):
            b.exchange([1, 2, 3, 4])
    finally:
        b.close()


def test_check_word_changes_with_any_word():
    base = [5, 11, 0, 2, 7]
    c = _check(base)
    for i in range(5):
        for d in (1, -1, 2, 1 << 40):
            w = list(base)
            w[i] += d
            assert _check(w) != c


def test_board_never_closed_is_unlinked_at_exit_without_a_leak_warning():
    """A process that exits without closing its board (a script that never closes its ExpertParallel)
    unlinks the segment itself: no "leaked shared_memory" warning from the resource tracker, no segment
    left behind."""
    import subprocess
    import sys
    from multiprocessing import shared_memory

    code = ("from moonep.transport.order_board import OrderBoard\n"
            "b = OrderBoard(0, 1, lambda o: [o], 5.0)\n"
            "print(b._shm.name, flush=True)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "leaked" not in r.stderr, r.stderr
    with pytest.raises(FileNotFoundError):
        shared_memory.SharedMemory(name=r.stdout.strip())
