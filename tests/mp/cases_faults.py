"""Fault injection without killing a process: mismatched collective order and stalled ranks.

Run by tests/mp/test_mp_faults.py (3 ranks, so "rank 2 called combine while rank 0 called dispatch" is
exercised).  Every rank must raise MoonepError naming what happened; stalls must be reported within the
timeout (3 s here).  Killed ranks are in tests/mp/fault_kill.py (a rank's death ends an mpiexec job).
"""
import time

import torch

import moonep
from faults_common import expect_moonep_error, isolated, make_ep, problem, step

TIMEOUT = 3.0
TRANSPORTS = ("mpi", "torch")


def case_order_mismatch_combine_vs_dispatch(rt):
    """The last rank calls combine #3 while the others call dispatch #3: detected, on every rank, at once."""
    R = rt.world_size
    for transport in TRANSPORTS:
        sub = isolated(rt, timeout=30)
        ep = make_ep(sub, transport, timeout=30)
        x, idx, w, _ = problem(sub, ep.num_experts)
        h = ep.dispatch(x, idx, w)             # #1
        ep.combine(h.tokens, h)                # #2
        if R == 1:
            continue
        bad = R - 1
        call = (lambda: ep.combine(h.tokens, h)) if sub.rank == bad else (lambda: ep.dispatch(x, idx, w))
        want = f"rank {bad} called combine #3 while rank 0 called dispatch #3"
        expect_moonep_error(call, want, within=10)  # detected, not timed out (timeout is 30 s)


def case_order_mismatch_prefetch_vs_reduce_grad_and_two_layers(rt):
    """A different op, and two ExpertParallel objects (two layers) called in different orders."""
    R = rt.world_size
    if R == 1:
        return
    for transport in TRANSPORTS:
        sub = isolated(rt, timeout=30)
        ep0, ep1 = make_ep(sub, transport, 30), make_ep(sub, transport, 30)
        x, idx, w, home = problem(sub, ep0.num_experts)
        h = ep0.dispatch(x, idx, w)  # #1
        grad = torch.zeros(2 * ep0.epn, home.shape[1])
        call = (lambda: ep0.reduce_grad(h, grad)) if sub.rank == 1 else (lambda: ep0.prefetch(h, home))
        expect_moonep_error(call, "rank 1 called reduce_grad #2 while rank 0 called prefetch #2", within=10)
        # Layer order differs: rank 0 runs layer 1 first, the others layer 0.
        first = ep1 if sub.rank == 0 else ep0
        expect_moonep_error(lambda: first.dispatch(x, idx, w), "collective order mismatch",
                            "of ExpertParallel #", within=10)


def case_order_mismatch_in_backward(rt):
    """Autograd passes are collectives too: one rank runs backward while the others run a new dispatch."""
    R = rt.world_size
    if R == 1:
        return
    sub = isolated(rt, timeout=30)
    ep = make_ep(sub, "mpi", 30)
    x, idx, w, _ = problem(sub, ep.num_experts)
    xg = x.clone().requires_grad_()
    h = ep.dispatch(xg, idx, w)                    # #1
    y = ep.combine(h.tokens, h)                    # #2
    if sub.rank == 0:
        call = lambda: y.sum().backward()          # combine.backward #3  # noqa: E731
    else:
        call = lambda: ep.dispatch(x, idx, w)      # dispatch #3  # noqa: E731
    expect_moonep_error(call, "rank 1 called dispatch #3 while rank 0 called combine.backward #3", within=10)


def _stall_case(rt, transport, op):
    """The last rank stalls (sleeps past the timeout) before ``op``; the others must raise in time."""
    R = rt.world_size
    if R == 1:
        return
    sub = isolated(rt, timeout=TIMEOUT)
    ep = make_ep(sub, transport, TIMEOUT)
    x, idx, w, home = problem(sub, ep.num_experts)
    stalled = R - 1
    h = ep.dispatch(x, idx, w) if op != "dispatch" else None
    if sub.rank == stalled:
        time.sleep(TIMEOUT + 1.5)  # past everybody's timeout; then it leaves this broken runtime alone
        return
    calls = {"dispatch": lambda: ep.dispatch(x, idx, w), "combine": lambda: ep.combine(h.tokens, h),
             "prefetch": lambda: ep.prefetch(h, home)}
    seq = 1 if op == "dispatch" else 2
    needles = [f"{op} #{seq}", f"{TIMEOUT:g}s"]
    if transport == "mpi":  # the point-to-point header tells exactly who is missing
        needles.append(f"rank {stalled} did not join")
    _, dt = expect_moonep_error(calls[op], *needles, within=TIMEOUT + 4)
    assert dt >= TIMEOUT - 0.5, f"raised after {dt:.1f}s, before the {TIMEOUT}s timeout"


def case_stall_before_dispatch_mpi(rt):
    _stall_case(rt, "mpi", "dispatch")


def case_stall_before_combine_torch(rt):
    _stall_case(rt, "torch", "combine")


def case_stall_inside_dispatch_mpi(rt):
    """The stall hits after the order header, inside the data exchange (the counts all-gather, which every
    rank needs): the error still names the op and the collective."""
    R = rt.world_size
    if R == 1:
        return
    sub = isolated(rt, timeout=TIMEOUT)
    ep = make_ep(sub, "mpi", TIMEOUT)
    x, idx, w, home = problem(sub, ep.num_experts)
    if sub.rank == R - 1:
        def stalled_all_gather(*a, **k):
            time.sleep(TIMEOUT + 1.5)
            raise SystemError("stalled rank gives up")  # never rejoins the broken exchange

        ep.transport.all_gather = stalled_all_gather
        try:
            ep.dispatch(x, idx, w)
        except SystemError:
            pass
        return
    _, dt = expect_moonep_error(lambda: ep.dispatch(x, idx, w), "dispatch #1", "all_gather",
                                f"{TIMEOUT:g}s", within=TIMEOUT + 4)
    assert dt >= TIMEOUT - 0.5, dt


def case_timeout_knob_defaults(rt):
    """The knobs: runtime timeout from MOONEP_TIMEOUT (default 60), ExpertParallel(timeout=) on the transport."""
    assert rt.timeout.total_seconds() <= 60
    with moonep.ExpertParallel(rt, num_experts=2 * rt.world_size, topk=1, hidden=4, max_tokens=2,
                               transport="mpi", timeout=7) as ep:
        assert ep.transport.timeout_s() == 7
    with moonep.ExpertParallel(rt, num_experts=2 * rt.world_size, topk=1, hidden=4, max_tokens=2,
                               transport="torch") as ep:
        assert ep.transport.timeout_s() == rt.timeout.total_seconds()
