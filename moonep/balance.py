"""Quantile Balancing (QB): router biases without an auxiliary loss (BRIEF section 2).

Routing picks ``top-K(s + b)`` and weighs the picks by the raw scores, so the bias ``b`` only steers
selection. Each step also takes the (K+1)-th biased score of every token, its cutoff ``alpha_i``, and the
*required bias* ``r_ij = alpha_i - s_ij`` (the bias at which expert j just enters token i's top-K). The new
``b_j`` is the ``q``-th smallest ``r_ij`` of the step, ``q = m*K/E`` for ``m`` tokens, then mean-centred.

Estimator (why it scales): each rank scatter-adds its ``r_ij`` into integer counts ``[E, bins]`` over the
range ``[b_min - 1, b_max + 1]``; since scores lie in [0, 1], every ``r`` falls inside. One integer
all-reduce pools the counts, so every rank computes the same bias from the same integers, whatever the
token split. Every token adds one count to every expert's row, so ``m`` is any row's sum and needs no
extra message. The quantile is read in the first bin whose cumulative count reaches ``ceil(q)``, with
linear interpolation inside that bin, so the error is at most one bin width.

CUDA: with CuPy available, recording and the step run as fused kernels (``csrc/balance.cu``: one launch per
micro-batch, two per step) that repeat the CPU path's float operations one for one, so the counts, the
range and the uncentred quantiles are bit-identical to it; without CuPy (or ``MOONEP_NO_CUPY=1``) the same
torch code as on CPU runs on the device. Neither syncs with the host.
"""
from __future__ import annotations

import copy
import json
import struct
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from . import cuda_runtime
from .eager_math import keep_eager
from .balance_check import STATE_BITS, state_bits, states_differ
from .errors import MoonepError, expect, expect_device, expect_same, expect_tensor, fail
from .guard import BALANCER
from .op_state import register_instance
from .transport.host_group import HostGroup, host_of, released

__all__ = ["QuantileBalancer", "histogram_quantiles", "normalise_topk"]


def _normalise(w: torch.Tensor) -> torch.Tensor:
    """Top-k weights ``w [s, K]`` (float) divided by their row sums -> ``[s, K]``, same dtype; a row of zeros
    stays zero.  Compiled, one opaque op with eager's rounding (:mod:`moonep.eager_math`)."""
    return w / w.sum(1, keepdim=True).clamp(min=torch.finfo(w.dtype).tiny)  # all-zero picks -> weights 0


normalise_topk = keep_eager(_normalise, "normalise_topk")  # keep_eager keeps the docstring

_CHECKED: dict = {}  # a group's global ranks -> balancers whose settings were checked on it so far
_DIFFERS = ("QuantileBalancer.step: expected the same bias and num_steps on every rank (they are replicated), "
            "got states that differ across ranks (e.g. a checkpoint loaded on some ranks only); the step was "
            "refused on every rank and the state left as it was: load the same state on every rank")
_TORCH_BALANCE = "torch ops for Quantile Balancing's histograms and step"  # the fallback, in CuPy's warning


def histogram_quantiles(counts: torch.Tensor, topk: int, lo: torch.Tensor, width: torch.Tensor):
    """The ``(K/E)``-quantile of every expert's required biases, read from pooled histograms.

    Args:
        counts: int32/int64 ``[E, B]``; ``counts[j, l]`` = required biases of expert j in bin l.
        topk: K.
        lo: float 0-dim, left edge of bin 0 (``b_min - 1``).
        width: float 0-dim, bin width.
    Returns:
        ``(b, m)``: ``b`` float64 ``[E]``, uncentred quantiles (``lo`` where the histogram is empty);
        ``m`` int64 0-dim, tokens counted (the sum of one row). No host sync.
    """
    E, B = counts.shape
    cum = counts.cumsum(1, dtype=torch.int64)                     # [E, B]
    m = cum[0, -1]
    need = torch.div(m * topk + (E - 1), E, rounding_mode="floor")  # ceil(q), exact in integers
    # first bin with cum >= ceil(q) (rows of cum are sorted); [E] int64
    l = torch.searchsorted(cum, need.expand(E, 1).contiguous()).squeeze(1).clamp_(max=B - 1)
    h = counts.gather(1, l[:, None]).squeeze(1).to(torch.int64)   # count inside that bin
    c = cum.gather(1, l[:, None]).squeeze(1) - h                  # count before it
    q = m.to(torch.float64) * topk / E
    # h >= 1 whenever m > 0; clamp keeps 0/0 out of the empty case (frac = 0 then).
    frac = ((q - c) / h.clamp(min=1)).clamp_(0.0, 1.0)
    b = lo.to(torch.float64) + (l.to(torch.float64) + frac) * width.to(torch.float64)
    return b, m


class _Pending(NamedTuple):
    """What :meth:`QuantileBalancer.record` records: the scores (detached; float32 or wider off the kernel
    path), the top-(K+1) biased scores ``[s, K+1]``, whether scores are checked on the device, whether the
    kernels record, and the scores to check (or ``None``)."""

    scores: torch.Tensor
    values: torch.Tensor
    deferred: bool
    fused: bool
    check: Optional[torch.Tensor]


def _record_op(balancer, raw, values, check: bool) -> None:
    """``balancer._record_cuda`` through the custom op ``moonep::qb_record`` (compiled code)."""
    from .ops import qb_record

    qb_record(balancer, raw, values, check)


class QuantileBalancer(torch.nn.Module):
    """Router biases from pooled margin histograms; one integer all-reduce per step.

    Args:
        num_experts: E (>= 2).
        topk: K, with ``1 <= K < E`` (the (K+1)-th score is the cutoff).
        bins: histogram bins B per expert.
        group: process group the counts are pooled over; ``None`` = the default group if
            ``torch.distributed`` is initialised, else a single process. Every rank of it calls ``step``.
        ema: in [0, 1); ``b <- ema * b_old + (1 - ema) * b_new`` (0 = plain QB).
        frozen: inference mode: the bias never changes, nothing is recorded, ``step`` is a local no-op.
        validate: scores must lie in [0, 1] with no NaN. ``True``: checked eagerly on CPU and deferred on
            CUDA; ``"eager"``: always in ``route`` (a host sync on CUDA); ``"deferred"``: counted on device,
            carried in the all-reduce; a step that saw bad scores on any rank leaves the bias unchanged on
            every rank and ``step`` raises once the count has reached the host (CPU: that same step; CUDA:
            a later ``step``, without syncing); ``False``: not checked (binning stays NaN-safe).
        device: where the bias and counts live (``.to()`` moves them too).

    Buffers: ``bias`` float32 ``[E]`` (persistent), ``num_steps`` int64 0-dim (persistent), the counts
    int32 ``[E*B + 1 + 31]`` (slot ``E*B`` counts micro-batches with bad scores, the last 31 carry the
    cross-rank state check; not persistent).
    Recording happens only in training mode and not frozen; ``eval()`` routes without recording.
    """

    def __init__(self, num_experts: int, topk: int, bins: int = 1000, group=None, ema: float = 0.0, *,
                 frozen: bool = False, validate=True, device=None):
        super().__init__()
        if device is not None:
            device = expect_device(device)
        expect(group is None or isinstance(group, dist.ProcessGroup), "group", "None or a ProcessGroup",
               type(group).__name__)
        expect(isinstance(num_experts, int) and num_experts >= 2, "num_experts", "an int >= 2", num_experts)
        expect(isinstance(topk, int) and 1 <= topk < num_experts, "topk",
               f"an int in [1, num_experts={num_experts}) (top-(k+1) cutoffs need k < E)", topk)
        expect(isinstance(bins, int) and bins >= 1, "bins", "an int >= 1", bins)
        expect(bins * num_experts < 2**31 - 1, "bins", "num_experts * bins < 2**31", bins * num_experts)
        expect(isinstance(ema, (int, float)) and 0.0 <= ema < 1.0, "ema", "a float in [0, 1)", ema)
        expect(validate in (True, False, "eager", "deferred"), "validate",
               "True, False, 'eager' or 'deferred'", validate)
        self.num_experts, self.topk, self.bins, self.ema = num_experts, topk, bins, float(ema)
        self.group, self.frozen, self.validate = group, bool(frozen), validate
        E, B = num_experts, bins
        self.register_buffer("bias", torch.zeros(E, dtype=torch.float32, device=device))
        self.register_buffer("num_steps", torch.zeros((), dtype=torch.int64, device=device))
        # [E*B] histograms, [1] micro-batches with bad scores, [STATE_BITS] the state check (balance_check.py)
        self.register_buffer("_counts", torch.zeros(E * B + 1 + STATE_BITS, dtype=torch.int32, device=device),
                             persistent=False)
        self.register_buffer("_row_start", torch.arange(E, dtype=torch.int32, device=device) * B,
                             persistent=False)  # [E] int32: flat index of each expert's bin 0
        self.register_buffer("_lo", torch.zeros((), device=device), persistent=False)      # range of this step
        self.register_buffer("_width", torch.ones((), device=device), persistent=False)
        # running totals: [0] micro-batches with bad scores, [1] steps refused because the ranks' states differ
        self.register_buffer("_bad_total", torch.zeros(2, dtype=torch.int64, device=device), persistent=False)
        # CUDA kernels' scratch: [0:E] uncentred quantiles (float64 bits), [E] m, [E+1] two int32 flags
        self.register_buffer("_work", torch.zeros(E + 2, dtype=torch.int64, device=device), persistent=False)
        self._recording = False  # host flag: counts recorded since the last step (avoids reading device)
        self._bad_host = self._bad_event = None  # CUDA deferred check: pinned copy of _bad_total + its event
        self._bad_reported = [0, 0]
        self._config_checked = False  # the ranks' settings agree (checked by the first step of a group)
        self._config_key = None  # where this balancer's settings are published in the group's store
        self._group_index = -1  # this balancer's index among those of its group (from the settings check)
        self._host = None  # the header-first collectives of the group's gloo group (False: none)
        self._steps_called = 0  # host count of step() calls (named in errors; num_steps is on the device)
        self._op_id = register_instance(self)  # how moonep::qb_record (torch.compile) finds it

    def __deepcopy__(self, memo) -> "QuantileBalancer":
        """A copy with its own buffers and the same process group (a ProcessGroup cannot be copied)."""
        if self.group is not None:
            memo[id(self.group)] = self.group
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        # the deferred CUDA check's pinned copy and its event are per instance (an event cannot be copied)
        state = {k: v for k, v in self.__dict__.items() if k not in ("_bad_host", "_bad_event", "_host")}
        new.__dict__.update(copy.deepcopy(state, memo))
        new._bad_host = new._bad_event = new._host = None
        new._op_id = register_instance(new)  # its own entry: compiled routes must record into the copy
        return new

    # ---------------------------------------------------------------- routing
    def route(self, scores: torch.Tensor):
        """Select experts and weights; records required biases when training and not frozen.

        Args:
            scores: float ``[s, E]`` sigmoid router scores in [0, 1] (any float dtype; may require grad).
        Returns:
            ``(topk_idx, weights)``: int64 ``[s, K]`` (by decreasing biased score) and ``[s, K]`` in
            ``scores.dtype``, ``scores[i, idx] / sum``; differentiable wrt ``scores``, never wrt ``bias``.
        """
        idx, weights, pending = self.select(scores)
        self.record(pending)
        return idx, weights

    def select(self, scores: torch.Tensor):
        """:meth:`route` without recording: ``(topk_idx, weights, pending)``, where ``pending`` is what
        :meth:`record` records (``None`` when nothing is to be: eval mode, frozen).

        For callers that record only once the routing has been used: :class:`moonep.LatentMoE` records
        after its step's collectives went through on every rank, so a forward refused on every rank leaves
        every rank's balancer as it was.  Record before the next :meth:`step` (the cutoffs are the current
        bias's)."""
        E, K = self.num_experts, self.topk
        expect_tensor(scores, "scores", dim=2)
        if scores.shape[1] != E:  # (messages are built only on failure)
            fail("scores", f"shape [s, {E}] (num_experts={E})", f"{list(scores.shape)}")
        expect(scores.is_floating_point(), "scores", "a floating dtype", scores.dtype)
        if scores.device != self.bias.device:
            fail("scores", f"device {self.bias.device} (the balancer's)", scores.device)
        record = self.training and not self.frozen
        mode = self._check_mode(scores)
        if mode == "eager":
            self._check_now(scores)
        with torch.no_grad():
            s = scores.detach()
            ctype = torch.promote_types(s.dtype, torch.float32)
            fused = record and self._use_kernels(s)
            if not (s.is_cuda or fused):  # CUDA: the mixed-dtype add below gives the same sums, one pass fewer
                s = s.to(ctype)
            top = torch.topk(s + self.bias.to(ctype), K + 1 if record else K, dim=1)
            idx = top.indices[:, :K]
        deferred = mode == "deferred"
        pending = _Pending(s, top.values, deferred, fused, s if deferred else None) if record else None
        return idx, normalise_topk(scores.gather(1, idx)), pending

    @torch.no_grad()
    def record(self, pending) -> None:
        """Record the required biases of a :meth:`select` (its ``pending``; ``None``: nothing)."""
        if pending is None:
            return
        s, values, deferred, fused, raw = pending
        if fused and torch.compiler.is_compiling():  # the kernel launch as a custom op (moonep/ops.py)
            _record_op(self, s, values, deferred)
        elif fused:  # reads the scores in their own dtype
            self._record_cuda(s, values, deferred)
        else:
            self._record(s.to(torch.promote_types(s.dtype, torch.float32)), values[:, self.topk], raw)

    def _record(self, s: torch.Tensor, alpha: torch.Tensor, raw) -> None:
        """Scatter-add ``r = alpha[:, None] - s`` ([s, E]) into the counts; device ops only."""
        B = self.bins
        if not self._recording:  # first micro-batch of the step: fix the range from the current bias
            self._set_range()
            self._recording = True
        x = alpha[:, None] - s
        x.sub_(self._lo.to(x.dtype)).div_(self._width.to(x.dtype))
        # r lies in range by construction; nan_to_num + clamp only keep bad input from indexing out of bounds.
        # int32 indices (E*B < 2**31) halve the index traffic; truncation is floor since x >= 0.
        x = torch.nan_to_num_(x, nan=0.0).clamp_(0, B - 1).to(torch.int32)
        x += self._row_start
        flat = x.reshape(-1)  # x follows the scores' strides: a transposed input is not viewable
        self._counts.index_add_(0, flat, torch.ones((), dtype=torch.int32, device=flat.device).expand(flat.numel()))
        if raw is not None and raw.numel():  # deferred validation: +1 per micro-batch with bad scores
            mn, mx = torch.aminmax(raw.detach())  # one pass; NaN propagates into both
            bad = self.num_experts * B
            self._counts[bad:bad + 1].add_(~((mn >= 0) & (mx <= 1)))

    # ---------------------------------------------------------------- CUDA kernels
    _KERNEL_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16", torch.float64: "f64"}
    _RECORD_THREADS = 512
    _RECORD_SMEM = 96 * 1024  # per block: two blocks of 512 threads per SM

    def _use_kernels(self, t: torch.Tensor) -> bool:
        return t.is_cuda and t.dtype in self._KERNEL_DTYPES and cuda_runtime.available_for(_TORCH_BALANCE)

    def _kernel_step(self) -> bool:
        return self._counts.is_cuda and cuda_runtime.available_for(_TORCH_BALANCE)

    def _record_layout(self):
        """(experts per tile, tiles, shared bytes, privatise): shared-memory histograms of a tile of experts."""
        E, B = self.num_experts, self.bins
        et = min(E, self._RECORD_SMEM // (4 * B))
        if et >= 1:
            tiles = -(-E // et)
            et = -(-E // tiles)  # even tiles
            return et, tiles, et * B * 4, 1
        et = min(E, 32)  # bins too many for shared memory: global atomics
        return et, -(-E // et), 0, 0

    def _record_cuda(self, raw: torch.Tensor, values: torch.Tensor, check: bool) -> None:
        """One fused kernel: r = alpha - s, its bin, the counts (+ the range on the first micro-batch, + the
        deferred score check). ``values``: the top-(K+1) biased scores ``[s, K+1]`` (alpha = column K)."""
        self.record_kernel(raw, values, check, self.bias, self._lo, self._width, self._counts, self._work,
                           not self._recording)
        self._recording = True

    def record_kernel(self, raw, values, check: bool, bias, lo, width, counts, work, first: bool) -> None:
        """The kernel of :meth:`_record_cuda` on the buffers given (``moonep::qb_record`` passes the ones of
        its compiled graph, which functionalisation may have copied): ``bias`` float32 ``[E]``, ``lo`` and
        ``width`` 0-d (set from ``bias`` when ``first``), ``counts`` int32 ``[E*B+1+31]``, ``work`` (flags)."""
        E, B, K = self.num_experts, self.bins, self.topk
        if raw.stride(1) != 1:
            raw = raw.contiguous()
        if values.stride(1) != 1:
            values = values.contiguous()
        n, dev = raw.shape[0], raw.device
        et, tiles, smem, priv = self._record_layout()
        sms = cuda_runtime.num_sms(dev.index)
        chunks = max(1, min(-(-n // 64), (2 * sms) // tiles))
        tpb = max(1, -(-n // chunks))
        grid_y = max(1, -(-n // tpb))
        name = "qb_record_" + self._KERNEL_DTYPES[raw.dtype]
        k = cuda_runtime.kernels("balance", dev.index)
        i32, i64, p = cuda_runtime.i32, cuda_runtime.i64, cuda_runtime.ptr
        alpha = i64(values.data_ptr() + K * values.element_size())  # (addresses)
        flags = i64(work.data_ptr() + (E + 1) * 8)
        k.need_smem(name, smem)
        k.launch(name, (tiles, grid_y), (self._RECORD_THREADS,),
                 (p(raw), i64(raw.stride(0)), alpha, i64(values.stride(0)), i32(n), i32(E), i32(B),
                  i32(et), i32(tpb), p(bias), p(lo), p(width), i32(bool(first)),
                  p(counts), i32(bool(check) and n > 0), flags, i32(priv)), smem, True)

    def _step_cuda(self) -> None:
        """Two kernels: per-expert quantiles (zeroing rows 1..E-1), then centring/EMA/update/reset."""
        import numpy as np
        E, B, K = self.num_experts, self.bins, self.topk
        dev = self._counts.device
        k = cuda_runtime.kernels("balance", dev.index)
        i32, p = cuda_runtime.i32, cuda_runtime.ptr
        k.launch("qb_quantiles", (E,), (256,), (
            p(self._counts), i32(E), i32(B), i32(K), p(self.bias), p(self._lo), p(self._width),
            i32(not self._recording), p(self._work)), 0, True)
        k.launch("qb_finalize", (1,), (512,), (
            p(self._work), p(self._counts), i32(E), i32(B), p(self.bias), np.float64(self.ema),
            np.float64(1.0 - self.ema), p(self.num_steps), p(self._bad_total)), 0, True)
        self._recording = False

    def _set_range(self) -> None:
        lo = self.bias.min() - 1.0
        self._lo.copy_(lo)
        self._width.copy_((self.bias.max() + 1.0 - lo) / self.bins)

    def _check_mode(self, t):
        v = self.validate
        if v is False:
            return None
        # compiled code checks deferred, as on CUDA: the eager check reads the device (a graph break)
        if v == "eager" or (v is True and t.device.type != "cuda" and not torch.compiler.is_compiling()):
            return "eager"
        return "deferred"

    @staticmethod
    def _check_now(scores) -> None:
        if not scores.numel():
            return
        mn, mx = torch.aminmax(scores.detach())  # one pass; NaN propagates into both
        if not (bool(mn >= 0) and bool(mx <= 1)):
            s = scores.detach()
            bad = ~((s >= 0) & (s <= 1))
            nan = int(s.isnan().sum())
            finite = s[~s.isnan()]
            rng = f"[{float(finite.min()):.6g}, {float(finite.max()):.6g}]" if finite.numel() else "none"
            raise ValueError(f"scores: expected values in [0, 1] (sigmoid router scores) and no NaN, got "
                             f"{int(bad.sum())} invalid values ({nan} NaN, range of the rest {rng})")

    # ---------------------------------------------------------------- the step
    def _world(self):
        if self.group is None and not (dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size(self.group)

    @torch.no_grad()
    def step(self) -> None:
        """Pool the counts (one int32 all-reduce of ``E*B + 1 + 31``) and set the bias used from now on.

        Collective over ``group`` unless frozen. No host sync on CUDA. The first step checks that every
        rank built the balancer with the same ``num_experts``, ``topk``, ``bins``, ``ema``, ``validate``
        and bias dtype (through the group's key-value store, on the host): a difference raises
        ``ValueError`` on every rank, naming the argument and each rank's value, where the counts'
        all-reduce of different sizes would abort the process or hang.  An empty histogram (no tokens on
        any rank) or a step with bad scores leaves the bias unchanged.

        Every step also checks that the ranks hold the same ``bias`` and ``num_steps`` (a hash of them
        rides in the all-reduce, :mod:`moonep.balance_check`): where they differ (a checkpoint loaded on one
        rank only), the step is refused on every rank, leaving the state as it was, with ``ValueError``
        (CPU: this step; CUDA: a later step, without syncing).  On a gloo group (or a NCCL group made by
        ``moonep.init``) the all-reduce is preceded by a header exchange on the gloo group
        (:mod:`moonep.transport.host_group`): a rank in another moonep collective fails cleanly.
        """
        if self.frozen:
            self._reset_counts()
            return
        R = self._world()
        self._steps_called += 1
        host = None
        if R > 1:
            if not self._config_checked:
                self._check_config()
            host = self._host_group()  # None: a NCCL group moonep did not make (no gloo group for a header)
        if host is None:
            self._report_bad(*self._update(R))
            return
        what = f"QuantileBalancer.step #{self._steps_called}"
        host.agree(BALANCER, self._counts.numel(), instance=self._group_index, what=what)
        with host.span(what):  # left part way on this rank (an interrupt): the group is abandoned
            found = self._update(R)
        self._report_bad(*found)  # after the collectives: every rank is in step, whatever is raised

    def _update(self, R: int):
        """The step after its header: all-reduce, new bias (unless refused), reset.  Returns what
        :meth:`_report_bad` reports: ``(bad, differs)``."""
        E, B = self.num_experts, self.bins
        differs = before = None
        if R > 1:
            self._counts[E * B + 1:].copy_(state_bits(self.bias, self.num_steps))
            before = self.bias.clone(), self.num_steps.clone()
        if self._kernel_step():
            if R > 1:
                self._all_reduce_counts()
                differs = states_differ(self._counts[E * B + 1:], R)
            self._step_cuda()  # resets the histograms and the bad count
            bad = None  # the kernels added it to the running total
        else:
            if not self._recording:  # nothing recorded here: same range as the peers, from the same bias
                self._set_range()
            if R > 1:
                self._all_reduce_counts()
                differs = states_differ(self._counts[E * B + 1:], R)
            b, m = histogram_quantiles(self._counts[:E * B].view(E, B), self.topk, self._lo, self._width)
            b = b - b.mean()
            if self.ema > 0:
                b = self.ema * self.bias.to(torch.float64) + (1.0 - self.ema) * b
                b = b - b.mean()
            bad = self._counts[E * B].clone()
            ok = (m > 0) & (bad == 0)
            self.bias.copy_(torch.where(ok, b.to(torch.float32), self.bias))
            self.num_steps += 1
        if differs is not None:  # refused on every rank (all see the same sums): the state stays as it was
            self.bias.copy_(torch.where(differs, before[0], self.bias))
            self.num_steps.copy_(torch.where(differs, before[1], self.num_steps))
        self._reset_counts()
        return bad, differs

    def _report_bad(self, bad, differs=None) -> None:
        """Raise for bad scores (``bad``: this step's count, ``None`` when the kernels added it to the total)
        or for ranks whose states differ (``differs``: bool 0-dim, or ``None``) once they are on the host;
        never blocks on CUDA.

        CUDA: a running device total is copied (non-blocking) into pinned memory each step; a later
        ``step`` reads it only once its event has completed, so the error surfaces a step or so late.
        Inside CUDA-graph capture only the device total moves; the first eager ``step`` after it reports.
        """
        if not self._bad_total.is_cuda:
            if differs is not None and bool(differs):
                raise ValueError(_DIFFERS)
            n = int(bad)
            if n:
                raise ValueError(f"scores: expected values in [0, 1] and no NaN, got invalid values in {n} "
                                 f"micro-batch(es) of this step (all ranks); the bias was not updated")
            return
        if bad is not None:
            self._bad_total[0] += bad
        if differs is not None:
            self._bad_total[1] += differs
        if torch.cuda.is_current_stream_capturing():
            return
        seen = None
        if self._bad_event is not None and self._bad_event.query():
            seen = self._bad_host.tolist()  # arrived: a host read, no sync
        if self._bad_host is None:
            self._bad_host = torch.zeros(2, dtype=torch.int64, pin_memory=True)
            self._bad_event = torch.cuda.Event()
        self._bad_host.copy_(self._bad_total, non_blocking=True)  # cumulative, so overwriting loses nothing
        self._bad_event.record()
        if seen is None:
            return
        (n_bad, n_differ), (old_bad, old_differ) = seen, self._bad_reported
        self._bad_reported = list(seen)
        if n_differ > old_differ:
            raise ValueError(f"{_DIFFERS} ({n_differ - old_differ} step(s), seen a step or so late)")
        if n_bad > old_bad:
            raise ValueError(f"scores: expected values in [0, 1] and no NaN, got invalid values in "
                             f"{n_bad - old_bad} micro-batch(es) of an earlier step (all ranks); those steps left "
                             "the bias unchanged")

    def _host_group(self):
        """The :class:`moonep.transport.host_group.HostGroup` for this balancer's headers, or ``None``."""
        if self._host is None:
            gloo = host_of(self.group if self.group is not None else dist.group.WORLD)
            self._host = HostGroup(gloo) if gloo is not None else False
        return self._host or None

    def _all_reduce_counts(self) -> None:
        """Sum the histograms over the group; a dead or stalled peer raises MoonepError naming the step.

        gloo raises after the group's timeout (``moonep.init(timeout=...)``); NCCL reports asynchronously
        (its watchdog ends the process after the timeout), so there this only names synchronous failures.
        """
        self._all_reduce(self._counts, "the all_reduce of the score histograms")

    def _all_reduce(self, t: torch.Tensor, what: str) -> None:
        try:
            with released(self.group, t):
                dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        except RuntimeError as exc:
            self._failed_collective(what, exc)

    def _failed_collective(self, what: str, exc: Exception):
        from .guard import mark_failed
        from .runtime import default_timeout_s

        rank = dist.get_rank(self.group) if dist.is_initialized() else 0
        try:
            timeout = default_timeout_s()
        except ValueError:  # a bad MOONEP_TIMEOUT: moonep.init refused it, so the group did not use it
            timeout = 60.0
        mark_failed(None, timeout)  # under mpirun: the process still ends (see guard.py)
        raise MoonepError(f"rank {rank}: QuantileBalancer.step #{int(self.num_steps) + 1}: {what} failed "
                          f"(group timeout, MOONEP_TIMEOUT={timeout:g}s by default; a peer is dead, stalled "
                          f"or called a different collective): {str(exc).strip()[:500]}") from exc

    _VALIDATE_CODES = {False: 0, True: 1, "eager": 2, "deferred": 3}
    _DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)

    def _config_fields(self):
        """``[(argument, int code), ...]``: the settings every rank of the group must share."""
        ema_bits = struct.unpack("<q", struct.pack("<d", self.ema))[0]
        dtype = self._DTYPES.index(self.bias.dtype) if self.bias.dtype in self._DTYPES else -1
        return [("num_experts", self.num_experts), ("topk", self.topk), ("bins", self.bins), ("ema", ema_bits),
                ("validate", self._VALIDATE_CODES[self.validate]), ("dtype", dtype)]

    def _readable(self, name: str, code: int) -> str:
        if name == "ema":
            return repr(struct.unpack("<d", struct.pack("<q", code))[0])
        if name == "validate":
            return repr({v: k for k, v in self._VALIDATE_CODES.items()}.get(code, code))
        if name == "dtype":
            return str(self._DTYPES[code]) if 0 <= code < len(self._DTYPES) else f"dtype #{code}"
        return str(code)

    def _check_config(self) -> None:
        """Every rank's settings, through the process group's key-value store (host only: no device work
        and no device-to-host sync, on NCCL as on gloo, also under CUDA-graph capture); raises
        ``ValueError`` on every rank when they differ.  Each rank of the group publishes its settings under
        ``moonep/QuantileBalancer/<global ranks>/<n>/<rank>``, where ``n`` counts the balancers checked
        on this group so far (the same on every rank: first steps are collective), and reads everyone's.
        The store's reads wait at most its timeout (``moonep.init``'s)."""
        R, rank = self._world(), dist.get_rank(self.group)
        if self._config_key is None:
            ranks = tuple(dist.get_process_group_ranks(self.group if self.group is not None else dist.group.WORLD))
            n = _CHECKED.get(ranks, 0)
            _CHECKED[ranks] = n + 1
            self._config_key = f"moonep/QuantileBalancer/{'-'.join(map(str, ranks))}/{n}/"
            self._group_index = n
        fields = self._config_fields()
        try:
            store = dist.distributed_c10d._get_default_store()
            store.set(self._config_key + str(rank), json.dumps([code for _, code in fields]))
            rows = [json.loads(store.get(self._config_key + str(r))) for r in range(R)]
        except Exception as exc:  # noqa: BLE001 (the store's timeout: a rank that never steps, or died)
            self._failed_collective("the settings check (through the process group's store)", exc)
        for i, (name, _) in enumerate(fields):
            expect_same(name, [row[i] for row in rows], lambda c, name=name: self._readable(name, c))
        self._config_checked = True

    def _reset_counts(self) -> None:
        self._counts.zero_()
        self._recording = False

    # ---------------------------------------------------------------- state
    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        key = prefix + "bias"
        if key in state_dict:
            t = state_dict[key]
            expect(isinstance(t, torch.Tensor) and tuple(t.shape) == (self.num_experts,), f"state_dict[{key!r}]",
                   f"a tensor of shape [{self.num_experts}] (num_experts)", f"{list(getattr(t, 'shape', []))}")
            expect(t.is_floating_point(), f"state_dict[{key!r}]", "a floating dtype", t.dtype)
            finite = torch.isfinite(t)
            expect(bool(finite.all()), f"state_dict[{key!r}]", "finite values (a NaN or inf bias picks the same "
                   "experts for every token for ever)", f"{int((~finite).sum())} non-finite value(s)")
        key = prefix + "num_steps"
        if key in state_dict:
            t = state_dict[key]
            ok = isinstance(t, torch.Tensor) and t.numel() == 1 and not t.is_floating_point() and t.dtype != torch.bool
            expect(ok, f"state_dict[{key!r}]", "an integer tensor with one element", getattr(t, "dtype", type(t)))
            expect(int(t) >= 0, f"state_dict[{key!r}]", "a count >= 0", int(t))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self._reset_counts()  # counts taken over the old range are meaningless now

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, topk={self.topk}, bins={self.bins}, ema={self.ema}, "
                f"frozen={self.frozen}")
