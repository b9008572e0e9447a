"""GPU planner: bit-identical to the CPU planner, no host sync, CUDA-graph capturable (needs CUDA + cupy)."""
import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("cupy")

from moonep.layout import cu_seqlens, token_destinations  # noqa: E402
from moonep.planner import plan_balanced  # noqa: E402
from tests.harness.planner_corpus import counts_from_topk, random_counts, routing, verify_plan  # noqa: E402
from tests.harness.cuda_graph import capture  # noqa: E402

FIELDS = ("assignment", "replica_experts", "replica_source", "recv_counts", "expert_counts")


def same(pc, pg):
    for f in FIELDS:
        a, b = getattr(pc, f), getattr(pg, f).cpu()
        assert a.dtype == b.dtype and torch.equal(a, b), f


def cases():
    rng = np.random.default_rng(0)
    out = []
    # epn > 32: the general fill (wfill_gen) and its merge re-sort of the donor
    for R, epn in [(1, 4), (2, 1), (3, 5), (8, 32), (16, 24), (64, 14), (64, 16), (1024, 8), (7, 16),
                   (2, 128), (2, 33), (3, 50), (4, 64), (5, 160), (1, 256)]:
        for fam in ["uniform", "zipf1.0", "zipf1.5", "zipf2.0", "hot", "theorem2", "dirichlet"]:
            out.append(random_counts(fam, R, epn, 8, 64, int(rng.integers(1 << 30))))
        c = np.zeros((R, R * epn), np.int64)
        c[:, -1] = 100
        out.append(c)  # all to one expert
        out.append(rng.integers(0, 1000, size=(R, R * epn)))
        out.append(np.zeros((R, R * epn), np.int64))
    for _ in range(200):
        R = int(rng.integers(1, 65))
        out.append(rng.integers(0, 30, size=(R, R * int(rng.integers(1, 17)))) ** int(rng.integers(1, 4)))
    for _ in range(40):  # few ranks, many experts each: fills that touch many experts (wfill_gen)
        R, epn = int(rng.integers(2, 7)), int(rng.integers(33, 200))
        c = rng.integers(0, 30, size=(R, R * epn)) ** int(rng.integers(1, 4))
        c[:, :epn] *= int(rng.integers(1, 20))  # rank 0's experts hot: donors give many experts
        out.append(c)
    return out


@pytest.mark.parametrize("slack", [0.0, 0.05, 0.5])
def test_bit_identical(slack):
    for c in cases():
        pc = plan_balanced(torch.from_numpy(c), slack=slack)
        for dt in (torch.int64, torch.int32):
            pg = plan_balanced(torch.from_numpy(c).to(dt).cuda(), slack=slack)
            same(pc, pg)
            assert int(pg.error) == 0
        verify_plan(pg, c, slack)


def test_layout_identical():
    for fam in ["zipf1.5", "theorem2", "hot"]:
        R, E, K, s = 8, 64, 4, 100
        tk = routing(fam, E, R, K, s, 3)
        tk[0, :7, 1] = -1
        c = torch.from_numpy(counts_from_topk(tk, E))
        pc, pg = plan_balanced(c), plan_balanced(c.cuda())
        for r in range(R):
            for al in (1, 16):
                a = token_destinations(pc, r, torch.from_numpy(tk[r]), al)
                b = token_destinations(pg, r, torch.from_numpy(tk[r]).cuda(), al)
                assert torch.equal(a[0], b[0].cpu()) and torch.equal(a[1], b[1].cpu())
                assert torch.equal(cu_seqlens(pc, r, al), cu_seqlens(pg, r, al).cpu())


@pytest.mark.parametrize("R,epn,K,s", [(8, 32, 8, 700), (64, 14, 16, 512), (16, 24, 8, 3000), (1024, 8, 16, 64)])
def test_layout_identical_many_tiles(R, epn, K, s):
    """Multi-block layout (several tiles, prefix blocks over earlier sources), int32 and int64 topk,
    repeated experts within a token and masked copies."""
    E = R * epn
    rng = np.random.default_rng(R + s)
    tk = rng.integers(0, E, size=(R, s, K))
    tk[:, :, 0] = rng.integers(0, 4, size=(R, s))      # hot experts: long runs inside tiles
    tk[rng.random(tk.shape) < 0.05] = -1
    c = torch.from_numpy(counts_from_topk(tk, E))
    for slack in (0.0, 0.1):
        pc, pg = plan_balanced(c, slack=slack), plan_balanced(c.cuda(), slack=slack)
        for r in sorted({0, 1, R // 2, R - 1}):
            for al, dt in ((1, torch.int64), (8, torch.int32)):
                a = token_destinations(pc, r, torch.from_numpy(tk[r]), al)
                b = token_destinations(pg, r, torch.from_numpy(tk[r]).to(dt).cuda(), al)
                assert torch.equal(a[0], b[0].cpu()) and torch.equal(a[1], b[1].cpu()), (r, al)
            b2 = token_destinations(pg, r, torch.from_numpy(tk[r]).cuda(), 1)  # flags re-armed: same again
            assert torch.equal(b2[1].cpu(), token_destinations(pc, r, torch.from_numpy(tk[r]), 1)[1])
        assert torch.equal(cu_seqlens(pc, None, 8), cu_seqlens(pg, None, 8).cpu())


def test_no_host_sync():
    c = torch.from_numpy(random_counts("zipf1.5", 64, 14, 16, 64, 1)).cuda()
    tk = torch.randint(0, 896, (256, 16), device="cuda")
    plan_balanced(c), token_destinations(plan_balanced(c), 3, tk, 8)  # compile / warm up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for slack in (0.0, 0.1):
            p = plan_balanced(c, slack=slack, tokens_per_rank=64, topk=16)
            token_destinations(p, 3, tk, 8)
            cu_seqlens(p, None, 8)
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_device_error_flags():
    c = torch.ones(2, 4, dtype=torch.int64, device="cuda")
    c[1, 2] = -3
    with pytest.raises(ValueError, match="non-negative"):
        plan_balanced(c).check()
    with pytest.raises(ValueError, match="row sums"):
        plan_balanced(torch.ones(2, 4, dtype=torch.int64, device="cuda"), tokens_per_rank=3, topk=1, validate=True)


def _replay_against_cpu(step, R, epn, K, s, src, fams):
    """Capture ``step(counts, topk) -> (plan, dst_rank, dst_row)`` (after two warm-up calls on a side stream)
    in a CUDA graph, then replay it on each family's routing of source rank ``src``: the plan and the
    destinations must equal the CPU planner's bit for bit."""
    E = R * epn
    static_c = torch.zeros(R, E, dtype=torch.int64, device="cuda")
    static_tk = torch.zeros(s, K, dtype=torch.int64, device="cuda")
    g, (plan, dr, dw) = capture(lambda: step(static_c, static_tk))
    for seed, fam in enumerate(fams):
        tk = routing(fam, E, R, K, s, seed)
        c = counts_from_topk(tk, E)
        static_c.copy_(torch.from_numpy(c))
        static_tk.copy_(torch.from_numpy(tk[src]))
        g.replay()
        torch.cuda.synchronize()
        pc = plan_balanced(torch.from_numpy(c))
        same(pc, plan)
        ref = token_destinations(pc, src, torch.from_numpy(tk[src]))
        assert torch.equal(ref[0], dr.cpu()) and torch.equal(ref[1], dw.cpu()), fam


@pytest.mark.parametrize("R,epn", [(8, 32), (64, 14)])
def test_cuda_graph_replay(R, epn):
    def step(c, tk):
        plan = plan_balanced(c)
        return (plan, *token_destinations(plan, 0, tk))

    _replay_against_cpu(step, R, epn, 8, 128, 0, ["uniform", "zipf2.0", "theorem2", "hot", "dirichlet"])


@pytest.mark.parametrize("R,epn,K,s", [(8, 32, 8, 700), (64, 14, 16, 512), (16, 24, 8, 3000), (3, 5, 2, 40),
                                       (2, 128, 8, 2048), (1, 64, 4, 300), (4, 100, 6, 900)])
def test_plan_and_destinations_one_launch(R, epn, K, s):
    """moonep_plan_layout (plan and layout in one launch) gives the CPU plan and layout bit for bit, for
    int32/int64 counts and topk, exact and slack plans, every kind of source rank, called back to back
    (its flags must re-arm) and on stale workspace memory; so do the source rank's slot experts and
    cu_seqlens, which the launch writes too (views of its buffer), and those of other ranks (a kernel)."""
    from moonep.layout import plan_and_destinations, slot_experts
    from moonep.planner.cuda import plan_layout_cuda

    E = R * epn
    rng = np.random.default_rng(R * 7 + s)
    tk = rng.integers(0, E, size=(R, s, K))
    tk[:, :, 0] = rng.integers(0, 4, size=(R, s))
    tk[rng.random(tk.shape) < 0.05] = -1
    c = torch.from_numpy(counts_from_topk(tk, E))
    junk = torch.full((1 << 20,), -1, dtype=torch.int64, device="cuda")  # leave non-zero memory behind
    del junk
    for slack in (0.0, 0.1):
        pc = plan_balanced(c, slack=slack)
        for r in sorted({0, 1, R // 2, R - 1} & set(range(R))):
            for al, cdt, tdt in ((1, torch.int64, torch.int64), (8, torch.int32, torch.int32)):
                tkr = torch.from_numpy(tk[r]).to(tdt).cuda()
                assert plan_layout_cuda(c.to(cdt).cuda(), slack, r, tkr, al) is not None  # the fused kernel ran
                for _ in range(2):
                    pg, dr, dw = plan_and_destinations(c.to(cdt).cuda(), r, tkr, slack=slack, align=al)
                    same(pc, pg)
                    a = token_destinations(pc, r, torch.from_numpy(tk[r]), al)
                    assert torch.equal(a[0], dr.cpu()) and torch.equal(a[1], dw.cpu()), (r, al, slack)
                    assert pg._pre is not None and pg._pre[:2] == (r, al)
                    for q in sorted({r, (r + 1) % R}):  # q == r: the launch's own output
                        assert torch.equal(cu_seqlens(pc, q, al), cu_seqlens(pg, q, al).cpu()), (q, r, al)
                        assert torch.equal(slot_experts(pc, q), slot_experts(pg, q).cpu()), (q, r)
                    assert torch.equal(cu_seqlens(pc, None, al), cu_seqlens(pg, None, al).cpu())


def test_plan_and_destinations_graph_replay():
    """One launch captured in a CUDA graph: replays reuse the launch's tag, so its flags must be re-armed
    by the kernel itself."""
    from moonep.layout import plan_and_destinations

    _replay_against_cpu(lambda c, tk: plan_and_destinations(c, 2, tk), 8, 32, 8, 256, 2,
                        ["uniform", "zipf2.0", "theorem2", "hot", "dirichlet", "uniform"])


def test_plan_and_destinations_hot_path(monkeypatch):
    """The recorded hot launch (one allocation: the plan's workspace, then dst rank and dst row as views)
    gives the CPU results; earlier calls' outputs stay intact, and writing into the returned destinations
    leaves the plan alone."""
    from moonep.layout import plan_and_destinations
    from moonep.planner import cuda

    monkeypatch.setattr(cuda, "_FUSED_FAST", {})
    R, epn, K, s = 8, 32, 8, 700
    E = R * epn
    kept = []
    for seed, fam in enumerate(["zipf1.5", "theorem2", "uniform"]):
        tk = routing(fam, E, R, K, s, seed)
        c = torch.from_numpy(counts_from_topk(tk, E))
        pc = plan_balanced(c)
        a = token_destinations(pc, 5, torch.from_numpy(tk[5]))
        for _ in range(3):  # the first call records the launch, the next ones take the hot path
            pg, dr, dw = plan_and_destinations(c.cuda(), 5, torch.from_numpy(tk[5]).cuda())
            assert dr.shape == dw.shape == (s, K) and dr.dtype == dw.dtype == torch.int64
            assert dr.is_contiguous() and dw.is_contiguous()
            kept.append((pc, a, pg, dr, dw))
    assert len(cuda._FUSED_FAST) == 1
    for pc, a, pg, dr, dw in kept:
        same(pc, pg)
        assert torch.equal(a[0], dr.cpu()) and torch.equal(a[1], dw.cpu())
    pc, a, pg, dr, dw = kept[-1]
    dr.fill_(-7)
    dw.fill_(-7)
    same(pc, pg)


def test_fused_plan_then_layout_kernel():
    """A plan from the one-launch kernel, given to token_destinations (moonep_layout, many more blocks) on
    memory left non-zero: the fused launch must leave every layout flag zeroed, as moonep_plan does (found
    in review: it zeroed only its own flags, so moonep_layout's later blocks could pass unwritten ones)."""
    from moonep.layout import plan_and_destinations

    R, epn, K, s = 64, 32, 8, 512
    E = R * epn
    tk = routing("zipf1.5", E, R, K, s, 11)
    c = torch.from_numpy(counts_from_topk(tk, E))
    pc = plan_balanced(c)
    for _ in range(3):
        junk = torch.full((1 << 22,), -1, dtype=torch.int64, device="cuda")  # leave non-zero memory behind
        del junk
        pg, _, _ = plan_and_destinations(c.cuda(), 0, torch.from_numpy(tk[0]).cuda())
        for r in (0, 5, R - 1):
            a = token_destinations(pc, r, torch.from_numpy(tk[r]))
            b = token_destinations(pg, r, torch.from_numpy(tk[r]).cuda())
            assert torch.equal(a[0], b[0].cpu()) and torch.equal(a[1], b[1].cpu()), r


def test_bit_identical_large_counts():
    """Counts too large for the 32-bit selections (and for int32 values): the int64 paths of the kernel."""
    rng = np.random.default_rng(7)
    for R, epn in [(8, 32), (64, 14), (3, 5), (100, 2)]:
        for hi in (1 << 33, 1 << 40):
            c = rng.integers(0, hi, size=(R, R * epn))
            c[0, :epn] = 0  # one cold rank (Theorem 2)
            for slack in (0.0, 0.05):
                pc = plan_balanced(torch.from_numpy(c), slack=slack)
                pg = plan_balanced(torch.from_numpy(c).cuda(), slack=slack)
                same(pc, pg)
                assert int(pg.error) == 0
                verify_plan(pg, c, slack)
