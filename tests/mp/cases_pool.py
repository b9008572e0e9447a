"""The experts stage with a shared ReplicaPool: home weights read in place, replicas in the pool, against the
dense float64 reference, on every rank (CPU here; tests/gpu/test_mp_pool_gpu.py runs it on CUDA ranks).

MOONEP_TEST_DTYPES: comma list of row dtypes (default float64; the GPU run: float32,bfloat16)."""
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import moonep
from ep_reference import expect_error, make_problem, my_slice
from moonep.experts import ReplicaPool, expert_bias, expert_matmul

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
from bench_pool_memory import peak_memory, stack  # noqa: E402

DTYPES = [getattr(torch, d) for d in os.environ.get("MOONEP_TEST_DTYPES", "float64").split(",")]
# tolerances: relative to the reference's magnitude (fp64: summation order; fp32: ~1e-6 per op; bf16: 8 bits)
TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 3e-3}
KINDS = ["home0", "hot", "cold_rank", "zipf", "uniform"]  # home0: every choice among rank 0's experts


def _sizes(R, S):
    sizes = [S - (r % 3) for r in range(R)]
    if R > 2:
        sizes[1] = 0  # a rank without tokens
    return sizes


def _close(name, got, ref, dtype):
    ref = ref.double().cpu()
    err = (got.double().cpu() - ref).abs().max().item() if ref.numel() else 0.0
    scale = max(ref.abs().max().item() if ref.numel() else 0.0, 1e-30)
    assert err <= TOL[dtype] * scale, f"{name}: max error {err:.3g} > {TOL[dtype]:g} x {scale:.3g} ({dtype})"


def _expert(x, w1, b1, w2):
    """Per token t: tanh(x_t W1_t + b1_t) W2_t (the token's expert's weights, [T, H, F], [T, F], [T, F, H])."""
    return torch.einsum("tf,tfh->th", torch.tanh(torch.einsum("th,thf->tf", x, w1) + b1), w2)


def _two_projections(rt, kind, dtype, transpose, pool, seed=0):
    """y = combine(expert_matmul(tanh(expert_matmul(dispatch(x), W1)), W2)), W1 [E, H, F], W2 [E, F, H]
    (stored transposed with ``transpose``): forward and gradients against the dense float64 loop."""
    R, E, K, H, F, S = rt.world_size, 4 * rt.world_size, 2, 32, 24, 12
    dev = rt.device
    sizes = _sizes(R, S)
    x, idx, w, W1, W2, gy = make_problem(seed, R, E, K, H, F, sizes, "uniform" if kind == "home0" else kind)
    if kind == "home0":  # all load on rank 0: every other rank is filled with its replicas, the most there are
        idx = torch.rand(idx.shape[0], E // R, generator=torch.Generator().manual_seed(seed + 9)).topk(K, 1).indices
    B1 = torch.randn(E, F, generator=torch.Generator().manual_seed(seed + 5), dtype=torch.float64)
    xr, W1r, B1r, W2r = (t.clone().requires_grad_() for t in (x, W1, B1, W2))
    yr = sum(w[:, k, None] * _expert(xr, W1r[idx[:, k]], B1r[idx[:, k]], W2r[idx[:, k]]) for k in range(K))
    (yr * gy).sum().backward()

    sl, epn = my_slice(rt, sizes), E // R
    home = slice(rt.rank * epn, (rt.rank + 1) * epn)
    store = (lambda W: W[home].transpose(1, 2).contiguous()) if transpose else (lambda W: W[home].clone())
    W1l, W2l = (store(W).to(dev, dtype).requires_grad_() for W in (W1, W2))
    B1l = B1[home].to(dev, dtype).requires_grad_()
    versions = (W1l._version, W2l._version)
    ep = moonep.ExpertParallel(rt, num_experts=E, topk=K, hidden=H, max_tokens=S, dtype=dtype)
    xl = x[sl].to(dev, dtype).requires_grad_()
    h = ep.dispatch(xl, idx[sl].to(dev), w[sl].to(dev, dtype))
    if kind == "hot" and R > 1:  # everything on one expert: the plan must place replicas
        assert int(h.plan.num_replicas().max()) > 0, "the skewed routing placed no replica"
    if kind == "home0" and R > 1:  # every rank but 0 holds replicas of rank 0's experts
        assert int((h.plan.num_replicas()[1:] > 0).sum()) == R - 1, h.plan.num_replicas()
    r1, r2, rb = pool.fetch(ep, h, W1l, "w1"), pool.fetch(ep, h, W2l, "w2"), pool.fetch(ep, h, B1l, "b1")
    a = expert_bias(expert_matmul(h.tokens, h.cu_seqlens, W1l, r1, transpose=transpose), h.cu_seqlens, B1l, rb)
    a = torch.tanh(a)
    out = expert_matmul(a, h.cu_seqlens, W2l, r2, transpose=transpose)
    # what a model's next layer does: fetch into the same slots before this layer's backward
    pool.fetch(ep, h, (W1l.detach() + 1).requires_grad_(), "w1")  # other weights
    y = ep.combine(out, h)
    (y * gy[sl].to(dev, dtype)).sum().backward()
    _close("y", y, yr.detach()[sl], dtype)
    _close("grad x", xl.grad, xr.grad[sl], dtype)
    for name, Wl, Wr in (("W1", W1l, W1r), ("W2", W2l, W2r), ("b1", B1l, B1r)):
        g = Wr.grad[home].transpose(1, 2) if transpose and name != "b1" else Wr.grad[home]
        _close(f"grad {name}", Wl.grad, g, dtype)
    assert (W1l._version, W2l._version) == versions, "the home weights were written"
    ep.close()


def case_expert_matmul_vs_dense(rt):
    for dtype in DTYPES:
        for kind in KINDS:
            for transpose in (False, True):
                _two_projections(rt, kind, dtype, transpose, ReplicaPool())
        _two_projections(rt, "hot", dtype, False, ReplicaPool(backward="keep"))
        _two_projections(rt, "hot", dtype, False, ReplicaPool(buffers=2, overlap=False))


def case_micro_batches_fetched_before_either_gemm(rt):
    """Two micro-batches fetch into one pool buffer before either's GEMM (fetch A, fetch B, GEMM A, GEMM B): A's
    replicas were overwritten by B's, so A's GEMM fetches them again.  Both outputs and the home weights'
    gradient match the dense float64 loop: on buffers=1 and 2, with the fetch made at once and asynchronously."""
    R, E, K, H, S = rt.world_size, 4 * rt.world_size, 1, 16, 10
    dev, dtype, epn = rt.device, DTYPES[0], E // R
    home = slice(rt.rank * epn, (rt.rank + 1) * epn)
    W = torch.randn(E, H, H, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    hot = (0, E - 1)  # A: every token to rank 0's first expert, B: to the last rank's last (replicas of each)
    data = []  # per rank: (xs, gys) of both micro-batches, so that every rank can build the dense gradient
    for r in range(R):
        g = torch.Generator().manual_seed(50 + r)
        data.append(([torch.randn(S, H, generator=g, dtype=torch.float64) for _ in hot],
                     [torch.randn(S, H, generator=g, dtype=torch.float64) for _ in hot]))
    grad = torch.zeros_like(W)
    for xs, gys in data:
        for e, x, gy in zip(hot, xs, gys):
            grad[e] += x.t() @ gy
    xs, gys = data[rt.rank]
    for buffers in (1, 2):
        for async_op in (None, True):
            ep = moonep.ExpertParallel(rt, num_experts=E, topk=K, hidden=H, max_tokens=S, dtype=dtype)
            pool, w = ReplicaPool(buffers=buffers), W[home].to(dev, dtype).requires_grad_()
            # (x requires grad, as in training: the NVLink dispatch copies the rows, which outlive the next one)
            hs = [ep.dispatch(x.to(dev, dtype).requires_grad_(), torch.full((S, K), e, device=dev),
                              torch.ones(S, K, device=dev, dtype=torch.float32)) for e, x in zip(hot, xs)]
            if R > 1:
                assert all(int(h.plan.num_replicas().max()) > 0 for h in hs), "no replica placed"
            reps = [pool.fetch(ep, h, w, "w", async_op=async_op) for h in hs]
            ys = [ep.combine(expert_matmul(h.tokens, h.cu_seqlens, w, r), h) for h, r in zip(hs, reps)]
            sum((y * gy.to(dev, dtype)).sum() for y, gy in zip(ys, gys)).backward()
            for name, y, x, e in zip("AB", ys, xs, hot):
                _close(f"y {name} (buffers={buffers}, async_op={async_op})", y, x @ W[e], dtype)
            _close(f"grad w (buffers={buffers}, async_op={async_op})", w.grad, grad[home], dtype)
            ep.close()


def case_rows_overwritten_by_a_later_dispatch_refused(rt):
    """NVLink zero-copy rows (no grad mode, zero_copy="auto") are views of the receive buffer, valid until the
    next dispatch: expert_matmul, module_slots and combine (its rows, then h.weights) on an older dispatch's rows
    raise ValueError naming them on every rank, instead of reading the later dispatch's; the next valid call is
    right.  In grad mode the rows are copies though x needs no gradient (a backward may read them later)."""
    R, E, K, H, S = rt.world_size, 2 * rt.world_size, 1, 16, 8
    dev, dtype, epn = rt.device, DTYPES[0], E // R
    ep = moonep.ExpertParallel(rt, num_experts=E, topk=K, hidden=H, max_tokens=S, dtype=dtype)
    if ep.transport_name != "nvlink":
        ep.close()
        return  # the host transports' rows are tensors of their own
    W = torch.randn(E, H, H, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    w, pool = W[rt.rank * epn:(rt.rank + 1) * epn].to(dev, dtype), ReplicaPool()
    xs = [torch.randn(S, H, generator=torch.Generator().manual_seed(60 + rt.rank + 7 * i), dtype=torch.float64)
          for i in range(2)]
    with torch.no_grad():
        hs = [ep.dispatch(x.to(dev, dtype), torch.full((S, K), e, device=dev),
                          torch.ones(S, K, device=dev, dtype=torch.float32)) for e, x in zip((0, E - 1), xs)]
        rep = pool.fetch(ep, hs[0], w, "w")
        try:
            expert_matmul(hs[0].tokens, hs[0].cu_seqlens, w, rep)
        except ValueError as exc:
            assert str(exc).startswith("a: expected not a view of a receive buffer"), exc
        else:
            raise AssertionError("expert_matmul read rows that a later dispatch overwrote")
        lin = torch.nn.Linear(H, H, bias=False, device=dev, dtype=dtype)
        experts = [torch.nn.Linear(H, H, bias=False, device=dev, dtype=dtype) for _ in range(epn)]
        home = torch.stack([m.weight for m in experts])
        reps = {"weight": pool.fetch(ep, hs[0], home, "weight")}
        try:
            moonep.module_slots(lin, hs[0].tokens, hs[0].cu_seqlens, experts, reps, H)
        except ValueError as exc:
            assert str(exc).startswith("rows: expected not a view"), exc
        else:
            raise AssertionError("module_slots read rows that a later dispatch overwrote")
        try:
            ep.combine(hs[0].tokens, hs[0])
        except ValueError as exc:
            assert str(exc).startswith("expert_out: expected not a view"), exc
        else:
            raise AssertionError("combine read rows that a later dispatch overwrote")
        try:
            ep.combine(torch.zeros_like(hs[0].tokens), hs[0])
        except ValueError as exc:
            assert str(exc).startswith("h.weights: expected not a view"), exc
        else:
            raise AssertionError("combine read weights that a later dispatch overwrote")
        y = ep.combine(expert_matmul(hs[1].tokens, hs[1].cu_seqlens, w, pool.fetch(ep, hs[1], w, "w")), hs[1])
    _close("y of the live dispatch", y, xs[1] @ W[E - 1], dtype)
    # grad mode, x frozen (only the experts train): rows of their own, read after a later dispatch
    wg = w.clone().requires_grad_()
    hs = [ep.dispatch(x.to(dev, dtype), torch.full((S, K), e, device=dev),
                      torch.ones(S, K, device=dev, dtype=torch.float32)) for e, x in zip((0, E - 1), xs)]
    y = ep.combine(expert_matmul(hs[0].tokens, hs[0].cu_seqlens, wg, pool.fetch(ep, hs[0], wg, "w")), hs[0])
    _close("y of the first of two dispatches in grad mode", y, xs[0] @ W[0], dtype)
    ep.close()


class _HomeAccess(TorchDispatchMode):
    """Records every op that reads or writes the storage of ``home`` and the size of what it makes."""

    def __init__(self, home):
        super().__init__()
        self.ptr, self.n, self.ops = home.untyped_storage().data_ptr(), home.numel(), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat = torch.utils._pytree.tree_leaves((args, kwargs))
        if any(isinstance(t, torch.Tensor) and t.device.type != "meta" and t.untyped_storage().data_ptr() == self.ptr
               for t in flat):
            outs = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
            self.ops.append((str(func), max((t.numel() for t in outs), default=0),
                             any(t.untyped_storage().data_ptr() == self.ptr for t in outs)))
        return out


# a whole copy of the home weights (what the per-layer prefetch made); gathers of the rows peers replicate
# (the replica push on the host backends) read only what must be sent, and are not counted
_COPIES = ("clone", "copy", "cat", "stack", "_to_copy", "contiguous")


def case_fetch_of_several_projections_equals_one_by_one(rt):
    """``pool.fetch`` of a list of projections (one collective; on the host path their rows travel side by side
    as bytes) fills the slots bitwise as one call per projection does: different shapes, a float16 bias of
    odd row bytes, skewed routing with replicas; a persistent pool reused over steps; the deprecated
    ``prefetch_replicas`` warns and still gives the same slots."""
    import warnings

    R, E, K, H, F, S = rt.world_size, 4 * rt.world_size, 2, 32, 24, 12
    dev, dtype = rt.device, DTYPES[0]
    sizes = _sizes(R, S)
    ep = moonep.ExpertParallel(rt, num_experts=E, topk=K, hidden=H, max_tokens=S, dtype=dtype)
    epn = E // R
    g = torch.Generator().manual_seed(40 + rt.rank)
    homes = [torch.randn(epn, H, F, generator=g).to(dev, dtype), torch.randn(epn, F, H, generator=g).to(dev, dtype),
             torch.randn(epn, 7, generator=g).to(dev, torch.float16)]
    names = ["w1", "w2", "b1"]
    together, apart = ReplicaPool(), ReplicaPool()
    for step, kind in enumerate(("hot", "uniform", "hot")):
        x, idx, w, *_ = make_problem(step, R, E, K, H, F, sizes, kind)
        sl = my_slice(rt, sizes)
        h = ep.dispatch(x[sl].to(dev, dtype), idx[sl].to(dev), w[sl].to(dev, dtype))
        got = together.fetch(ep, h, homes, names)
        want = [apart.fetch(ep, h, t, n) for t, n in zip(homes, names)]
        for n, a, b in zip(names, got, want):
            assert torch.equal(a.weights(), b.weights()), f"rank {rt.rank} step {step} {n}"
        if kind == "hot" and R > 1:
            assert int(h.plan.num_replicas().max()) > 0
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            old = ep.prefetch_replicas(h, homes[0], torch.zeros_like(homes[0]))
        assert [w.category for w in seen] == [DeprecationWarning], [str(w.message) for w in seen]
        assert all(w.filename == __file__ for w in seen), [w.filename for w in seen]  # the caller's line
        assert torch.equal(old, want[0].weights())
    assert together.fetch(ep, h, [], []) == []
    # equal-shaped projections in another order on one rank: refused on every rank, named
    order = names[:2] if rt.rank == 0 or R == 1 else names[1::-1]
    if R > 1:
        expect_error(lambda: together.fetch(ep, h, [homes[0], homes[0]], order), "name")
    assert torch.equal(together.fetch(ep, h, homes[:1], names[:1])[0].weights(), want[0].weights())  # usable
    expect_error(lambda: together.fetch(ep, h, homes[:2], ["w1"]), "name")
    expect_error(lambda: together.fetch(ep, h, homes[:2], ["w1", "w1"]), "name")
    ep.close()


def case_no_home_copy(rt):
    """No op copies the whole home weight tensor, and none writes it, in a forward and backward."""
    R, E, K, H, S = rt.world_size, 4 * rt.world_size, 2, 32, 12
    dtype = DTYPES[0]
    x, idx, w, _, _, _ = make_problem(3, R, E, K, H, 8, [S] * R, "hot")
    ep = moonep.ExpertParallel(rt, num_experts=E, topk=K, hidden=H, max_tokens=S, dtype=dtype)
    Wl = (torch.randn(E // R, H, H, dtype=torch.float64) / H ** 0.5).to(rt.device, dtype).requires_grad_()
    sl = my_slice(rt, [S] * R)
    pool = ReplicaPool()
    with _HomeAccess(Wl) as seen:
        h = ep.dispatch(x[sl].to(rt.device, dtype).requires_grad_(), idx[sl].to(rt.device), w[sl].to(rt.device, dtype))
        out = expert_matmul(h.tokens, h.cu_seqlens, Wl, pool.fetch(ep, h, Wl, "w"))
        ep.combine(out, h).sum().backward()
    assert seen.ops, "the home weights were never read"
    copies = [op for op in seen.ops if any(c in op[0] for c in _COPIES) and op[1] >= Wl.numel()]
    writes = [op for op in seen.ops if op[2] and not any(v in op[0] for v in ("view", "alias", "detach", "t.",
                                                                              "transpose", "select", "slice",
                                                                              "expand", "unsqueeze", "reshape",
                                                                              "permute", "as_strided"))]
    assert not copies, f"ops copied the home weights: {copies}"
    assert not writes, f"ops wrote into the home weights' storage: {writes}"
    if ep.transport_name == "nvlink":  # its kernels move rows of the buffers' width only: refused, then usable
        h = ep.dispatch(x[sl].to(rt.device, dtype), idx[sl].to(rt.device), w[sl].to(rt.device, dtype))
        expect_error(lambda: ep.combine(h.tokens.new_zeros(h.tokens.shape[0], H + 8), h), "hidden=32")
        assert ep.combine(h.tokens, h).shape == (S, H)
    ep.close()


def case_pool_memory_does_not_grow_with_layers(rt):
    """Peak memory of forward + backward over a stack of L layers: growing L adds the layers' own weights
    and activations only, and the pool holds at most buffers x epn experts per projection."""
    dtype = DTYPES[0]
    dev = rt.device
    peaks, pools = {}, {}
    for L in (2, 4):
        for path in ("pool", "prefetch"):
            model, pool = stack(rt, L, path=path, dtype=dtype)
            peaks[path, L] = peak_memory(rt, model)
            pools[path, L] = pool.nbytes() if pool is not None else 0
            del model
    layer = stack(rt, 1, path="pool", dtype=dtype)[0].layers[0]
    epn = layer.experts.moonep_epn
    local = [p.to_local() if hasattr(p, "to_local") else p for p in (layer.experts.w_in, layer.experts.w_out)]
    expert = sum(p.numel() * p.element_size() for p in local) // epn
    grow_pool = peaks["pool", 4] - peaks["pool", 2]
    grow_old = peaks["prefetch", 4] - peaks["prefetch", 2]
    # the old path holds a [2*epn] copy of each layer's experts until the backward: 2 layers more cost at
    # least 2 x 2*epn experts more than the pool path
    assert grow_old - grow_pool >= 2 * 2 * epn * expert * 0.9, (grow_old, grow_pool, expert, dev)
    assert pools["pool", 4] <= epn * expert, pools


def case_layer_stack_paths_agree(rt):
    """A stack of LatentMoE layers: the pool (refetch, keep, two buffers) and the old prefetch path give the
    same outputs and gradients (bitwise on the loop path)."""
    for dtype in DTYPES:
        _paths_agree(rt, dtype)


def _paths_agree(rt, dtype):
    results = {}
    for path in ("pool", "keep", "buffers2", "prefetch"):
        model, _ = stack(rt, 3, path=path, dtype=dtype)
        g = torch.Generator().manual_seed(rt.rank)
        x = torch.randn(7 + rt.rank, model.d, generator=g, dtype=torch.float64).to(rt.device, dtype)
        y = model(x.requires_grad_())
        y.square().sum().backward()
        results[path] = [y.detach()] + [p.grad.clone() for p in model.parameters()]
    for path in ("keep", "buffers2", "prefetch"):
        for a, b in zip(results["pool"], results[path]):
            if dtype == torch.float64 or rt.device.type == "cpu":
                assert torch.equal(a, b), f"{path} differs from the pool path"
            else:
                _close(path, a, b, dtype)


def case_module_slots_vs_dense(rt):
    """Any expert module (Linear, Tanh, Linear with biases): home experts run as themselves, replica slots
    with the pool's parameters; forward and every gradient against the dense float64 loop."""
    from torch import nn

    from moonep.experts import module_slots, stack_parameters, stacked_views_intact

    R, E, K, H, F, S = rt.world_size, 4 * rt.world_size, 2, 16, 12, 10
    dev, epn = rt.device, E // (rt.world_size)
    for dtype in DTYPES:
        for kind, pool in (("hot", ReplicaPool()), ("zipf", ReplicaPool()), ("hot", ReplicaPool(backward="keep"))):
            sizes = _sizes(R, S)
            x, idx, w, _, _, gy = make_problem(4, R, E, K, H, F, sizes, kind)
            torch.manual_seed(0)
            full = nn.ModuleList(nn.Sequential(nn.Linear(H, F), nn.Tanh(), nn.Linear(F, H)) for _ in range(E)).double()
            ref = [m for m in full]
            xr = x.clone().requires_grad_()
            yr = torch.zeros_like(x)
            for k in range(K):
                for e in range(E):
                    sel = idx[:, k] == e
                    if sel.any():
                        yr[sel] = yr[sel] + w[sel, k, None] * ref[e](xr[sel])
            (yr * gy).sum().backward()

            import copy
            home = [copy.deepcopy(full[e]).to(dev, dtype) for e in range(rt.rank * epn, (rt.rank + 1) * epn)]
            for m in home:
                m.zero_grad(set_to_none=True)
            stacked = stack_parameters(home)
            assert stacked_views_intact(home, stacked)
            ep = moonep.ExpertParallel(rt, num_experts=E, topk=K, hidden=H, max_tokens=S, dtype=dtype)
            sl = my_slice(rt, sizes)
            xl = x[sl].to(dev, dtype).requires_grad_()
            h = ep.dispatch(xl, idx[sl].to(dev), w[sl].to(dev, dtype))
            reps = {n: pool.fetch(ep, h, t, n) for n, t in stacked.items()}
            out = module_slots(home[0], h.tokens, h.cu_seqlens, home, reps, H)
            for n, t in stacked.items():  # a later layer (stacked too) reuses the slots before this backward
                pool.fetch(ep, h, t + 1, n)  # other weights: a stale slot would change the gradients
            y = ep.combine(out, h)
            (y * gy[sl].to(dev, dtype)).sum().backward()
            _close("y", y, yr.detach()[sl], dtype)
            _close("grad x", xl.grad, xr.grad[sl], dtype)
            for j, m in enumerate(home):
                for (n, p), (_, pr) in zip(m.named_parameters(), full[rt.rank * epn + j].named_parameters()):
                    want = pr.grad if pr.grad is not None else torch.zeros_like(pr)  # an expert nobody chose
                    _close(f"grad expert {rt.rank * epn + j} {n}", p.grad, want, dtype)
            ep.close()
