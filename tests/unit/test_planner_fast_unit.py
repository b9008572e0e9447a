"""The fused planner launch's hot path (moonep/planner/cuda.py plan_layout_fast), checked without a GPU: a
recorded launch is replayed against a recording kernel, on CPU tensors. It must allocate one buffer, hand
the kernel its start (workspace) and the address after the workspace (outputs), and return dst rank and
dst row as the [s, K] views the kernel writes, and the rank's slot experts and cu_seqlens after them as the
views ``moonep.layout`` returns."""
import types

import torch

from moonep.planner import cuda


class _Rec:
    def __init__(self):
        self.calls = []

    def __call__(self, grid, block, args, smem, stream):
        self.calls.append((grid, block, args, smem, stream))


def test_plan_layout_fast_one_buffer(monkeypatch):
    monkeypatch.setattr(cuda, "_cur_dev", lambda: -1)  # CPU tensors: get_device() == -1
    monkeypatch.setattr(cuda, "_cur_stream", lambda di: 1234)
    monkeypatch.setattr(cuda, "_FUSED_FAST", {})
    cuda._plan_cls()
    R, E, s, K, words = 2, 8, 3, 2, 50
    counts = torch.zeros(R, E, dtype=torch.int64)
    topk = torch.zeros(s, K, dtype=torch.int64)
    fn, geo = _Rec(), types.SimpleNamespace(R=R, E=E, epn=E // R)
    mid, tail = ("R", "E", "flags", "sb"), ("n", "rank", "align", "cfg")
    cuda._FUSED_FAST[(-1, counts.shape, counts.dtype, 0.0, topk.shape, topk.dtype, 1, 1)] = (
        fn, (7,), (256,), 999, {1234: "stream"}, words, counts.device, (s, K), geo, mid, tail, int, True, None)
    plan, dr, dw = cuda.plan_layout_fast(counts, 0.0, 1, topk, 1)
    (grid, block, args, smem, st), = fn.calls
    buf = plan._ws
    p = buf.data_ptr()
    assert (grid, block, smem, st) == ((7,), (256,), 999, "stream")
    assert args[:6] == (counts.data_ptr(), p) + mid and args[6:8] == (topk.data_ptr(), p + 8 * words)
    assert args[8:12] == tail and args[12] != 0  # the launch's nonce
    epn = E // R
    assert buf.numel() == words + 2 * s * K + 3 * epn + 1 and plan._geo is geo and plan.counts is counts
    assert plan._pre == (1, 1, words + 2 * s * K)  # (rank, align, word offset of the slot experts)
    assert dr.shape == dw.shape == (s, K) and dr.is_contiguous() and dw.is_contiguous()
    assert dr.data_ptr() == p + 8 * words and dw.data_ptr() == p + 8 * (words + s * K)
    buf[words:words + 2 * s * K].copy_(torch.arange(2 * s * K))  # what the kernel writes: dst rank, then dst row
    assert torch.equal(dr, torch.arange(s * K).view(s, K))
    assert torch.equal(dw, torch.arange(s * K, 2 * s * K).view(s, K))
    # then slot experts (int64 [2*epn]) and cu_seqlens (int32 [2*epn + 1]), as the kernel writes them
    from moonep.layout import cu_seqlens, slot_experts

    o = words + 2 * s * K
    buf[o:o + 2 * epn].copy_(torch.arange(100, 100 + 2 * epn))
    buf.view(torch.int32)[2 * (o + 2 * epn):2 * (o + 2 * epn) + 2 * epn + 1].copy_(torch.arange(2 * epn + 1) * 3)
    assert torch.equal(slot_experts(plan, 1), torch.arange(100, 100 + 2 * epn))
    cu = cu_seqlens(plan, 1, align=1)
    assert cu.dtype == torch.int32 and torch.equal(cu, (torch.arange(2 * epn + 1) * 3).to(torch.int32))
    assert plan.launch_slots(1, 8)[1] is None and plan.launch_slots(0, 1) is None  # not written
    # another kind of call (here: another rank) has no record: the caller takes the validated path
    assert cuda.plan_layout_fast(counts, 0.0, 0, topk, 1) is None
