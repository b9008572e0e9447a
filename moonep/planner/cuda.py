"""GPU balanced planner and token layout: thin launchers for the "plan" program of
:mod:`moonep.cuda_runtime` (``csrc/planner.cu`` + ``csrc/layout.cu``).

Why CuPy RawModule: no build step for CPU installs (cupy is imported lazily, only for CUDA inputs),
and plain CUDA C lets the kernels mirror ``cpu.py`` / the torch layout statement by statement, which
is what makes the results bit-identical. The constants below mirror the kernels' (checked against the
sources by tests/unit/test_cuda_abi.py).

Host cost is what bounds small plans (the kernels take a few µs), so the launch path is lean:

* one ``torch.empty`` per plan (an int64 workspace holding every output and the layout's tables);
  the :class:`~moonep.planner.Plan` tensors are views of it, created on first access;
* one launch for the plan (``moonep_plan``; two more grid kernels only when R*E > 2**18) and one for
  a rank's token layout (``moonep_layout``);
* kernels are launched through the cached ``cupy.cuda.Function`` with an explicit stream (torch's
  current raw stream, wrapped once per stream by the runtime) and pre-built ``CIntptr`` arguments, so there is no
  per-call stream object, device context switch, DLPack hand-off or host sync. Everything is
  CUDA-graph capturable (the workspace comes from torch's allocator, so from the graph's pool);
* the first call of a (device, shape, dtype, slack) plan or (geometry, shape, rank, align, dtype) layout
  records its launch (function, grid, block, shared memory, constant argument tail) in ``_PLAN_FAST`` /
  ``_LAY_FAST``; later calls take a hot path of one dict lookup, one ``torch.empty`` and the launch
  (no imports, no validation branches, no per-call constant arguments).
"""
from __future__ import annotations

import os
import struct

import torch

from .. import cuda_runtime
from ..cuda_runtime import _cur_dev, _cur_stream

FLAG_INTS = 256       # csrc/planner.cu
HIST_BLOCKS = 64
F_C32, F_CAP, F_COLSUM, F_ASSIGN, F_DECL_SCALAR, F_DECL_PTR, F_FUSED, F_AMT_SMEM = 1, 2, 4, 8, 16, 32, 64, 128
# cfg word of moonep_layout / moonep_plan_layout (csrc/layout.cu CFG_*): bits 0-7 prefix blocks, then
LAY_B_SHIFT = 8       # bits 8-15: tile blocks
LAY_SUB_SHIFT = 16    # bits 16-31: copies per warp
LAY_T32 = 1 << 32     # topk is int32
LAY_C32 = 1 << 33     # moonep_plan_layout: counts are int32
LAY_STAGE = 1 << 34   # moonep_layout cfg: the plan's chunk tables staged in shared memory
LAY_PRE = 1 << 35     # moonep_plan_layout cfg: also the rank's slot experts and cu_seqlens after dst row
LAY_NW_SHIFT = 40     # bits 40-47: warps that own copies (0: all of the block's)
LAY_TILES = 48        # tile blocks aimed at (48 beat 16 on the H200; docs/performance.md); a profiling tool may set it
BIG = 1 << 18         # R*E above this: column sums and assignment as separate grid kernels
# The kernels' static shared memory (272 B in moonep_plan / moonep_plan_layout, more in profiling builds) counts
# against the same per-block limits as the dynamic bytes: the runtime keeps cuda_runtime.STATIC_SMEM below both
# (Kernels.smem_max, the opt-in threshold).
_GEO: dict = {}


def sized() -> bool:
    """Whether a workspace geometry was computed (its size depends on the kernel build: phase stamps)."""
    return bool(_GEO)


cuda_runtime.BUILD_SIZED.append(sized)  # a profiling build may not change under a sized workspace


def lay_tiles() -> int:
    """``LAY_TILES``, read once per layout geometry (cached there)."""
    return LAY_TILES


_i64 = torch.int64
_i32 = torch.int32
_empty = torch.empty
# Hot-path launch records (common calls only: no declaration, one block, kernel launched with the stream
# keyword). plan: (di, shape, dtype, slack) -> _PlanFast; layout: (geo, n, rank, align, dtype, di) -> tuple.
_PLAN_FAST: dict = {}
_LAY_FAST: dict = {}
_FUSED_FAST: dict = {}  # plan_layout_cuda: (di, shapes, dtypes, slack, rank, align) -> launch record
_NEW = object.__new__
_Plan = None


_LOADED = cuda_runtime.loaded("plan")


def _dev(di: int) -> cuda_runtime.Kernels:
    """The plan program's kernels on device di (compiled and loaded on first use)."""
    d = _LOADED.get(di)
    return d if d is not None else cuda_runtime.kernels("plan", di)


class _Geo:
    """Workspace layout (int64 words) of one (R, E, int32-counts); mirrors ``ws_layout`` in csrc/planner.cu."""

    def __init__(self, R: int, E: int, c32: bool):
        self.R, self.E, self.epn, self.c32 = R, E, E // R, c32
        o = 0

        def take(n):
            nonlocal o
            o += n
            return o - n
        self.A, self.rx, self.rs, self.rc = take(E * R), take(E), take(R), take(R)
        self.L, self.rem, self.amt, self.cst = take(E), take(E), take(E), take(2 * E)
        self.crk, self.cseg, self.err, self.flags = take(E), take((E + 2) // 2), take(1), take(FLAG_INTS // 2)
        self.pre, self.hist, self.c64 = take(E), take(HIST_BLOCKS * E // 2), take(R * E if c32 else 0)
        # profiling builds (MOONEP_PLAN_CLOCKS / _STAMPS): 32 words of phase stamps per block of a fused launch
        prof = cuda_runtime.profile_switch("MOONEP_PLAN_CLOCKS") or cuda_runtime.profile_switch("MOONEP_PLAN_STAMPS")
        self.stamps = take(32 * (FLAG_INTS // 2) if prof else 0)
        self.words = o
        self.big = R * E > BIG
        self.nt = min(1024, max(128, 1 << (E - 1).bit_length()))
        # + 128: kneed (planner.cu) reads 16 psum words unconditionally, past the last rank's
        self.smem = (8 * (2 * E + R) + 4 * (E + 4 * R + 2 + self.epn) + R + 15) // 16 * 16 + 128
        self.smem_amt = self.smem + 8 * E   # F_AMT_SMEM: the fill's amounts in shared memory too
        nw = 32  # layout: warps per block, so that per-warp expert counters fit in shared memory
        while nw > 2 and (16 + 2 * nw) * E > 48 * 1024:
            nw //= 2
        self.lay_nw = nw
        self.lay_smem = max((16 + 2 * nw) * E, nw * 256)
        self.lay_smem_stage = max((44 + 2 * nw) * E + 16, nw * 256)  # + staged chunk tables (LAY_STAGE)
        self.lay: dict = {}
        self.fused: dict = {}
        self.args: dict = {}

    def view(self, ws: torch.Tensor, name: str):
        R, E = self.R, self.E
        if name == "assignment":
            return ws[self.A:self.A + E * R].view(E, R)
        if name == "replica_experts":
            return ws[self.rx:self.rx + E].view(R, self.epn)
        if name == "replica_source":
            return ws[self.rs:self.rs + R]
        if name == "recv_counts":
            return ws[self.rc:self.rc + R]
        if name == "expert_counts":
            return ws[self.L:self.L + E]
        if name == "error":
            return ws[self.err:self.err + 1].view(torch.int32)[0]
        if name == "counts":
            return ws[self.c64:self.c64 + R * E].view(R, E)
        raise AttributeError(name)

    def layout_cfg(self, n: int, rank0: bool):
        """(grid, cfg) of moonep_layout for n copies, or None if n is too large for the kernel."""
        key = (n, rank0)
        v = self.lay.get(key)
        if v is None:
            nw = self.lay_nw
            per_warp = -(-n // (nw * lay_tiles()))   # aim at ~LAY_TILES tile blocks
            sub = max(32, (per_warp + 31) // 32 * 32)
            if nw * sub > 32768:
                sub = 32768 // nw
            B = -(-n // (nw * sub))
            P = 0 if rank0 else min(-(-self.E // 32), 128)
            v = None if B > HIST_BLOCKS else (P + B, P | (B << LAY_B_SHIFT) | (sub << LAY_SUB_SHIFT))
            self.lay[key] = v
        return v

    def fused_cfg(self, n: int, rank0: bool, smem_max: int):
        """(grid, cfg, threads, smem) of moonep_plan_layout for n copies, or None (too large: two launches).

        Unlike moonep_layout's, the layout blocks here count, publish and build their prefixes while the
        plan block runs, so many blocks cost nothing on the critical path: up to HIST_BLOCKS tile blocks of
        the plan's thread count, each warp owning as few rounds of 32 copies as that allows (pass 2, the part
        after the plan, is then one or two rounds)."""
        key = (n, rank0, smem_max)
        v = self.fused.get(key)
        if v is None and key not in self.fused:
            E, nt = self.E, self.nt
            nw = nt // 32
            while nw > 1 and (44 + 2 * nw) * E + 16 > smem_max:  # staged tables + per-warp counters
                nw //= 2
            P = 0 if rank0 else min(-(-E // 32), 128)
            bmax = min(HIST_BLOCKS, FLAG_INTS // 2 - 2 - P)  # i64 flags: counter, plan done, one per block
            smem = max(self.smem_amt, (44 + 2 * nw) * E + 16, nt // 32 * 256)
            v = None
            if bmax >= 1 and smem <= smem_max:
                sub = 32 * -(-n // (nw * 32 * bmax))
                B = -(-n // (nw * sub))
                if nw * sub <= 32768 and B <= bmax:  # per-warp counters are 16-bit
                    v = (1 + P + B, P | (B << LAY_B_SHIFT) | (sub << LAY_SUB_SHIFT) | (nw << LAY_NW_SHIFT) | LAY_STAGE,
                         nt, smem)
            self.fused[key] = v
        return v


def _geo(R: int, E: int, c32: bool) -> _Geo:
    key = (R, E, c32)
    g = _GEO.get(key)
    if g is None:
        g = _GEO[key] = _Geo(R, E, c32)
    return g


def _int_input(t: torch.Tensor):
    """(t as a contiguous int32 or int64 tensor (other dtypes become int64), its dtype)."""
    dt = t.dtype
    if dt is not _i64 and dt is not _i32:
        t, dt = t.to(_i64), _i64
    if not t.is_contiguous():
        t = t.contiguous()
    return t, dt


def _guard(di: int):
    return torch._C._cuda_getDevice() != di


def _plan_cls():
    global _Plan
    from .plan import Plan
    _Plan = Plan
    return Plan


def plan_cuda(counts: torch.Tensor, slack: float, tokens_per_rank=None, topk=None):
    """counts int32/int64 [R, E] on CUDA -> Plan on the same device, no host synchronisation."""
    if tokens_per_rank is None:  # hot path: one dict lookup, one torch.empty, one launch, no imports
        di = counts.get_device()
        f = _PLAN_FAST.get((di, counts.shape, counts.dtype, slack))
        if f is not None and _cur_dev() == di and counts.is_contiguous():
            fn, grid, block, smem, streams, words, device, geo, tail, arg, keep, dev = f
            ws = _empty(words, dtype=_i64, device=device)
            ptr = _cur_stream(di)
            st = streams.get(ptr)
            if st is None:
                st = dev.stream(ptr)
            fn(grid, block, (arg(counts.data_ptr()), arg(ws.data_ptr())) + tail, smem, st)
            p = _NEW(_Plan)
            d = p.__dict__
            d["_ws"], d["_geo"], d["slack"] = ws, geo, slack
            if keep:
                d["counts"] = counts
            return p
    return _plan_cuda(counts, slack, tokens_per_rank, topk)


def _plan_cuda(counts: torch.Tensor, slack: float, tokens_per_rank=None, topk=None):
    from .plan import ERR_ROWSUM, Plan, _declared

    di = counts.get_device()
    if _guard(di):
        with torch.cuda.device(di):
            return plan_cuda(counts, slack, tokens_per_rank, topk)
    counts, dt = _int_input(counts)
    R, E = counts.shape
    c32 = dt is _i32
    g = _geo(R, E, c32)
    d = _dev(di)
    ws = torch.empty(g.words, dtype=_i64, device=counts.device)
    wp = d.arg(ws.data_ptr())
    flags = (F_C32 if c32 else 0) | (F_CAP if slack > 0 else 0)
    decl_ptr, decl_scalar, decl_t = 0, 0, None
    if tokens_per_rank is not None:
        if isinstance(tokens_per_rank, int) and not g.big:
            flags |= F_DECL_SCALAR
            decl_scalar = tokens_per_rank * topk
        else:
            decl_t = _declared(tokens_per_rank, R, counts.device) * topk
            if not g.big:
                flags |= F_DECL_PTR
                decl_ptr = decl_t.data_ptr()
    if g.big:
        d.launch("moonep_colsum", (-(-E // 256),), (256,),
                 (d.arg(counts.data_ptr()), wp, d.c(R), d.c(E), d.c(int(c32))))
    else:
        flags |= F_COLSUM | F_ASSIGN
    psm = g.smem
    if g.smem_amt <= d.smem_max:
        flags |= F_AMT_SMEM
        psm = g.smem_amt
    key = (flags, slack, decl_scalar)
    tail = g.args.get(key)
    if tail is None:
        sb = struct.unpack("<q", struct.pack("<d", float(slack)))[0]
        tail = g.args[key] = (d.c(R), d.c(E), d.c(flags), d.c(sb))
    if psm > d.smem_max:
        raise ValueError(f"counts: R={R}, E={E} needs {psm} B of shared memory for the GPU planner, "
                         f"the device has {d.smem_max} B per block")
    d.need_smem("moonep_plan", psm)
    d.launch("moonep_plan", (1,), (g.nt,), (d.arg(counts.data_ptr()), wp) + tail + (d.arg(decl_ptr), d.c(decl_scalar)),
             psm)
    if tokens_per_rank is None and not g.big and d.lean and counts.dtype in (_i64, _i32):
        if _Plan is None:
            _plan_cls()
        _PLAN_FAST[(di, counts.shape, counts.dtype, slack)] = (
            d.fn["moonep_plan"], (1,), (g.nt,), psm, d.streams, g.words, d.device, g, tail + (d.c(0), d.c(0)),
            d.arg, not c32, d)
    if g.big:
        n = E * R
        d.launch("moonep_assign", (-(-n // 256),), (256,), (wp, d.c(R), d.c(E)))
    plan = Plan._cuda(ws, g, None if c32 else counts, float(slack))
    if g.big and decl_t is not None:  # device-side contract check, recorded in plan.error
        bad = (counts.sum(1, dtype=_i64) != decl_t).any()
        plan.error.bitwise_or_(bad.to(torch.int32) * ERR_ROWSUM)
    return plan


def layout_fast(plan, rank: int, topk_idx: torch.Tensor, align: int):
    """The hot path of :func:`layout_cuda`: a launch recorded by an earlier validated call with the same
    geometry, shape, rank, align, dtype and device (so the argument checks it passed hold again), else None."""
    g = plan._geo
    ws = plan._ws
    di = ws.get_device()
    f = _LAY_FAST.get((g, topk_idx.shape, rank, align, topk_idx.dtype, di))
    if f is not None and topk_idx.get_device() == di and _cur_dev() == di and topk_idx.is_contiguous():
        fn, grid, block, smem, streams, device, oshape, tail, arg, c64off, dev = f
        out = _empty(oshape, dtype=_i64, device=device)
        wsp = ws.data_ptr()
        c = plan.__dict__.get("counts")
        cp = c.data_ptr() if c is not None else wsp + c64off
        ptr = _cur_stream(di)
        st = streams.get(ptr)
        if st is None:
            st = dev.stream(ptr)
        fn(grid, block, (arg(topk_idx.data_ptr()), arg(out.data_ptr()), arg(wsp), arg(cp)) + tail, smem, st)
        return out.unbind(0)
    return None


def layout_cuda(plan, rank: int, topk_idx: torch.Tensor, align: int):
    """(dst_rank, dst_row) int64 [s, K] of source ``rank`` from a CUDA plan, or None when the kernel
    does not cover the case (the caller falls back to torch ops)."""
    res = layout_fast(plan, rank, topk_idx, align)
    return res if res is not None else _layout_cuda(plan, rank, topk_idx, align)


def _layout_cuda(plan, rank: int, topk_idx: torch.Tensor, align: int):
    g = plan._geo
    ws = plan._ws
    di = ws.get_device()
    if topk_idx.get_device() != di:
        return None
    topk_idx, dt = _int_input(topk_idx)
    s, K = topk_idx.shape
    n = s * K
    cfg = g.layout_cfg(n, rank == 0)
    d = _dev(di)
    if cfg is None or g.lay_smem > d.smem_max:
        return None
    stage = g.lay_smem_stage <= d.smem_max
    lsm = g.lay_smem_stage if stage else g.lay_smem
    if _guard(di):
        with torch.cuda.device(di):
            return layout_cuda(plan, rank, topk_idx, align)
    out = torch.empty((2, s, K), dtype=_i64, device=ws.device)
    if n == 0:
        return out.unbind(0)
    d.need_smem("moonep_layout", lsm)
    grid, c = cfg
    if dt is torch.int32:
        c |= LAY_T32
    if stage:
        c |= LAY_STAGE
    a = d.arg
    tail = (a(n), d.c(g.R), d.c(g.E), d.c(rank), d.c(align), d.c(c))
    d.launch("moonep_layout", (grid,), (g.lay_nw * 32,),
             (a(topk_idx.data_ptr()), a(out.data_ptr()), a(ws.data_ptr()), a(plan.counts.data_ptr())) + tail,
             lsm)
    if d.lean and (dt is _i64 or dt is _i32) and isinstance(rank, int) and isinstance(align, int):
        _LAY_FAST[(g, topk_idx.shape, rank, align, dt, di)] = (
            d.fn["moonep_layout"], (grid,), (g.lay_nw * 32,), lsm, d.streams, d.device, (2, s, K), tail,
            d.arg, 8 * g.c64, d)
    return out.unbind(0)


_NONCE = [int.from_bytes(os.urandom(7), "little") | 1]  # 56-bit launch tags of moonep_plan_layout (never 0)


def _next_nonce() -> int:
    n = _NONCE[0] = (_NONCE[0] + 1) & 0xFFFFFFFFFFFFFF or 1
    return n


def plan_layout_cuda(counts: torch.Tensor, slack: float, rank: int, topk_idx: torch.Tensor, align: int):
    """Plan and source ``rank``'s token layout in ONE launch (``moonep_plan_layout``): the layout's
    counting overlaps the plan. Returns ``(plan, dst_rank, dst_row)``, or None when the case needs the
    separate kernels (R*E > 2**18, too many layout blocks, no copies, shared memory); the caller falls back.
    Arguments are validated by the caller."""
    di = counts.get_device()
    if topk_idx.get_device() != di or _guard(di):
        return None
    if counts.dtype is not _i64 and counts.dtype is not _i32:
        return None
    if topk_idx.dtype is not _i64 and topk_idx.dtype is not _i32:
        return None
    counts, topk_idx = counts.contiguous(), topk_idx.contiguous()
    R, E = counts.shape
    s, K = topk_idx.shape
    n = s * K
    c32 = counts.dtype is _i32
    g = _geo(R, E, c32)
    if g.big or n == 0:
        return None
    d = _dev(di)
    cfg = g.fused_cfg(n, rank == 0, d.smem_max)
    if cfg is None:
        return None
    grid, c, threads, smem = cfg
    d.need_smem("moonep_plan_layout", smem)
    buf, dst_rank, dst_row = _ws_and_out(g.words, s, K, counts.device, g.epn)
    flags = (F_C32 if c32 else 0) | (F_CAP if slack > 0 else 0) | F_COLSUM | F_ASSIGN | F_AMT_SMEM
    sb = struct.unpack("<q", struct.pack("<d", float(slack)))[0]
    c |= (LAY_T32 if topk_idx.dtype is _i32 else 0) | (LAY_C32 if c32 else 0) | LAY_PRE
    nonce = _next_nonce()
    a = d.arg
    mid = (d.c(R), d.c(E), d.c(flags), a(sb))
    tail = (a(n), d.c(rank), d.c(align), a(c))
    d.launch("moonep_plan_layout", (grid,), (threads,),
             (a(counts.data_ptr()), a(buf.data_ptr())) + mid + (a(topk_idx.data_ptr()),
                                                              a(buf.data_ptr() + 8 * g.words)) + tail + (a(nonce),), smem)
    if d.lean and type(slack) is float:
        if _Plan is None:
            _plan_cls()
        _FUSED_FAST[(di, counts.shape, counts.dtype, slack, topk_idx.shape, topk_idx.dtype, rank, align)] = (
            d.fn["moonep_plan_layout"], (grid,), (threads,), smem, d.streams, g.words, d.device, (s, K),
            g, mid, tail, d.arg, not c32, d)
    from .plan import Plan
    plan = Plan._cuda(buf, g, None if c32 else counts, float(slack))
    plan.__dict__["_pre"] = (rank, align, g.words + 2 * n)
    return plan, dst_rank, dst_row


def _pre_words(epn: int) -> int:
    """int64 words after dst row in a fused launch's buffer (LAY_PRE): the rank's slot experts (int64
    [2*epn]), then its cu_seqlens (int32 [2*epn + 1], padded to a word)."""
    return 2 * epn + epn + 1


def _ws_and_out(words: int, s: int, K: int, device, epn: int):
    """One allocation for a fused launch: int64 [words + 2*s*K + _pre_words(epn)], the plan's workspace (the
    plan keeps the whole buffer; its views are offsets from 0), dst rank and dst row (returned as [s, K]
    views), then slot experts and cu_seqlens. One ``torch.empty`` instead of two: each costs ~3.5 us of host
    time on the H200 machine, and at (256, 8, 8) the host time of a call is larger than its device time
    (h200x1_planner_host_breakdown_188c31c.json)."""
    buf = _empty(words + 2 * s * K + _pre_words(epn), dtype=_i64, device=device)
    return buf, buf.as_strided((s, K), (K, 1), words), buf.as_strided((s, K), (K, 1), words + s * K)


def plan_layout_fast(counts: torch.Tensor, slack: float, rank: int, topk_idx: torch.Tensor, align: int):
    """The hot path of :func:`plan_layout_cuda`: a launch recorded by an earlier validated call of the same
    kind (device, shapes, dtypes, slack, rank, align), else None. One ``torch.empty`` and one launch."""
    di = counts.get_device()
    f = _FUSED_FAST.get((di, counts.shape, counts.dtype, slack, topk_idx.shape, topk_idx.dtype, rank, align))
    if (f is None or topk_idx.get_device() != di or _cur_dev() != di or not counts.is_contiguous()
            or not topk_idx.is_contiguous()):
        return None
    fn, grid, block, smem, streams, words, device, sk, geo, mid, tail, arg, keep, dev = f
    s, K = sk
    n = s * K
    buf = _empty(words + 2 * n + _pre_words(geo.epn), dtype=_i64, device=device)
    p = buf.data_ptr()
    ptr = _cur_stream(di)
    st = streams.get(ptr)
    if st is None:
        st = dev.stream(ptr)
    fn(grid, block, (arg(counts.data_ptr()), arg(p)) + mid + (arg(topk_idx.data_ptr()), arg(p + 8 * words)) + tail
       + (arg(_next_nonce()),), smem, st)
    pl = _NEW(_Plan)
    d = pl.__dict__
    d["_ws"], d["_geo"], d["slack"], d["_pre"] = buf, geo, slack, (rank, align, words + 2 * n)
    if keep:
        d["counts"] = counts
    return pl, buf.as_strided(sk, (K, 1), words), buf.as_strided(sk, (K, 1), words + n)


def cu_seqlens_cuda(plan, rank, align: int):
    """int32 cu_seqlens of ``rank`` ([2*epn + 1]) or of every rank ([R, 2*epn + 1]) from a CUDA plan."""
    g = plan._geo
    ws = plan._ws
    di = ws.get_device()
    if _guard(di):
        with torch.cuda.device(di):
            return cu_seqlens_cuda(plan, rank, align)
    d = _dev(di)
    shape = (2 * g.epn + 1,) if rank is not None else (g.R, 2 * g.epn + 1)
    out = torch.empty(shape, dtype=torch.int32, device=ws.device)
    nthreads = 32 * (1 if rank is not None else g.R)  # a warp per rank
    d.launch("moonep_cu", (-(-nthreads // 128),), (128,),
             (d.arg(ws.data_ptr()), d.arg(out.data_ptr()), d.c(g.R), d.c(g.E), d.c(align),
              d.c(-1 if rank is None else rank)))
    return out


__all__ = ["plan_cuda", "layout_cuda", "layout_fast", "plan_layout_cuda", "plan_layout_fast", "cu_seqlens_cuda"]
