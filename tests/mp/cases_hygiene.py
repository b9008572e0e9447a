"""Resource hygiene: ExpertParallel has close() and is a context manager; building and closing one 100
times (with a step every 10th) leaks no file descriptors and no memory (RSS).  Run by tests/mp/test_mp_faults.py."""
import gc
import os

import torch

import moonep
from faults_common import problem


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _cycle(rt, transport, i, use_with):
    kw = dict(num_experts=2 * rt.world_size, topk=2, hidden=8, max_tokens=16, transport=transport)
    if use_with:
        with moonep.ExpertParallel(rt, **kw) as ep:
            if i % 10 == 0:
                x, idx, w, home = problem(ep.rt, ep.num_experts, seed=i)
                h = ep.dispatch(x, idx, w)
                ep.prefetch(h, home)
                ep.combine(h.tokens, h)
        return ep
    ep = moonep.ExpertParallel(rt, **kw)
    ep.close()
    return ep


def case_create_close_100_times_no_leak(rt):
    for transport in ("mpi", "torch"):
        for i in range(5):  # warm-up: caches, numba, allocator arenas
            _cycle(rt, transport, i, True)
        gc.collect()
        fd0, rss0 = _fds(), _rss_mb()
        for i in range(100):
            _cycle(rt, transport, i, use_with=i % 2 == 0)
        gc.collect()
        fd1, rss1 = _fds(), _rss_mb()
        assert fd1 <= fd0, f"{transport}: file descriptors {fd0} -> {fd1} after 100 create/close"
        assert rss1 - rss0 < 16, f"{transport}: RSS grew {rss1 - rss0:.1f} MiB after 100 create/close"


def case_closed_instance_refuses_calls(rt):
    ep = moonep.ExpertParallel(rt, num_experts=2 * rt.world_size, topk=2, hidden=8, max_tokens=16)
    x, idx, w, home = problem(rt, ep.num_experts)
    h = ep.dispatch(x, idx, w)
    ep.close()
    ep.close()  # idempotent
    for call in (lambda: ep.dispatch(x, idx, w), lambda: ep.combine(h.tokens, h), lambda: ep.prefetch(h, home),
                 lambda: ep.reduce_grad(h, torch.zeros(2 * ep.epn, 8))):
        try:
            call()
        except ValueError as exc:
            assert "ExpertParallel" in str(exc) and "close()" in str(exc), exc
        else:
            raise AssertionError("a closed ExpertParallel accepted a call")


def case_context_manager_closes_on_error(rt):
    try:
        with moonep.ExpertParallel(rt, num_experts=2 * rt.world_size, topk=2, hidden=8, max_tokens=16) as ep:
            raise KeyError("boom")
    except KeyError:
        pass
    assert ep._closed
