"""MoonepRoutedExperts on its own over the whole job, CPU or CUDA ranks (MOONEP_TEST_DEVICE): torchtitan's
GroupedExperts (float32 tokens) and GPT-OSS's experts (biases, clamped SwiGLU; bf16 tokens: they return bf16,
which torchtitan's own combine takes only for bf16 tokens) with moonep's dispatcher, home rows and replica
rows, against torchtitan's own RoutedExperts
holding every expert on every rank (its local dispatcher): outputs, and the gradients of the tokens, the
scores and every expert's weights (summed over the ranks for the reference).  The routing is skewed to rank
0's experts, so the other ranks compute replicas of them; every rank computes the same number of rows."""
import sys

import torch
import torch.distributed as dist

from tests.harness.mp import SkipCase

SkipCase = getattr(sys.modules.get("__main__"), "SkipCase", SkipCase)  # noqa: F811  (mprun's own class)

E, K, D, F, T = 8, 3, 64, 32, 48


def _modules(rt, kind: str):
    try:
        from torch.distributed.device_mesh import DeviceMesh
        from torchtitan.models.common.moe import GroupedExperts, RoutedExperts
        from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher
        from torchtitan.models.gpt_oss.moe import GptOssGroupedExperts

        from moonep.integrations.torchtitan import moonep_experts
    except ImportError as exc:
        raise SkipCase(f"torchtitan is not installed: {exc}")
    inner = {"grouped": GroupedExperts, "gpt_oss": GptOssGroupedExperts}[kind]
    cfg = RoutedExperts.Config(inner_experts=inner.Config(dim=D, hidden_dim=F, num_experts=E),
                               token_dispatcher=LocalTokenDispatcher.Config(num_experts=E, top_k=K))
    torch.manual_seed(0)  # the same experts on every rank
    ref = cfg.build().to(rt.device)
    with torch.no_grad():
        for p in ref.inner_experts.parameters():
            p.copy_(torch.randn(p.shape) * 0.1)
    mine = moonep_experts(cfg).build().to(rt.device)
    epn, r = E // rt.world_size, rt.rank
    for n, p in ref.inner_experts.named_parameters():  # this rank's home experts, as EP shards them
        setattr(mine.inner_experts, n, torch.nn.Parameter(p.detach()[r * epn:(r + 1) * epn].clone()))
    mesh = None if rt.world_size == 1 else DeviceMesh.from_group(rt.group, rt.device.type, mesh_dim_names=("ep",))
    mine.token_dispatcher.wire_meshes(ep_mesh=mesh)
    return ref, mine


def case_moonep_experts_match_torchtitans_with_replicas(rt):
    for kind, dtype in (("grouped", torch.float32), ("gpt_oss", torch.bfloat16)):
        _compare(rt, kind, dtype)


def _compare(rt, kind: str, dtype: torch.dtype) -> None:
    ref, mine = _modules(rt, kind)
    R, dev = rt.world_size, rt.device
    g = torch.Generator().manual_seed(10 + rt.rank)
    x = torch.randn(1, T, D, generator=g).to(dev, dtype).requires_grad_()
    logits = torch.randn(1, T, E, generator=g)
    logits[..., : E // R] += 2.0  # rank 0's experts hot: replicas of them elsewhere
    scores, ids = logits.softmax(-1).topk(K, dim=-1)
    scores = scores.to(dev).requires_grad_()
    ids = ids.to(dev)
    counts = torch.zeros(E, dtype=torch.int64, device=dev).scatter_add_(0, ids.reshape(-1),
                                                                       torch.ones(T * K, dtype=torch.int64, device=dev))
    outs = []
    for m in (ref, mine):
        x.grad = scores.grad = None
        y = m(x, scores, ids, counts)
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(20 + rt.rank)).to(dev, dtype))
        outs.append((y.detach(), x.grad, scores.grad))
    # the experts compute in bf16 (torchtitan casts to it); bf16 tokens: also the sums around them
    tol = dict(rtol=2e-2, atol=2e-3) if dtype == torch.float32 else dict(rtol=4e-2, atol=2e-2)
    for a, b, what in zip(outs[0], outs[1], ("output", "token gradient", "score gradient")):
        torch.testing.assert_close(b.float(), a.float(), **tol, msg=lambda m, w=what: f"{kind} {w}: {m}")
    epn, r = E // R, rt.rank
    for n, p in ref.inner_experts.named_parameters():
        full = p.grad.float().clone()
        if R > 1:
            dist.all_reduce(full, group=rt.group)  # every rank's tokens reach the home expert's gradient
        mine_g = getattr(mine.inner_experts, n).grad.float()
        err = float((mine_g - full[r * epn:(r + 1) * epn]).abs().max() / full.abs().max())
        assert err < (2e-2 if dtype == torch.float32 else 4e-2), \
            f"{kind} {n}: home expert gradient differs by {err:.2e}"
    # balance: every rank computed T*K/R rows (+-1), replicas included
    with torch.no_grad():
        rows, _, meta = mine.token_dispatcher.dispatch(x[0], scores[0], ids[0], counts)
    n = torch.tensor([int(meta.h.cu_seqlens[-1])], dtype=torch.int64)
    every = [torch.zeros_like(n) for _ in range(R)]
    dist.all_gather(every, n, group=rt.cpu_group) if R > 1 else every.__setitem__(0, n)
    got = [int(t) for t in every]
    assert max(got) - min(got) <= 1 and sum(got) == T * K * R, got
    if R > 1:
        replicas = int(meta.h.cu_seqlens[2 * epn] - meta.h.cu_seqlens[epn])
        assert rt.rank == 0 or replicas > 0, f"rank {rt.rank} computed no replica rows under a skewed routing"
