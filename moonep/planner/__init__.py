"""The balanced plan: which rank computes which token copies of which expert.

``plan_balanced(counts)`` takes the global routing count matrix and returns a :class:`Plan` in which
every rank receives the same number of token copies (``T // R``, the first ``T % R`` ranks one more),
using at most ``E // R`` replicas per rank, all from one home rank. CPU tensors run the numba planner
(``cpu.py``); CUDA tensors run the kernel in ``csrc/planner.cu`` (``cuda.py``) with no host sync.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from .cpu import plan_arrays
from .. import cuda_runtime
from .cuda import plan_cuda
from .plan import ERR_NEGATIVE, ERR_ROWSUM, MAX_TOTAL, Plan, _declared, _validate, cap_for  # noqa: F401 (re-exported)

__all__ = ["Plan", "plan_balanced", "cap_for"]


def plan_balanced(counts: torch.Tensor, *, slack: float = 0.0,
                  tokens_per_rank: Union[int, Sequence[int], torch.Tensor, None] = None,
                  topk: Optional[int] = None, validate: Optional[bool] = None) -> Plan:
    """Plan balanced expert placement for one layer.

    counts           integer [R, E], E % R == 0: copies source rank r routes to expert e
    slack            0: exact balance; > 0: every rank <= ceil((1 + slack) * T / R), fewest replicas
    tokens_per_rank, topk  optional declaration: counts[r].sum() must equal tokens_per_rank[r] * topk
    validate         CUDA only: True checks values now (one host sync); default None/False records
                     problems in ``plan.error`` on device, raised by ``plan.check()``. CPU always checks.

    Bad input raises ValueError naming the argument, what was expected and what was got.
    """
    _validate(counts, slack, tokens_per_rank, topk)
    if validate not in (None, True, False):
        raise ValueError(f"validate: expected None, True or False, got {validate!r}")
    if counts.is_cuda:
        if cuda_runtime.available_for("the CPU planner (the counts copied to the host every step)"):
            plan = plan_cuda(counts, float(slack), tokens_per_rank, topk)
            return plan.check() if validate else plan
        # Without CuPy: the same plan from the CPU planner (it checks values eagerly), moved back.
        p = plan_balanced(counts.cpu(), slack=slack, tokens_per_rank=tokens_per_rank, topk=topk)
        return Plan(*(t.to(counts.device) for t in (p.assignment, p.replica_experts, p.replica_source,
                                                     p.recv_counts, p.expert_counts, p.counts)), p.slack, None)
    if counts.device.type != "cpu":  # e.g. "meta": no values to plan from
        raise ValueError(f"counts: expected a CPU or CUDA tensor, got device {counts.device}")
    R, E = counts.shape
    declared = None
    if tokens_per_rank is not None:
        declared = _declared(tokens_per_rank, R, counts.device)
        if int(declared.max()) * topk >= MAX_TOTAL:  # Python ints: the int64 product would wrap
            raise ValueError(f"tokens_per_rank and topk: expected tokens_per_rank * topk below 2**62, got "
                             f"{int(declared.max())} * {topk}")
        declared = declared * topk
    c = counts.to(torch.int64)
    if bool((c < 0).any()):
        bad = (c < 0).nonzero()[0].tolist()
        raise ValueError(f"counts: expected non-negative values, got {int(c[bad[0], bad[1]])} at {tuple(bad)}")
    if declared is not None:
        rs = c.sum(1)
        if not torch.equal(rs, declared):
            r = int((rs != declared).nonzero()[0, 0])
            raise ValueError(f"counts: row {r} sums to {int(rs[r])}, expected tokens_per_rank[{r}] * topk"
                             f" = {int(declared[r])}")
    total = float(c.sum(dtype=torch.float64))  # float: an int64 sum would wrap silently
    if total >= MAX_TOTAL:
        raise ValueError(f"counts: expected a total below 2**62 token copies, got about {total:.3g}")
    L = c.sum(0)
    T = int(L.sum())
    # A cap above T never binds (no rank can exceed T): clamping keeps a huge slack inside int64.
    cap = -1 if slack == 0 else min(cap_for(T, R, float(slack)), T)
    a, rx, rs_, rc, _ = plan_arrays(L.numpy(), R, cap)
    return Plan(torch.from_numpy(a), torch.from_numpy(rx), torch.from_numpy(rs_), torch.from_numpy(rc),
                L, c, float(slack), None)
