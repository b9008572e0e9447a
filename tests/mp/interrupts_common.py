"""Helpers of the interrupt and disagreement cases (tests/mp/cases_interrupts.py, cases_disagree.py): an
interrupt injected at the k-th collective of a transport, canary memory, one checked training step."""
import contextlib
import time

import numpy as np
import torch

import moonep
import moonep.transport.mpi as mpi_mod
from ep_reference import dense_reference, make_problem, my_slice, run_slots
from moonep.transport.mpi import MPITransport
from moonep.transport.torchdist import TorchDistTransport

WAITS = ("exchange_header", "all_gather", "all_to_all", "all_to_all_sized", "all_gather_object")
CANARY = 0xA5


class Injected(KeyboardInterrupt):
    """The interrupt a test injects (Ctrl-C): a BaseException, not an Exception."""


@contextlib.contextmanager
def interrupt_at(k: int, late: float = 0.0, interrupt: bool = True):
    """Count the collectives of every transport (class-wide: construction included) and interrupt the k-th.

    mpi: the interrupt is raised inside the k-th collective's poll loop, while its requests are pending;
    ``late`` seconds are slept first (the peers pass it, so that the interrupted rank waits for their data,
    which arrives after the interrupt).  torch: raised right after the k-th collective returns (where a
    signal that arrives during a blocking gloo call is delivered).  ``k = 0``: only count;
    ``interrupt=False``: only be late.  Yields a list holding the count so far."""
    count, armed = [0], [False]
    saved = [(cls, name, getattr(cls, name)) for cls in (MPITransport, TorchDistTransport) for name in WAITS]
    real_nap = mpi_mod._nap

    def nap(spins, waited):
        if armed[0]:
            armed[0] = False
            raise Injected(f"injected into collective #{count[0]}")
        real_nap(spins, waited)

    def wrap(cls, real):
        def call(self, *args, **kwargs):
            count[0] += 1
            if count[0] != k:
                return real(self, *args, **kwargs)
            if not interrupt:
                time.sleep(late)
                return real(self, *args, **kwargs)
            if cls is TorchDistTransport:
                real(self, *args, **kwargs)
                raise Injected(f"injected after collective #{k}")
            time.sleep(late)
            armed[0] = True  # the next wait is interrupted: this one's, or, if it needs none, a later one's
            return real(self, *args, **kwargs)
        return call

    for cls, name, real in saved:
        setattr(cls, name, wrap(cls, real))
    mpi_mod._nap = nap
    try:
        yield count
    finally:
        mpi_mod._nap = real_nap
        for cls, name, real in saved:
            setattr(cls, name, real)


def canaries():
    """Buffers allocated right after an interrupt, where a freed receive buffer would be reused: numpy and
    torch, every multiple of 16 bytes up to 4 KiB (malloc's and numpy's small size classes), then powers of
    two up to 64 KiB, filled with ``CANARY``."""
    sizes = list(range(16, 4097, 16)) + [1 << s for s in range(13, 17)]
    return [f(n) for n in sizes for f in (lambda n: np.full(n, CANARY, dtype=np.uint8),
                                          lambda n: torch.full((n,), CANARY, dtype=torch.uint8))]


def intact(bufs) -> bool:
    return all(bool((b == CANARY).all()) for b in bufs)


def fenced(t: torch.Tensor, pad: int = 64):
    """A copy of ``t`` inside a larger buffer whose ``pad`` bytes before and after hold ``CANARY``: returns
    (the copy, the whole buffer, the copy's byte range)."""
    nbytes = t.numel() * t.element_size()
    whole = torch.full((nbytes + 2 * pad,), CANARY, dtype=torch.uint8)
    inner = whole[pad:pad + nbytes].view(t.dtype).view(t.shape)
    inner.copy_(t)
    return inner, whole, (pad, pad + nbytes)


def fence_intact(whole, span) -> bool:
    a, b = span
    return bool((whole[:a] == CANARY).all()) and bool((whole[b:] == CANARY).all())


def transports(rt):
    """The host transports of ``rt``'s tensors: both on CPU, the torch transport with CUDA tensors (NCCL,
    or gloo when ranks share a GPU)."""
    return ("mpi", "torch") if rt.device.type == "cpu" else ("torch",)


def problem(sub, seed, E):
    """This rank's part of a global float64 problem on its device (inputs requiring grad), and the dense
    reference (on the host)."""
    R, K, H, F = sub.world_size, 2, 8, 5
    sizes = [6 - 3 * (r % 2) for r in range(R)]  # rank 1 of 2 and 3 has 3 tokens, the others 6
    x, idx, w, w1, w2, gy = make_problem(seed, R, E, K, H, F, sizes, "hot")
    sl, home = my_slice(sub, sizes), slice(sub.rank * E // R, (sub.rank + 1) * E // R)
    xr = x.clone().requires_grad_()
    ref = dense_reference(xr, idx, w, w1, w2)
    ref.backward(gy)
    d = sub.device
    mine = dict(x=x[sl].to(d).requires_grad_(), idx=idx[sl].to(d), w=w[sl].to(d), w1=w1[home].to(d),
                w2=w2[home].to(d), gy=gy[sl].to(d))
    return mine, ref.detach()[sl], xr.grad[sl]


def train_step(ep, p):
    """Forward (dispatch, two prefetches, the experts, combine) and backward of one step; returns y."""
    h = ep.dispatch(p["x"], p["idx"], p["w"])
    w1s, w2s = ep.prefetch(h, p["w1"]), ep.prefetch(h, p["w2"])
    y = ep.combine(run_slots(h.tokens, h.cu_seqlens.tolist(), w1s, w2s), h)
    y.backward(p["gy"])
    return y


def checked_step(sub, ep, seed):
    """A training step equal to the dense float64 reference (values and the gradient of x)."""
    p, y_ref, gx_ref = problem(sub, seed, ep.num_experts)
    y = train_step(ep, p)
    torch.testing.assert_close(y.detach().cpu(), y_ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(p["x"].grad.cpu(), gx_ref, atol=1e-12, rtol=0)


def make_ep(sub, transport, timeout):
    return moonep.ExpertParallel(sub, num_experts=2 * sub.world_size, topk=2, hidden=8, max_tokens=8,
                                 dtype=torch.float64, transport=transport, timeout=timeout)
