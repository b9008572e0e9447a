"""The nvlink backend: device-initiated, zero-copy dispatch and combine between GPUs of one node.

``ExpertParallel(..., transport="nvlink")`` (or ``"auto"`` on CUDA when every rank is on one node and the
GPUs reach each other) runs the data path through :class:`NVLinkBackend`, whose kernels (``csrc/route.cu``,
``dispatch.cu``, ``combine.cu``, ``replicas.cu``) write straight into the peers' memory (CUDA IPC):

    plan_step   validation, counts and routing flags on device -> ``moonep_gather`` (peer stores)
                -> ``layout.plan_and_destinations`` (plan + layout, one GPU kernel)
    dispatch    ``moonep_dispatch_send``: each token once per destination rank, into its first row there,
                with its row list, weights and epoch tags (in zero-copy mode the token's rows on the own
                rank are all written here, x read once); ``moonep_dispatch_expand``: after the data
                signal, copy first rows of tokens from peers into their other rows locally (each first
                row read once), zero unwritten rows
    combine     ``moonep_combine_reduce``: per received token, k-ordered fp32 sum of w*out, rounded to
                the wire dtype (the token dtype for bf16/fp16, fp32 for fp32: see moonep/combine.py) and
                pushed with 16-byte stores into ``back[me][src_token]`` on the source rank;
                ``moonep_combine_sum``: each source sums its rows from every destination rank, in rank
                order, from local memory

Fused kernels (``Tuning.fused``, default ``("route", "dispatch")``; ``()`` selects the two-kernel path above,
bit-identical):

    plan_step   ``moonep_route_gather``: one launch validates the routing (range, duplicates, finite
                weights), writes the masked int64 ids and fp32 weights, builds this rank's histogram and
                all-gathers [counts, s, flags] through peer stores into one half of a double-buffered area
                (no entry barrier: its data wait is the barrier)
    dispatch    ``moonep_dispatch_fused``: blocks [0, num_sms) push each token once per remote rank, in
                ``nch`` chunks of source tokens with a signal per chunk; the other blocks (every other SM;
                every SM on one rank, where there is nothing to push) write this rank's own tokens into
                their local rows and, chunk by chunk as the peers' signals arrive, expand the peers' first
                rows locally, one warp per (peer, token) found through the first-row list ``flist`` the
                senders write; it leaves ``tokfirst [R, S]``, the step's first row of every source token,
                through which ``moonep_combine_reduce`` walks tokens; rows nobody writes are zeroed in the
                same launch when ``align == 1`` (they are the rows past this rank's count), else by
                ``moonep_dispatch_zero`` after it (tags)
    fp8         ``dispatch_dtype=torch.float8_e4m3fn``: the same kernels read the float tokens and quantise
                them in registers into fp8 wire rows (``moonep.fp8``) wherever they would store a token row;
                the receivers move wire rows as bytes; no quantiser pass (csrc/dispatch.cu)
    combine     ``moonep_combine_fused``: blocks [0, 2*num_sms) reduce the tokens received from peers and
                push one partial per (token, rank), chunk by chunk (none on one rank); the other blocks
                compute, per chunk as it arrives, y for this rank's tokens in rank order, this rank's own
                partial computed on the spot (it never goes through memory)

Barriers: the counts gather of ``plan_step`` starts with an entry barrier (fused: ends with a data wait); the dispatch send that follows
it in the same step skips its own (every peer already finished reading the areas it writes).  Combine's
receive-back area is double-buffered by call parity, so combine needs no entry barrier: a peer can only
reach combine n+2 after my combine n+1 pushed, which follows my combine n's reads in stream order.
    prefetch    ``moonep_prefetch_push`` / ``_finish``: the home rank writes replica weights into the
                pools of the ranks it serves.  With ``out=`` (a persistent pool of the caller) ``_finish``
                copies only the filled replica slots, zeroes only the slots that became empty since the
                last call into the same ``out``, and copies the home half only when the home weights are
                not already ``out[:epn]``
    reduce_grad ``moonep_reduce_stage`` / ``_finish``: replica gradients staged in the own pool, the home
                rank reads and adds them in rank order

No step copies anything from the device to the host: kernels run on torch's current stream (so CUDA graph
capture records them), all sizes are static (``capacity`` rows), and waits on peers have a timeout.

Errors are reported *lazily*, without a host sync:

* a peer that does not signal within ``timeout`` seconds (dead, stalled, out of step) makes the waiting
  kernel record a fatal error in pinned host memory and every later kernel skip its work; the next call
  into this ``ExpertParallel`` (or :meth:`ExpertParallel.synchronize`, or ``close()``) raises
  :class:`moonep.MoonepError`.  After that the object is unusable.
* bad routing values (expert ids out of range, repeated experts, non-finite weights, a wrong
  ``num_global_tokens``) are detected on device: the step proceeds with such choices masked, and the next
  call (or ``synchronize()``) raises ``ValueError`` naming the rank, on every rank.  Shape, dtype and
  device errors are still raised immediately.

Zero-copy: with ``zero_copy=True`` ``h.tokens``/``h.weights`` are views of this rank's receive buffers.
The expert may write its output into ``h.tokens`` in place, and combine reads it there.  The views are
valid until the next ``dispatch`` of the same ``ExpertParallel``.  With ``zero_copy="auto"`` (default)
views are returned outside grad mode only (training keeps its own copies, so that several layers may share
one ``ExpertParallel`` and a backward reads its rows after later dispatches).  Both modes give bitwise
identical results.
"""
from __future__ import annotations

import contextlib
import functools
import weakref

import torch

from .. import cuda_runtime, fp8, layout
from ..config import Tuning, parse_fused
from ..errors import MoonepError, expect, fail
from ..guard import HEADER_WORDS, check_order_enabled
from ..handles import NVLinkStep
from ..replicas import forget_zero_slots
from ..transport.ipc import HostWords, SymmetricBuffer
from ..transport.order_board import OrderBoard
from . import nvlink_abi as abi
from .base import Backend
from .nvlink_token import Kept, StepToken

_DT = {torch.float32: abi.DT_F32, torch.bfloat16: abi.DT_BF16, torch.float16: abi.DT_F16}
_MAXR = abi.MAXR
_MAX_CHUNKS = abi.MAX_CHUNKS
_CTR_WORDS = abi.CTR_WORDS
_ES = {abi.DT_F32: 4, abi.DT_BF16: 2, abi.DT_F16: 2}
_ERR_INPUT = {abi.ERR_BAD_IDX: "topk_idx: expected expert ids in [-1, {E})",
              abi.ERR_DUP_IDX: "topk_idx: expected distinct experts per token",
              abi.ERR_NONFINITE: "topk_weights: expected finite values",
              abi.ERR_TOTAL: "num_global_tokens: expected the sum of tokens over ranks",
              abi.ERR_NONFINITE_X: "x: expected finite values (fp8 dispatch)"}
_GATHERS = ("moonep_gather", "moonep_route_gather")
_p = cuda_runtime.ptr   # kernel argument for a tensor's address (None: null)
_i64 = cuda_runtime.i64  # kernel argument for an int64 value
_i32 = cuda_runtime.i32  # kernel argument for an int value


@functools.cache
def _bytes() -> tuple:
    """The dispatch kernels' fp8 arguments that move rows as bytes (built at the first dispatch, after the launch
    probe chose the argument types)."""
    return _i32(-1), _i32(0), _i64(0), _p(None)


class _QuantInSend:
    """fp8 dispatch of a float ``x`` on NVLink: the dispatch kernels quantise it while sending (no wire rows
    in between).  ``x``: contiguous, 16-byte aligned, detached."""

    __slots__ = ("x", "pow2")

    def __init__(self, x, pow2: bool):
        self.x, self.pow2 = x, bool(pow2)


def nvlink_available(rt) -> tuple[bool, str]:
    """Whether this rank can use the NVLink transport (CUDA device, one node, CuPy, peer access)."""
    if rt.device.type != "cuda":
        return False, "not a CUDA device"
    if rt.local_world_size != rt.world_size:
        return False, "ranks span several nodes"
    try:
        import cupy  # noqa: F401
    except Exception as exc:  # pragma: no cover - depends on the machine
        cuda_runtime.warn_cupy_missing("the host transport instead of nvlink")  # else the fallback is silent
        return False, f"cupy not importable ({exc!r})"
    n = torch.cuda.device_count()
    used = sorted({r % n for r in range(rt.world_size)})
    me = rt.device.index
    for d in used:
        if d != me and not torch.cuda.can_device_access_peer(me, d):
            return False, f"no peer access from cuda:{me} to cuda:{d}"
    return True, ""


def _align(n: int, a: int = 256) -> int:
    return (n + a - 1) // a * a


def _vec(nbytes: int, *ptrs: int) -> int:
    for v in (16, 4):
        if nbytes % v == 0 and all(p % v == 0 for p in ptrs):
            return v
    return 2


class NVLinkBackend(Backend):
    """Symmetric buffers, kernels and the per-step operations of the nvlink backend for one
    :class:`moonep.ExpertParallel`.  Construction is collective."""

    name = "nvlink"
    step_type = NVLinkStep
    weight_dtypes = (torch.float32, torch.bfloat16, torch.float16)
    checks_backward_order = False
    lazy_input_errors = True   # a non-finite x of an fp8 dispatch joins the routing flags (no host sync)

    def __init__(self, ep, *, timeout: float, zero_copy="auto", tuning: Tuning = Tuning(), block: int = 512):
        R, K = ep.world_size, ep.topk
        expect(R <= _MAXR, "world_size", f"at most {_MAXR} ranks for the NVLink transport", R)
        expect(K <= 32, "topk", "at most 32 for the NVLink transport", K)
        expect(ep.dtype in _DT, "dtype", "float32, bfloat16 or float16 for the NVLink transport", ep.dtype)
        expect(zero_copy in ("auto", True, False), "zero_copy", '"auto", True or False', repr(zero_copy))
        self.ep, self.rank, self.R, self.K = ep, ep.rank, R, K
        self.S, self.H, self.E, self.epn, self.cap = ep.max_tokens, ep.hidden, ep.num_experts, ep.epn, ep.capacity
        expect(R * self.S < 2 ** 31 and self.cap < 2 ** 28, "max_tokens", "R*S below 2**31 and capacity below 2**28",
               (R * self.S, self.cap))
        self.device = ep.device
        self.dev_index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", self.dev_index)
        self.timeout = float(timeout)
        self.zero_copy = zero_copy
        props = torch.cuda.get_device_properties(self.device)
        self.sm_count = props.multi_processor_count
        self.num_sms = max(1, min(int(tuning.num_sms), self.sm_count))
        self.block = block
        self.dispatch_block = cuda_runtime.dispatch_threads()  # the fused dispatch's launch bounds
        # Fused kernels, chosen per stage (all bit-identical to the two-kernel path; Tuning.fused).  The fused
        # route and dispatch are the default; the fused combine measured slower (docs/performance.md).
        self.set_fused(tuning.fused)
        self.nch = max(1, min(int(tuning.chunks), _MAX_CHUNKS))
        # Blocks that drive NVLink in the fused kernels; the rest of the grid (every SM) does local HBM
        # work.  Combine's NVLink blocks also read ~K/R rows per row they push: twice the dispatch budget.
        # One rank has no peer to push to: every block does local work (the NVLink blocks would only idle,
        # and the local blocks' last round of tokens would run on fewer warps).
        self.grid_fused = max(self.sm_count, self.num_sms + 1)
        self.nnv_dispatch = self.num_sms if R > 1 else 0
        comb = tuning.combine_sms or 2 * self.num_sms
        self.nnv_combine = max(1, min(comb, self.grid_fused - 1)) if R > 1 else 0
        self.generation = 0
        self._token = StepToken(self.cap, K, R, self.S, self.epn)
        self.token_state_words = self._token.state_words
        self._closed = False
        self._gather_obj = ep.transport.all_gather_object
        self._barrier = lambda: self._gather_obj(None)
        # Collective-order headers through host shared memory (the kernels cannot tell ops apart).
        self.board = (OrderBoard(self.rank, R, self._gather_obj, timeout, HEADER_WORDS)
                      if check_order_enabled() and R > 1 else None)
        self.order_exchange = self.exchange_header
        self.es = torch.empty((), dtype=ep.dtype).element_size()
        self.E2 = self.E + 2
        # Combine's receive-back area: two halves of [R*S, H] rows in the token dtype (double-buffered by
        # call parity, no entry barrier).  fp32 expert outputs with 16-bit tokens need 4-byte rows: they use
        # the whole area with an entry barrier.  gwacc: per-choice weight gradients, two halves.
        self.acc_half = _align(R * self.S * self.H * self.es)
        self.gw_half = _align(R * self.S * K * 4)
        self._comb_parity = 0
        self._comb_barrier_next = False
        self._last_op = None
        self.profile = None  # a list to record (label, CUDA event) marks around every kernel (benchmarks)
        # -- main symmetric allocation ---------------------------------------------------------------
        sizes = dict(esig=R * 8, dsig=R * 8, ctr=_CTR_WORDS * 8, derr=16, gather=2 * R * self.E2 * 8,
                     recv=self.cap * self.H * self.es, w=self.cap * 4, tag=self.cap * 8,
                     meta=self.cap * K * 4, msrc=self.cap * 4, acc=2 * self.acc_half,
                     gwacc=2 * self.gw_half, csig=_MAX_CHUNKS * R * 8, flist=R * self.S * 4,
                     xbad=R * 8)  # fp8: the data epoch of each peer's last non-finite x (a kernel argument)
        self.off, total = {}, 0
        for name, n in sizes.items():
            self.off[name] = total
            total += _align(max(n, 1))
        torch.cuda.set_device(self.device)
        self._kernels = cuda_runtime.kernels("ep", self.dev_index)
        self.main = SymmetricBuffer(total, self.device, self.rank, R, self._gather_obj)
        self.herr = HostWords(4, self.device)
        self.recv = self.main.view(self.off["recv"], (self.cap, self.H), ep.dtype)
        # fp8 dispatch: the same area as [cap, wire_bytes(H)] bytes of wire rows (<= H * es: es >= 2 there)
        self.recv_wire = (self.main.view(self.off["recv"], (self.cap, fp8.wire_bytes(self.H)), torch.uint8)
                          if getattr(ep, "fp8", False) else None)
        self._xflag = torch.zeros(1, dtype=torch.int32, device=self.device)  # unfused route: a pair's non-finite bit
        self._xrep = torch.zeros(1, dtype=torch.int64, device=self.device)   # fp8: last data epoch of a recorded bad x
        self.wbuf = self.main.view(self.off["w"], (self.cap,), torch.float32)
        # the addresses of zero-copy outputs (rows, fp8 wire rows, weights): [recv, end of wbuf)
        self._views = (self.recv.data_ptr(), self.wbuf.data_ptr() + self.cap * 4)
        self.grad = None       # SymmetricBuffer for the backward of combine (dispatch of dy), lazy
        self._grad_views = {}
        self.pool = None       # SymmetricBuffer for replica weights / gradients, lazy
        self._pool_prev = {}   # out.data_ptr() -> (weakref(out), int64 [epn] replica table last written)
        # route_gather's histogram/flag/block-counter scratch (zero between calls)
        self._scratch = torch.zeros(self.E + 2, dtype=torch.int32, device=self.device)
        self._ctx = torch.zeros(abi.CTX_WORDS, dtype=torch.int64, device=self.device)
        self._write_ctx()
        self._barrier()

    # -- context ---------------------------------------------------------------------------------------
    def _write_ctx(self) -> None:
        """The kernels' context block (struct Ctx, csrc/common.cuh), from its declaration in nvlink_abi."""
        words = abi.ctx_words(
            rank=self.rank, R=self.R, S=self.S, K=self.K, H=self.H, cap=self.cap, E2=self.E2,
            timeout_ns=int(self.timeout * 1e9), ctr=self.main.ptr + self.off["ctr"],
            derr=self.main.ptr + self.off["derr"], herr=self.herr.device_ptr,
            **{f"off_{name}": self.off[name] for name in abi.CTX_OFFSETS},
            base=self.main.peer_ptrs[:self.R], gbase=self.grad.peer_ptrs[:self.R] if self.grad is not None else None,
            pbase=self.pool.peer_ptrs[:self.R] if self.pool is not None else None)
        self._ctx.copy_(torch.tensor(words, dtype=torch.int64))
        self._ctx_arg = _p(self._ctx)
        torch.cuda.synchronize(self.device)

    def mark(self, label: str) -> None:
        """With ``self.profile`` a list: record a CUDA event on the current stream, labelled (benchmarks)."""
        if self.profile is not None:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.profile.append((label, ev))

    def _launch(self, name: str, grid: int, args: tuple, block: int | None = None) -> None:
        if self.profile is not None:
            self.mark("gap")
        # the runtime's lean launch (no context managers when torch's current device is this backend's:
        # host time between the step's kernels is the "launch gaps" of bench_ep_gpu.py)
        self._kernels.launch(name, (max(1, grid),), (block or self.block,), (self._ctx_arg,) + tuple(args), 0, True)
        self._last_op = name
        if self.profile is not None:
            self.mark(name)

    def _grow(self, which: str, nbytes: int) -> None:
        """(Re)allocate a lazy symmetric buffer: collective, synchronising, outside graph capture."""
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"moonep: the NVLink {which} buffer is allocated on first use; run one step "
                               "(forward and backward) before capturing a CUDA graph")
        prev = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode(0)  # one-time setup, not part of the steady-state step
        try:
            torch.cuda.synchronize(self.device)
            old = getattr(self, which)
            new = SymmetricBuffer(nbytes, self.device, self.rank, self.R, self._gather_obj)
            if old is not None:
                old.close(barrier=self._barrier)
            setattr(self, which, new)
            if which == "grad":
                self._grad_views = {}
            self._write_ctx()
        finally:
            torch.cuda.set_sync_debug_mode(prev)

    def set_fused(self, stages) -> None:
        """Pick the fused kernels: a tuple of stages (see :class:`moonep.Tuning`), or a spec string "0"
        (none), "1" (all) or a comma list of route, dispatch, combine (benchmarks and tests switch them)."""
        if isinstance(stages, str):
            stages = parse_fused(stages)
        self.fused_route, self.fused_dispatch, self.fused_combine = (
            "route" in stages, "dispatch" in stages, "combine" in stages)

    # -- errors ----------------------------------------------------------------------------------------
    def check(self, inputs: bool = True) -> None:
        """Raise the error a kernel recorded (no CUDA call: a load from pinned host memory).

        Before launching, only fatal errors are checked (``inputs=False``): every rank must launch the same
        kernel sequence, and when a bad-input flag reaches the host differs between ranks. Bad-input errors
        are raised after the launches of a public call, so each rank raises at that call or a later one.
        """
        fatal = self.herr[0]
        if fatal:
            op = getattr(self, "op_label", None)  # set by ExpertParallel: the call that surfaced it
            at = f" (raised in {op}; recorded by that call's kernels or an earlier one's)" if op else ""
            raise MoonepError(f"rank {self.rank}: rank {fatal >> 8} did not signal within the timeout of "
                              f"{self.timeout:g}s (a peer died, stalled or called a different collective){at}; "
                              "this ExpertParallel cannot be used any more")
        bad = self.herr[1] if inputs else 0
        if bad:
            self.herr[1] = 0
            code, r = bad & 0xFF, bad >> 8
            what = next(m for b, m in _ERR_INPUT.items() if code & b).format(E=self.E)
            raise ValueError(f"{what} (on rank {r}; detected on device in an earlier step, whose results are "
                             "invalid)")

    def exchange_header(self, header):
        """Every rank's collective-order header (see :mod:`moonep.guard`, which calls this only when
        the check is on and R > 1, i.e. when the board exists), on the host."""
        return self.board.exchange(header, getattr(self.ep.transport, "current_op", "a collective"))

    def abandon_call(self, why: str) -> None:
        if self.board is not None:  # its headers: every later call of this instance is refused
            self.board.broken = True

    def label(self, op: str) -> None:
        self.op_label = op

    def after_call(self) -> None:
        self.check()

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)
        self.check()

    def close(self, peers_ok: bool = True, check: bool = True) -> None:
        """With ``check``, raise a recorded error first; then free the buffers, collective (barriers) unless
        this instance saw a failure.

        ``peers_ok=False``: a collective of this instance raised :class:`moonep.MoonepError`.  The decision
        is per instance, not the runtime's sticky ``failed``: after a failure the peers of this instance
        all raised too (every wait is bounded), while a later instance's peers are in step again."""
        if self._closed:
            return
        try:
            if check:
                self.check()
        finally:
            self._release(peers_ok)

    def _release(self, peers_ok: bool) -> None:
        self._closed = True
        # a failed collective (kernel timeout, the order board's host timeout): don't wait for peers
        fatal = not peers_ok or self.herr[0] != 0 or (self.board is not None and self.board.broken)
        torch.cuda.synchronize(self.device)
        barrier = None if fatal else self._barrier  # with a dead peer, don't wait for it
        for buf in (self.grad, self.pool, self.main):
            if buf is not None:
                buf.close(barrier=barrier)
        self.herr.close()
        if self.board is not None:
            self.board.close()
        self.recv = self.wbuf = self.recv_wire = None
        self._views = (0, 0)  # (freed memory: no tensor is a view of it any more)

    # -- plan ------------------------------------------------------------------------------------------
    def plan_step(self, x, topk_idx, topk_weights, num_global_tokens=None):
        """Value checks on device; all-gather counts through peer stores; plan; destinations.  No host sync.
        Bad values are flagged on device and raised by a later call (see the module docstring)."""
        ep, E, K, dev = self.ep, self.E, self.K, self.device
        self.check(inputs=False)
        self.mark("gap")
        s = x.shape[0]
        total = -1 if num_global_tokens is None else int(num_global_tokens)
        if self.fused_route:
            # One kernel: range/duplicate/finite checks, masked int64 ids, fp32 weights, this rank's
            # histogram and the all-gather of [counts, s, flags] (no torch ops, no entry barrier).
            ti, tw = topk_idx.contiguous(), topk_weights.contiguous()
            # idx int64 [s, K], w32 fp32 [s, K] and counts int64 [R, E] in one allocation (host time)
            n = s * K
            buf = torch.empty(n + (n + 1) // 2 + self.R * E, dtype=torch.int64, device=dev)
            idx = buf.as_strided((s, K), (K, 1), 0)
            w32 = buf.view(torch.float32).as_strided((s, K), (K, 1), 2 * n)
            counts = buf.as_strided((self.R, E), (E, 1), n + (n + 1) // 2)
            grid = max(1, min(self.sm_count, -(-s * K // 512)))  # a choice per thread: loads in flight at once
            self._launch("moonep_route_gather", grid,
                         (_p(ti), _i32(ti.dtype == torch.int64), _p(tw), _i32(_DT[tw.dtype]), _i32(s),
                          _p(idx), _p(w32), _p(self._scratch), _p(counts), _i64(total)))
        else:
            idx, w32, gathered = self._validate_gather(s, topk_idx, topk_weights, total)
            counts = gathered[:, :E].contiguous()
        # plan + this rank's layout: one launch (the layout's counting overlaps the plan's loop)
        plan, dst_rank, dst_row = layout.plan_and_destinations(counts, self.rank, idx,
                                                               slack=ep.slack, align=ep.align)
        self.mark("planner")
        st = NVLinkStep(s, dst_rank.to(torch.int64).contiguous(), dst_row.to(torch.int64).contiguous())
        st.w32 = w32
        # int32 [2*epn + 1]: a view of the planner launch's output on its one-launch path; with align 1 its
        # last entry (this rank's rows) tells the fused dispatch which rows nobody writes
        st.cu = layout.cu_seqlens(plan, self.rank, align=ep.align)
        self.mark("layout")
        # the planner's kernels are local: the gather's barrier (its data wait) still holds for dispatch
        self._last_op = "moonep_route_gather" if self.fused_route else "moonep_gather"
        return plan, st

    def _validate_gather(self, s, topk_idx, topk_weights, total):
        """Unfused: checks and counts in torch ops, then ``moonep_gather`` (entry barrier + peer stores)."""
        E, K, dev = self.E, self.K, self.device
        idx = topk_idx.to(torch.int64)
        inr = (idx >= -1) & (idx < E)
        idx = torch.where(inr, idx, torch.full_like(idx, -1))
        flag = (~inr).any().to(torch.int64)
        if K > 1:  # pairwise, not sort: O(s*K^2) booleans, trivially free of host syncs
            upper = torch.ones(K, K, dtype=torch.bool, device=dev).triu(1)
            dup = ((idx[:, :, None] == idx[:, None, :]) & upper & (idx[:, :, None] >= 0)).any()
            flag = flag | (dup.to(torch.int64) * 2)
        flag = flag | ((~torch.isfinite(topk_weights)).any().to(torch.int64) * 4)
        flag = flag | self._xflag[0].to(torch.int64)  # fp8 dispatch: x's non-finite bit (wire_rows)
        self._xflag.zero_()
        counts = torch.zeros(E + 1, dtype=torch.int64, device=dev)
        counts.scatter_add_(0, torch.where(idx >= 0, idx, torch.full_like(idx, E)).reshape(-1),
                            torch.ones(s * K, dtype=torch.int64, device=dev))
        # Built with device ops only: writing a Python int into a CUDA tensor is a host-to-device copy.
        mine = torch.cat([counts[:E], torch.full((1,), s, dtype=torch.int64, device=dev), flag.reshape(1)])
        gathered = torch.empty(self.R, self.E2, dtype=torch.int64, device=dev)
        self.mark("validate")
        self._launch("moonep_gather", 1, (_p(mine), _p(gathered), _i64(total)), block=256)
        return idx, topk_weights.to(torch.float32).contiguous(), gathered

    # -- dispatch --------------------------------------------------------------------------------------
    def slots(self, plan, st):
        return st.cu, layout.slot_experts(plan, self.rank)

    def dispatch(self, x, topk_weights, st, tracked):
        # zero_copy "auto": views of the receive buffer unless a backward may read the rows (``tracked``: autograd
        # records the dispatch, or grad mode was on at the call)
        zero_copy = (not tracked) if self.zero_copy == "auto" else bool(self.zero_copy)
        w32 = st.w32 if st.w32 is not None else topk_weights.to(torch.float32).contiguous()
        tokens, weights = self._dispatch_rows(x, w32, st, zero_copy)
        return tokens, weights.to(topk_weights.dtype)

    def pack_step(self, h, device, graph: bool):
        """Compiled: the step's device state travels in the token (:mod:`moonep.backends.nvlink_token`)."""
        if not graph:
            return super().pack_step(h, device, graph)
        return self._token.pack(h, device), self._token.host_part(h)

    def unpack_step(self, kept, token):
        return self._token.unpack(kept, token) if isinstance(kept, Kept) else kept

    @contextlib.contextmanager
    def copied_rows(self):
        saved = self.zero_copy
        if saved == "auto":  # explicit zero_copy=True stays the user's choice
            self.zero_copy = False
        try:
            yield
        finally:
            self.zero_copy = saved

    def wire_rows(self, x, pow2_scales: bool):
        """fp8 dispatch.  A float ``x`` is quantised by the dispatch kernels as they send it (``_QuantInSend``);
        a non-finite group there is recorded as ERR_NONFINITE_X on every rank (csrc/dispatch.cu, xbad), no host
        sync.  A pair is packed into wire rows (a copy), its non-finite scales ORed into the routing flags of
        this step's counts gather."""
        if isinstance(x, (tuple, list)):
            flag = self._scratch[self.E:self.E + 1] if self.fused_route else self._xflag
            flag.bitwise_or_((~torch.isfinite(x[1])).any().to(torch.int32) * abi.ERR_NONFINITE_X)
            return fp8.pack_pair(x[0], x[1])
        x = x.detach().contiguous()
        if x.data_ptr() % 16:  # the kernels read 16-byte words
            x = x.clone()
        return _QuantInSend(x, pow2_scales)

    def _fp8_args(self, q) -> tuple:
        """The dispatch kernels' trailing (qdt, pow2, off_xbad, xrep): quantise ``q.x`` (a ``_QuantInSend``),
        or move rows as bytes (``q`` None)."""
        if q is None:
            return _bytes()
        return (_i32(_DT[q.x.dtype]), _i32(q.pow2), _i64(self.off["xbad"]), _p(self._xrep))

    def _out_rows(self, x, zero_copy: bool, wire: bool = False):
        """Where dispatch lands: the receive buffer (zero-copy) or fresh tensors, rows like ``x``'s
        (token dtype ``[cap, H]``), or fp8 wire rows uint8 ``[cap, wire_bytes(H)]`` (``wire``, or a uint8 ``x``)."""
        wire = wire or x.dtype == torch.uint8
        if zero_copy:
            return (self.recv_wire if wire else self.recv), self.wbuf
        shape = (self.cap, fp8.wire_bytes(self.H)) if wire else (self.cap, x.shape[1])
        return (torch.empty(shape, dtype=torch.uint8 if wire else x.dtype, device=self.device),
                torch.empty(self.cap, dtype=torch.float32, device=self.device))

    def _dispatch_rows(self, x, w32, st: NVLinkStep, zero_copy: bool):
        """Forward dispatch.  Returns ``(tokens [cap, H], weights fp32 [cap])``.  fp8: ``tokens`` are uint8 wire
        rows; ``x`` is a ``_QuantInSend`` (quantised by the kernels while they send it) or pre-packed uint8 wire
        rows (moved as bytes)."""
        self.check(inputs=False)
        q = x if isinstance(x, _QuantInSend) else None
        if q is not None:
            x, rb = q.x, fp8.wire_bytes(self.H)
        else:
            x = x.contiguous()
            rb = x.shape[1] * x.element_size()
        fa = self._fp8_args(q)
        self.generation += 1
        st.generation, st.zero_copy = self.generation, zero_copy
        # Right after this step's counts gather (plan_step), every peer has passed an entry barrier after
        # its last read of the receive buffers: no second barrier.  Same call sequence on every rank.
        barrier = 0 if self._last_op in _GATHERS else 1
        if self.fused_dispatch:
            return self._dispatch_fused(x, w32, st, zero_copy, rb, barrier, q)
        self._launch("moonep_dispatch_send", self.num_sms,
                     (_i32(0), _p(x), _i64(rb), _i32(_vec(rb, x.data_ptr())), _i32(st.num_tokens),
                      _p(st.dst_rank), _p(st.dst_row), _p(w32), _i32(barrier), _i32(1 if zero_copy else 0))
                     + fa)
        tokens, weights = self._out_rows(x, zero_copy, q is not None)
        st.row_first = torch.empty(self.cap, dtype=torch.int32, device=self.device)
        st.rec = torch.empty((self.cap, self.K), dtype=torch.int32, device=self.device)
        st.src = torch.empty(self.cap, dtype=torch.int32, device=self.device)
        st.tokfirst = None  # a backward of this step takes the two-kernel path too
        self._launch("moonep_dispatch_expand", self.sm_count,
                     (_i32(0), _p(tokens), _p(weights), _p(st.row_first), _p(st.rec), _p(st.src),
                      _i64(rb), _i32(_vec(rb, tokens.data_ptr())), _i32(1 if zero_copy else 0))
                     + fa[2:])
        return tokens, weights

    def _step_lists(self, st: NVLinkStep) -> None:
        # row_first [cap], rec [cap, K], src [cap] in one allocation (entries of non-first rows are unused)
        cap, K = self.cap, self.K
        lists = torch.empty(cap * (K + 2) + self.R * self.S, dtype=torch.int32, device=self.device)
        st.row_first, st.rec = lists[:cap], lists[cap:cap * (K + 1)].view(cap, K)
        st.src, st.tokfirst = lists[cap * (K + 1):cap * (K + 2)], lists[cap * (K + 2):]

    def _dispatch_fused(self, x, w32, st: NVLinkStep, zero_copy: bool, rb: int, barrier: int, q=None):
        tokens, weights = self._out_rows(x, zero_copy, q is not None)
        self._step_lists(st)
        vec = _i32(_vec(rb, x.data_ptr(), tokens.data_ptr()))
        cu = st.cu
        # align 1: rows [0, cu[-1]) are exactly this step's copies, so the fused kernel zeroes the rest itself
        # and the tag pass over every row (moonep_dispatch_zero, one more launch) is not needed
        # (an int: a kernel argument object is always true)
        zero_from = cu.data_ptr() + 4 * (cu.numel() - 1) if cu is not None and self.ep.align == 1 else 0
        self._launch("moonep_dispatch_fused", self.grid_fused,
                     (_i32(0), _p(x), _i64(rb), vec, _i32(st.num_tokens), _p(st.dst_rank),
                      _p(st.dst_row), _p(w32), _i32(barrier), _i32(self.nnv_dispatch), _i32(self.nch),
                      _p(tokens), _p(weights), _p(st.row_first), _p(st.rec), _p(st.src), _p(st.tokfirst),
                      _i64(zero_from)) + self._fp8_args(q), block=self.dispatch_block)
        if not zero_from:
            self._launch("moonep_dispatch_zero", self.sm_count,
                         (_p(tokens), _p(weights), _p(st.row_first), _i64(rb), vec))
        return tokens, weights

    def dispatch_grad(self, gy, st: NVLinkStep):
        """Backward of combine: send ``gy [s, H]`` over the forward's routing.  Returns ``[cap, H]`` (a view
        of the gradient receive buffer, consumed before the next collective)."""
        self.check(inputs=False)
        expect(gy.dtype in _DT, "grad of combine", "float32, bfloat16 or float16", gy.dtype)
        gy = gy.contiguous()
        rb = self.H * gy.element_size()
        if self.grad is None or self.grad.nbytes < self.cap * rb:
            self._grow("grad", self.cap * rb)
        if gy.dtype not in self._grad_views:  # views are made once: wrapping memory is not free of syncs
            self._grad_views[gy.dtype] = self.grad.view(0, (self.cap, self.H), gy.dtype)
        if self.fused_dispatch and st.tokfirst is not None:  # the forward ran fused: its tokfirst list
            out = self._grad_views[gy.dtype]
            self._launch("moonep_dispatch_fused", self.grid_fused,
                         (_i32(1), _p(gy), _i64(rb), _i32(_vec(rb, gy.data_ptr(), out.data_ptr())),
                          _i32(st.num_tokens), _p(st.dst_rank), _p(st.dst_row), _p(None), _i32(1),
                          _i32(self.nnv_dispatch), _i32(self.nch), _p(out), _p(None), _p(st.row_first),
                          _p(st.rec), _p(st.src), _p(st.tokfirst), _p(None)) + _bytes(), block=self.dispatch_block)
            return out
        self._launch("moonep_dispatch_send", self.num_sms,
                     (_i32(1), _p(gy), _i64(rb), _i32(_vec(rb, gy.data_ptr())), _i32(st.num_tokens),
                      _p(st.dst_rank), _p(st.dst_row), _p(None), _i32(1), _i32(1)) + _bytes())
        out = self._grad_views[gy.dtype]
        self._launch("moonep_dispatch_expand", self.sm_count,
                     (_i32(1), _p(out), _p(None), _p(st.row_first), _p(st.rec), _p(st.src),
                      _i64(rb), _i32(_vec(rb, out.data_ptr())), _i32(1)) + _bytes()[2:])
        return out

    # -- combine ---------------------------------------------------------------------------------------
    def check_rows(self, rows, st) -> None:
        # the kernels move rows of the buffers' width: another width would be read past or short
        if rows.shape[1] != self.H:  # (the message only on failure)
            fail("expert_out", f"shape [cap, hidden={self.H}] on the NVLink transport", list(rows.shape))
        self.check_live(rows, st, "expert_out")

    def in_recv(self, rows) -> bool:
        # (plain tensors only: a subclass or fake tensor has no storage of its own to compare)
        return type(rows) is torch.Tensor and self._views[0] <= rows.data_ptr() < self._views[1]

    def check_live(self, rows, st, name: str) -> None:
        if st.generation != self.generation and self.in_recv(rows):
            fail(name, "not a view of a receive buffer that a later dispatch has overwritten (zero-copy views are "
                 "valid until the next dispatch; zero_copy=False or grad mode copies them)",
                 f"rows of dispatch #{st.generation}, buffer now holds #{self.generation}")

    def combine(self, rows, weights, st, out_dtype):
        w32 = weights.to(torch.float32).contiguous() if weights is not None else None
        return self._combine_rows(rows, w32, None, st, out_dtype)[0]

    def dispatch_backward(self, g_tokens, g_weights, st, want_x, want_w, x_dtype, w_dtype):
        if not (want_x or want_w):
            return None, None
        if g_tokens is None:
            g_tokens = torch.zeros((self.cap, self.H), dtype=x_dtype, device=self.device)
        gw_in = None
        if want_w:
            gw_in = (g_weights.to(torch.float32).contiguous() if g_weights is not None
                     else torch.zeros(self.cap, dtype=torch.float32, device=self.device))
        # the backward of dispatch is a combine without weights, plus the per-choice weight gradients
        gx, gw = self._combine_rows(g_tokens, None, gw_in, st, x_dtype, want_gw=want_w)
        return (gx if want_x else None), (gw.to(w_dtype) if want_w else None)

    def combine_backward(self, gy, st, own: bool = False):
        g_rows = self.dispatch_grad(gy, st)
        return g_rows.clone() if own else g_rows

    def _combine_rows(self, out, weights, gw_in, st: NVLinkStep, y_dtype, want_gw: bool = False):
        """``out [cap, H]`` -> ``y [s, H]`` in ``y_dtype`` (fp32 accumulation, fixed order).

        ``weights``: fp32 ``[cap]`` or None (plain sum).  ``gw_in``: fp32 ``[cap]`` per-row gradients to send
        back per choice (backward of dispatch) or None.  Returns ``(y, gw [s, K] fp32 or None)``.
        """
        self.check(inputs=False)
        expect(out.dtype in _DT, "expert_out", "float32, bfloat16 or float16 for the NVLink transport", out.dtype)
        expect(y_dtype in _DT, "output dtype", "float32, bfloat16 or float16", y_dtype)
        out = out.contiguous()
        H, dt = self.H, _DT[out.dtype]  # the wire dtype is the row dtype (fp32 rows: fp32 partials)
        rb = H * _ES[dt]
        vec = int(rb % 16 == 0 and out.data_ptr() % 16 == 0)
        if rb * self.R * self.S <= self.acc_half:  # double-buffered: no entry barrier
            barrier, acc_off = int(self._comb_barrier_next), self.off["acc"] + self._comb_parity * self.acc_half
            gw_off = self.off["gwacc"] + self._comb_parity * self.gw_half
            self._comb_parity ^= 1
            self._comb_barrier_next = False
        else:  # fp32 rows with 16-bit tokens: the whole area, behind an entry barrier (and the next one too:
            # its half overlaps what this one's sum still reads)
            barrier, acc_off, gw_off = 1, self.off["acc"], self.off["gwacc"]
            self._comb_barrier_next = True
        if self.fused_combine:
            y = torch.empty((st.num_tokens, H), dtype=y_dtype, device=self.device)
            gw = torch.empty((st.num_tokens, self.K), dtype=torch.float32, device=self.device) if want_gw else None
            self._launch("moonep_combine_fused", self.grid_fused,
                         (_p(out), _i32(dt), _p(weights), _p(gw_in), _p(st.row_first), _p(st.rec), _p(st.src),
                          _i32(vec), _i32(barrier), _i64(acc_off), _i64(gw_off),
                          _i32(st.num_tokens), _p(st.dst_rank), _p(st.dst_row), _p(y), _i32(_DT[y_dtype]),
                          _p(gw), _i32(self.nnv_combine), _i32(self.nch)))
            return y, gw
        self._launch("moonep_combine_reduce", self.sm_count,
                     (_p(out), _i32(dt), _p(weights), _p(gw_in), _p(st.row_first), _p(st.rec),
                      _p(st.src), _i32(vec), _i32(barrier), _i64(acc_off), _i64(gw_off),
                      _p(st.tokfirst)))
        y = torch.empty((st.num_tokens, H), dtype=y_dtype, device=self.device)
        gw = torch.empty((st.num_tokens, self.K), dtype=torch.float32, device=self.device) if want_gw else None
        self._launch("moonep_combine_sum", self.sm_count,
                     (_i32(st.num_tokens), _p(st.dst_rank), _p(y), _i32(_DT[y_dtype]), _p(gw),
                      _i32(int(rb % 16 == 0)), _i64(acc_off), _i64(gw_off), _i32(dt)))
        return y, gw

    # -- replicas --------------------------------------------------------------------------------------
    def _replica_tables(self, plan):
        rep = plan.replica_experts.to(device=self.device, dtype=torch.int64).contiguous()
        src = plan.replica_source.to(device=self.device, dtype=torch.int64).contiguous()
        return rep, src

    def prefetch(self, plan, local_weight):
        """``[epn, *D]`` home weights -> ``[2*epn, *D]`` (home experts, then replicas; empty slots zero)."""
        lw = local_weight.contiguous()
        out = torch.empty((2 * self.epn, *lw.shape[1:]), dtype=lw.dtype, device=self.device)
        self._prefetch(plan, lw, out[:self.epn], out[self.epn:], None)
        return out

    def prefetch_replicas(self, plan, local_weights, replicas, fresh: bool = False):
        """This rank's replica slots of each projection into ``replicas[i] [epn, *D_i]``; the home weights are
        read where they are.  ``fresh``: new buffers, every empty slot zeroed and no replica table kept for
        them (a CUDA graph pool must not see a device tensor outlive the op); else persistent buffers, whose
        slots that stayed empty since the last call into them are not zeroed again.  Returns ``replicas``."""
        tables = self._replica_tables(plan)  # once for every projection
        for w, buf in zip(local_weights, replicas):  # one push and one finish kernel per projection
            self._prefetch(plan, w.contiguous(), None, buf, None if fresh else self._prev_replicas(buf), tables)
            forget_zero_slots(buf)  # a host-path fetch into this pool buffer later zeroes every empty slot
        return replicas

    def _prefetch(self, plan, lw, home_out, rep_out, prev, tables=None):
        """Push the replicated home rows to the ranks they serve; fill ``rep_out`` (and ``home_out`` unless
        ``None``).  ``prev``: the replica table at the last call into ``rep_out``'s pool, or ``None``;
        ``tables``: :meth:`_replica_tables` of ``plan`` when the caller has them."""
        self.check(inputs=False)
        epn = self.epn
        rb = rep_out[0].numel() * rep_out.element_size() if rep_out.numel() else 0
        if self.pool is None or self.pool.nbytes < epn * rb:
            self._grow("pool", max(epn * rb, 256))
        rep, src = self._replica_tables(plan) if tables is None else tables
        vec = _vec(rb, lw.data_ptr(), rep_out.data_ptr(), *(() if home_out is None else (home_out.data_ptr(),)))
        self._launch("moonep_prefetch_push", self.num_sms,
                     (_p(lw), _i64(rb), _i32(vec), _i32(epn), _p(rep), _p(src)))
        # The finish kernel waits for every peer's push, then copies the filled replica slots from the
        # staging pool (and the home rows into home_out, when given).  Slots empty now and at the previous
        # call into this same pool are still zero and are not written: most of a pool of large expert
        # weights is such slots.
        self._launch("moonep_prefetch_finish", self.sm_count,
                     (_p(home_out), _p(rep_out), _p(lw), _i64(rb), _i32(vec), _i32(epn), _p(rep),
                      _p(prev)))
        if prev is not None:
            prev.copy_(rep[self.rank])
            # written by a raw kernel: mark it modified in place, so a saved earlier value raises in backward
            torch.autograd.graph.increment_version(rep_out)

    def _prev_replicas(self, out):
        """int64 [epn]: this rank's replica table at the last prefetch into ``out`` (all 0, "filled", for an
        ``out`` not seen before, so every empty slot gets zeroed once).  Keyed by the tensor object (a weak
        reference): a new tensor at a reused address starts over."""
        key = out.data_ptr()
        ent = self._pool_prev.get(key)
        if ent is None or ent[0]() is not out:
            if len(self._pool_prev) >= 16:
                self._pool_prev = {k: v for k, v in self._pool_prev.items() if v[0]() is not None}
            ent = self._pool_prev[key] = (weakref.ref(out), torch.zeros(self.epn, dtype=torch.int64,
                                                                         device=self.device))
        return ent[1]

    def reduce_grad(self, plan, grad_view):
        """``[2*epn, *D]`` slot gradients -> ``[epn, *D]``, replica parts added at home in rank order."""
        g = grad_view.contiguous()
        return self.reduce_replicas(plan, g[:self.epn], g[self.epn:])

    def reduce_replicas(self, plan, home_grad, replica_grad, scratch: bool = False):
        """``home_grad [epn, *D]`` plus the replica gradients (``replica_grad [epn, *D]`` of every rank) of
        this rank's experts, added at home in rank order -> ``[epn, *D]``.  ``scratch``: ``home_grad`` is the
        caller's own (a backward's), summed in place: experts that no rank replicated are not copied."""
        self.check(inputs=False)
        hg, rg = home_grad.contiguous(), replica_grad.contiguous()
        expect(hg.dtype in _DT, "grad_view", "float32, bfloat16 or float16 for the NVLink transport", hg.dtype)
        epn = self.epn
        n = hg[0].numel() if hg.numel() else 0
        rb = n * hg.element_size()
        if self.pool is None or self.pool.nbytes < epn * rb:
            self._grow("pool", max(epn * rb, 256))
        rep, src = self._replica_tables(plan)
        out = hg if scratch else torch.empty_like(hg)
        self._launch("moonep_reduce_stage", self.num_sms,
                     (_p(rg), _i64(rb), _i32(_vec(rb, rg.data_ptr())), _i32(epn), _p(rep)))
        self._launch("moonep_reduce_finish", self.sm_count,
                     (_p(out), _p(hg), _i64(n), _i32(_DT[hg.dtype]), _i32(epn), _p(rep), _p(src),
                      _i32(_vec(rb, out.data_ptr(), hg.data_ptr()))))
        return out


def default_timeout(rt) -> float:
    """``MOONEP_NVLINK_TIMEOUT`` (a finite number of seconds > 0), else the runtime's timeout."""
    from ..config import env_float

    return env_float("MOONEP_NVLINK_TIMEOUT", rt.timeout.total_seconds())
