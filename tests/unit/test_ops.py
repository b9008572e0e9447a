"""moonep.ops in one process (local backend): the custom ops give the eager bits, eagerly and compiled
(aot_eager), and release each step's state after its backward."""
import gc

import torch
import torch._dynamo

import moonep
from moonep import op_state, ops

E, K, H, S = 8, 2, 16, 24


def _problem(s, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(s, H, generator=g, dtype=torch.float64).requires_grad_()
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(s)]) if s else \
        torch.zeros(0, K, dtype=torch.int64)
    return x, idx, torch.rand(s, K, generator=g, dtype=torch.float64).requires_grad_()


def test_ops_match_eager_and_release_steps():
    torch._dynamo.reset()
    ep = moonep.ExpertParallel(num_experts=E, topk=K, hidden=H, max_tokens=S, dtype=torch.float64)
    W = torch.randn(E, H, H, dtype=torch.float64, requires_grad=True)

    def eager(x, idx, w):
        h = ep.dispatch(x, idx, w)
        return ep.combine(moonep.slot_matmul(h.tokens, h.cu_seqlens, ep.prefetch(h, W)), h)

    def through_ops(x, idx, w):
        h = ops.dispatch(ep, x, idx, w)
        return ops.combine(ops.slot_matmul(h.tokens, h.cu_seqlens, ops.prefetch(h, W)), h)

    compiled = torch.compile(through_ops, backend="aot_eager", fullgraph=True)
    for s in (9, 14, 0):
        got = []
        for fn in (eager, through_ops, compiled):
            x, idx, w = _problem(s, s)
            W.grad = None
            y = fn(x, idx, w)
            y.square().sum().backward()
            got.append((y.detach(), x.grad, w.grad, W.grad))
        for other in got[1:]:
            for a, b in zip(got[0], other):
                assert torch.equal(a, b), s
    del got, y
    gc.collect()
    ops.dispatch(ep, *_problem(3, 0))  # storing a step drops the released ones
    assert op_state.live_steps() <= 1, op_state.live_steps()
    ep.close()
