"""moonep's float32 slot GEMMs (moonep/experts_cuda.py, csrc/slot_gemm.cu) against a float64 loop: products and
weight gradients, home/replica weights with transposed views, empty slots, padding rows zero; the same bits on
every call; no host sync; CUDA-graph capture with new offsets at every replay.  The row moves around torch's
grouped GEMM (bf16/fp16) give the bits of the torch index/where ops they replace.  Skipped without CUDA."""
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from moonep import cuda_runtime, experts_cuda  # noqa: E402
from moonep import experts  # noqa: E402
from moonep.experts import _two_loop  # noqa: E402
from tests.harness.cuda_graph import capture  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_runtime.available(), reason="needs CuPy")]


def _offsets(counts, device="cuda"):
    return torch.tensor([0] + list(torch.tensor(counts).cumsum(0)), dtype=torch.int32, device=device)


def _ref(a, cu, ws):
    c = cu.tolist()
    out = torch.zeros(a.shape[0], ws[0].shape[-1], dtype=torch.float64)
    for j in range(len(c) - 1):
        out[c[j]:c[j + 1]] = a[c[j]:c[j + 1]].double().cpu() @ ws[j].double().cpu()
    return out


@pytest.mark.parametrize("counts,cap,D,N", [([3, 0, 70, 1], 90, 33, 65), ([0, 0, 0, 0], 8, 16, 16),
                                             ([130, 64, 0, 5, 17, 1], 300, 128, 200), ([1], 1, 1, 1)])
@pytest.mark.parametrize("transpose", [False, True])
def test_slot_gemm_matches_float64(counts, cap, D, N, transpose):
    g = torch.Generator().manual_seed(len(counts) + cap)
    G, nh = len(counts), (len(counts) + 1) // 2
    cu = _offsets(counts)
    a = torch.randn(cap, D, generator=g).cuda()
    a[cu[-1]:] = float("nan")  # padding rows may hold anything: they must not reach the output
    ws = [torch.randn(D, N, generator=g).cuda() for _ in range(G)]
    home, rep = torch.stack(ws[:nh]), torch.stack(ws[nh:]) if G > nh else torch.zeros(0, D, N, device="cuda")
    if transpose:  # the nn.Linear layout, read through strides
        home, rep = home.mT.contiguous().mT, rep.mT.contiguous().mT
    out = experts_cuda.slot_gemm(a, cu, home, rep)
    want = _ref(torch.nan_to_num(a), cu, ws)
    torch.testing.assert_close(out.double().cpu(), want, rtol=1e-5, atol=1e-4)
    assert torch.equal(out, experts_cuda.slot_gemm(a, cu, home, rep))  # the same bits every call
    assert not out[cu[-1]:].any()


def test_slot_wgrad_matches_float64():
    g = torch.Generator().manual_seed(1)
    counts, cap, D, N = [5, 0, 77, 1, 40], 140, 48, 70
    cu = _offsets(counts)
    a, gy = torch.randn(cap, D, generator=g).cuda(), torch.randn(cap, N, generator=g).cuda()
    gw = experts_cuda.slot_wgrad(a, gy, cu)
    c = cu.tolist()
    for j in range(len(counts)):
        want = a[c[j]:c[j + 1]].double().t() @ gy[c[j]:c[j + 1]].double()
        torch.testing.assert_close(gw[j].double(), want, rtol=1e-5, atol=1e-4)
    assert torch.equal(gw, experts_cuda.slot_wgrad(a, gy, cu))


def test_no_host_sync_and_cuda_graph_replay():
    g = torch.Generator().manual_seed(2)
    cap, D, N, G = 96, 32, 40, 4
    a = torch.randn(cap, D, generator=g).cuda()
    w = torch.randn(G, D, N, generator=g).cuda()
    gy = torch.randn(cap, N, generator=g).cuda()
    cu = _offsets([10, 20, 0, 30])
    experts_cuda.slot_gemm(a, cu, w), experts_cuda.slot_wgrad(a, gy, cu)  # compile and load outside capture
    torch.cuda.set_sync_debug_mode("error")
    try:
        experts_cuda.slot_gemm(a, cu, w)
        experts_cuda.slot_wgrad(a, gy, cu)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph, (out, gw) = capture(lambda: (experts_cuda.slot_gemm(a, cu, w), experts_cuda.slot_wgrad(a, gy, cu)),
                               warmup=1)
    for counts in ([10, 20, 0, 30], [0, 0, 96, 0], [1, 2, 3, 4], [0, 0, 0, 0]):
        cu.copy_(_offsets(counts))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, experts_cuda.slot_gemm(a, cu, w)), counts
        assert torch.equal(gw, experts_cuda.slot_wgrad(a, gy, cu)), counts


def test_expert_matmul_float32_uses_the_kernels():
    """The float32 expert GEMM on CUDA ("auto") equals the per-slot cuBLAS loop up to rounding."""
    g = torch.Generator().manual_seed(3)
    epn, D, N, cap = 3, 24, 36, 64
    cu = _offsets([5, 9, 0, 11, 0, 20])
    a = torch.randn(cap, D, generator=g).cuda()
    home, rep = torch.randn(epn, D, N, generator=g).cuda(), torch.randn(epn, D, N, generator=g).cuda()
    got = experts_cuda.slot_gemm(a, cu, home, rep)
    want = _two_loop(a, cu, home, rep)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_slot_sums_fixed_order_and_bad_operands_refused():
    """The bias-gradient sums (slot_sums) are float32 sums in a fixed order: equal to a float64 reference
    and the same bits on every call, bf16 input included; mismatched operands raise ValueError, a CPU cu
    is moved to the rows' device."""
    g = torch.Generator().manual_seed(4)
    counts, cap, N = [3, 0, 200, 1, 57], 300, 40
    cu = _offsets(counts)
    for dt in (torch.float32, torch.bfloat16):
        gy = torch.randn(cap, N, generator=g).to(dt).cuda()
        got = experts_cuda.slot_sums(gy, cu)
        c = cu.tolist()
        want = torch.stack([gy[c[j]:c[j + 1]].double().sum(0) for j in range(len(counts))])
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
        assert all(torch.equal(got, experts_cuda.slot_sums(gy, cu)) for _ in range(3))
    a = torch.randn(cap, 16, generator=g).cuda()
    w = torch.randn(len(counts), 16, 8, generator=g).cuda()
    assert torch.equal(experts_cuda.slot_gemm(a, cu.cpu(), w), experts_cuda.slot_gemm(a, cu, w))
    for bad, name in ((w.bfloat16(), "w_home"), (w[:, :8], "w_home"), (w[:3], "w_home, w_rep")):
        with pytest.raises(ValueError, match=name):
            experts_cuda.slot_gemm(a, cu, bad)


@pytest.mark.skipif(experts._GMM is None, reason="no grouped GEMM in this torch")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("counts,cap", [([5, 9, 0, 11, 0, 20], 64), ([7, 3, 0, 0, 0, 0], 16), ([0, 0, 0, 4, 0, 9], 13),
                                        ([0] * 6, 8)])
@pytest.mark.parametrize("D,N,sliced", [(32, 48, False), (24, 40, True)])
def test_row_moves_equal_the_torch_ops(monkeypatch, dtype, counts, cap, D, N, sliced):
    """Home/replica products (``_two_grouped``), their weight gradients (``_wgrad_grouped``) and one-tensor slot
    products (``_rows_grouped``) with moonep's row kernels equal, bit for bit, the same GEMMs with torch's
    index_select/where moves (empty replica slots, all-empty steps and padding rows included; rows read
    through a column slice: a row stride other than D and a storage offset); padding rows are zero."""
    g = torch.Generator().manual_seed(len(counts) + cap)
    epn = 3
    cu = _offsets(counts)
    a = torch.randn(cap, D + 8 * sliced, generator=g).to(dtype).cuda()[:, 8 * sliced:]  # (16-byte aligned)
    gy = torch.randn(cap, N, generator=g).to(dtype).cuda()
    home = torch.randn(epn, D, N, generator=g).to(dtype).cuda()
    rep = torch.randn(epn, D, N, generator=g).to(dtype).cuda()

    def run():
        return [experts._two_grouped(a, cu, home, rep), *experts._wgrad_grouped(a, gy, cu, epn),
                experts._rows_grouped(a, cu, torch.cat([home, rep]))]

    got = run()
    with monkeypatch.context() as m:
        m.setattr(experts_cuda, "loadable", lambda t: False)
        want = run()
    for i, (x, y) in enumerate(zip(got, want)):
        assert torch.equal(x, y), i
    assert not got[0][sum(counts):].any() and not got[3][sum(counts):].any()
