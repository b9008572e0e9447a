"""The experts stage: slot GEMMs with the home weights used where they are and one replica pool per model.

Rows arrive grouped home-first (:class:`moonep.Dispatched`): rows ``cu[0]:cu[epn]`` belong to this rank's
home experts and rows ``cu[epn]:cu[2*epn]`` to the replica slots.  So a projection is two grouped GEMMs:

    out[:cu[epn]]          = rows @ home_weight[j]      the layer's own parameter, never copied
    out[cu[epn]:cu[2epn]]  = rows @ replicas[j]         a slot of the ReplicaPool

and the pool only ever holds ``epn`` replica experts per projection shape (times ``buffers``), whatever the
number of layers: every layer fetches its replicas into the same memory, right after its plan exists.

    pool = moonep.ReplicaPool()                              # one per model
    h = ep.dispatch(x, idx, w)
    rep = pool.fetch(ep, h, w_in, "w_in")                    # on CUDA: a side stream, overlapping ...
    y = moonep.expert_matmul(h.tokens, h.cu_seqlens, w_in, rep)   # ... the home rows' GEMM

Backward: the replica rows' weight gradient goes home through ``ep.reduce_replicas`` (summed at home in rank
order).  The pool slot was reused by later layers by then, so by default the backward fetches the replicas
again (``backward="refetch"``: the weight traffic twice, no memory per layer); ``backward="keep"`` keeps
each layer's replicas in its own buffer until its backward instead (``epn`` experts per projection per
layer, no second fetch).

The GEMM is ``torch.nn.functional.grouped_mm`` (or ``torch._grouped_mm``) with device offsets on CUDA (no
host sync; float32: moonep's own kernels in :mod:`moonep.experts_cuda`), a loop over slots elsewhere.  A
grouped GEMM starts its first group at row 0, so the replica rows are moved to the front of a scratch
buffer (and their results back): activations, never weights, and with CuPy only the replica rows (moonep's
row kernels read their count on the device).  Padding rows are zero in the output and in the gradients.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.func import functional_call

from . import experts_cuda
from .eager_only import eager_only
from .errors import expect, fail
from .fp8 import as_float_rows, received_rows
from .handles import Dispatched, Fetched
from . import op_state
from .op_state import instance, replicas_id
from .replicas import track_zero_slots
from .work import CompiledWork, chain, side_stream

_GMM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
_FAILED: set = set()  # (device type, dtype) where the grouped GEMM raised once: the loop from then on


# --------------------------------------------------------------------------------------------- GEMMs
def _grouped_ok(a: torch.Tensor, *ws: torch.Tensor) -> bool:
    if (a.device.type, a.dtype) in _FAILED:
        return False
    if experts_cuda.usable(a):  # float32: moonep's kernels (torch's grouped GEMM takes bf16/fp16)
        return True
    if _GMM is None or a.device.type != "cuda":
        return False
    if a.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    es = a.element_size()
    # grouped GEMMs want 16-byte aligned strides on both operands
    return all(s * es % 16 == 0 for w in ws for s in (a.stride(0), w.stride(0), max(w.stride(1), w.stride(2))))


def _shift(x: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """``x [cap, D]`` -> rows ``start:`` moved to the front (``start`` a 0-d device int; no host sync)."""
    idx = (torch.arange(x.shape[0], device=x.device) + start).clamp_(max=max(x.shape[0] - 1, 0))
    return x.index_select(0, idx)


def _live(out: torch.Tensor, end) -> torch.Tensor:
    """Rows ``end:`` of ``out`` set to zero (``where``, not a product: unwritten rows may hold NaN)."""
    rows = torch.arange(out.shape[0], device=out.device)
    return torch.where((rows < end)[:, None], out, out.new_zeros(()))


# A grouped GEMM starts its first group at row 0 and writes only its groups' rows.  So the replica slots' rows
# go to the front of a scratch copy and their products in behind the home rows', and the padding rows are
# zeroed.  With CuPy, moonep's row kernels move only those rows (their count read on the device); else torch's
# index and where ops, which pass over every row.
_ROW_KERNELS = [True]  # False once the row kernels failed to build or launch here: torch's ops from then on


def _front(x: torch.Tensor, cu: torch.Tensor, n_home: int) -> torch.Tensor:
    """Rows ``cu[n_home]:`` of ``x [cap, D]`` moved to the front (rows past ``cu[-1] - cu[n_home]`` unspecified)."""
    if _ROW_KERNELS[0] and experts_cuda.loadable(x):
        try:
            return experts_cuda.rows_front(x, cu, n_home)
        except RuntimeError:  # the grouped GEMM itself still runs (its fallback, the loop, syncs)
            _ROW_KERNELS[0] = False
    return _shift(x, cu[n_home])


def _back(out: torch.Tensor, rep: torch.Tensor, cu: torch.Tensor, n_home: int) -> torch.Tensor:
    """``out``'s rows ``r >= cu[n_home]`` replaced by ``rep[r - cu[n_home]]`` up to ``cu[-1]``, zero after (in
    place with CuPy).  ``rep is None``: ``n_home`` is the last slot, only the padding is zeroed."""
    if _ROW_KERNELS[0] and experts_cuda.loadable(out):
        try:
            return experts_cuda.rows_back(out, out if rep is None else rep, cu, n_home)
        except RuntimeError:
            _ROW_KERNELS[0] = False
    if rep is not None:
        rows = torch.arange(out.shape[0], device=out.device)
        back = rep.index_select(0, (rows - cu[n_home]).clamp_(min=0))
        out = torch.where((rows < cu[n_home])[:, None], out, back)
    return _live(out, cu[-1])


# Grouped (CUDA, device offsets) and loop versions of: the product of every slot's rows (``rows``), the same
# with the home weights and the replicas apart (``two``), and the weight gradient of ``two`` (``wgrad``).
def _rows_grouped(a, cu, w):
    if experts_cuda.usable(a):
        return experts_cuda.slot_gemm(a, cu, w)
    return _back(_GMM(a, w, offs=cu[1:].to(torch.int32)), None, cu, w.shape[0])


def _rows_loop(a, cu, w):
    # Each slot's product written in place, empty slots skipped: a slot costs nothing unless it has rows
    # (replica slots are often empty), and no concatenation copies the output.  Called without autograd.
    c = cu.tolist()  # a host read (free for CPU tensors)
    out = a.new_empty(a.shape[0], w.shape[-1])
    for j in range(len(c) - 1):
        if c[j + 1] > c[j]:
            torch.mm(a[c[j]:c[j + 1]], w[j], out=out[c[j]:c[j + 1]])
    out[c[-1]:].zero_()
    return out


def _two_grouped(a, cu, w_home, w_rep):
    if experts_cuda.usable(a):
        return experts_cuda.slot_gemm(a, cu, w_home, w_rep)
    epn, offs = w_home.shape[0], cu[1:].to(torch.int32)
    home = _GMM(a, w_home, offs=offs[:epn])          # rows past cu[epn] are not written
    rep = _GMM(_front(a, cu, epn), w_rep, offs=offs[epn:] - offs[epn - 1])
    return _back(home, rep, cu, epn)


def _two_loop(a, cu, w_home, w_rep):
    return _rows_loop(a, cu, _Cat(w_home, w_rep))


def _wgrad_rows_grouped(a, g, cu):
    if experts_cuda.usable(a):
        return experts_cuda.slot_wgrad(a, g, cu)
    return _GMM(a.t(), g, offs=cu[1:].to(torch.int32))


def _wgrad_rows_loop(a, g, cu, lo: int = 0, hi: int | None = None, skip=()):
    """Weight gradients of slots ``lo:hi``, ``[hi - lo, D, N]`` (an empty slot's is zero, not computed);
    slots in ``skip`` are left unwritten (nobody reads them: unoccupied replica slots)."""
    c = cu.tolist()
    hi = len(c) - 1 if hi is None else hi
    out = a.new_empty(hi - lo, a.shape[1], g.shape[1])
    for j in range(lo, hi):
        if c[j + 1] > c[j]:
            torch.mm(a[c[j]:c[j + 1]].t(), g[c[j]:c[j + 1]], out=out[j - lo])
        elif j not in skip:
            out[j - lo].zero_()
    return out


def _wgrad_grouped(a, g, cu, epn, unoccupied=()):
    if experts_cuda.usable(a):
        gw = experts_cuda.slot_wgrad(a, g, cu)
        return gw[:epn], gw[epn:]
    offs = cu[1:].to(torch.int32)
    gh = _GMM(a.t(), g, offs=offs[:epn])
    gr = _GMM(_front(a, cu, epn).t(), _front(g, cu, epn), offs=offs[epn:] - offs[epn - 1])
    return gh, gr


def _wgrad_loop(a, g, cu, epn, unoccupied=()):
    # host path: the replica gradient reduce reads only occupied replica slots; the others are not written
    # (a fresh [epn, D, N] costs its page faults only where it is touched)
    return _wgrad_rows_loop(a, g, cu, 0, epn), _wgrad_rows_loop(a, g, cu, epn, skip=unoccupied)


def _unoccupied(h, epn: int) -> set:
    """Slot indices ``epn + j`` of the replica slots that hold no replica in ``h``'s step (host tensors)."""
    return {epn + j for j, e in enumerate(h.slot_experts[epn:].tolist()) if e < 0}


class _Cat:
    """``[w_home; w_rep]`` indexed by slot without concatenating (the loop reads one slot at a time)."""

    def __init__(self, home, rep):
        self.home, self.rep, self.n = home, rep, home.shape[0]
        self.shape = home.shape

    def __getitem__(self, j):
        return self.home[j] if j < self.n else self.rep[j - self.n]


def _run(impl: str, grouped, loop, a, *args):
    """``grouped`` on CUDA when it takes these operands (``impl="auto"``), else ``loop``."""
    if impl == "grouped" or (impl == "auto" and _grouped_ok(a, *(w for w in args if isinstance(w, torch.Tensor)
                                                               and w.dim() == 3))):
        try:
            return grouped(a, *args)
        except torch.OutOfMemoryError:  # not the grouped GEMM's refusal: the loop would need the same output
            raise
        except RuntimeError:
            if impl == "grouped":
                raise
            _FAILED.add((a.device.type, a.dtype))
    return loop(a, *args)


def slot_matmul_grads(g, a, w, cu, impl: str, want_a: bool, want_w: bool):
    """The backward of :func:`slot_matmul` (eager and ``moonep::slot_matmul``): ``g [cap, N]`` ->
    ``(ga [cap, D] or None, gw [G, D, N] or None)``."""
    g = g.contiguous()
    ga = _run(impl, _rows_grouped, _rows_loop, g, cu, w.mT) if want_a else None
    gw = _run(impl, _wgrad_rows_grouped, _wgrad_rows_loop, a, g, cu) if want_w else None
    return ga, gw


def slot_matmul(a: torch.Tensor, cu_seqlens: torch.Tensor, w: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """Rows of slot ``j`` times ``w[j]`` (one ``[G, D, N]`` weight tensor for all slots).

    Args:
        a: ``[cap, D]`` rows grouped by slot (rows past ``cu_seqlens[-1]`` are padding).  fp8 dispatch: also the
            :class:`moonep.Dispatched` ``h`` (dequantised to ``w``'s dtype, gradient straight through to ``x``)
            or a pair ``(h.tokens, h.scales)`` (dequantised, no gradient): :func:`moonep.fp8.as_float_rows`.
        cu_seqlens: int32 ``[G + 1]``, slot ``j`` owns rows ``cu_seqlens[j]:cu_seqlens[j+1]``.
        w: ``[G, D, N]`` one matrix per slot, same dtype as ``a``.
        impl: ``"auto"`` (grouped on CUDA when possible), ``"grouped"`` or ``"loop"``.
    Returns:
        ``[cap, N]`` in ``a.dtype``; padding rows are zero, and so is their gradient.  Differentiable with
        respect to ``a`` and ``w``.  For expert weights use :func:`expert_matmul`, which reads the home
        weights in place instead of a ``[2*epn]`` copy.

    The op ``moonep::slot_matmul``, eagerly and compiled.
    """
    expect(impl in ("auto", "grouped", "loop"), "impl", '"auto", "grouped" or "loop"', repr(impl))
    a = as_float_rows(a, w.dtype)  # fp8 rows: dequantised first (torch has no fp8 x bf16 scaled grouped GEMM)
    return op_state.call(torch.ops.moonep.slot_matmul.default, a, cu_seqlens, w, impl)  # eagerly and compiled


def expert_matmul_grads(g, a, w_home, cu, rep, transpose: bool, impl: str, want_a: bool, want_w: bool):
    """The backward of :func:`expert_matmul` (eager and ``moonep::expert_matmul``): ``g [cap, N]`` ->
    ``(ga [cap, D] or None, gw like w_home or None)``.  ``rep``: the step's :class:`Replicas` (or what gives
    the same ``weights_for_backward()``, ``reduce(home, replica)`` and ``h``); the replica slots' weight
    gradient is added at home through its ``reduce`` (collective)."""
    g = g.contiguous()
    wh, wr = _operands(w_home, rep.weights_for_backward(), transpose)
    ga = _run(impl, _two_grouped, _two_loop, g, cu, wh.mT, wr.mT) if want_a else None
    gw = None
    if want_w:
        epn = w_home.shape[0]
        unoccupied = _unoccupied(rep.h, epn) if a.device.type == "cpu" else ()
        gh, gr = _run(impl, _wgrad_grouped, _wgrad_loop, a, g, cu, epn, unoccupied)
        if transpose:
            gh, gr = gh.mT, gr.mT
        # contiguous (transpose: a copy), so that the reduce sums in place and returns w_home's layout
        gw = rep.reduce(gh.to(w_home.dtype).contiguous(), gr.to(w_home.dtype).contiguous())
    return ga, gw


def check_matmul_args(home_weight, transpose: bool, impl: str, bias, bias_replicas) -> None:
    """The arguments of :func:`expert_matmul` (and ``moonep.ops.expert_matmul``) that need no step: ``impl``,
    and ``bias [epn, N]`` given exactly with its replicas (raises ``ValueError``)."""
    expect(impl in ("auto", "grouped", "loop"), "impl", '"auto", "grouped" or "loop"', repr(impl))
    expect((bias is None) == (bias_replicas is None), "bias_replicas", "given exactly when bias is",
           f"bias {'given' if bias is not None else 'None'}, bias_replicas "
           f"{'given' if bias_replicas is not None else 'None'}")
    if bias is not None:
        expect(bias.dim() == 2 and bias.shape[1] == (home_weight.shape[-2] if transpose else home_weight.shape[-1]),
               "bias", "shape [epn, N] (N: the product's width)", list(bias.shape))


def _operands(w_home, w_rep, transpose: bool):
    return (w_home.mT, w_rep.mT) if transpose else (w_home, w_rep)


def expert_matmul(a: torch.Tensor, cu_seqlens: torch.Tensor, home_weight: torch.Tensor, replicas: "Replicas", *,
                  transpose: bool = False, impl: str = "auto", bias: torch.Tensor | None = None,
                  bias_replicas: "Replicas | None" = None) -> torch.Tensor:
    """One projection of every slot: home rows times the home weights in place, replica rows times the pool.

    Args:
        a: ``[cap, D]`` rows grouped by slot (``h.tokens`` or an activation of it), the weights' dtype.  fp8
            dispatch: also ``h`` itself or ``(h.tokens, h.scales)``, dequantised first (see :func:`slot_matmul`).
        cu_seqlens: int32 ``[2*epn + 1]`` (``h.cu_seqlens``): slot ``j`` owns rows ``cu[j]:cu[j+1]``.
        home_weight: ``[epn, D, N]`` this rank's home experts (``[epn, N, D]`` with ``transpose=True``, the
            ``nn.Linear`` / transformers layout); a parameter, read where it is.
        replicas: what :meth:`ReplicaPool.fetch` returned for ``home_weight`` in this step.
        transpose: multiply by ``home_weight[j].T``.
        impl: ``"auto"`` (grouped GEMMs on CUDA when they take the operands), ``"grouped"`` or ``"loop"``.
        bias: optional ``[epn, N]`` home experts' biases, with ``bias_replicas`` (what ``ReplicaPool.fetch``
            returned for them): added to each row by its slot in the same op (as :func:`expert_bias` does), so
            that the backward's two reduces keep their order on every rank.
    Returns:
        ``[cap, N]`` in ``a.dtype``; padding rows are zero, and so are their gradients.  Differentiable with
        respect to ``a`` and ``home_weight`` (and ``bias``): the replica rows' weight gradient is added to its
        home expert's on the home rank (collective in the backward).

    The op ``moonep::expert_matmul``, eagerly and compiled.  Eagerly its backward asks the pool for the replicas
    again (fetched again when a later layer reused the slots); with the :class:`moonep.ops.Fetched` replicas of
    a compiled step they are kept until the backward.
    """
    check_matmul_args(home_weight, transpose, impl, bias, bias_replicas)
    if tuple(cu_seqlens.shape) != (2 * home_weight.shape[0] + 1,):  # (the message only on failure)
        fail("cu_seqlens", f"shape [2*epn+1={2 * home_weight.shape[0] + 1}]", list(cu_seqlens.shape))
    kept = isinstance(replicas, Fetched)  # a compiled step's: the slots are kept until the backward
    kind = Fetched if kept else Replicas
    expect(isinstance(replicas, kind) and replicas.home is home_weight, "replicas",
           "what ReplicaPool.fetch returned for this home_weight", type(replicas).__name__)
    if bias is not None:
        expect(isinstance(bias_replicas, kind) and bias_replicas.home is bias and bias_replicas.h is replicas.h,
               "bias_replicas", "what ReplicaPool.fetch returned for this bias in the same step",
               type(bias_replicas).__name__)
    if not torch.compiler.is_compiling():  # (compiled dispatches copy their rows)
        # a zero-copy h.tokens that a later dispatch overwrote (the rows themselves: fp8 ones are dequantised next)
        (instance(replicas.h.op_id) if kept else replicas.ep).check_live_rows(replicas.h, received_rows(a), "a")
    a = as_float_rows(a, home_weight.dtype)  # fp8 rows: dequantised first
    if kept:
        replicas, bias_replicas = _ready(replicas), bias_replicas if bias is None else _ready(bias_replicas)
        return call_expert_matmul(replicas.h, a, home_weight, replicas.replicas, transpose, impl, bias,
                                  None if bias is None else bias_replicas.replicas, cu_seqlens)
    # (eagerly without the graph-break wrapper, which costs a few µs per call)
    matmul = _pool_matmul if torch.compiler.is_compiling() else _pool_matmul_eager
    return matmul(a, cu_seqlens, home_weight, replicas, transpose, impl, bias, bias_replicas)


def _pool_matmul_eager(a, cu_seqlens, home_weight, replicas, transpose, impl, bias, bias_replicas):
    """``moonep::expert_matmul`` over an eager pool's slots (the current stream waits for their fetch); the op's
    autograd finds the :class:`Replicas` by id, and its backward asks the pool for them again."""
    ids = (replicas_id(replicas), -1 if bias is None else replicas_id(bias_replicas))
    return call_expert_matmul(replicas.h, a, home_weight, replicas.weights(), transpose, impl, bias,
                              None if bias is None else bias_replicas.weights(), cu_seqlens, ids)


# an eager pool's Replicas (host objects) inside compiled code: eagerly, one graph break
_pool_matmul = eager_only(_pool_matmul_eager)


def _row_slots(cu: torch.Tensor, cap: int) -> torch.Tensor:
    """int64 ``[cap]``: the slot of every row (``2*epn`` for padding rows), on the device (no host sync)."""
    rows = torch.arange(cap, device=cu.device, dtype=cu.dtype)
    return torch.searchsorted(cu[1:].contiguous(), rows, right=True)


class _ExpertBias(torch.autograd.Function):
    """``out + b[slot of row]`` with ``b`` = home biases then replicas; the replica part of the gradient
    goes home through ``ep.reduce_replicas``."""

    @staticmethod
    def forward(ctx, out, b_home, cu, rep):
        slot = _row_slots(cu, out.shape[0])
        ctx.rep, ctx.slot, ctx.cu = rep, slot, cu
        return out + _gather_slots(slot, b_home, rep.weights()).to(out.dtype)

    @staticmethod
    def backward(ctx, g):
        gb = expert_bias_grad(g, ctx.slot, ctx.cu, ctx.rep) if ctx.needs_input_grad[1] else None
        return g, gb, None, None


def expert_bias_grad(g, slot, cu, rep):
    """The home bias gradient of :func:`expert_bias` (eager and ``moonep::expert_matmul``): ``g [cap, N]``,
    ``slot`` int64 ``[cap]`` (:func:`_row_slots`) -> like ``rep.home`` ``[epn, N]``, the replica slots' part
    added at home through ``rep.reduce`` (collective)."""
    epn, dt = rep.home.shape[0], rep.home.dtype
    if g.dtype == torch.float64 and g.device.type == "cuda":
        # fixed-order float64 sums: a one-hot GEMM (index_add_ uses atomics; the kernel sums in float32)
        onehot = slot[:, None] == torch.arange(2 * epn + 1, device=g.device)
        acc = onehot.to(g.dtype).t() @ g
    elif experts_cuda.loadable(g):  # CUDA: fixed-order float32 sums (index_add_ uses atomics)
        acc = experts_cuda.slot_sums(g, cu)
    else:
        acc = torch.zeros((2 * epn + 1, g.shape[1]), dtype=g.dtype, device=g.device)
        acc.index_add_(0, slot, g)  # padding rows land in the extra row, dropped
    return rep.reduce(acc[:epn].to(dt), acc[epn:2 * epn].to(dt))


def _gather_slots(slot, b_home, b_rep):
    table = torch.cat([b_home, b_rep, b_home.new_zeros((1,) + tuple(b_home.shape[1:]))])  # [2*epn + 1, N]: small
    return table.index_select(0, slot)


def expert_bias(out: torch.Tensor, cu_seqlens: torch.Tensor, home_bias: torch.Tensor,
                replicas: "Replicas") -> torch.Tensor:
    """Add each row's expert bias: ``out[i] + bias[slot(i)]``, home biases read in place, replicas from the pool.

    Args:
        out: ``[cap, N]`` rows grouped by slot (an :func:`expert_matmul` result).
        cu_seqlens: int32 ``[2*epn + 1]``.
        home_bias: ``[epn, N]`` this rank's home experts' biases (a parameter).
        replicas: what :meth:`ReplicaPool.fetch` returned for ``home_bias`` in this step.
    Returns:
        ``[cap, N]`` in ``out.dtype``; padding rows get no bias.  Differentiable with respect to ``out`` and
        ``home_bias`` (the replica rows' bias gradient is added at home, collective in the backward).
    """
    if isinstance(replicas, Fetched):  # compiled: expert_matmul(..., bias=) keeps it in the graph; this breaks it
        replicas = _eager_replicas(_ready(replicas))
    expect(isinstance(replicas, Replicas) and replicas.home is home_bias, "replicas",
           "the Replicas that ReplicaPool.fetch returned for this home_bias", type(replicas).__name__)
    expect(home_bias.dim() == 2 and out.dim() == 2 and home_bias.shape[1] == out.shape[1], "home_bias",
           f"shape [epn, N={out.shape[1]}]", list(home_bias.shape))
    if torch.is_grad_enabled() and (out.requires_grad or home_bias.requires_grad):
        return _ExpertBias.apply(out, home_bias, cu_seqlens, replicas)
    slot = _row_slots(cu_seqlens, out.shape[0])
    return out + _gather_slots(slot, home_bias, replicas.weights()).to(out.dtype)


def slot_apply(fn, a: torch.Tensor, cu_seqlens: torch.Tensor, out_width: int) -> torch.Tensor:
    """``fn(j, rows)`` on every slot's rows (arbitrary expert modules); padding rows give zero.

    Args:
        fn: ``(slot j, rows [n_j, D]) -> [n_j, out_width]``.
        a: ``[cap, D]``; cu_seqlens: int32 ``[G + 1]`` (read on the host).
    Returns:
        ``[cap, out_width]`` in ``a.dtype``.
    """
    cu = cu_seqlens.tolist()
    parts = [fn(j, a[cu[j]:cu[j + 1]]) if cu[j + 1] > cu[j] else a.new_zeros(0, out_width)
             for j in range(len(cu) - 1)]
    parts.append(a.new_zeros(a.shape[0] - cu[-1], out_width))
    return torch.cat([p.to(a.dtype) for p in parts])


class _ModuleSlots(torch.autograd.Function):
    """Any expert module on every slot: home slots with the experts' own parameters, replica slots with the
    pool's.  The per-slot graph is built inside (a nested autograd graph, so unused slots cost nothing) and
    differentiated in the backward, where the replica parameters' gradients go home (collective: it runs on
    every rank, since the output always reaches combine)."""

    @staticmethod
    def forward(ctx, rows, meta, *params):
        template, names, epn, reps, cu, width, _ = meta
        with torch.enable_grad():
            rows_l = rows.detach().requires_grad_()
            homes = [p.detach().requires_grad_() for p in params]
            # .data: a view of the pool slots with its own version counter, so that a backward refetch
            # into the same memory is read by this graph instead of raising as an in-place change
            reps_l = [r.weights().data.requires_grad_() for r in reps]

            def one(j, x):
                ps = {n: homes[i * epn + j] if j < epn else reps_l[i][j - epn] for i, n in enumerate(names)}
                return functional_call(template, ps, (x,))

            out = slot_apply(one, rows_l, cu, width)
        ctx.graph, ctx.meta = (out, rows_l, homes, reps_l), meta
        return out.detach()

    @staticmethod
    def backward(ctx, g):
        out, rows_l, homes, reps_l = ctx.graph
        _, names, epn, reps, _, _, scale = ctx.meta
        for r in reps:
            r.weights_for_backward()  # the slots hold this layer's replicas again (refetched if reused)
        leaves = [rows_l, *homes, *reps_l]
        grads = (torch.autograd.grad(out, leaves, g, allow_unused=True) if out.requires_grad
                 else [None] * len(leaves))  # no live row on this rank: zeros, but still reduce (collective)
        fill = lambda gr, like: torch.zeros_like(like) if gr is None else gr  # noqa: E731
        param_grads = []
        for i, r in enumerate(reps):
            home_g = torch.stack([fill(grads[1 + i * epn + j], homes[i * epn + j]) for j in range(epn)])
            rep_g = fill(grads[1 + len(homes) + i], reps_l[i])
            total = r.reduce(home_g, rep_g)
            param_grads += list((total if scale == 1 else total * scale).unbind(0))
        ctx.graph = None
        return (fill(grads[0], rows_l), None, *param_grads)


def module_slots(template: torch.nn.Module, rows: torch.Tensor, cu_seqlens: torch.Tensor, experts: list,
                 replicas: dict, out_width: int, grad_scale: float = 1.0) -> torch.Tensor:
    """Any expert module on the ``2*epn`` slots: ``experts[j]`` itself on home slot ``j``, and ``template``
    with the pool's parameters (``torch.func.functional_call``) on the replica slots.

    Args:
        template: a module of the experts' structure (e.g. ``experts[0]``), called functionally.
        rows: ``[cap, D]`` rows grouped by slot; cu_seqlens: int32 ``[2*epn + 1]`` (read on the host).
        experts: the ``epn`` home expert modules; their parameters must be views of the stacked tensors the
            replicas were fetched from (see ``replicas``), so nothing is copied.
        replicas: parameter name -> :class:`Replicas` from :meth:`ReplicaPool.fetch` of the stacked
            ``[epn, *shape]`` home parameter of that name.
        out_width: the experts' output width.
        grad_scale: multiplies the home experts' parameter gradients (``1/R``: the mean over the ranks, the
            data-parallel convention of :mod:`moonep.training`).
    Returns:
        ``[cap, out_width]`` in ``rows.dtype``; padding rows zero.  Differentiable with respect to ``rows`` and
        every home expert's parameters (replica parameter gradients are added at home; collective in the
        backward).
    """
    # a compiled fetch's replicas: the module calls run eagerly (one graph break each)
    replicas = {n: _eager_replicas(_ready(r)) if isinstance(r, Fetched) else r for n, r in replicas.items()}
    names = list(replicas)
    epn = len(experts)
    if names:  # (a zero-copy h.tokens that a later dispatch overwrote)
        first = replicas[names[0]]
        first.ep.check_live_rows(first.h, received_rows(rows), "rows")
    params = [dict(m.named_parameters())[n] for n in names for m in experts]
    if not (torch.is_grad_enabled() and (rows.requires_grad or any(p.requires_grad for p in params))):
        reps = {n: replicas[n].weights() for n in names}
        return slot_apply(lambda j, x: experts[j](x) if j < epn else
                          functional_call(template, {n: reps[n][j - epn] for n in names}, (x,)),
                          rows, cu_seqlens, out_width)
    meta = (template, names, epn, [replicas[n] for n in names], cu_seqlens, out_width, float(grad_scale))
    return _ModuleSlots.apply(rows, meta, *params)


def stack_parameters(modules: list) -> dict:
    """One ``[len(modules), *shape]`` tensor per parameter name, each module's parameter becoming a view of
    its row: the copy happens once, here, and afterwards a :class:`ReplicaPool` fetches replicas from the
    stacked tensors while every module keeps computing with its own parameters in place.

    Returns ``{name: stacked}``; call again when :func:`stacked_views_intact` says the modules were moved
    (``.to()``, ``load_state_dict`` with ``assign=True``, ...)."""
    names = [n for n, _ in modules[0].named_parameters()]
    out = {}
    for n in names:
        ps = [dict(m.named_parameters())[n] for m in modules]
        stacked = torch.stack([p.detach() for p in ps])
        for j, p in enumerate(ps):
            p.data = stacked[j]
        out[n] = stacked
    return out


def stacked_views_intact(modules: list, stacked: dict) -> bool:
    """Whether every module's parameter still is row ``j`` of its stacked tensor (same memory and shape)."""
    for n, t in stacked.items():
        for j, m in enumerate(modules):
            p = dict(m.named_parameters()).get(n)
            if p is None or p.data_ptr() != t[j].data_ptr() or p.shape != t.shape[1:] or p.dtype != t.dtype:
                return False
    return True


# --------------------------------------------------------------------------------------------- pool
@dataclass(eq=False)
class Replicas:
    """One layer's replica slots for one projection and step (:meth:`ReplicaPool.fetch`).

    Attributes:
        pool, key, index: where the slots live (``pool`` buffer ``index`` of projection ``key``).
        ep, h: the ExpertParallel and the :class:`moonep.Dispatched` of the step (a refetch and the gradient
            reduce use them).
        home: the ``[epn, *D]`` home weights the replicas are copies of.
        buffer: ``[epn, *D]`` the slots (slot ``j``: expert ``h.slot_experts[epn + j]``, zero if ``-1``).
        generation: the pool buffer's fetch count when this was fetched (it still holds these replicas while
            that is unchanged).
        event: on CUDA with the side stream, recorded after the fetch; the :class:`moonep.Work` of an
            ``async_op=True`` fetch; ``None`` otherwise.
    """

    pool: "ReplicaPool"
    key: tuple
    index: int
    ep: object
    h: object
    home: torch.Tensor
    buffer: torch.Tensor
    generation: int
    event: object = field(default=None, repr=False)

    def weights(self) -> torch.Tensor:
        """The slots, once the fetch finished (the current stream waits for the side stream; an async fetch's
        Work is waited for), and fetched again if a later fetch into the same pool buffer has overwritten them
        (collective, the same on every rank: every rank makes the same fetches in the same order).  So a fetch's
        replicas are right however many fetches of the same projection come before its GEMM (two micro-batches
        on ``buffers=1``: each GEMM then fetches again; ``buffers=2`` keeps both)."""
        return self._current(in_backward=False)

    def weights_for_backward(self) -> torch.Tensor:
        """The slots again, for the backward: still in the pool, kept, or fetched again (collective, as in
        :meth:`weights`)."""
        return self._current(in_backward=True)

    def _current(self, in_backward: bool) -> torch.Tensor:
        if isinstance(self.event, torch.cuda.Event):
            chain(self.buffer.device).current()[0].wait_event(self.event)
        elif self.event is not None:
            self.event.wait()
        self.event = None
        if self.index != -1 and self.pool.generation(self.key, self.index) != self.generation:
            self.generation = self.pool._bump(self.key, self.index)
            self.ep._fetch_replicas(self.h, [self.home.detach()], [self.buffer], in_backward=in_backward,
                                    names=[self.key[0]])
        return self.buffer

    def reduce(self, home_grad: torch.Tensor, replica_grad: torch.Tensor) -> torch.Tensor:
        """``[epn, *D]`` gradient of the home weights: ``home_grad`` plus every rank's replica gradients of
        this rank's experts (collective).  For a backward's own gradients: ``home_grad`` is consumed (the sum
        may be made in it)."""
        return self.ep.reduce_replicas(self.h, home_grad, replica_grad, in_backward=True)


def fetch_op(h: Dispatched, weights: list, names=None, *, traced_async: bool = False, many: bool = True):
    """``moonep::fetch_replicas`` of a step into fresh slots: one collective for every ``[epn, *D]`` home tensor
    -> a :class:`moonep.handles.Fetched` each (a list, or the one of ``weights[0]`` when not ``many``);
    ``traced_async``: through ``moonep::fetch_replicas_async``, the slots waited for where they are first read
    (as an eager async fetch's :meth:`Replicas.weights`)."""
    outs = [torch.empty(w.shape, dtype=w.dtype, device=w.device) for w in weights]
    args = ([w.detach() for w in weights], outs, h.step, h.op_id, True, False, list(names or ()))

    work = None
    if traced_async:  # one wait for all of them, at the first read of any (_ready)
        work = CompiledWork("prefetch", outs, torch.ops.moonep.fetch_replicas_async.default(*args), h.op_id, None,
                            args[0])
    else:
        op_state.call(torch.ops.moonep.fetch_replicas.default, *args)
    out = [Fetched(h, w, r, work) for w, r in zip(weights, outs)]
    return out if many else out[0]


def _ready(r: Fetched) -> Fetched:
    """``r``, its async fetch waited for (``moonep::wait_work`` writes the slots in place: every read of them
    comes after it in the graph)."""
    if r.work is not None:
        r.work.wait()
    return r


def call_expert_matmul(h: Dispatched, a, home_weight, replicas, transpose: bool, impl: str, bias=None, bias_replicas=None,
                       cu_seqlens=None, ids=(-1, -1)):
    """``moonep::expert_matmul`` of a step (``replicas`` and ``bias_replicas`` the fetched tensors; ``cu_seqlens``
    the slots' rows, default ``h.cu_seqlens``; ``ids``: of an eager pool's :class:`Replicas`, see the op):
    ``a [cap, D]`` -> ``[cap, N]``."""
    cu = h.cu_seqlens if cu_seqlens is None else cu_seqlens
    return op_state.call(torch.ops.moonep.expert_matmul.default, a, cu, home_weight, replicas, bias, bias_replicas,
                         h.step, h.op_id, transpose, impl, *ids)


def kept_replicas(ep, h, home: torch.Tensor, buffer: torch.Tensor) -> "Replicas":
    """:class:`Replicas` outside any pool: ``buffer [epn, *D]`` holds the step's replicas of ``home`` and is
    kept until the backward (index -1: no refetch); ``h`` the step's :class:`moonep.Dispatched` (in an op's body,
    its :class:`moonep.handles.Step`)."""
    return Replicas(None, None, -1, ep, h, home, buffer, 0)


@eager_only  # builds host objects around a compiled step: runs eagerly (one graph break)
def _eager_replicas(r: Fetched) -> "Replicas":
    """The :class:`Replicas` of a compiled fetch, for the calls that have no op (:func:`module_slots`,
    :func:`expert_bias`): its slots kept until the backward, which reduces through the step's token."""
    ep = instance(r.h.op_id)
    ep._check_routed(r.h)
    return kept_replicas(ep, r.h, r.home, r.replicas)


_DEFAULT: list = []


def default_pool() -> "ReplicaPool":
    """The process's shared pool (``ReplicaPool()``): what the layers and integrations use unless given
    one, so every layer of every model in the process shares the slots of equal projections."""
    if not _DEFAULT:
        _DEFAULT.append(ReplicaPool())
    return _DEFAULT[0]


class ReplicaPool:
    """Replica slots shared by every layer of a model: ``epn`` experts per projection shape and buffer.

    Args:
        buffers: 1, or 2 so that a layer's fetch can start while the previous layer's replicas of the same
            projection are still being read.
        backward: ``"refetch"`` (default): the backward fetches the replicas again when later layers reused
            the slots (weight traffic twice, no memory per layer); ``"keep"``: each layer keeps its replicas
            in its own buffer until its backward (``epn`` experts per projection per layer; no second fetch).
        overlap: on the NVLink backend, fetch on a side stream so that the transfer overlaps the home rows'
            GEMM (the replica rows' GEMM waits for it).

    Memory: ``sum over projection shapes of buffers * epn * expert_bytes`` (with ``backward="keep"``, plus
    ``epn * expert_bytes`` per projection per layer whose backward is pending).
    """

    def __init__(self, buffers: int = 1, backward: str = "refetch", overlap: bool = True):
        expect(buffers in (1, 2), "buffers", "1 or 2", repr(buffers))
        expect(backward in ("refetch", "keep"), "backward", '"refetch" or "keep"', repr(backward))
        expect(isinstance(overlap, bool), "overlap", "True or False", repr(overlap))
        self.buffers, self.backward, self.overlap = buffers, backward, overlap
        self._slots: dict = {}    # key -> [tensor [epn, *D]] * buffers
        self._gen: dict = {}      # (key, index) -> fetches into that buffer so far
        self._next: dict = {}     # key -> buffer index of the next fetch
        self._streams: dict = {}  # device -> side stream

    def __deepcopy__(self, memo) -> "ReplicaPool":
        """The pool itself: a copied model shares it, as every model shares :func:`default_pool` (its slots are
        scratch that each fetch refills; a CUDA stream cannot be copied)."""
        return self

    def generation(self, key, index: int) -> int:
        return self._gen.get((key, index), 0)

    def _bump(self, key, index: int) -> int:
        self._gen[(key, index)] = self.generation(key, index) + 1
        return self._gen[(key, index)]

    def nbytes(self) -> int:
        """Bytes the shared slots hold (not counting kept per-layer buffers)."""
        return sum(t.numel() * t.element_size() for bufs in self._slots.values() for t in bufs)

    def _buffer(self, key, home: torch.Tensor):
        bufs = self._slots.setdefault(key, [])
        i = self._next.get(key, 0)
        self._next[key] = (i + 1) % self.buffers
        if len(bufs) <= i:
            bufs.append(track_zero_slots(torch.zeros(home.shape, dtype=home.dtype, device=home.device)))
        return i, bufs[i]

    def fetch(self, ep, h, home_weight, name, *, async_op: bool | None = None):
        """Fetch this step's replicas of one projection, or of several in one collective, into the pool.

        Args:
            ep: the :class:`moonep.ExpertParallel` of ``h``.
            h: the step's :class:`moonep.Dispatched` (its plan says which replicas land here).
            home_weight: ``[epn, *D]`` this rank's home experts of the projection (read, never copied); or a
                list/tuple of such tensors, one per projection, fetched together (one collective: fewer
                rounds of messages than one call each).
            name: the projection's name within the layer (``"w_in"``), or a list/tuple of names, one per
                tensor: projections of one layer must not share slots, projections of the same name and
                shape in different layers do.
            async_op: ``None`` (default): on the NVLink backend the side stream of ``overlap=True``, else at once;
                ``True``: as :meth:`moonep.ExpertParallel.dispatch`'s ``async_op`` on any backend (on CPU ranks the
                worker thread), :meth:`Replicas.weights` (which :func:`expert_matmul` calls) waits for it.
        Returns:
            :class:`Replicas` for :func:`expert_matmul` (and :func:`expert_bias`); a list of them, in order,
            for a list of tensors.  Under ``torch.compile``: :class:`moonep.ops.Fetched`, fresh slots from one
            ``moonep::fetch_replicas`` (no pool buffer: a compiled graph holds its own), kept until the
            backward (``backward="keep"``).
        """
        many = isinstance(home_weight, (list, tuple))
        weights, names = (list(home_weight), name) if many else ([home_weight], [name])
        expect(isinstance(names, (list, tuple)) and len(names) == len(weights) and all(isinstance(n, str)
                                                                                          for n in names),
               "name", f"a str naming the projection ({len(weights)} of them for a list of home weights)",
               repr(name))
        expect(len(set(names)) == len(names), "name", "distinct names (one per projection)", repr(name))
        for w in weights:
            expect(isinstance(w, torch.Tensor), "home_weight", "a torch.Tensor", type(w).__name__)
        if not weights:  # a module without parameters, on every rank alike: nothing to fetch
            return []
        if async_op not in (None, True, False):
            ep.refuse("prefetch", f"async_op: expected None, True or False, got {async_op!r}")  # on every rank
        if torch.compiler.is_compiling():  # one node of the graph (fresh slots: a compiled graph holds its own)
            ep._check_routed(h)
            return fetch_op(h, weights, names, traced_async=bool(async_op), many=many)
        return self._fetch_eager(ep, h, weights, names, many, async_op)

    def _fetch_eager(self, ep, h, weights: list, names: list, many: bool, async_op=None):
        # whether home_weight itself requires grad does not matter: module_slots differentiates the experts'
        # parameters, views of a stacked home_weight that requires none
        keep = self.backward == "keep" and torch.is_grad_enabled()
        slots = []
        for w, n in zip(weights, names):
            key = (n, tuple(w.shape), w.dtype, w.device)
            if keep:  # this layer's own buffer (index -1), alive until its backward
                index, buf = -1, track_zero_slots(torch.zeros(w.shape, dtype=w.dtype, device=w.device))
            else:
                index, buf = self._buffer(key, w)
            slots.append((key, index, buf, self._bump(key, index)))
        homes, bufs = [w.detach() for w in weights], [buf for _, _, buf, _ in slots]
        side = None if async_op is not None else self._side_stream(ep, weights[0])
        events = [None] * len(weights)
        if async_op:  # one Work for all of them, waited for by each projection's first reader
            work = ep._launch("prefetch", True, None, lambda _: ep._fetch_replicas(h, homes, bufs, names=names),
                              (h, homes, bufs))
            work.unguarded()  # read only through Replicas.weights(), which waits: nothing to guard
            events = [work] * len(weights)
        elif side is None:
            ep._fetch_replicas(h, homes, bufs, names=names)
        else:
            # The plan (made on the current stream) must exist, and earlier readers of the buffers be done.
            side.wait_stream(chain(weights[0].device).current()[0])
            for i in range(len(weights)):  # one call and event each: a projection's GEMM waits for its own
                with torch.cuda.stream(side):
                    ep._fetch_replicas(h, homes[i:i + 1], bufs[i:i + 1], names=names[i:i + 1])
                events[i] = torch.cuda.Event()
                events[i].record(side)
            ep.queued_on(side)  # the next collective of ep waits for this fetch, whether or not it is used
        out = [Replicas(self, key, index, ep, h, w, buf, gen, event)
               for w, (key, index, buf, gen), event in zip(weights, slots, events)]
        return out if many else out[0]

    def _side_stream(self, ep, w: torch.Tensor):
        if not (self.overlap and w.device.type == "cuda" and getattr(ep, "transport_name", "") == "nvlink"):
            return None
        if torch.cuda.is_current_stream_capturing():
            return None  # CUDA graphs: keep the capture on one stream
        s = self._streams.get(w.device)
        if s is None:
            s = self._streams[w.device] = side_stream(w.device)
        return s
