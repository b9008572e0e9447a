"""async_op=True collectives and the two-micro-batch schedule (moonep/work.py, moonep/layers/overlap.py), on every
rank, both host transports (CPU) or the device's (MOONEP_TEST_TRANSPORT), against the synchronous calls bitwise
and the dense float64 reference (float64 rows on CPU; float32 on CUDA, where NVLink moves no float64)."""
import os
import random
import time

import torch
import torch.nn.functional as F

import moonep
from moonep import eager_math
from ep_reference import expect_error, make_problem, my_slice
from moonep.layers.overlap import two_batch_moe
from tests.harness.mp import SkipCase


def transports(rt):
    if os.environ.get("MOONEP_TEST_TRANSPORT"):
        return os.environ["MOONEP_TEST_TRANSPORT"].split(",")
    return ["mpi", "torch"] if rt.device.type == "cpu" else ["nvlink"]


def _dt(rt):
    return torch.float64 if rt.device.type == "cpu" else torch.float32


def _ep(rt, transport, E=None, K=2, H=8, S=12, dtype=None, **kw):
    E, dtype = E or 2 * rt.world_size, dtype or _dt(rt)
    return moonep.ExpertParallel(rt, num_experts=E, topk=K, hidden=H, max_tokens=S, dtype=dtype, transport=transport,
                                 **kw)


def _problem(rt, seed, E, K, H, S, kind="hot", dtype=None):
    R, dtype = rt.world_size, dtype or _dt(rt)
    sizes = [S - (r % 3) for r in range(R)]
    if R > 2:
        sizes[1] = 0  # a rank without tokens
    x, idx, w, w1, w2, gy = make_problem(seed, R, E, K, H, 5, sizes, kind, dtype=dtype)
    sl = my_slice(rt, sizes)
    dev = rt.device
    return (x[sl].to(dev), idx[sl].to(dev), w[sl].to(dev), gy[sl].to(dev)), (x, idx, w, w1, w2, gy), sl


def _swiglu_experts(ep, pool, w1, w2):
    def experts(h):
        r1, r2 = pool.fetch(ep, h, [w1, w2], ["w1", "w2"])
        g, u = moonep.expert_matmul(h.tokens, h.cu_seqlens, w1, r1).chunk(2, -1)
        return moonep.expert_matmul(F.silu(g) * u, h.cu_seqlens, w2, r2)
    return experts


def case_async_calls_match_sync_bitwise(rt):
    """dispatch, combine, reduce_grad and reduce_replicas with async_op=True: the same bits as without, forward
    and backward, and the reference's values."""
    for transport in transports(rt):
        E, K, H, S = 2 * rt.world_size, 2, 8, 12
        ep = _ep(rt, transport, E, K, H, S)
        (x, idx, w, gy), (_, _, _, w1, _, _), _ = _problem(rt, 3, E, K, H, S)
        home = slice(rt.rank * E // rt.world_size, (rt.rank + 1) * E // rt.world_size)
        w1l = w1[home].to(x.device)

        def step(async_op):
            def call(fn, *args, **kw):  # the call, synchronous or waited at once
                return fn(*args, **kw, async_op=True).wait() if async_op else fn(*args, **kw)
            xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
            h = call(ep.dispatch, xl, idx, wl)
            y = call(ep.combine, torch.tanh(h.tokens) * 1.5, h)
            slots = ep.prefetch(h, w1l)
            g = call(ep.reduce_grad, h, slots)
            r = call(ep.reduce_replicas, h, slots[:ep.epn], slots[ep.epn:])
            (y * gy).sum().backward()
            return [y.detach(), xl.grad, wl.grad, g, r]

        sync, asyn = step(False), step(True)
        for a, b in zip(sync, asyn):
            assert torch.equal(a, b), (rt.rank, transport)
        ep.close()


def case_two_batch_schedule_is_bitwise_serial(rt):
    """two_batch_moe: outputs and gradients bitwise equal to the plain serial calls, to overlap=False and with the
    replica fetch given apart (fetch=), on
    adversarial routings (one hot expert, a cold rank, Zipf), a rank with no tokens and both weight modes; the
    values match the dense float64 reference."""
    R = rt.world_size
    for transport in transports(rt):
        for kind, apply_weights in [("hot", "combine"), ("cold_rank", "combine"), ("zipf", "dispatch")]:
            E, K, H, S, Fd = 2 * R, 2, 8, 12, 4
            ep = _ep(rt, transport, E, K, H, S, apply_weights=apply_weights)
            pool = moonep.ReplicaPool()
            gen = torch.Generator().manual_seed(7)
            W1 = torch.randn(E, H, 2 * Fd, generator=gen, dtype=torch.float64) / H ** 0.5
            W2 = torch.randn(E, Fd, H, generator=gen, dtype=torch.float64) / Fd ** 0.5
            home = slice(rt.rank * ep.epn, (rt.rank + 1) * ep.epn)
            w1 = W1[home].to(rt.device, _dt(rt)).requires_grad_()
            w2 = W2[home].to(rt.device, _dt(rt)).requires_grad_()
            experts = _swiglu_experts(ep, pool, w1, w2)

            def computed(h, r1, r2):
                g, u = moonep.expert_matmul(h.tokens, h.cu_seqlens, w1, r1).chunk(2, -1)
                return moonep.expert_matmul(F.silu(g) * u, h.cu_seqlens, w2, r2)

            probs = [_problem(rt, 11 + i, E, K, H, S, kind) for i in range(2)]

            def run(mode):
                w1.grad = w2.grad = None
                bs = [(p[0][0].clone().requires_grad_(), p[0][1], p[0][2].clone().requires_grad_()) for p in probs]
                if mode == "plain":
                    ys = []
                    for x, i, w in bs:
                        h = ep.dispatch(x, i, w)
                        ys.append(ep.combine(experts(h), h))
                elif mode == "fetch apart":  # the replicas fetched before the next collective is issued
                    ys = two_batch_moe(ep, bs, lambda h, reps: computed(h, *reps), [w1, w2],
                                       fetch=lambda h: pool.fetch(ep, h, [w1, w2], ["w1", "w2"]))
                else:
                    ys = two_batch_moe(ep, bs, experts, [w1, w2], overlap=mode == "overlap")
                sum((y * p[0][3]).sum() for y, p in zip(ys, probs)).backward()
                return [y.detach() for y in ys] + [t.grad for x, _, w in bs for t in (x, w)] + [w1.grad, w2.grad]

            ref = run("plain")
            for mode in ("serial", "overlap", "fetch apart"):
                got = run(mode)
                for i, (a, b) in enumerate(zip(ref, got)):
                    assert torch.equal(a, b), (rt.rank, transport, kind, mode, i, float((a - b).abs().max()))
            # the values: the dense float64 loop (SwiGLU experts) over each micro-batch's global batch
            for i, (mine, (gx, gidx, gw, *_), sl) in enumerate(probs):
                y = dense_reference_swiglu(gx.double(), gidx, gw.double(), W1, W2, apply_weights)
                tol = 1e-12 if _dt(rt) == torch.float64 else 2e-5
                torch.testing.assert_close(ref[i].cpu().double(), y[sl], atol=tol, rtol=tol)
            ep.close()


def dense_reference_swiglu(x, idx, w, W1, W2, apply_weights):
    y = torch.zeros_like(x)
    for k in range(idx.shape[1]):
        for e in range(W1.shape[0]):
            sel = idx[:, k] == e
            if sel.any():
                xs = x[sel] * w[sel, k, None] if apply_weights == "dispatch" else x[sel]
                g, u = (xs @ W1[e]).chunk(2, -1)
                o = (F.silu(g) * u) @ W2[e]
                y[sel] = y[sel] + (o if apply_weights == "dispatch" else w[sel, k, None] * o)
    return y


def case_overlap_stress_with_random_delays(rt):
    """Overlapped steps (1000 on CUDA, 200 on 2 CPU ranks, 60 on more) with random delays in the experts (the
    compute stream or thread) and, on CUDA, on the communication stream before calls: every step's outputs are
    the serial schedule's."""
    R = rt.world_size
    E, K, H, S, Fd = 2 * R, 2, 8, 12, 4
    ep = _ep(rt, transports(rt)[0], E, K, H, S)
    pool = moonep.ReplicaPool()
    gen = torch.Generator().manual_seed(5)
    home = slice(rt.rank * ep.epn, (rt.rank + 1) * ep.epn)
    w1 = (torch.randn(E, H, 2 * Fd, generator=gen, dtype=torch.float64)[home]).to(rt.device, _dt(rt)).requires_grad_()
    w2 = (torch.randn(E, Fd, H, generator=gen, dtype=torch.float64)[home]).to(rt.device, _dt(rt)).requires_grad_()
    plain = _swiglu_experts(ep, pool, w1, w2)
    rnd = random.Random(rt.rank)

    def slow(h):  # the compute stream (CUDA) or the thread (CPU) late by a random time
        if h.tokens.is_cuda:
            torch.cuda._sleep(int(rnd.random() * 2e6))
        else:
            time.sleep(rnd.random() * 2e-3)
        return plain(h)

    cuda = rt.device.type == "cuda"
    for step in range(1000 if cuda else 200 if R <= 2 else 60):  # CPU ranks beyond 2 share 2 cores in CI
        probs = [_problem(rt, 100 + 2 * step + i, E, K, H, S, ["hot", "zipf", "uniform"][step % 3])
                 for i in range(2)]
        outs = []
        for mode in ("overlap", "serial"):
            bs = [(p[0][0], p[0][1], p[0][2]) for p in probs]
            with torch.no_grad():
                if cuda and ep._overlap.chain.stream is not None and rnd.random() < 0.5:
                    with torch.cuda.stream(ep._overlap.chain.stream):  # the communication stream starts late
                        torch.cuda._sleep(int(rnd.random() * 2e6))
                elif rnd.random() < 0.5:
                    time.sleep(rnd.random() * 1e-3)
                outs.append(two_batch_moe(ep, bs, slow if mode == "overlap" else plain, overlap=mode == "overlap"))
        for a, b in zip(*outs):
            assert torch.equal(a, b), (rt.rank, step)
    ep.close()


def case_dropped_work_refuses_the_next_call_everywhere(rt):
    """A Work dropped without wait() (on one rank only, then on all): the next collective raises ValueError on
    every rank, naming async_op; the call after it works."""
    for transport in transports(rt):
        ep = _ep(rt, transport)
        (x, idx, w, _), _, _ = _problem(rt, 1, ep.num_experts, 2, 8, 12)
        work = ep.dispatch(x, idx, w, async_op=True)
        if rt.rank == rt.world_size - 1:
            del work  # the bug
        else:
            work.wait()
        expect_error(lambda: ep.dispatch(x, idx, w), "async_op: every Work must be waited for")
        h = ep.dispatch(x, idx, w)
        ep.combine(h.tokens, h, async_op=True)  # dropped on every rank
        expect_error(lambda: ep.dispatch(x, idx, w, async_op=True).wait(), "was dropped without wait()")
        h = ep.dispatch(x, idx, w, async_op=True).wait()
        torch.testing.assert_close(ep.combine(h.tokens, h), ep.combine(h.tokens, h, async_op=True).wait())
        ep.close()


def case_bad_async_arguments_are_refused_everywhere(rt):
    """async_op that is not a bool, or a previous_event on CPU tensors, on one rank: ValueError on every rank
    naming the argument; an error inside an async call (bad routing on one rank) surfaces at wait() on every
    rank; the instance stays usable."""
    for transport in transports(rt):
        ep = _ep(rt, transport)
        (x, idx, w, _), _, _ = _problem(rt, 1, ep.num_experts, 2, 8, 12)
        last = rt.rank == rt.world_size - 1
        # the bad rank raises at the call, the peers' async calls at wait()
        expect_error(lambda: _waited(ep.dispatch(x, idx, w, async_op=1 if last else True)), "async_op")
        if rt.device.type == "cpu":
            expect_error(lambda: ep.dispatch(x, idx, w, previous_event=object() if last else None),
                         "previous_event")
        bad = idx.clone()
        if last and bad.numel():
            bad[0, 0] = ep.num_experts  # out of range
        if rt.world_size > 1 or bad.numel():  # CUDA: flagged on device, raised by that call or a later one
            expect_error(lambda: (ep.dispatch(x, bad, w, async_op=True).wait(), ep.synchronize()), "topk_idx")
        h = ep.dispatch(x, idx, w, async_op=True).wait()
        assert h.tokens.shape == (ep.capacity, 8)
        ep.close()


def _waited(result):
    return result.wait() if isinstance(result, moonep.Work) else result


def case_async_calls_of_two_instances_interleave(rt):
    """Two ExpertParallel instances, their async calls interleaved and waited out of order: every result is
    the synchronous one."""
    transport = transports(rt)[0]
    a = _ep(rt, transport)
    (xa, ia, wa, _), _, _ = _problem(rt, 2, a.num_experts, 2, 8, 12)
    pending = a.dispatch(xa, ia, wa, async_op=True)
    b = _ep(rt, transport, K=1, H=4)  # a host collective made while a call is queued: runs after it
    rt.barrier()
    pending.wait()
    (xb, ib, wb, _), _, _ = _problem(rt, 4, b.num_experts, 1, 4, 12)
    ha_s, hb_s = a.dispatch(xa, ia, wa), b.dispatch(xb, ib, wb)
    want = (a.combine(ha_s.tokens * 2, ha_s), b.combine(hb_s.tokens * 3, hb_s))
    for _ in range(5):
        wa_, wb_ = a.dispatch(xa, ia, wa, async_op=True), b.dispatch(xb, ib, wb, async_op=True)
        hb = wb_.wait()
        cb = b.combine(hb.tokens * 3, hb, async_op=True)
        ha = wa_.wait()
        ca = a.combine(ha.tokens * 2, ha, async_op=True)
        assert torch.equal(cb.wait(), want[1]) and torch.equal(ca.wait(), want[0])
    a.close()
    b.close()


def case_close_and_synchronize_finish_queued_calls(rt):
    """synchronize() and close() wait for the queued async calls (no hang, no lost call)."""
    ep = _ep(rt, transports(rt)[0])
    (x, idx, w, _), _, _ = _problem(rt, 1, ep.num_experts, 2, 8, 12)
    works = [ep.dispatch(x, idx, w, async_op=True) for _ in range(3)]
    ep.synchronize()
    assert all(wk.is_completed() for wk in works)
    hs = [wk.wait() for wk in works]
    last = ep.combine(hs[-1].tokens, hs[-1], async_op=True)
    ep.close()
    assert last.is_completed()
    last.wait()


def case_async_calls_under_activation_checkpointing(rt):
    """An async dispatch and combine inside torch.utils.checkpoint (non-reentrant: with its saved-tensor hooks
    active the calls run in order on the caller's thread): outputs and gradients are the plain calls' bits."""
    from torch.utils.checkpoint import checkpoint

    ep = _ep(rt, transports(rt)[0])
    (x, idx, w, gy), _, _ = _problem(rt, 6, ep.num_experts, 2, 8, 12)

    def layer(x, w, async_op):
        if async_op:
            h = ep.dispatch(x, idx, w, async_op=True).wait()
            return ep.combine(torch.tanh(h.tokens) * 2, h, async_op=True).wait()
        h = ep.dispatch(x, idx, w)
        return ep.combine(torch.tanh(h.tokens) * 2, h)

    got = []
    for mode in ("plain", "checkpointed async"):
        xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = layer(xl, wl, False) if mode == "plain" else checkpoint(layer, xl, wl, True, use_reentrant=False)
        (y * gy).sum().backward()
        got.append([y.detach(), xl.grad, wl.grad])
    for a, b in zip(*got):
        assert torch.equal(a, b), rt.rank
    ep.close()


def case_async_pool_fetch_matches_sync(rt):
    """ReplicaPool.fetch(async_op=True): the replicas arrive while the caller goes on; expert_matmul's outputs
    and gradients are the synchronous fetch's bits."""
    R = rt.world_size
    E, K, H, S, Fd = 2 * R, 2, 8, 12, 4
    ep = _ep(rt, transports(rt)[0], E, K, H, S)
    home = slice(rt.rank * ep.epn, (rt.rank + 1) * ep.epn)
    gen = torch.Generator().manual_seed(3)
    w1 = torch.randn(E, H, 2 * Fd, generator=gen, dtype=torch.float64)[home].to(rt.device, _dt(rt)).requires_grad_()
    w2 = torch.randn(E, Fd, H, generator=gen, dtype=torch.float64)[home].to(rt.device, _dt(rt)).requires_grad_()
    (x, idx, w, gy), _, _ = _problem(rt, 8, E, K, H, S)
    got = []
    for async_op in (None, True):
        pool = moonep.ReplicaPool()
        w1.grad = w2.grad = None
        h = ep.dispatch(x, idx, w)
        r1, r2 = pool.fetch(ep, h, [w1, w2], ["w1", "w2"], async_op=async_op)
        g, u = moonep.expert_matmul(h.tokens, h.cu_seqlens, w1, r1).chunk(2, -1)
        y = ep.combine(moonep.expert_matmul(F.silu(g) * u, h.cu_seqlens, w2, r2), h)
        (y * gy).sum().backward()
        got.append([y.detach(), w1.grad, w2.grad])
    for a, b in zip(*got):
        assert torch.equal(a, b), rt.rank
    pool = moonep.ReplicaPool()
    h = ep.dispatch(x, idx, w)
    pool.fetch(ep, h, [w1], ["w1"], async_op=True)  # never read: no refusal (only Replicas.weights reads it)
    ep.dispatch(x, idx, w)
    ep.close()


def _compiled_two_batches(ep, pool, w1, w2, async_op):
    """Two micro-batches in one compiled step (fullgraph): with ``async_op``, B's dispatch and A's replica fetch run
    while A's experts wait, A's combine while B's experts compute (``moonep::<op>_async`` and ``wait_work``)."""
    def experts(h, r1, r2):
        g, u = moonep.expert_matmul(h.tokens, h.cu_seqlens, w1, r1).chunk(2, -1)
        return moonep.expert_matmul(F.silu(g) * u, h.cu_seqlens, w2, r2)

    def step(xa, ia, wa, xb, ib, wb):
        ha = ep.dispatch(xa, ia, wa)
        work_b = ep.dispatch(xb, ib, wb, async_op=async_op)
        ra = pool.fetch(ep, ha, [w1, w2], ["w1", "w2"], async_op=async_op)  # waited at its first read
        oa = experts(ha, *ra)
        hb = work_b.wait() if async_op else work_b
        work_a = ep.combine(oa, ha, async_op=async_op)
        ob = experts(hb, *pool.fetch(ep, hb, [w1, w2], ["w1", "w2"]))
        ya = work_a.wait() if async_op else work_a
        return ya, ep.combine(ob, hb)
    return step


def _compile_backends(rt):
    """Inductor, whose scheduling the ranks must agree on (aot_eager's compiled async step is compared with
    eager's in one process: tests/unit/test_ops.py).  One rank has no peer to disagree with: the compile time
    is paid at several ranks only."""
    if rt.world_size == 1:
        raise SkipCase("one rank: tests/unit/test_ops.py compiles the async step in one process")
    return ["inductor"]


def _expert_weights(rt, ep, seed, H, Fd):
    """This rank's home experts of a SwiGLU layer (``w1 [epn, H, 2Fd]``, ``w2 [epn, Fd, H]``), requiring grad."""
    gen = torch.Generator().manual_seed(seed)
    home = slice(rt.rank * ep.epn, (rt.rank + 1) * ep.epn)
    E = ep.num_experts
    w1 = torch.randn(E, H, 2 * Fd, generator=gen, dtype=torch.float64)[home].to(rt.device, _dt(rt)).requires_grad_()
    w2 = torch.randn(E, Fd, H, generator=gen, dtype=torch.float64)[home].to(rt.device, _dt(rt)).requires_grad_()
    return w1, w2


def _async_matches_serial(rt, fns, probs, w1, w2, tag) -> None:
    """One step of the compiled step without (``fns[False]``) and with (``fns[True]``) async_op on the same
    micro-batches ``probs``: outputs and gradients bitwise equal."""
    got = []
    for async_op in (False, True):
        w1.grad = w2.grad = None
        xs = [(p[0].clone().requires_grad_(), p[1], p[2].clone().requires_grad_()) for p in probs]
        ya, yb = fns[async_op](*xs[0], *xs[1])
        ((ya * probs[0][3]).sum() + (yb * probs[1][3]).sum()).backward()
        # copies, the inputs' gradients too: the other step's CUDA graph replays overwrite this one's outputs
        got.append([t.clone() for t in (ya.detach(), yb.detach(), w1.grad, w2.grad)]
                   + [t.grad.clone() for x, _, w in xs for t in (x, w)])
    for i, (a, b) in enumerate(zip(*got)):
        assert torch.equal(a, b), (rt.rank, tag, i, float((a - b).abs().max()))


def case_compiled_async_step_matches_serial(rt):
    """async_op=True under torch.compile (dispatch, combine, the pool's fetch; reduce_grad and reduce_replicas):
    one graph without breaks, whose outputs and gradients are bitwise those of the same step compiled without
    async_op, with token counts that differ per rank (a rank without tokens) and change between steps."""
    import torch._dynamo

    E, K, H, S, Fd = 2 * rt.world_size, 2, 8, 12, 4
    ep = _ep(rt, transports(rt)[0], E, K, H, S)
    w1, w2 = _expert_weights(rt, ep, 5, H, Fd)
    gen = torch.Generator().manual_seed(5)
    for backend in _compile_backends(rt):
        torch._dynamo.reset()
        fns = {a: torch.compile(_compiled_two_batches(ep, moonep.ReplicaPool(), w1, w2, a), backend=backend,
                                fullgraph=True) for a in (False, True)}
        with eager_math.bitwise():  # (the two graphs fuse the layer's own math differently: eager's kernels)
            for seed in range(3):
                probs = [_problem(rt, 20 + seed + 7 * i, E, K, H, S, kind)[0]
                         for i, kind in enumerate(("hot", "zipf"))]
                _async_matches_serial(rt, fns, probs, w1, w2, (backend, seed))

        def reduces(h, g, home_g, rep_g, async_op):
            r = ep.reduce_grad(h, g, async_op=async_op)
            s_ = ep.reduce_replicas(h, home_g, rep_g, async_op=async_op)
            return (r.wait(), s_.wait()) if async_op else (r, s_)
        (x, idx, w, _), _, _ = _problem(rt, 9, E, K, H, S)
        h = ep.dispatch(x, idx, w)
        g = torch.randn(2 * ep.epn, 3, generator=gen, dtype=torch.float64).to(rt.device, _dt(rt))
        outs = [torch.compile(reduces, backend=backend, fullgraph=True)(h, g, g[:ep.epn] * 2, g[ep.epn:], a)
                for a in (False, True)]
        for a, b in zip(*outs):
            assert torch.equal(a, b), (rt.rank, backend)
    ep.close()


def case_compiled_async_under_cuda_graphs(rt):
    """CUDA: the compiled async step under CUDA graphs (mode="reduce-overhead"; while capturing, the async ops run
    in order on the captured stream): warm-up, recording and replays give the step compiled without async_op,
    bitwise."""
    if rt.device.type != "cuda":
        raise SkipCase("CUDA graphs need CUDA")
    import torch._dynamo

    E, K, H, S, Fd = 2 * rt.world_size, 2, 8, 12, 4
    ep = _ep(rt, "nvlink", E, K, H, S)
    w1, w2 = _expert_weights(rt, ep, 6, H, Fd)
    torch._dynamo.reset()
    fns = {a: torch.compile(_compiled_two_batches(ep, moonep.ReplicaPool(), w1, w2, a), mode="reduce-overhead",
                            fullgraph=True, dynamic=False) for a in (False, True)}
    probs = [_problem(rt, 40 + i, E, K, H, S, kind)[0] for i, kind in enumerate(("hot", "zipf"))]
    with eager_math.bitwise():
        for it in range(4):  # the same sizes each time: warm-up, recording, replays
            _async_matches_serial(rt, fns, probs, w1, w2, it)
    ep.close()


def case_cuda_graph_capture_after_async_calls(rt):
    """CUDA: after async calls and a side-stream pool fetch (collectives on several streams from then on), a
    dispatch and combine still capture into a CUDA graph, and its replays on new inputs give the eager bits."""
    if rt.device.type != "cuda":
        raise SkipCase("needs CUDA")
    from tests.harness.cuda_graph import capture

    E, K, H, S = 2 * rt.world_size, 2, 8, 12
    ep = _ep(rt, transports(rt)[0], E, K, H, S, zero_copy=True)
    pool = moonep.ReplicaPool()
    w1 = torch.randn(ep.epn, H, H, device=rt.device)
    probs = [_problem(rt, 30 + i, E, K, H, S) for i in range(3)]
    (x, idx, w, _), _, _ = probs[0]
    h = ep.dispatch(x, idx, w, async_op=True).wait()
    pool.fetch(ep, h, w1, "w1").weights()  # the pool's side stream
    assert ep._streams
    sx, sidx, sw = (torch.zeros(S, H, device=rt.device), torch.full((S, K), -1, device=rt.device),
                    torch.zeros(S, K, device=rt.device))

    def load(p):
        (x, idx, w, _), _, _ = p
        n = x.shape[0]
        sx.zero_()
        sidx.fill_(-1)
        sw.zero_()
        sx[:n], sidx[:n], sw[:n] = x, idx, w

    def step():
        h = ep.dispatch(sx, sidx, sw)
        return ep.combine(torch.tanh(h.tokens) * 2, h)

    load(probs[0])
    with torch.no_grad():
        graph, y = capture(step)
        for p in probs + probs[::-1]:
            load(p)
            graph.replay()
            got = y.clone()
            assert torch.equal(got, step()), rt.rank
    torch.cuda.synchronize()
    ep.close()


def case_cuda_streams_race_free_and_no_host_sync(rt):
    """(Last: the sanitizer stays on.)  CUDA: the overlapped schedule, forward and backward, under torch's CUDA
    stream sanitizer (reports a tensor used on two streams without an order between them; it sees torch's
    kernels, not CuPy's) and ``set_sync_debug_mode("error")`` (a host sync raises)."""
    if rt.device.type != "cuda":
        raise SkipCase("needs CUDA")
    from torch.cuda._sanitizer import enable_cuda_sanitizer

    R = rt.world_size
    E, K, H, S, Fd = 2 * R, 2, 8, 12, 4
    ep = _ep(rt, transports(rt)[0], E, K, H, S)
    pool = moonep.ReplicaPool()
    home = slice(rt.rank * ep.epn, (rt.rank + 1) * ep.epn)
    gen = torch.Generator().manual_seed(9)
    w1 = torch.randn(E, H, 2 * Fd, generator=gen)[home].to(rt.device).requires_grad_()
    w2 = torch.randn(E, Fd, H, generator=gen)[home].to(rt.device).requires_grad_()
    experts = _swiglu_experts(ep, pool, w1, w2)
    probs = [_problem(rt, 21 + i, E, K, H, S) for i in range(2)]
    bs = [(p[0][0].clone().requires_grad_(), p[0][1], p[0][2].clone().requires_grad_()) for p in probs]
    ys = two_batch_moe(ep, bs, experts, [w1, w2])  # warm: kernels compiled, buffers made
    (ys[0].sum() + ys[1].sum()).backward()
    enable_cuda_sanitizer()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            ys = two_batch_moe(ep, bs, experts, [w1, w2])
            (ys[0].sum() + ys[1].sum()).backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    ep.close()
