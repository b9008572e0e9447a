"""The NVLink transport's collective-order board (moonep/transport/order_board.py) on CPU ranks: headers
of one generation come back from every rank, a mismatched call is reported on every rank, a late peer
times out with its rank named, and close() removes the shared-memory segment."""
import os
import time

from moonep.errors import MoonepError
from tests.harness.mprun import quiet_barrier
from moonep.guard import HEADER_WORDS, CollectiveGuard
from moonep.transport.order_board import OrderBoard


class _Named:
    """The bits of a transport CollectiveGuard touches (its own exchange is never used here)."""

    def __init__(self, rank, world_size):
        self.rank, self.world_size, self.current_op = rank, world_size, "a collective"

    def timeout_s(self):
        return 5.0

    def exchange_header(self, header):
        raise AssertionError("the board's exchange must be used")


def _board(rt, timeout=10.0, words=4):
    return OrderBoard(rt.rank, rt.world_size, rt.comm.allgather, timeout, words)


def case_board_returns_every_header_in_order(rt):
    b = _board(rt)
    try:
        for g in range(300):  # many generations: both halves reused many times
            got = b.exchange([g, rt.rank, 7 * rt.rank + g, -g])
            assert got == [[g, r, 7 * r + g, -g] for r in range(rt.world_size)], (g, got)
    finally:
        b.close()


def case_board_mismatch_raises_on_every_rank(rt):
    b = _board(rt, words=HEADER_WORDS)
    guard = CollectiveGuard(_Named(rt.rank, rt.world_size), None, instance=0)
    try:
        guard.enter("dispatch", exchange=b.exchange)
        op = "combine" if rt.rank == rt.world_size - 1 else "dispatch"
        try:
            guard.enter(op, exchange=b.exchange)
        except MoonepError as e:
            msg = str(e)
            assert "collective order mismatch" in msg and "combine #2" in msg and "dispatch #2" in msg, msg
        else:
            raise AssertionError(f"rank {rt.rank}: no error for a mismatched call order")
        guard.enter("combine", exchange=b.exchange)  # the ranks stay in step after a reported mismatch
    finally:
        b.close()


def case_board_late_peer_times_out_naming_it(rt):
    b = _board(rt, timeout=0.5)
    late = rt.world_size - 1
    try:
        if rt.rank == late:
            time.sleep(3.0)
            b.exchange([1, 0, 1, 1])  # its peers already wrote this generation: returns at once
        else:
            t0 = time.monotonic()
            try:
                b.exchange([1, 0, 1, 1], "dispatch #1")
            except MoonepError as e:
                assert f"rank {late} did not start dispatch #1 within the timeout of 0.5s" in str(e), str(e)
                assert time.monotonic() - t0 < 2.5  # long before the late rank arrives
            else:
                raise AssertionError("no timeout")
            try:  # the generations are out of step now: refused at once, never a false "mismatch"
                b.exchange([1, 0, 1, 2], "combine #2")
            except MoonepError as e:
                assert "cannot be used any more" in str(e), str(e)
            else:
                raise AssertionError("a board that timed out was used again")
        quiet_barrier(rt.comm)
    finally:
        b.close()


def case_board_close_removes_the_segment(rt):
    b = _board(rt)
    name = b._shm.name
    b.exchange([0, 0, 0, 0])
    b.close()
    b.close()  # idempotent
    quiet_barrier(rt.comm)
    assert not os.path.exists(f"/dev/shm/{name.lstrip('/')}"), name
