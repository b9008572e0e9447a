"""moonep.ops in one process (local backend): the custom ops give the eager bits, eagerly and compiled
(aot_eager), and release each step's state after its backward."""
import contextlib
import gc

import pytest
import torch
import torch._dynamo

import moonep
from moonep import op_state, ops

E, K, H, S = 8, 2, 16, 24


def _problem(s, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(s, H, generator=g, dtype=torch.float64)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(s)]) if s else \
        torch.zeros(0, K, dtype=torch.int64)
    w = torch.rand(s, K, generator=g, dtype=torch.float64)
    return x.to(device).requires_grad_(), idx.to(device), w.to(device).requires_grad_()


def _through_ops(ep, W):
    """The MoE step of the tests through the ops: ``(x, idx, w) -> [s, H]`` (one expert matrix per slot)."""
    def step(x, idx, w):
        h = ops.dispatch(ep, x, idx, w)
        return ops.combine(ops.slot_matmul(h.tokens, h.cu_seqlens, ops.prefetch(h, W)), h)
    return step


@pytest.mark.parametrize("apply_weights", ["combine", "dispatch"])
def test_ops_match_eager_and_release_steps(apply_weights):
    """Outputs and gradients through the ops, eagerly and compiled, bitwise those of the eager API; with
    apply_weights="dispatch" the rows are scaled in the graph and the weights' gradient comes through them."""
    torch._dynamo.reset()
    ep = moonep.ExpertParallel(num_experts=E, topk=K, hidden=H, max_tokens=S, dtype=torch.float64, device="cpu",
                               apply_weights=apply_weights)
    W = torch.randn(E, H, H, dtype=torch.float64, requires_grad=True)

    def eager(x, idx, w):
        h = ep.dispatch(x, idx, w)
        return ep.combine(moonep.slot_matmul(h.tokens, h.cu_seqlens, ep.prefetch(h, W)), h)

    through_ops = _through_ops(ep, W)
    compiled = torch.compile(through_ops, backend="aot_eager", fullgraph=True)
    fns = (eager, through_ops, compiled)
    if apply_weights == "dispatch":  # the scaling is graph code: inductor fuses it (the weights' gradient, a sum
        fns += (torch.compile(through_ops, fullgraph=True),)  # over H, within float64 rounding; the rest bitwise)
    for s in (9, 14, 0):
        got = []
        for fn in fns:
            x, idx, w = _problem(s, s)
            W.grad = None
            y = fn(x, idx, w)
            y.square().sum().backward()
            got.append((y.detach(), x.grad, w.grad, W.grad))
        for other in got[1:3]:
            for a, b in zip(got[0], other):
                assert torch.equal(a, b), s
        for a, b in zip(got[0], got[3] if len(got) > 3 else ()):  # inductor
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    del got, y
    gc.collect()
    ops.dispatch(ep, *_problem(3, 0))  # storing a step drops the released ones
    assert op_state.live_steps() <= 1, op_state.live_steps()
    ep.close()


@pytest.mark.parametrize("apply_weights", ["combine", "dispatch"])
def test_the_eager_api_compiles_into_one_graph(apply_weights):
    """Code written against the eager API (ExpertParallel.dispatch, ReplicaPool.fetch, expert_matmul,
    slot_matmul, ExpertParallel.prefetch and combine) compiles whole: each collective is one node
    (``fullgraph=True``), and outputs and gradients are eager's, bitwise (aot_eager)."""
    torch._dynamo.reset()
    ep = moonep.ExpertParallel(num_experts=E, topk=K, hidden=H, max_tokens=S, dtype=torch.float64, device="cpu",
                               apply_weights=apply_weights)
    g = torch.Generator().manual_seed(11)
    w_in = torch.randn(E, H, 2 * H, generator=g, dtype=torch.float64, requires_grad=True)
    w_out = torch.randn(E, 2 * H, H, generator=g, dtype=torch.float64, requires_grad=True)
    W = torch.randn(E, H, H, generator=g, dtype=torch.float64, requires_grad=True)
    pool = moonep.ReplicaPool()

    def layer(x, idx, w):
        h = ep.dispatch(x, idx, w)
        r_in, r_out = pool.fetch(ep, h, [w_in, w_out], ["w_in", "w_out"])
        a = torch.relu(moonep.expert_matmul(h.tokens, h.cu_seqlens, w_in, r_in))
        b = moonep.slot_matmul(h.tokens, h.cu_seqlens, ep.prefetch(h, W))
        y = ep.combine(moonep.expert_matmul(a, h.cu_seqlens, w_out, r_out) + b, h)
        return y, h.plan.recv_counts

    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    for s in (9, 14, 0):
        got = []
        for fn in (layer, compiled):
            x, idx, w = _problem(s, s)
            for p in (w_in, w_out, W):
                p.grad = None
            y, recv = fn(x, idx, w)
            y.square().sum().backward()
            got.append((y.detach(), recv, x.grad, w.grad, w_in.grad, w_out.grad, W.grad))
        for name, a, b in zip(("y", "recv_counts", "dx", "dw", "dw_in", "dw_out", "dW"), *got):
            assert torch.equal(a, b), (s, name)
    ep.close()


def test_fp8_dispatch_compiles_into_one_graph():
    """fp8 dispatch through the eager API under torch.compile (fullgraph, aot_eager): the rows and scales come
    out of moonep::dispatch, dequantised in the graph, the gradient straight through to x; bitwise eager's."""
    torch._dynamo.reset()
    Hq = 128  # fp8 groups of 128 channels
    ep = moonep.ExpertParallel(num_experts=E, topk=K, hidden=Hq, max_tokens=S, dtype=torch.bfloat16, device="cpu",
                               dispatch_dtype=torch.float8_e4m3fn)
    W = torch.randn(E, Hq, Hq, generator=torch.Generator().manual_seed(3), dtype=torch.bfloat16) * 0.05
    W.requires_grad_()

    def layer(x, idx, w):
        h = ep.dispatch(x, idx, w)
        return ep.combine(moonep.slot_matmul(h, h.cu_seqlens, ep.prefetch(h, W)), h), h.tokens.dtype

    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    for s in (9, 14, 0):
        got = []
        for fn in (layer, compiled):
            g = torch.Generator().manual_seed(s)
            x = torch.randn(s, Hq, generator=g, dtype=torch.bfloat16).requires_grad_()
            idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(s)]) if s else \
                torch.zeros(0, K, dtype=torch.int64)
            w = torch.rand(s, K, generator=g, dtype=torch.float32).requires_grad_()
            W.grad = None
            y, rows_dtype = fn(x, idx, w)
            assert rows_dtype == torch.float8_e4m3fn
            y.float().square().sum().backward()
            got.append((y.detach(), x.grad, w.grad, W.grad))
        for name, a, b in zip(("y", "dx", "dw", "dW"), *got):
            assert torch.equal(a, b), (s, name)
    ep.close()


def test_pre_quantised_pair_and_num_global_tokens_compile():
    """A pre-quantised fp8 pair (the op's x and x_scales) and num_global_tokens (an op argument) compile into
    one graph (fullgraph, aot_eager) with eager's bits; a wrong num_global_tokens is refused there too."""
    from moonep.quant import quantize_fp8

    torch._dynamo.reset()
    Hq = 128
    ep = moonep.ExpertParallel(num_experts=E, topk=K, hidden=Hq, max_tokens=S, dtype=torch.bfloat16, device="cpu",
                               dispatch_dtype=torch.float8_e4m3fn)

    def layer(q, sc, idx, w, total):
        h = ep.dispatch((q, sc), idx, w, num_global_tokens=total)
        return ep.combine(moonep.fp8.dequantize_rows(h, 0, h.tokens.shape[0]), h)

    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(9, Hq, generator=g, dtype=torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(9)])
    w = torch.rand(9, K, generator=g).requires_grad_()
    q, sc = quantize_fp8(x)
    want = layer(q, sc, idx, w, 9)
    want.float().sum().backward()
    dw, w.grad = w.grad, None
    got = compiled(q, sc, idx, w, 9)
    got.float().sum().backward()
    assert torch.equal(got, want) and torch.equal(w.grad, dw)
    for bad in (10, -5):
        with pytest.raises(ValueError, match="num_global_tokens"):
            compiled(q, sc, idx, w, bad)
    assert torch.equal(compiled(q, sc, idx, w, 9), want)
    ep.close()


def test_transposed_expert_matmul_with_bias_compiles():
    """The nn.Linear layout (``transpose=True``) with biases, as the transformers experts use it, under inductor:
    the backward op's gradients have the layout its fake implementation promises (contiguous, like the
    weights), and values agree with eager's."""
    torch._dynamo.reset()
    ep = moonep.ExpertParallel(num_experts=E, topk=K, hidden=H, max_tokens=S, dtype=torch.float64, device="cpu")
    g = torch.Generator().manual_seed(12)
    w = torch.randn(E, 2 * H, H, generator=g, dtype=torch.float64, requires_grad=True)  # [epn, N, D]
    b = torch.randn(E, 2 * H, generator=g, dtype=torch.float64, requires_grad=True)
    pool = moonep.ReplicaPool()

    def layer(x, idx, tw):
        h = ep.dispatch(x, idx, tw)
        rw, rb = pool.fetch(ep, h, [w, b], ["w", "b"])
        out = moonep.expert_matmul(h.tokens, h.cu_seqlens, w, rw, transpose=True, bias=b, bias_replicas=rb)
        return ep.combine(out[:, :H] * out[:, H:], h)

    got = []
    for fn in (layer, torch.compile(layer, fullgraph=True)):
        x, idx, tw = _problem(9, 9)
        w.grad = b.grad = None
        y = fn(x, idx, tw)
        y.square().sum().backward()
        got.append((y.detach(), x.grad, tw.grad, w.grad, b.grad))
    for a, c in zip(*got):
        torch.testing.assert_close(a, c, rtol=1e-12, atol=1e-12)
    assert got[1][3].is_contiguous()
    ep.close()


def test_reduces_compile_as_ops():
    """reduce_grad and reduce_replicas of a compiled dispatch compile whole (``moonep::reduce_grad``,
    ``moonep::reduce_replicas``) with eager's values; a handle of another instance is refused."""
    torch._dynamo.reset()
    ep = moonep.ExpertParallel(num_experts=E, topk=K, hidden=H, max_tokens=S, dtype=torch.float64, device="cpu")
    other = moonep.ExpertParallel(num_experts=E, topk=K, hidden=H, max_tokens=S, dtype=torch.float64, device="cpu")
    g2 = torch.randn(2 * E, H, dtype=torch.float64, generator=torch.Generator().manual_seed(5))

    def step(x, idx, w):
        h = ep.dispatch(x, idx, w)
        return ep.reduce_grad(h, g2), ep.reduce_replicas(h, g2[:E], g2[E:]), ops.reduce_replicas(h, g2[:E], g2[E:]), h

    x, idx, w = _problem(9, 9)
    want = step(x, idx, w)
    g2_before = g2.clone()
    got = torch.compile(step, backend="aot_eager", fullgraph=True)(x, idx, w)
    assert isinstance(got[3], ops.Routed)
    for a, b in zip(want[:3], got[:3]):
        assert torch.equal(a, b)
    assert torch.equal(g2, g2_before)  # the public reduces return tensors of their own
    with pytest.raises(ValueError, match="h: expected a Dispatched of this ExpertParallel"):
        other.reduce_grad(got[3], g2)
    ep.close(), other.close()


class _OpLog(torch.utils._python_dispatch.TorchDispatchMode):
    """The names of the moonep ops that reach the dispatcher's Python key."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "moonep":
            self.names.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


_STEP_OPS = ["dispatch", "fetch_replicas", "expert_matmul", "combine", "combine_backward", "expert_matmul_backward",
             "dispatch_backward", "reduce_grad"]  # (the replica gradient reduce runs inside expert_matmul's backward)


def _pool_step():
    """A one-rank training step through the eager API (dispatch, the pool's fetch, expert_matmul, combine,
    backward, reduce_grad) and the ExpertParallel it runs on: ``(run, ep)``, ``run()`` returning the values."""
    ep = moonep.ExpertParallel(num_experts=E, topk=K, hidden=H, max_tokens=S, dtype=torch.float64, device="cpu")
    g = torch.Generator().manual_seed(3)
    w_in = torch.randn(E, H, H, generator=g, dtype=torch.float64, requires_grad=True)
    pool = moonep.ReplicaPool()

    def run():
        x, idx, w = _problem(9, 9)
        w_in.grad = None
        h = ep.dispatch(x, idx, w)
        r = pool.fetch(ep, h, w_in, "w_in")
        y = ep.combine(moonep.expert_matmul(h.tokens, h.cu_seqlens, w_in, r), h)
        y.square().sum().backward()
        return y.detach(), x.grad, w_in.grad, ep.reduce_grad(h, torch.ones(2 * E, 3, dtype=torch.float64))

    return run, ep


def test_eager_collectives_are_the_ops():
    """Eager code runs every collective as moonep's op, forward and backward: dispatch, the pool's replica fetch
    (``moonep::fetch_replicas``, into the pool's buffers), the expert GEMM (whose backward reduces the replica
    gradients), combine and ``reduce_grad``; values as without the log (a dispatch mode: every call passes
    through the dispatcher)."""
    run, ep = _pool_step()
    want = run()
    with _OpLog() as log:
        got = run()
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    assert log.names == _STEP_OPS, log.names
    ep.close()


def test_eager_calls_run_the_op_kernels_directly(monkeypatch):
    """Without a dispatch mode, ``op_state.call`` runs each op's own kernel (the function the dispatcher would
    run) without the dispatcher: every op of the step goes that way, the values are bitwise those through the
    dispatcher, and torch.profiler still shows each op by name."""
    run, ep = _pool_step()
    want = run()
    direct = []
    names = {id(getattr(torch.ops.moonep, n).default): n for n in _STEP_OPS}
    kernels = {key: ((lambda name, fn: lambda *a: direct.append(name) or fn(*a))(names[key], fn), *rest)
               for key, (fn, *rest) in op_state._KERNELS.items() if key in names}
    assert len(kernels) == len(_STEP_OPS)
    monkeypatch.setattr(op_state, "_KERNELS", kernels)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        got = run()
    assert direct == _STEP_OPS, direct
    ranges = [e.name for e in prof.events() if e.name.startswith("moonep::")]
    assert [n for n in ranges if n.split("::")[1] in _STEP_OPS] == [f"moonep::{n}" for n in _STEP_OPS], ranges
    monkeypatch.setattr(op_state, "_KERNELS", {})  # every call through the dispatcher
    through = run()
    for a, b, c in zip(want, got, through):
        assert torch.equal(a, b) and torch.equal(a, c)
    ep.close()


def test_bad_input_under_compile_is_refused_and_the_next_call_works():
    """Compiled code checks its arguments as eager code does (in the op's body): a bad expert id or width is
    refused with the argument's name, and the next valid call works."""
    torch._dynamo.reset()
    ep = moonep.ExpertParallel(num_experts=E, topk=K, hidden=H, max_tokens=S, dtype=torch.float64, device="cpu")
    W = torch.randn(E, H, H, dtype=torch.float64)

    def layer(x, idx, w):
        h = ep.dispatch(x, idx, w)
        return ep.combine(moonep.slot_matmul(h.tokens, h.cu_seqlens, ep.prefetch(h, W)), h)

    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    x, idx, w = _problem(5, 5)
    want = layer(x, idx, w)
    bad = idx.clone()
    bad[4, 1] = E + 1
    with pytest.raises(ValueError, match="topk_idx: expected expert ids"):
        compiled(x, bad, w)
    with pytest.raises(ValueError, match="x: expected shape"):
        compiled(x[:, :H // 2], idx, w)
    assert torch.equal(compiled(x, idx, w), want)
    ep.close()


def _two_batches(ep, W, async_op):
    """Two micro-batches through one ExpertParallel: B's dispatch runs while A's experts compute, A's combine
    while B's experts compute (``async_op``), or everything in order."""
    def expert(h):
        return moonep.slot_matmul(h.tokens, h.cu_seqlens, ep.prefetch(h, W)).tanh()

    def layer(xa, ia, wa, xb, ib, wb):
        ha = ep.dispatch(xa, ia, wa)
        work_b = ep.dispatch(xb, ib, wb, async_op=async_op)
        oa = expert(ha)
        hb = work_b.wait() if async_op else work_b
        work_a = ep.combine(oa, ha, async_op=async_op)
        ob = expert(hb)
        ya = work_a.wait() if async_op else work_a
        return ya, ep.combine(ob, hb)
    return layer


def _copies_at_wait(monkeypatch) -> list:
    """Records the outputs that moonep::wait_work had to copy (a compiler copied them before the wait)."""
    import threading

    from moonep import work
    seen, real = [], work._copy_into

    def spy(out, src):
        if not threading.current_thread().name.startswith("moonep-overlap"):  # (the worker's own fill: not these)
            seen.append(tuple(out.shape))
        real(out, src)
    monkeypatch.setattr(work, "_copy_into", spy)
    return seen


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_async_op_under_compile_is_bitwise_the_serial_step(backend, monkeypatch):
    """async_op=True under torch.compile: moonep::dispatch_async / combine_async and moonep::wait_work in one
    graph (fullgraph, no break), outputs and gradients bitwise those of the serial step compiled alike (and,
    with aot_eager, of the eager one).  Under inductor each wait stays after the compute the program put
    before it (moonep/compile_order.py pins it there), in training and inference graphs.  Inductor writes
    the waited outputs in place (nothing copied at the wait); aot_eager copies them before the wait, and the
    wait gives the copies the call's values."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    ep = moonep.ExpertParallel(num_experts=E, topk=K, hidden=H, max_tokens=S, dtype=torch.float64, device="cpu")
    W = torch.randn(E, H, H, dtype=torch.float64, requires_grad=True)
    ops_seen = []

    def spy_backend(gm, inputs):
        ops_seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward
    copies = _copies_at_wait(monkeypatch)
    # against the serial step compiled alike (inductor fuses the experts' math its own way), and eager's
    serial = torch.compile(_two_batches(ep, W, False), backend=backend, fullgraph=True)
    compiled = torch.compile(_two_batches(ep, W, True), backend=backend, fullgraph=True)
    fns = (serial, compiled) + ((_two_batches(ep, W, False),) if backend == "aot_eager" else ())
    for sa, sb in ((9, 14), (0, 5), (12, 0)):
        got = []
        for fn in fns:
            a, b = _problem(sa, sa), _problem(sb, 100 + sb)
            W.grad = None
            ya, yb = fn(*a, *b)
            (ya.square().sum() + yb.sin().sum()).backward()
            got.append((ya.detach(), yb.detach(), a[0].grad, a[2].grad, b[0].grad, b[2].grad, W.grad))
        for other in got[1:]:
            for name, u, v in zip(("ya", "yb", "xa.grad", "wa.grad", "xb.grad", "wb.grad", "W.grad"), got[0], other):
                assert torch.equal(u, v), f"{backend} {sa},{sb}: {name} differs"
    if backend == "inductor":
        assert copies == [], f"inductor copied the waited outputs {copies}"
        for train in (True, False):  # each wait stays after the expert compute that the program put before it
            torch._dynamo.reset()
            with torch.set_grad_enabled(train):
                _, code = run_and_get_code(torch.compile(_two_batches(ep, W, True), fullgraph=True),
                                           *_problem(9, 1), *_problem(14, 2))
            calls = [c.split("torch.ops.moonep.")[1].split(".")[0] for c in code[0].splitlines()
                     if "torch.ops.moonep." in c and ".default(" in c]
            assert calls == ["dispatch", "dispatch_async", "prefetch", "slot_matmul", "wait_work", "combine_async",
                             "prefetch", "slot_matmul", "wait_work", "combine"], (train, calls)
            lines = [c.strip() for c in code[0].splitlines()]
            first_wait = next(i for i, c in enumerate(lines) if "wait_work.default(" in c)
            assert any(c.startswith("cpp_fused") and "tanh" in c.split("(")[0] for c in lines[:first_wait]), \
                code[0]  # A's activation (the kernel's name lists what it fuses)
    else:
        assert copies, "aot_eager was expected to copy an output before its wait"
    torch.compile(_two_batches(ep, W, True), backend=spy_backend, fullgraph=True)(*_problem(3, 1), *_problem(4, 2))
    assert {"moonep.dispatch_async.default", "moonep.combine_async.default", "moonep.wait_work.default"} <= \
        set(ops_seen), ops_seen
    ep.close()


def test_async_op_waited_then_read_by_a_collective_is_not_copied(monkeypatch):
    """A dispatch waited at once and combined: inductor writes the waited rows in place (the next collective is
    chained on the work tensor, not on a tensor that the wait writes), outputs bitwise the serial ones."""
    torch._dynamo.reset()
    ep = moonep.ExpertParallel(num_experts=E, topk=K, hidden=H, max_tokens=S, dtype=torch.float64, device="cpu")
    copies = _copies_at_wait(monkeypatch)

    def step(x, idx, w, async_op):
        h = ep.dispatch(x, idx, w, async_op=async_op)
        h = h.wait() if async_op else h
        return ep.combine(h.tokens * 2, h)
    x, idx, w = (t.detach() for t in _problem(7, 4))
    fn = torch.compile(step, fullgraph=True)
    assert torch.equal(fn(x, idx, w, True), fn(x, idx, w, False))
    assert copies == [], copies
    ep.close()


def test_async_op_under_compile_dropped_work_refuses_the_next_call():
    """A compiled step that drops an async call's Work unwaited: its next collective is refused, naming
    async_op; the call after it works.  previous_event under torch.compile is refused by name."""
    torch._dynamo.reset()
    ep = moonep.ExpertParallel(num_experts=E, topk=K, hidden=H, max_tokens=S, dtype=torch.float64, device="cpu")

    def dropped(x, idx, w):
        h = ep.dispatch(x, idx, w)
        ep.combine(h.tokens * 2, h, async_op=True)  # never waited
        return h.tokens.sum()

    x, idx, w = (t.detach() for t in _problem(5, 5))
    torch.compile(dropped, backend="aot_eager")(x, idx, w)
    with pytest.raises(ValueError, match="async_op: every Work must be waited for"):
        ep.dispatch(x, idx, w)
    h = ep.dispatch(x, idx, w)
    torch.testing.assert_close(ep.combine(h.tokens, h), x * w.sum(1, keepdim=True))

    def with_event(x, idx, w):
        return ep.dispatch(x, idx, w, async_op=True, previous_event=object())
    with pytest.raises(ValueError, match="previous_event: expected None on cpu"):
        torch.compile(with_event, backend="aot_eager")(x, idx, w)
    ep.close()


def _nvlink_like(s, tokfirst, seed):
    """A stand-in NVLink instance and a step of it on the CPU (random lists: only their travel is checked)."""
    from types import SimpleNamespace

    from moonep.handles import NVLinkStep, Step

    cap, Kn, R, Sn, En = 37, 3, 2, 11, 6
    ep = SimpleNamespace(capacity=cap, topk=Kn, world_size=R, max_tokens=Sn, num_experts=En)
    g = torch.Generator().manual_seed(seed)
    i32 = lambda *shape: torch.randint(-1, 1000, shape, generator=g, dtype=torch.int32)  # noqa: E731
    i64 = lambda *shape: torch.randint(-1, 1000, shape, generator=g, dtype=torch.int64)  # noqa: E731
    st = NVLinkStep(s, i64(s, Kn), i64(s, Kn), generation=5, zero_copy=False, row_first=i32(cap),
                    rec=i32(cap, Kn), src=i32(cap), tokfirst=i32(R * Sn) if tokfirst else None,
                    w32=torch.rand(s, Kn, generator=g), cu=i32(2 * En // R + 1))
    st.step, st.instance = 7, 3
    plan = SimpleNamespace(replica_experts=i64(R, En // R), replica_source=i64(R))
    h = Step(st.cu, i64(2 * En // R), plan, st)
    return ep, h


def test_nvlink_step_state_travels_in_the_token():
    """The NVLink step state goes through the step token (so that no device tensor outlives an op unless it
    is an op output: CUDA graph pools); the registry keeps no tensor; the token has the fake's size."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from moonep.backends.nvlink_token import StepToken

    for s, tokfirst in ((5, True), (5, False), (0, True)):
        ep, h = _nvlink_like(s, tokfirst, s)
        tok = StepToken(ep.capacity, ep.topk, ep.world_size, ep.max_tokens, ep.num_experts // ep.world_size)
        token = tok.pack(h, torch.device("cpu"))
        packed = tok.host_part(h)
        held = [v for v in vars(packed.step).values() if isinstance(v, torch.Tensor)]
        held += [v for v in vars(packed.step.routing).values() if isinstance(v, torch.Tensor)]
        assert not held and packed.step.plan is None and packed.tokfirst == tokfirst
        got = tok.unpack(packed, token)
        st, want = got.routing, h.routing
        assert (st.step, st.instance, st.generation, st.zero_copy, st.num_tokens) == (7, 3, 5, False, s)
        for name in ("dst_rank", "dst_row", "row_first", "rec", "src"):
            a, b = getattr(st, name), getattr(want, name)
            assert a.dtype == b.dtype and torch.equal(a, b), name
            assert a.untyped_storage().data_ptr() == token.untyped_storage().data_ptr(), name
        assert (st.tokfirst is None) == (not tokfirst)
        if tokfirst:
            assert torch.equal(st.tokfirst, want.tokfirst)
        assert st.w32 is None and st.cu is None
        for name in ("replica_experts", "replica_source"):
            assert torch.equal(getattr(got.plan, name), getattr(h.plan, name)), name
        words = tok.state_words
        assert token.numel() == words + 2 * s * ep.topk
        with FakeTensorMode():
            x = torch.empty(s, 4)
            idx, w = torch.empty(s, ep.topk, dtype=torch.int64), torch.empty(s, ep.topk)
            out = torch.ops.moonep.dispatch(x, idx, w, None, -1, 1, ep.capacity, ep.num_experts, ep.world_size,
                                            words, False, torch.float32, True, 0)  # the graph's token
            assert out[7].shape == token.shape and out[7].dtype == torch.int64  # then fp8's scales and anchor


def plan_op_matches_eager(device):
    """moonep::plan_and_destinations compiled with fullgraph=True (no graph break) gives the eager plan and
    destinations bitwise, for routings that change shape between calls (cold experts, everything on one)."""
    from moonep.layout import plan_and_destinations

    torch._dynamo.reset()
    R, E_, K_ = 4, 16, 3
    fn = torch.compile(lambda c, i: ops.plan_and_destinations(c, 2, i, align=4), fullgraph=True, dynamic=True)
    for seed, s in ((0, 21), (1, 5), (2, 0), (3, 40)):
        g = torch.Generator().manual_seed(seed)
        counts = torch.randint(0, 9, (R, E_), generator=g)
        counts[:, :4] = 0 if seed == 1 else counts[:, :4]        # rank 0's experts cold
        idx = torch.stack([torch.randperm(E_, generator=g)[:K_] for _ in range(s)]) if s else \
            torch.zeros(0, K_, dtype=torch.int64)
        if seed == 3:
            idx[:, 0] = 7                                        # everything to one expert
            idx[:, 1:] = torch.where(idx[:, 1:] == 7, 8, idx[:, 1:])
        counts[2] = torch.zeros(E_, dtype=torch.int64).scatter_add_(0, idx.reshape(-1), torch.ones(s * K_).long())
        counts, idx = counts.to(device), idx.to(device)
        got = fn(counts, idx)
        plan, dst_rank, dst_row = plan_and_destinations(counts, 2, idx, align=4)
        want = (plan.assignment, plan.replica_experts, plan.replica_source, plan.recv_counts, plan.expert_counts,
                dst_rank, dst_row)
        for name, a, b in zip(ops.Planned._fields, got, want):
            assert torch.equal(a, b.to(torch.int64)), (seed, name)
        assert int(got.error) == 0, seed
    n = torch._dynamo.explain(lambda c, i: ops.plan_and_destinations(c, 2, i))(counts, idx).graph_break_count
    assert n == 0, n


def test_plan_op_matches_eager():
    plan_op_matches_eager("cpu")


def test_backward_collectives_stay_in_the_backward_graph():
    """A rank with no tokens has empty tangents, which the compiler may replace with constants (seen with
    inductor on CUDA); its backward collectives then depend on no tangent.  They must still be partitioned
    into the backward graph, or that rank runs them in the forward, in another order than its peers.  The
    constant is put in by hand here (the partition function), then AOTAutograd's min-cut partitioner runs."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    torch._dynamo.reset()
    ep = moonep.ExpertParallel(num_experts=E, topk=K, hidden=H, max_tokens=S, dtype=torch.float64, device="cpu")
    W = torch.randn(E, H, H, dtype=torch.float64, requires_grad=True)
    placed = {}

    def partition(joint, inputs, **kw):
        g = joint.graph
        for n in list(g.nodes):
            if n.target is torch.ops.moonep.combine_backward.default:
                gy = n.args[0]
                with g.inserting_before(n):
                    const = g.call_function(torch.ops.aten.zeros.default, (list(gy.meta["val"].shape),),
                                            {"dtype": gy.meta["val"].dtype})
                const.meta = {k: v for k, v in gy.meta.items() if k in ("val", "tensor_meta")}
                const.meta["partitioner_tag"] = "is_backward"
                n.replace_input_with(gy, const)
        g.eliminate_dead_code()
        joint.recompile()
        fw, bw = min_cut_rematerialization_partition(joint, inputs, **kw)
        for name, mod in (("forward", fw), ("backward", bw)):
            placed[name] = [n.target.__name__ for n in mod.graph.nodes
                            if getattr(n.target, "namespace", None) == "moonep"]
        return fw, bw

    keep = lambda gm, _: make_boxed_func(gm)  # noqa: E731
    backend = aot_autograd(fw_compiler=keep, bw_compiler=keep, partition_fn=partition)

    through_ops = _through_ops(ep, W)
    x, idx, w = _problem(0, 1)
    torch.compile(through_ops, backend=backend, fullgraph=True)(x, idx, w).sum().backward()
    assert not any(n.endswith("_backward") or n.startswith("reduce") for n in placed["forward"]), placed
    assert "combine_backward.default" in placed["backward"], placed
    ep.close()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_collectives_run_when_nothing_reads_their_output(monkeypatch, request, device):
    """Inductor drops a kernel whose output nothing reads, and a load from a zero-element buffer reads
    nothing: a rank with no tokens would skip its combine (seen on CUDA, the peers then wait for it), and in
    training its dispatch's backward, whose gradients are empty too.  The collective ops are registered as
    side-effecting (``ops._define``), so they always run.  Inductor's caches do not key on that
    registration: they are off here, so that an artifact compiled without it cannot answer."""
    no_caches = torch.compiler.config.patch(force_disable_caches=True)  # (monkeypatch cannot restore it)
    no_caches.__enter__()
    request.addfinalizer(lambda: no_caches.__exit__(None, None, None))
    torch._dynamo.reset()
    ep = moonep.ExpertParallel(num_experts=E, topk=K, hidden=H, max_tokens=S, dtype=torch.float64, device=device)
    W = torch.randn(E, H, H, dtype=torch.float64, device=device, requires_grad=True)
    calls, combine = [], ep._combine_body  # what the op's body runs
    monkeypatch.setattr(ep, "_combine_body", lambda *a, **kw: (calls.append("combine"), combine(*a, **kw))[1])
    for name in ("dispatch_grads", "combine_grads"):  # the backward rules the ops call
        monkeypatch.setattr(ops, name, lambda *a, _bwd=getattr(ops, name), _name=name: (calls.append(_name),
                                                                                          _bwd(*a))[1])

    step = _through_ops(ep, W)
    compiled = torch.compile(lambda x, idx, w: step(x, idx, w) * 2, fullgraph=True)  # inductor
    x, idx, w = _problem(0, 1, device)
    with torch.no_grad():
        y = compiled(x, idx, w)
    assert y.shape == (0, H) and calls == ["combine"], (y.shape, calls)
    calls.clear()
    compiled(x, idx, w).sum().backward()
    assert sorted(calls) == ["combine", "combine_grads", "dispatch_grads"], calls
    ep.close()


def test_saved_tensor_hooks_that_copy_keep_the_backward_working():
    """A saved-tensor hook that copies what autograd saves (as torch.autograd.graph.save_on_cpu does) must not
    lose the step: the eager ops keep the step token out of the saved tensors.  Gradients as without it."""
    ep = moonep.ExpertParallel(num_experts=E, topk=K, hidden=H, max_tokens=S, dtype=torch.float64, device="cpu")
    W = torch.randn(E, H, H, dtype=torch.float64, requires_grad=True)
    got = []
    for hooked in (False, True):
        x, idx, w = _problem(9, 9)
        W.grad = None
        hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t) if hooked else \
            contextlib.nullcontext()
        with hooks:
            h = ep.dispatch(x, idx, w)
            y = ep.combine(moonep.slot_matmul(h.tokens, h.cu_seqlens, ep.prefetch(h, W)), h)
        y.square().sum().backward()
        got.append((y.detach(), x.grad, w.grad, W.grad))
    for a, b in zip(*got):
        assert torch.equal(a, b)
    ep.close()


def test_what_the_op_cannot_take_is_refused_by_name():
    """Arguments that would not reach the op's body (a meta tensor runs the fake implementation) are refused
    before it, naming them; an eager combine of a compiled step checks the weights' shape; the instance works
    afterwards."""
    from moonep.quant import quantize_fp8

    Hq = 128
    ep = moonep.ExpertParallel(num_experts=E, topk=K, hidden=Hq, max_tokens=S, dtype=torch.bfloat16, device="cpu",
                               dispatch_dtype=torch.float8_e4m3fn)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(9, Hq, generator=g, dtype=torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(9)])
    w = torch.rand(9, K, generator=g)
    q, sc = quantize_fp8(x)
    with pytest.raises(ValueError, match="x"):
        ep.dispatch((q, sc.to("meta")), idx, w)
    h = ep.dispatch((q, sc), idx, w)
    with pytest.raises(ValueError, match="h.step"):
        ep.combine(moonep.fp8.dequantize_rows(h), h._replace(step=h.step.to("meta")))
    with pytest.raises(ValueError, match="num_global_tokens"):
        ep.dispatch(x, idx, w, num_global_tokens=2 ** 63)
    y = ep.combine(moonep.fp8.dequantize_rows(h), h)
    assert y.shape == (9, Hq)
    ep.close()
    assert all(entry[1] != ep.op_id for entry in op_state._STEPS.values())  # close() forgot its steps

    torch._dynamo.reset()
    ep = moonep.ExpertParallel(num_experts=E, topk=K, hidden=H, max_tokens=S, dtype=torch.float64, device="cpu")
    compiled = torch.compile(lambda x, idx, w: ep.dispatch(x, idx, w), backend="aot_eager", fullgraph=True)
    x, idx, w = _problem(9, 9)
    h = compiled(x, idx, w)
    with pytest.raises(ValueError, match="h.weights: expected shape"):
        ep.combine(h.tokens, h._replace(weights=h.weights[:-1]))
    assert torch.equal(ep.combine(h.tokens, h), ep.combine(h.tokens, ep.dispatch(x, idx, w)))
    ep.close()


def test_combine_weights_grad_inside_bitwise_is_eager_bits():
    """Combine's product rule runs after its backward op as graph code.  Compiled with inductor inside
    ``eager_math.bitwise()`` the weights' gradient (a sum over H, which inductor would sum in its own order) is
    eager's, bit for bit, also on a torch whose AOTAutograd traces the backward with ``is_compiling()`` False
    (2.11); outside it, inductor's sum, within float32 rounding."""
    from moonep import eager_math

    torch._dynamo.reset()
    Hb = 1024
    ep = moonep.ExpertParallel(num_experts=E, topk=K, hidden=Hb, max_tokens=S, dtype=torch.float32, device="cpu")
    g = torch.Generator().manual_seed(8)
    x = torch.randn(S, Hb, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(S)])
    w0 = torch.rand(S, K, generator=g)
    gy = torch.randn(S, Hb, generator=g)

    def step(x, w):
        h = ep.dispatch(x, idx, w)
        return ep.combine(h.tokens * 2.0, h)  # (exact: the only rounding is moonep's)

    def grads(fn):
        w = w0.clone().requires_grad_()
        xg = x.clone().requires_grad_()
        fn(xg, w).backward(gy)
        return w.grad, xg.grad

    want = grads(step)
    with eager_math.bitwise():
        got = grads(torch.compile(step, fullgraph=True))
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    torch._dynamo.reset()
    fused = grads(torch.compile(step, fullgraph=True))
    for a, b in zip(want, fused):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    ep.close()


def test_eager_pool_replicas_inside_compiled_code_run_eagerly():
    """A pool fetched eagerly, its ``Replicas`` handed to compiled code: ``expert_matmul`` runs them eagerly
    (one graph break), with eager's values and gradients, step after step (no recompile per step)."""
    torch._dynamo.reset()
    ep = moonep.ExpertParallel(num_experts=E, topk=K, hidden=H, max_tokens=S, dtype=torch.float64, device="cpu")
    w_in = torch.randn(E, H, H, dtype=torch.float64, generator=torch.Generator().manual_seed(4), requires_grad=True)
    pool = moonep.ReplicaPool()
    gemm = lambda h, r: moonep.expert_matmul(h.tokens, h.cu_seqlens, w_in, r).relu()  # noqa: E731
    compiled = torch.compile(gemm, backend="aot_eager")
    for s in (9, 9, 14):
        got = []
        for fn in (gemm, compiled):
            x, idx, w = _problem(s, s)
            w_in.grad = None
            h = ep.dispatch(x, idx, w)
            y = ep.combine(fn(h, pool.fetch(ep, h, w_in, "w_in")), h)
            y.square().sum().backward()
            got.append((y.detach(), x.grad, w.grad, w_in.grad))
        for a, b in zip(*got):
            assert torch.equal(a, b), s
    ep.close()


def test_compiled_collectives_are_chained_in_program_order(monkeypatch):
    """Inductor's joint graph of a training step: every moonep collective but the first of the forward and of
    the backward gets the previous one's output as ``after`` (moonep/compile_order.py), through
    auto_functionalized too; the generated code passes it; a joint pass configured before moonep's still runs."""
    from torch._inductor.utils import run_and_get_code

    from moonep import compile_order

    torch._dynamo.reset()
    ep = moonep.ExpertParallel(num_experts=E, topk=K, hidden=H, max_tokens=S, dtype=torch.float64, device="cpu")
    W = torch.randn(E, H, H, dtype=torch.float64, requires_grad=True)
    pool = moonep.ReplicaPool()

    def step(xa, ia, wa, xb, ib, wb):
        ha = ep.dispatch(xa, ia, wa)
        work_b = ep.dispatch(xb, ib, wb, async_op=True)
        ra = pool.fetch(ep, ha, W, "W", async_op=True)
        oa = moonep.expert_matmul(ha.tokens, ha.cu_seqlens, W, ra)
        hb = work_b.wait()
        ya = ep.combine(oa, ha)
        return ya, ep.combine(moonep.expert_matmul(hb.tokens, hb.cu_seqlens, W, pool.fetch(ep, hb, W, "W")), hb)

    seen, theirs = [], []
    real = compile_order.order_collectives

    def spy(graph):
        chained = real(graph)
        ops = [n for n in graph.nodes if compile_order._target_op(n) is not None]
        seen.append((len(ops), chained, [n.kwargs.get("after") is not None for n in ops]))
        return chained
    monkeypatch.setattr(compile_order, "order_collectives", spy)
    import torch._inductor.config as config

    def run():
        ya, yb = torch.compile(step, fullgraph=True)(*_problem(7, 1), *_problem(9, 2))
        (ya.sum() + yb.sum()).backward()
    with config.patch(joint_custom_pre_pass=compile_order.OrderCollectives(theirs.append), force_disable_caches=True):
        _, code = run_and_get_code(run)
    assert theirs, "the joint pass configured before moonep's did not run"
    (n_ops, chained, flags), = seen
    # forward: dispatch, dispatch_async, fetch_async, combine, fetch, combine; backward: 2 combine_backward,
    # 2 expert_matmul_backward (each reduces its replicas' gradient), 2 dispatch_backward
    assert n_ops == 12 and chained == 10 and flags.count(False) == 2, seen
    calls = [line for line in code[0].splitlines() if "torch.ops.moonep." in line and "wait_work" not in line
             and "expert_matmul.default" not in line]
    assert calls and sum("after=None" in c for c in calls) == 1, calls  # the forward's first collective only
    ep.close()


def test_a_joint_pass_assigned_after_import_is_wrapped(monkeypatch):
    """A joint pass that a user assigns after moonep's import: moonep's ordering pass is back in the config by the
    time inductor runs the joint passes, and the user's pass runs too."""
    import torch._inductor.config as config

    from moonep import compile_order

    torch._dynamo.reset()
    ran = []
    real = compile_order.order_collectives
    monkeypatch.setattr(compile_order, "order_collectives", lambda g: ran.append("moonep") or real(g))
    ep = moonep.ExpertParallel(num_experts=E, topk=K, hidden=H, max_tokens=S, dtype=torch.float64, device="cpu")

    def step(x, idx, w):
        h = ep.dispatch(x, idx, w)
        return ep.combine(h.tokens * 2, h)
    x, idx, w = (t.detach() for t in _problem(5, 6))
    with config.patch(joint_custom_pre_pass=lambda graph: ran.append("theirs"), force_disable_caches=True):
        torch.compile(step, fullgraph=True)(x, idx, w)
        assert isinstance(config.joint_custom_pre_pass, compile_order.OrderCollectives)
    assert ran == ["theirs", "moonep"], ran
    ep.close()


def test_grouped_gemm_out_of_memory_propagates(monkeypatch):
    """An out-of-memory error of the grouped GEMM reaches the caller: it does not mark the grouped GEMM as
    unusable for the process (a silent switch to the per-slot loop, which needs the same output anyway)."""
    from moonep import experts

    def oom(*args):
        raise torch.OutOfMemoryError("CUDA out of memory (test)")

    def refused(*args):
        raise RuntimeError("grouped GEMM does not take these operands (test)")

    a, cu, w = torch.randn(4, 3), torch.tensor([0, 2, 4], dtype=torch.int32), torch.randn(2, 3, 5)
    loop = experts._rows_loop
    monkeypatch.setattr(experts, "_FAILED", set())
    monkeypatch.setattr(experts, "_grouped_ok", lambda *args: True)  # as on CUDA with bf16 operands
    with pytest.raises(torch.OutOfMemoryError):
        experts._run("auto", oom, loop, a, cu, w)
    assert experts._FAILED == set()
    out = experts._run("auto", refused, loop, a, cu, w)  # any other refusal: the loop, from then on
    assert torch.equal(out, loop(a, cu, w)) and experts._FAILED == {("cpu", torch.float32)}
