"""Helpers shared by the fault-injection cases (tests/mp/cases_faults.py, tests/mp/fault_kill.py).

Fault cases leave broken communicators behind (requests that never complete, a gloo group that timed
out), so each runs on its own isolated runtime: a duplicate of the MPI communicator and a fresh gloo
group with a short timeout.  The harness's own communicator and group stay healthy for the next case.
"""
import datetime
import os
import time

import torch
import torch.distributed as dist

import moonep
from moonep.runtime import Runtime


def isolated(rt, timeout: float, ranks=None, comm=None) -> Runtime:
    """A runtime over ``ranks`` (default all) with its own MPI communicator and gloo group, on ``rt``'s
    device (CUDA runtimes whose group is NCCL get a NCCL group too, for the data).

    Collective over the whole job (``dist.new_group`` must be called by every rank, in the same order).
    ``comm``: an already split communicator for ``ranks`` (default: a duplicate of ``rt.comm``).
    """
    td = datetime.timedelta(seconds=timeout)
    ranks = list(range(rt.world_size)) if ranks is None else list(ranks)
    cpu_group = dist.new_group(ranks, backend="gloo", timeout=td)
    backend = rt.backend if rt.device.type == "cuda" else "gloo"
    group = dist.new_group(ranks, backend=backend, timeout=td) if backend != "gloo" else cpu_group
    comm = rt.comm.Dup() if comm is None else comm
    if rt.rank not in ranks:
        return None
    device = rt.device if rt.device.type == "cuda" else torch.device("cpu")
    return Runtime(ranks.index(rt.rank), len(ranks), rt.local_rank, rt.local_world_size, device, group, cpu_group,
                   backend, "mpi", td, comm)


def problem(sub, E, K=2, H=8, S=16, seed=0):
    """Tokens, a skewed routing (so the plan places replicas) and home weights for this rank."""
    g = torch.Generator().manual_seed(seed * 100 + sub.rank)
    x = torch.randn(S, H, generator=g)
    hot = torch.zeros(S, 1, dtype=torch.int64)  # every token picks expert 0: replicas are needed
    rest = torch.stack([torch.randperm(E - 1, generator=g)[:K - 1] + 1 for _ in range(S)])
    idx = torch.cat([hot, rest], dim=1)
    w = torch.rand(S, K, generator=g)
    home = torch.randn(E // sub.world_size, H, generator=g)
    return x, idx, w, home


def make_ep(sub, transport, timeout, E=None):
    E = E or 2 * sub.world_size
    return moonep.ExpertParallel(sub, num_experts=E, topk=2, hidden=8, max_tokens=16, transport=transport,
                                 timeout=timeout)


def step(ep, sub, seed=0):
    """One full forward step: dispatch, prefetch, combine."""
    x, idx, w, home = problem(sub, ep.num_experts, seed=seed)
    h = ep.dispatch(x, idx, w)
    ep.prefetch(h, home)
    return ep.combine(h.tokens, h), h


def expect_moonep_error(fn, *needles, within: float):
    """Run ``fn``; it must raise MoonepError within ``within`` seconds, its message holding every needle."""
    t0 = time.monotonic()
    try:
        fn()
    except moonep.MoonepError as exc:
        dt = time.monotonic() - t0
        msg = str(exc)
        missing = [n for n in needles if n not in msg]
        assert not missing, f"MoonepError lacks {missing}: {msg}"
        assert dt <= within, f"raised after {dt:.1f}s (> {within}s): {msg}"
        return msg, dt
    raise AssertionError(f"no MoonepError raised (pid {os.getpid()})")
