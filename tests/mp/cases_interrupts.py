"""An interrupt (Ctrl-C: a KeyboardInterrupt, any BaseException) at every wait of an ExpertParallel training
step, construction and backward included, on both host transports.  Run by tests/mp/test_mp_faults.py at 2
and 3 ranks.

Every rank is interrupted at the same collective (Ctrl-C under mpirun reaches every rank), the k-th of the
step, for every k:

* mpi: inside the k-th collective's poll loop, while its receives are pending; the peers come late to
  that collective, so their data reaches the interrupted rank after the interrupt.  That memory must stay
  alive: buffers allocated right after the interrupt (canary bytes, numpy and torch, 16 B to 64 KiB, where a
  freed receive buffer would be reused) and canary bytes around the inputs must be intact once the late
  data has arrived, and the inputs unchanged.
* torch (gloo): a signal during a blocking collective is delivered when it returns: right after the k-th.

The interrupted instance then refuses its next call at once, naming the interrupt (torch: a new instance
on the same gloo group too); a fresh instance (mpi: on the same communicator; torch: on a new group) gives
the dense float64 values and gradients.
"""
import time

import torch

import moonep
from faults_common import isolated
from interrupts_common import (CANARY, Injected, canaries, checked_step, fence_intact, fenced, intact, interrupt_at,
                               make_ep, problem, train_step, transports)
from tests.harness.mp import SkipCase
from tests.harness.mprun import quiet_barrier

T = 2.0  # the isolated runtimes' timeout: nothing here waits for it
LATE = 0.1  # how late the peers come to the interrupted collective (mpi)


def _collectives_per_step(rt, transport) -> int:
    sub = isolated(rt, timeout=30)
    with interrupt_at(0) as count:
        ep = make_ep(sub, transport, 30)
        p, _, _ = problem(sub, 1, ep.num_experts)
        train_step(ep, p)
    ep.close()
    return count[0]


def _progress(comm, seconds=0.1):
    """Let MPI deliver what peers sent (a late message lands during this rank's MPI calls)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        comm.Iprobe()


def _refused_at_once(fn, *needles):
    t0 = time.monotonic()
    try:
        fn()
    except moonep.MoonepError as exc:
        msg, dt = str(exc), time.monotonic() - t0
        assert "refused" in msg and all(n in msg for n in needles) and dt < 0.5, (dt, msg)
        return dt
    raise AssertionError("the call after the interrupt was not refused")


def _interrupt_case(rt, transport, k):
    sub = isolated(rt, timeout=T)
    p, _, _ = problem(sub, 1, 2 * sub.world_size)
    if sub.device.type == "cpu":  # host memory the transports could write into
        x, x_whole, x_span = fenced(p["x"].detach())
        w, w_whole, w_span = fenced(p["w"])
        p.update(x=x.requires_grad_(), w=w)
    else:
        x, w = p["x"], p["w"]
        x_whole = w_whole = torch.full((2,), CANARY, dtype=torch.uint8)
        x_span = w_span = (1, 1)
    x0, w0 = x.detach().clone(), w.clone()
    ep, bufs, refused = None, None, 0.0
    with interrupt_at(k, late=0.0 if sub.rank == 0 else LATE):
        try:
            ep = make_ep(sub, transport, T)
            train_step(ep, p)
        except Injected:
            bufs = canaries()  # at once: where a freed receive buffer would be reused
    if transport == "torch" or sub.rank == 0:  # mpi peers may complete the step when k is its last wait
        assert bufs is not None, f"rank {sub.rank}: collective {k} was not interrupted"
    if bufs is not None and ep is not None:  # interrupted in a call (not in the construction)
        refused = _refused_at_once(lambda: ep.dispatch(p["x"], p["idx"], p["w"]), "Injected")
        if transport == "torch":  # the gloo group is left, for every instance on it
            refused = max(refused, _refused_at_once(lambda: make_ep(sub, transport, T), "process group"))
    if ep is not None:
        ep.close()
    bufs = bufs if bufs is not None else canaries()
    quiet_barrier(rt.comm)  # every rank's fault phase is over: the late data was sent
    _progress(sub.comm)
    quiet_barrier(rt.comm)
    assert intact(bufs), f"rank {sub.rank}: memory allocated after the interrupt at collective {k} was written"
    assert fence_intact(x_whole, x_span) and fence_intact(w_whole, w_span), f"rank {sub.rank}: bytes around x, w"
    assert torch.equal(x.detach(), x0) and torch.equal(w, w0), f"rank {sub.rank}: inputs changed"
    fresh = sub if transport == "mpi" else isolated(rt, timeout=T)
    ep2 = make_ep(fresh, transport, T)
    checked_step(fresh, ep2, seed=k)
    ep2.close()
    return refused


def _every_wait(rt, transport):
    if transport not in transports(rt):
        raise SkipCase(f"the {transport} transport does not move {rt.device.type} tensors")
    if rt.world_size == 1:
        return
    n = _collectives_per_step(rt, transport)
    assert n >= 12, n  # construction, dispatch, two prefetches, combine, their backward passes
    t0 = time.monotonic()
    refused = max(_interrupt_case(rt, transport, k) for k in range(1, n + 1))
    print(f"timing: {transport} interrupts at {n} waits, rank {rt.rank}/{rt.world_size}: {time.monotonic() - t0:.1f}s "
          f"in all, the slowest refusal after an interrupt {refused:.4f}s", flush=True)


def case_interrupt_at_every_wait_mpi(rt):
    _every_wait(rt, "mpi")


def case_interrupt_at_every_wait_torch(rt):
    _every_wait(rt, "torch")
