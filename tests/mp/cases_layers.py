"""LatentMoE and the integrations on every rank, against single-process dense float64 models."""
import io
import sys

import torch
import torch.distributed as dist

import moonep  # noqa: F401
from layers_reference import PlainLM, dense_latent_moe, tiny_hf
from moonep.layers import LatentMoE, balancer_step
from moonep.training import expert_parameters, full_state_dict, sync_grads
from tests.harness.mp import SkipCase

# mprun runs as __main__, so its SkipCase is a different class from the importable one: raise that one.
SkipCase = getattr(sys.modules.get("__main__"), "SkipCase", SkipCase)  # noqa: F811

D, L, K, FE, FS = 12, 6, 3, 10, 4


def _sizes(R, base, seed):
    g = torch.Generator().manual_seed(seed)
    sizes = [int(v) for v in torch.randint(1, base + 1, (R,), generator=g)]
    if R > 1:
        sizes[R // 2] = 0  # a rank with no token at all
    return sizes


def _slice(rt, sizes):
    start = sum(sizes[:rt.rank])
    return slice(start, start + sizes[rt.rank])


def _gather(rt, obj):
    out = [None] * rt.world_size
    dist.all_gather_object(out, obj, group=rt.cpu_group)
    return out


def _layer(rt, E, seed=0, **kw):
    torch.manual_seed(seed)
    return LatentMoE(D, L, E, K, FE, num_shared=2, d_shared=FS, group=rt, dtype=torch.float64, **kw)


def _check_against_dense(rt, m, bias, seed, sizes):
    """Forward and backward of ``m`` on this rank's tokens == the dense model on the global batch."""
    R, dev, E = rt.world_size, rt.device, m.num_experts
    g = torch.Generator().manual_seed(seed)
    T = sum(sizes)
    x = torch.randn(T, D, generator=g, dtype=torch.float64)
    gy = torch.randn(T, D, generator=g, dtype=torch.float64)
    with torch.no_grad():
        m.balancer.bias.copy_(bias)
    sl, home = _slice(rt, sizes), slice(rt.rank * E // R, (rt.rank + 1) * E // R)
    m.zero_grad()
    xl = x[sl].to(dev).requires_grad_()
    y = m(xl)
    (y * gy[sl].to(dev)).sum().backward()
    sync_grads(m)  # the data-parallel convention: every gradient is the mean over the ranks' losses

    full = full_state_dict(m)
    p = {k: v.detach().double().cpu().clone().requires_grad_() for k, v in full.items() if k != "balancer.bias"
         and not k.endswith("num_steps")}
    rx = x.clone().requires_grad_()
    ry = dense_latent_moe(p, rx, K, bias)
    (ry * gy).sum().backward()
    tol = dict(rtol=0, atol=1e-10)
    ctx = f"rank {rt.rank}/{R} E={E} seed={seed}"
    torch.testing.assert_close(y.cpu(), ry[sl].detach(), **tol, msg=lambda s: f"y {ctx}: {s}")
    torch.testing.assert_close(xl.grad.cpu(), rx.grad[sl], **tol, msg=lambda s: f"dx {ctx}: {s}")
    experts = {id(q) for q in expert_parameters(m)}
    for k, v in m.named_parameters():
        got, want = v.grad, p[k].grad / R
        if id(v) in experts:
            got, want = got.to_local(), want[home]
        torch.testing.assert_close(got.cpu(), want, **tol, msg=lambda s: f"d{k} {ctx}: {s}")
    # The guarantee: equal receive counts on every rank.
    recv = m.last_stats["recv_counts"]
    assert int(recv.max()) - int(recv.min()) <= 1 and int(recv.sum()) == T * K, (ctx, recv)
    return m.last_stats


def case_latent_moe_float64_matches_dense(rt):
    R = rt.world_size
    for epn, seed in ((1, 1), (2, 2), (3, 3)):
        E = max(epn * R, K + 1)
        if E % R:
            continue
        m = _layer(rt, E, seed=seed)
        sizes = _sizes(R, 9, seed)
        g = torch.Generator().manual_seed(seed)
        _check_against_dense(rt, m, 0.2 * torch.randn(E, generator=g), seed, sizes)
        hot = torch.zeros(E)
        hot[0] = 5.0  # every token picks expert 0: its rank overflows and replicas must absorb it
        st = _check_against_dense(rt, m, hot, seed + 100, sizes)
        # Whenever a home rank holds more than its share, replicas must have taken the excess.
        home_load = st["expert_load"].view(R, E // R).sum(1)
        if int(home_load.max()) > -(-sum(sizes) * K // R):
            assert int(st["replicas"].sum()) > 0, st


def case_latent_moe_deepcopy(rt):
    """copy.deepcopy of a LatentMoE that has run and stepped its balancer: the copy gives its output and
    gradients bitwise (its own ExpertParallel and balancer, the same runtime and replica pool), and the two
    run in turns."""
    import copy

    R = rt.world_size
    m = _layer(rt, R * -(-(K + 1) // R), seed=5, replica_pool=moonep.ReplicaPool())  # fewest experts > K
    x = torch.randn(4 + rt.rank, D, dtype=torch.float64, generator=torch.Generator().manual_seed(rt.rank))
    m, x = m.to(rt.device), x.to(rt.device)
    m(x)
    m.balancer.step()  # on CUDA: leaves the deferred check's event, which the copy must not take
    twin = copy.deepcopy(m)
    assert twin._rt is rt and twin._ep is not m._ep and twin.replica_pool is m.replica_pool
    qb, qb2 = m.balancer, twin.balancer  # its own buffers and compiled-op entry, the same process group
    assert qb2.group is qb.group and qb2._op_id != qb._op_id and qb2.bias.data_ptr() != qb.bias.data_ptr()
    for step in range(2):
        outs = []
        for mod in (m, twin):
            mod.zero_grad()
            xi = x.clone().requires_grad_()
            y = mod(xi)
            y.square().sum().backward()
            outs.append([y.detach(), xi.grad] + [p.grad for p in mod.parameters()])
        for i, (a, b) in enumerate(zip(*outs)):
            assert torch.equal(a, b), f"rank {rt.rank} step {step} tensor {i}"


def case_grouped_matmul_path_matches_loop(rt):
    if not hasattr(torch, "_grouped_mm"):
        raise SkipCase("no torch._grouped_mm")
    E = 2 * rt.world_size
    x = torch.randn(8, D, generator=torch.Generator().manual_seed(rt.rank)).float().to(rt.device)
    outs = []
    for impl in ("loop", "grouped"):
        torch.manual_seed(4)
        m = LatentMoE(D, 8, E, 2, 8, group=rt, d_shared=4, matmul=impl).to(rt.device)
        xl = x.clone().requires_grad_()
        y = m(xl)
        y.square().sum().backward()
        outs.append((y.detach(), xl.grad, m.experts.w_in.grad.to_local()))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def case_state_dict_reshard(rt):
    """A full checkpoint (as saved at any R) loads at this R, and gathers back bit-identically."""
    R, E = rt.world_size, 24
    torch.manual_seed(7)  # the checkpoint: any values, identical on every rank
    ref = {k: torch.randn_like(v) if v.is_floating_point() else v
           for k, v in full_state_dict(_layer(rt, E, seed=0)).items()}
    ref["balancer.bias"] = torch.linspace(-0.2, 0.2, E)
    buf = io.BytesIO()
    torch.save(ref, buf)
    buf.seek(0)
    m = _layer(rt, E, seed=99)
    m.load_state_dict(torch.load(buf))
    assert m.experts.w_in.to_local().shape[0] == E // R and m.experts.w_in.shape[0] == E
    back = full_state_dict(m)
    assert back.keys() == ref.keys()
    for k in ref:
        assert torch.equal(back[k].cpu(), ref[k].cpu()), k
    _check_against_dense(rt, m, ref["balancer.bias"], 8, _sizes(R, 6, 8))


def case_training_steps_stay_consistent(rt):
    """A few optimizer steps: replicated weights and the QB bias stay identical on every rank."""
    E = 4 * rt.world_size
    m = _layer(rt, E, seed=3)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + rt.rank)
    for _ in range(3):
        x = torch.randn(16, D, generator=g, dtype=torch.float64).to(rt.device)
        loss = m(x).square().mean()
        opt.zero_grad()
        loss.backward()
        sync_grads(m)
        opt.step()
        balancer_step(m)
        recv = m.last_stats["recv_counts"]
        assert int(recv.max()) == int(recv.min()) == 16 * K, recv
    state = {k: float(v.double().sum()) for k, v in m.state_dict().items() if not k.startswith("experts.")}
    states = _gather(rt, state)
    assert all(s == states[0] for s in states), states
    assert float(m.balancer.bias.abs().sum()) > 0


def case_bad_group_size(rt):
    R = rt.world_size
    if R == 1:
        raise SkipCase("every E is a multiple of 1")
    try:
        LatentMoE(D, L, R + 1, 1, FE, group=rt)
    except ValueError as e:
        assert f"num_experts: expected a multiple of the group size {R}, got {R + 1}" in str(e), str(e)
    else:
        raise AssertionError("no error for E % R != 0")


# ------------------------------------------------------------------------------------------ integrations
def case_generic_logits_equal(rt):
    from moonep.integrations import patch_generic, softmax_topk

    torch.manual_seed(11)  # the same unpatched model on every rank
    model = PlainLM(num_experts=24).double().to(rt.device)
    g = torch.Generator().manual_seed(rt.rank)
    ids = torch.randint(0, 32, (1 + rt.rank % 3, 5), generator=g).to(rt.device)
    ref = model(ids)
    patch_generic(model, rt, route=lambda b, x: softmax_topk(b.router(x), 3))
    assert len(model.blocks[0].experts) == 24 // rt.world_size
    torch.testing.assert_close(model(ids), ref, rtol=0, atol=1e-12)


def _hf_or_skip():
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise SkipCase("transformers is not installed (pip install -e .[hf])")


def case_hf_logits_equal(rt):
    _hf_or_skip()
    from moonep.integrations import patch_hf_moe

    for kind, dtype, tol in (("mixtral", torch.float64, 1e-10), ("mixtral", torch.float32, 2e-5),
                             ("qwen3_moe", torch.float64, 1e-10), ("qwen2_moe", torch.float64, 1e-10)):
        torch.manual_seed(21)
        model = tiny_hf(kind).to(dtype).to(rt.device)
        g = torch.Generator().manual_seed(rt.rank)
        ids = torch.randint(0, 64, (1 + rt.rank % 2, 6), generator=g).to(rt.device)
        with torch.no_grad():
            ref = model(ids).logits
            patch_hf_moe(model, rt)
            got = model(ids).logits
        torch.testing.assert_close(got, ref, rtol=0, atol=tol,
                                   msg=lambda s: f"{kind} {dtype} rank {rt.rank}: {s}")


def case_hf_mixtral_expert_grads(rt):
    """Backward through the patched model: each rank's expert gradients equal the unpatched model's on the
    global batch (all ranks' tokens), restricted to its home experts, averaged over the ranks (DDP's mean)."""
    _hf_or_skip()
    from moonep.integrations import patch_hf_moe

    R, E = rt.world_size, 24
    torch.manual_seed(31)
    model = tiny_hf("mixtral").double().to(rt.device)
    every = [torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(r)) for r in range(R)]
    model(torch.cat(every).to(rt.device)).logits.square().sum().backward()
    want = model.model.layers[1].mlp.experts.gate_up_proj.grad.cpu()
    model.zero_grad()
    patch_hf_moe(model, rt)
    model(every[rt.rank].to(rt.device)).logits.square().sum().backward()
    got = model.model.layers[1].mlp.experts.gate_up_proj.grad
    assert got.shape == want.shape  # a DTensor of the full [E, ...] gradient, this rank's rows local
    epn = E // R
    torch.testing.assert_close(got.to_local().cpu(), want[rt.rank * epn:(rt.rank + 1) * epn] / R, rtol=0,
                               atol=1e-10)
