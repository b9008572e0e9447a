"""``ExpertParallel``: balanced dispatch, combine, replica weight prefetch and gradient reduce.

    ep = moonep.ExpertParallel(num_experts=E, topk=K, hidden=H, max_tokens=S, dtype=torch.float32)
    pool = moonep.ReplicaPool()                      # once per model
    h = ep.dispatch(x, topk_idx, topk_weights)      # collective
    rep = pool.fetch(ep, h, w, "w")                  # moonep.ReplicaPool: this step's replicas (collective)
    out = moonep.expert_matmul(h.tokens, h.cu_seqlens, w, rep)   # home rows x w in place, replica rows x pool
    y = ep.combine(out, h)                           # [s, H]

Everything is differentiable: the backward of dispatch is a combine, the backward of combine is a
dispatch over the same plan, and the replica rows' weight gradients go home (``reduce_replicas``).

``ExpertParallel`` is the stateful face of the ops in :mod:`moonep.ops` (``moonep::dispatch``, ``combine``,
``prefetch``): construction and buffers, the argument checks, the cross-rank configuration check and the
call's header with the peers (the op bodies call them), and the backward rules the ops' backward ops run.
Rows move in a backend (:mod:`moonep.backends`), chosen once at construction; nothing here depends on which
one runs.
"""
from __future__ import annotations

import os
import sys
import warnings
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
import torch.utils.checkpoint  # noqa: F401  (its early-stop exception, below)

from . import eager_math, fp8, layout, op_state
from .backends import choose_backend, make_backend
from .combine import acc_dtype, product_grads
from .config import Tuning
from .errors import (MoonepError, RefusedEverywhere, expect, expect_device, expect_int, expect_same, expect_slack,
                     expect_tensor, fail, raise_together, valid_timeout)
from .eager_only import eager_only
from .guard import CollectiveGuard, OrderMismatch, mark_failed
from .handles import Dispatched, Step, check_issued, names_key
from .op_state import register_instance
from .runtime import Runtime, detect_launcher, init, local_runtime
from .transport import make_transport
from .work import CompiledWork, Overlap, Work, join_host

_FLOAT = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
TRANSPORTS = ("auto", "mpi", "torch", "nvlink", "local")
_DTYPES = _FLOAT + (torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8, torch.bool)


def _dt(t) -> int:
    """A small code of a tensor's dtype for the call signature (99: any other)."""
    try:
        return _DTYPES.index(t.dtype)
    except ValueError:
        return 99


def _shape_key(shape) -> int:
    """63 bits that differ between trailing shapes (tuple hashes of ints are the same in every process)."""
    return hash(tuple(shape)) & ((1 << 62) - 1)


def _weights_signature(name: str, t, h):
    """The call signature of a weight-shaped argument ``t`` named ``name`` for step ``h``: its dtype, trailing
    shape and the step, and the ``describe()`` that names them when ranks disagree."""
    step = h.routing.step
    describe = lambda: [(name, f"dtype {t.dtype}"), (name, f"shape {list(t.shape)}"),  # noqa: E731
                        ("h", f"dispatch #{step}")]
    return (_dt(t), _shape_key(t.shape), step), describe


_OWN_FILES = (__file__, eager_only.__code__.co_filename)  # (frames _deprecated skips)


def _deprecated(message: str) -> None:
    """A ``DeprecationWarning`` attributed to the caller's line: the first frame outside this file,
    :mod:`moonep.eager_only` and torch (the methods are wrapped by ``eager_only``), so that Python's filters
    show it there."""
    frame, level = sys._getframe(1), 2
    while frame is not None and (frame.f_code.co_filename in _OWN_FILES or
                                 os.sep + "torch" + os.sep in frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, DeprecationWarning, stacklevel=level)


def _local_error(check, *args):
    """Run a check that raises ``ValueError``; return its message, or ``None``."""
    try:
        check(*args)
    except ValueError as exc:
        return str(exc)
    return None


# Exceptions every rank raises at the same point of a call, which leave the instance in step: a refusal, and
# activation checkpointing's early stop of a recomputed forward (it stops after the same op on every rank,
# the recomputed graph being the same; torch.utils.checkpoint, use_reentrant=False).
_UNIFORM_EXITS = (RefusedEverywhere,) + tuple(
    e for e in (getattr(torch.utils.checkpoint, "_StopRecomputationError", None),) if e is not None)


def scale_rows(tokens, weights):
    """``apply_weights="dispatch"``: each row ``tokens [cap, H]`` times its weight ``weights [cap]``, in the
    accumulation dtype, rounded once to the tokens' dtype (after ``moonep::dispatch``, where autograd sees it)."""
    adt = acc_dtype(tokens.dtype)
    return (tokens.to(adt) * weights.to(adt)[:, None]).to(tokens.dtype)


# -- the backward rules, which the ops' backward ops run (moonep/ops.py) ---------------------------------------
def dispatch_grads(ep, st, g_tokens, g_weights, want_x: bool, want_w: bool, x_dtype, w_dtype):
    """The backward of a dispatch, a combine of the rows' gradients over step ``st``: ``g_tokens [cap, H]``,
    ``g_weights [cap]`` -> ``(gx [s, H] in x_dtype or None, gw [s, K] in w_dtype or None)``. Collective."""
    with ep._collective("dispatch.backward", backward=True):
        return ep._backend.dispatch_backward(g_tokens, g_weights, st, want_x, want_w, x_dtype, w_dtype)


def combine_grads(ep, st, gy, own: bool):
    """The backward of a combine, up to its products: ``gy [s, H]`` dispatched over step ``st`` -> each row's
    gradient ``g_rows [cap, H]`` in ``gy``'s dtype, from which :func:`combine_products` makes the inputs'
    gradients (``own``: a tensor of its own; else it may be a view of a receive buffer, read before the next
    collective). Collective."""
    with ep._collective("combine.backward", backward=True):
        return ep._backend.combine_backward(gy, st, own)


# compiled inside eager_math.bitwise(): the weights' gradient (a sum over H) summed as eager sums it
_weights_grad = eager_math.keep_eager(
    lambda g_rows, expert_out, weights: product_grads(g_rows, expert_out, weights, False, True)[1],
    "combine.weights_grad")


def combine_products(g_rows, expert_out, weights, want_out: bool, want_w: bool):
    """The product rule of combine's backward: ``g_rows [cap, H]`` (:func:`combine_grads`) -> ``(g_out like
    expert_out or None, g_w like weights or None)`` (``weights [cap]``, or ``None`` for the plain sum).  Graph
    code under ``torch.compile``, which fuses it (the weights' gradient within float32 rounding of eager's,
    bitwise inside ``eager_math.bitwise()``); eagerly :func:`moonep.combine.product_grads`'s kernels."""
    g_out = product_grads(g_rows, expert_out, weights, want_out, False)[0]
    g_w = _weights_grad(g_rows, expert_out, weights) if want_w and weights is not None else None
    return g_out, g_w


def prefetch_grad(ep, plan, g):
    """The backward of a prefetch: ``g [2*epn, *D]`` slot gradients -> ``[epn, *D]``, the replica slots'
    parts added at home. Collective."""
    with ep._collective("prefetch.backward", backward=True):
        return ep._backend.reduce_grad(plan, g.contiguous())


def call_combine(expert_out, h: Dispatched, traced_async: bool = False):
    """``moonep::combine`` of ``h``'s step and instance (``ExpertParallel.combine`` after its checks, and
    ``moonep.ops.combine``): ``expert_out [cap, H]`` -> ``[s, H]`` (``traced_async``: ``moonep::combine_async``,
    a :class:`moonep.work.CompiledWork` of it)."""
    # apply_weights="dispatch": the rows were scaled at dispatch, the weights reach no gradient through here
    weights = h.weights.detach() if h.scaled else h.weights
    op = torch.ops.moonep.combine_async if traced_async else torch.ops.moonep.combine
    out = op_state.call(op.default, expert_out, weights, h.step, h.op_id, h.num_tokens,
                        torch.compiler.is_compiling(), 0)
    return CompiledWork("combine", [out[0]], out[1], h.op_id, _first, (expert_out, weights)) if traced_async else out


def _first(outs):
    return outs[0]


def call_prefetch(h: Dispatched, local_weight):
    """``moonep::prefetch`` of ``h``'s step and instance (``ExpertParallel.prefetch`` after its checks, and
    ``moonep.ops.prefetch``): ``[epn, *D]`` -> ``[2*epn, *D]``."""
    return op_state.call(torch.ops.moonep.prefetch.default, local_weight, h.step, h.op_id,
                         torch.compiler.is_compiling(), 0)


def _tensor_pair(x) -> bool:
    return isinstance(x, (tuple, list)) and len(x) == 2 and all(isinstance(t, torch.Tensor) for t in x)


def _runtime(group, transport, device):
    """The runtime of ``group``; a plain process that nobody launched and that has no process group gets
    one without a group (the local backend), unless a transport that needs a group was asked for."""
    if isinstance(group, Runtime):
        return group
    if (group is None and transport in ("auto", "local") and detect_launcher() == "single"
            and not (dist.is_available() and dist.is_initialized())):
        return local_runtime(device)
    return init(group)


def _check_fp8_config(dispatch_dtype, dtype, hidden, apply_weights, pow2_scales) -> None:
    """The constructor's fp8 arguments (raises ``ValueError``)."""
    expect(dispatch_dtype in (None, dtype, fp8.FP8), "dispatch_dtype", f"None, {dtype} or torch.float8_e4m3fn",
           dispatch_dtype)
    expect(isinstance(pow2_scales, bool), "pow2_scales", "a bool", repr(pow2_scales))
    if dispatch_dtype != fp8.FP8:
        return
    expect(dtype in (torch.bfloat16, torch.float16, torch.float32), "dtype",
           "bfloat16, float16 or float32 with dispatch_dtype=torch.float8_e4m3fn", dtype)
    expect(isinstance(hidden, int) and hidden % fp8.GROUP == 0, "hidden",
           f"a multiple of {fp8.GROUP} with dispatch_dtype=torch.float8_e4m3fn (one scale per 128 channels)",
           hidden)
    # rows scaled at dispatch would need quantising again on the receiver
    expect(apply_weights == "combine", "apply_weights", '"combine" with dispatch_dtype=torch.float8_e4m3fn',
           repr(apply_weights))


class ExpertParallel:
    """Balanced expert-parallel dispatch/combine over one process group.

    Args:
        group: a :class:`moonep.Runtime`, a ``torch.distributed`` ProcessGroup, or ``None``: the launcher's
            job (``moonep.init()``), or, in a plain process with no process group, one rank without any
            (the local backend).
        num_experts: ``E``, divisible by the group size ``R``; rank ``r`` owns experts ``r*epn .. r*epn+epn-1``.
        topk: ``K`` choices per token.
        hidden: ``H``, row width of dispatched tokens.
        max_tokens: ``S``, the most tokens any rank passes to one ``dispatch``; sizes the static buffers.
        dtype: token dtype (float32, float64, bfloat16 or float16).
        device: defaults to the runtime's device.
        align: pad each slot to a multiple of this many rows (grouped GEMMs like 128).
        slack: 0 for exact balance; ``> 0`` lets ranks receive up to ``(1+slack)*T/R`` for fewer replicas.
        apply_weights: ``"combine"`` (default: ``y = sum_k w_k f(x)``) or ``"dispatch"`` (rows arrive scaled
            by their weight, ``y = sum_k f(w_k x)``, and combine sums without weights).
        transport: ``"auto"``, ``"mpi"``, ``"torch"``, ``"nvlink"`` (device-initiated GPU kernels over CUDA
            IPC, no host sync, CUDA-graph capturable; see :mod:`moonep.backends.nvlink`) or ``"local"`` (one
            process, no group).  ``"auto"`` picks NVLink on CUDA when every rank is on one node and the GPUs
            reach each other, else MPI for CPU tensors under mpirun, else torch.distributed.
        zero_copy: NVLink only: ``True`` returns ``h.tokens``/``h.weights`` as views of the receive buffer
            (valid until the next dispatch), ``False`` copies; ``"auto"`` returns views only outside grad mode
            (inference), where no backward reads the rows later.  Results are bitwise identical.
        timeout: seconds a collective waits for a peer before :class:`moonep.MoonepError` is raised, on the
            MPI transport and in the NVLink kernels (default: the runtime's timeout, ``MOONEP_TIMEOUT`` or
            60; ``MOONEP_NVLINK_TIMEOUT`` for NVLink).  The ``"torch"`` transport uses its process group's
            timeout (``moonep.init(timeout=...)``).
        tuning: a :class:`moonep.Tuning` for the NVLink kernels (SMs, chunks, fused stages); ``None`` is the
            default tuning.  Results are bitwise the same for every tuning.
        dispatch_dtype: ``None`` (default: ``dtype``) or ``torch.float8_e4m3fn``: tokens cross the wire and
            land as e4m3 with one float32 scale per token per 128 channels (:mod:`moonep.fp8`); ``dtype`` must
            then be bf16, fp16 or fp32, ``hidden`` a multiple of 128 and ``apply_weights="combine"``.
            Combine stays in the expert output's dtype.
        pow2_scales: fp8 dispatch only: power-of-two (UE8M0-style) scales instead of ``amax / 448``.

    Every rank must construct it with the same arguments; a mismatch raises ``ValueError`` on every rank.
    Call :meth:`close` (or use ``with``) to unmap the peers' buffers (NVLink) and end the instance.

    Every collective call first checks, with the peers, that they all make the same call (op and
    sequence number): a different order raises :class:`moonep.MoonepError` on every rank (on NVLink the
    headers go through host shared memory; its backward passes carry none).  A dead or stalled peer
    raises :class:`moonep.MoonepError` naming the op after ``timeout`` seconds.
    """

    def __init__(self, group=None, *, num_experts: int, topk: int, hidden: int, max_tokens: int,
                 dtype: torch.dtype = torch.float32, device=None, align: int = 1, slack: float = 0.0,
                 apply_weights: str = "combine", transport: str = "auto", zero_copy="auto",
                 timeout: float | None = None, tuning: Tuning | None = None, dispatch_dtype: torch.dtype | None = None,
                 pow2_scales: bool = False):
        expect(transport in TRANSPORTS, "transport", '"auto", "mpi", "torch", "nvlink" or "local"', repr(transport))
        self.rt = _runtime(group, transport, device)
        R = self.rt.world_size
        self.rank, self.world_size = self.rt.rank, R
        try:  # a bad device fails on every rank, in the collective check below, not as a hang
            self.device, dev_err = (expect_device(device) if device is not None else self.rt.device), None
        except ValueError as exc:
            self.device, dev_err = self.rt.device, str(exc)
        self._backend = None
        self._closed = False
        self._failed = False  # a collective of this instance raised MoonepError: close() must not wait for peers
        self._async_used = False  # an async_op=True call was made: no dispatch returns views of the receive buffer
        self._left = None  # why a call was left part way on this rank: every later call is refused
        self._overlap = Overlap(self.device)  # where async_op=True calls run (moonep/work.py)
        expect(transport != "local" or self.rt.group is None, "transport",
               '"local" only in a process without a process group', f"a group of {R} rank(s)")
        # the transport waits at most `timeout` from the first exchange on (construction included); a bad
        # value is refused below, on every rank, and the default is used until then
        self.transport = make_transport("auto" if transport in ("nvlink", "local") else transport, self.rt,
                                        timeout=timeout if valid_timeout(timeout) else None)
        kind = choose_backend(transport, self.rt, self.transport, self.device, dtype)
        config = dict(num_experts=num_experts, topk=topk, hidden=hidden, max_tokens=max_tokens,
                      dtype=str(dtype), align=align, apply_weights=apply_weights,
                      slack=float(slack) if isinstance(slack, (int, float)) else repr(slack),
                      transport=kind, tuning=repr(tuning),
                      dispatch_dtype=str(dtype if dispatch_dtype is None else dispatch_dtype),
                      pow2_scales=repr(pow2_scales))
        errors = [dev_err] if dev_err else []
        try:
            for name in ("num_experts", "topk", "hidden", "max_tokens", "align"):
                expect(isinstance(config[name], int) and not isinstance(config[name], bool) and config[name] > 0,
                       name, "a positive int", repr(config[name]))
            expect(num_experts % R == 0, "num_experts", f"a multiple of the group size {R}", num_experts)
            expect(topk <= num_experts, "topk", f"<= num_experts ({num_experts})", topk)
            expect(dtype in _FLOAT, "dtype", "float32, float64, bfloat16 or float16", dtype)
            expect_slack(slack)
            expect(zero_copy in (True, False, "auto"), "zero_copy", 'True, False or "auto"', repr(zero_copy))
            expect(valid_timeout(timeout), "timeout", "None or a finite number of seconds > 0", repr(timeout))
            expect(tuning is None or isinstance(tuning, Tuning), "tuning", "None or a moonep.Tuning",
                   type(tuning).__name__)
            expect(apply_weights in ("combine", "dispatch"), "apply_weights", '"combine" or "dispatch"',
                   repr(apply_weights))
            _check_fp8_config(dispatch_dtype, dtype, hidden, apply_weights, pow2_scales)
        except ValueError as exc:
            errors.append(str(exc))
        # Every rank checks every rank's configuration, so a mismatch fails everywhere, not as a hang later.
        join_host()  # (a collective beside a queued async call would pair with the wrong messages)
        configs = self.transport.all_gather_object((config, errors))
        for r, (cfg, errs) in enumerate(configs):
            if errs:
                raise ValueError(f"{errs[0]} (on rank {r})")
        for key in config:
            expect_same(key, [cfg[key] for cfg, _ in configs], repr)
        self.num_experts, self.topk, self.hidden, self.max_tokens = num_experts, topk, hidden, max_tokens
        self.epn = num_experts // R
        self.dtype, self.align, self.slack, self.apply_weights = dtype, align, float(slack), apply_weights
        self.dispatch_dtype = dtype if dispatch_dtype is None else dispatch_dtype
        self.fp8, self.pow2_scales = self.dispatch_dtype == fp8.FP8, bool(pow2_scales)
        self.capacity = layout.capacity(max_tokens, topk, R, num_experts, align=align, slack=slack)
        self._backend = make_backend(self, kind, timeout=timeout, zero_copy=zero_copy, tuning=tuning or Tuning())
        self._guard = CollectiveGuard(self.transport, self.rt, self.rt.next_instance())
        # the int by which moonep.ops' custom ops find this instance: see moonep/op_state.py
        self.op_id = register_instance(self)

    @contextmanager
    def _collective(self, op: str, *, error=None, sig=(), describe=None, backward: bool = False):
        """Run one collective call: refuse a closed instance, exchange the call's header with the peers
        (backward passes only where the backend checks them) and remember a failure so shutdown does not
        wait for a dead peer.

        The header carries the call order, whether this rank's arguments failed a local check (``error``)
        and the call's signature (``sig``: ints that must agree across ranks; ``describe()`` gives
        ``[(argument, readable value), ...]`` in the same order, built only when they disagree).  Every
        rank then refuses the call together, with a ``ValueError``, before any data moves, and the
        instance stays usable."""
        if self._closed:  # (messages are built only on failure: these checks run on every call)
            fail("ExpertParallel", "an open instance", f"{op} called after close()")
        if self._left is not None:
            raise MoonepError(f"rank {self.rank}: {op} #{self._guard.seq + 1}: refused: an earlier collective of "
                              f"this ExpertParallel failed or was left part way on this rank ({self._left[:300]}); "
                              "its peers may still be waiting in it or sending into it, so this instance cannot "
                              f"be used any more: build a new ExpertParallel{self._rebuild_hint()}")
        join_host()  # a call made beside the worker thread runs after the calls queued on it
        checked = not backward or self._backend.checks_backward_order
        if checked:  # the order guard: a Work dropped unwaited refuses this call everywhere (taken on every rank)
            dropped = self._overlap.take_dropped()
            error = error or dropped
        try:
            if checked:
                got = self._guard.enter(op, exchange=self._backend.order_exchange, refused=error is not None,
                                        sig=sig)
                self._backend.label(self.transport.current_op)  # (named lazily: see guard.CallName)
                if got is not None:
                    self._agree(got, error, describe)
        except ValueError:  # a refusal every rank raises here, from every rank's header: still in step
            raise
        except OrderMismatch:  # every rank saw every header and raises here: still in step
            self._record_failure()
            raise
        except BaseException as exc:  # the header exchange failed or was interrupted: peers may go on
            self._leave(exc)
            raise
        if error is not None:  # nothing was exchanged (one rank, or MOONEP_CHECK_ORDER=0)
            raise ValueError(error)
        chain = self._overlap.chain
        try:
            if chain is not None:
                chain.join()  # after the last collective on this device, whichever stream ran it
            yield
        except _UNIFORM_EXITS:  # raised by every rank at the same point of the call
            raise
        except OrderMismatch:
            self._record_failure()
            raise
        except BaseException as exc:  # left between the call's collectives (an error here, an interrupt)
            self._leave(exc)
            raise
        finally:
            if chain is not None and chain.multi:  # the next collective, on whichever stream, runs after this one
                chain.after()

    def _leave(self, exc: BaseException) -> None:
        """This rank leaves a call part way: refuse every later call of this instance (and, on the torch
        transport, of its gloo group) at once, naming why, instead of pairing a later call with the peers'
        collectives of this one (see :meth:`moonep.backends.base.Backend.abandon_call`)."""
        if self.world_size > 1:
            why = f"{self.transport.current_op}: {type(exc).__name__}: {str(exc)[:200]}"
            self._left = self._left or why
            self._backend.abandon_call(why)
        self._record_failure()

    def _rebuild_hint(self) -> str:
        return (" on a new process group (moonep.init(group=dist.new_group(...)))"
                if self._backend.name == "torch" else "")

    def check_live_rows(self, h: Dispatched, rows: torch.Tensor, name: str) -> None:
        """Raise ``ValueError`` naming ``name`` when ``rows`` is a zero-copy view of ``h``'s received rows that a
        later dispatch has overwritten (NVLink, ``zero_copy``): read, they would be another step's rows.  Every
        rank makes the same dispatches, so every rank raises alike."""
        if torch.compiler.is_compiling():  # (compiled dispatches copy their rows; no data_ptr in traced code)
            return
        if self._backend.in_recv(rows):  # (the step's lookup only for views: rows of their own need none)
            self._backend.check_live(rows, self._step_of(h).routing, name)

    def queued_on(self, stream) -> None:
        """This instance's last collective was launched on ``stream`` (not the current one): the next
        collective's kernels, of any instance on this device, wait for it (:class:`moonep.work.Chain`: two
        collectives must never run at once on two streams).  :class:`moonep.ReplicaPool` calls this after
        fetching on its side stream.  From then on every collective notes its stream (the next one, on
        another stream, waits for it)."""
        self._overlap.chain.after(stream)

    @property
    def _streams(self) -> bool:
        """CUDA: collectives on this device run on more than one stream (see :class:`moonep.work.Chain`)."""
        return self._overlap.chain is not None and self._overlap.chain.multi

    def _agree(self, headers, error, describe) -> None:
        """Raise the same ``ValueError`` on every rank when a rank refused its arguments or the signatures
        differ.  The messages travel only then (one small gather, on every rank alike)."""
        if any(h[4] for h in headers):
            raise_together(error, self.transport.all_gather_object)
        first = list(headers[0][5:])
        if all(list(h[5:]) == first for h in headers):
            return
        values = self.transport.all_gather_object(describe() if describe is not None else [])
        for i, (name, _) in enumerate(values[0]):
            expect_same(name, [v[i][1] for v in values])
        raise ValueError("the arguments of this call disagree across ranks")  # describe() missed a field

    def _record_failure(self) -> None:
        """A collective of this instance failed or disagreed: close() must not wait for peers, and the
        runtime's shutdown skips its barriers (see mark_failed)."""
        if self.world_size > 1:
            self._failed = True
            mark_failed(self.rt, self.transport.timeout_s())

    def _after_call(self) -> None:
        """Raise what the backend recorded during the call (the nvlink kernels' flags), after the call's
        collectives: the ranks are in step whatever is raised here."""
        try:
            self._backend.after_call()
        except MoonepError:
            self._record_failure()
            raise

    @property
    def transport_name(self) -> str:
        """The backend that moves the rows: ``"nvlink"``, ``"mpi"``, ``"torch"`` or ``"local"``."""
        return self._backend.name

    def synchronize(self) -> None:
        """Wait for this rank's queued work (``async_op=True`` calls included) and raise any error the NVLink
        kernels recorded."""
        join_host()
        try:
            self._backend.synchronize()
        except MoonepError:
            self._record_failure()
            raise

    def close(self, check: bool = True) -> None:
        """Release the NVLink buffers (collective unless a peer died) and, with ``check``, raise any error
        the kernels recorded.  Idempotent.  Later collective calls raise ``ValueError``."""
        if self._closed:
            return
        join_host()  # the queued async_op=True calls finish first
        self._closed = True
        if hasattr(self, "op_id"):  # (a constructor that failed registered none)
            op_state.drop_steps(self.op_id)
        try:
            if self._backend is not None:
                self._backend.close(peers_ok=not self._failed, check=check)
        finally:
            if hasattr(self.transport, "close"):  # the MPI transport drops this instance's late headers
                self.transport.close()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close(check=exc_type is None)  # don't mask the exception that is already propagating
        return False

    # -- the data path ------------------------------------------------------------------------------
    # Every collective is an op of moonep/ops.py, in eager code and compiled code alike.  The public methods
    # below turn their arguments into the op's; the op's body runs a ``_*_body`` method (the checks, the
    # call's header with the peers, the backend); its backward is registered on the op.  An argument the op
    # cannot take (not a tensor) is refused here, on every rank (``refuse``).

    def _check_step(self, step: Step) -> None:
        """``step`` must be a step of this instance and backend (raises ``ValueError``)."""
        st = step.routing
        if not (isinstance(st, self._backend.step_type) and st.instance == self._guard.instance):
            fail("h", f"a Dispatched of this ExpertParallel (#{self._guard.instance}, {self._backend.name} backend)",
                 f"{type(st).__name__} of ExpertParallel #{getattr(st, 'instance', '?')}")

    def _check_routed(self, h) -> None:
        """``h`` must be a :class:`Dispatched` of this instance (raises ``ValueError``)."""
        if not isinstance(h, Dispatched):
            fail("h", "the Dispatched returned by dispatch", type(h).__name__)
        if h.op_id != self.op_id:
            fail("h", f"a Dispatched of this ExpertParallel (op id {self.op_id})", f"one of op id {h.op_id}")
        expect(isinstance(h.step, torch.Tensor), "h.step", "the step token dispatch returned",
               type(h.step).__name__)

    def _token_step(self, token) -> Step:
        """The :class:`Step` stored under step token ``token`` for this instance (raises ``ValueError``)."""
        step = self._backend.unpack_step(op_state.step(token, self.op_id), token)
        self._check_step(step)
        return step

    def _step_of(self, h) -> Step:
        """The :class:`Step` of handle ``h``, of step token ``h`` (a tensor), or ``h`` itself (a Step of this
        instance); raises ``ValueError``."""
        if isinstance(h, Step):
            self._check_step(h)
            return h
        if isinstance(h, torch.Tensor):
            return self._token_step(h)
        self._check_routed(h)
        return self._token_step(h.step)

    def _lookup(self, h):
        """``(step, None)``, or ``(None, why)`` when ``h`` (what :meth:`_step_of` takes) is no step of this
        instance: the caller's collective refuses it on every rank."""
        try:
            return self._step_of(h), None
        except ValueError as exc:
            return None, str(exc)

    def _check_combine(self, expert_out, step: Step, weights, graph: bool) -> None:
        expect_tensor(expert_out, "expert_out", dim=2, dtypes=_FLOAT, device=self.device,
                      shape=(self.capacity, None))
        self._check_step(step)
        if not graph and step.routing.issued is not None:  # eager step, eager call: the very tensor it returned
            check_issued(step.routing, weights)
        else:  # a compiled graph passes tensors of its own: the shape combine reads
            expect_tensor(weights, "h.weights", dim=1, dtypes=_FLOAT, device=self.device, shape=(self.capacity,))
        self._backend.check_rows(expert_out, step.routing)
        if weights is not None:  # (h.weights: a zero-copy view)
            self._backend.check_live(weights, step.routing, "h.weights")

    def _routing_error(self, x, topk_idx, topk_weights):
        """The first failed shape/dtype/device check of dispatch's arguments, or ``None``.  (The backend
        checks the values and decides how a failure surfaces: see ``Backend.plan_step``.)"""
        S, K, H = self.max_tokens, self.topk, self.hidden
        try:
            if isinstance(x, (tuple, list)):  # pre-quantised (x_fp8, scales)
                if not self.fp8:
                    pair = _tensor_pair(x)
                    fail("x", f"a {self.dtype} tensor [s, {H}]" + (" (a pre-quantised pair needs dispatch_dtype="
                                                                   "torch.float8_e4m3fn)" if pair else ""),
                         "a pair of tensors" if pair else f"a {type(x).__name__} of {len(x)} items")
                fp8.check_pair(x, H, self.device, S)
                s = x[0].shape[0]
            else:
                expect_tensor(x, "x", dim=2, dtypes=self.dtype, device=self.device)
                s = x.shape[0]
                if x.shape[1] != H:
                    fail("x", f"shape [s, {H}]", list(x.shape))
                if s > S:
                    fail("x", f"at most max_tokens={S} rows", s)
            expect_tensor(topk_idx, "topk_idx", dtypes=(torch.int32, torch.int64), device=self.device,
                          shape=(s, K))
            expect_tensor(topk_weights, "topk_weights", dtypes=self._backend.weight_dtypes, device=self.device,
                          shape=(s, K))
        except ValueError as exc:
            return str(exc)
        return None

    def dispatch(self, x, topk_idx, topk_weights, *, num_global_tokens=None, async_op: bool = False,
                 previous_event=None) -> Dispatched | Work:
        """Send every token to the ranks of its experts, into its final slot rows there. Collective.

        Args:
            x: ``[s, H]`` tokens, ``dtype`` of the constructor, ``s <= max_tokens`` (``s`` may differ
                between ranks and may be 0).  With ``dispatch_dtype=torch.float8_e4m3fn`` also a pre-quantised
                pair ``(x_fp8 float8_e4m3fn [s, H], scales float32 [s, H/128])`` (:func:`moonep.quant.quantize_fp8`'s
                output; not differentiable); a bf16/fp16/fp32 ``x`` is quantised inside the send.
            topk_idx: int32/int64 ``[s, K]`` expert ids, distinct per token; ``-1`` masks a choice.
            topk_weights: float ``[s, K]`` finite routing weights.
            num_global_tokens: optional sum of ``s`` over ranks; checked when given.
            async_op, previous_event: see :meth:`_launch`.
        Returns:
            :class:`Dispatched`; ``tokens`` and ``weights`` are differentiable with respect to ``x`` and
            ``topk_weights``.  fp8 dispatch: ``h.tokens`` float8_e4m3fn ``[cap, H]`` and ``h.scales`` float32
            ``[cap, H/128]``; the gradient reaches ``x`` through :func:`moonep.fp8.dequantize_rows` (straight
            through).

        The op ``moonep::dispatch``, eagerly and as one node of a ``torch.compile`` graph.
        """
        if async_op is not False or previous_event is not None:
            return self._launch("dispatch", async_op, previous_event,
                                lambda traced: self._dispatch(x, topk_idx, topk_weights, num_global_tokens, traced),
                                (x, topk_idx, topk_weights))
        return self._dispatch(x, topk_idx, topk_weights, num_global_tokens, False)

    def _dispatch(self, x, topk_idx, topk_weights, num_global_tokens, traced_async: bool):
        """:meth:`dispatch` (``traced_async``: as ``moonep::dispatch_async``, returning a
        :class:`moonep.work.CompiledWork`)."""
        xs, x_scales = (x[0], x[1]) if _tensor_pair(x) else (x, None)
        err, graph = None, torch.compiler.is_compiling()
        given = (xs, topk_idx, topk_weights) + (() if x_scales is None else (x_scales,))
        if not all(isinstance(t, torch.Tensor) and not t.is_meta for t in given):  # (meta: the fake would run)
            err = self._routing_error(x, topk_idx, topk_weights) or \
                f"x: expected a tensor or a pair (x_fp8, scales), got {type(x).__name__}"
        elif num_global_tokens is not None and not graph:  # (compiled: an int input, checked in the body)
            err = _local_error(expect_int, num_global_tokens, "num_global_tokens", 0, 2 ** 62)
        if err is not None:
            self.refuse("dispatch", err)
        op = torch.ops.moonep.dispatch_async if traced_async else torch.ops.moonep.dispatch
        ngt = -1 if num_global_tokens is None else int(num_global_tokens)
        # grad mode on: an expert's weight gradient may keep the rows for a backward that runs after later
        # dispatches, even when autograd records no dispatch (frozen inputs): rows of their own (bit 2)
        keep = 4 if not graph and torch.is_grad_enabled() else 0
        out = op_state.call(
            op.default, xs, topk_idx, topk_weights, x_scales, ngt, self.op_id, self.capacity, self.num_experts,
            self.world_size, self._backend.token_state_words, self.fp8, self.dtype, graph, keep)
        if traced_async:
            return CompiledWork("dispatch", list(out[:-1]), out[-1], self.op_id,
                                lambda outs: self._dispatched(outs, xs.shape[0]), given)
        return self._dispatched(out, xs.shape[0])

    def _dispatched(self, out, num_tokens: int) -> Dispatched:
        """The :class:`Dispatched` of ``moonep::dispatch``'s outputs ``out``."""
        tokens, weights, scaled = out[0], out[1], self.apply_weights == "dispatch"
        if scaled:  # the op moved them unscaled: scaled here, where autograd sees the product
            tokens = scale_rows(tokens, weights)
        fp8_parts = (out[8], out[9] if out[9].dim() == 2 else None) if self.fp8 else (None, None)
        return Dispatched(tokens, weights, *out[2:8], self.op_id, num_tokens, scaled, *fp8_parts, self.rank)

    def _dispatch_body(self, x, topk_idx, topk_weights, x_scales, ngt: int, tracked: int, graph: bool):
        """The body of ``moonep::dispatch``: check, agree with the peers, plan, move the rows.

        ``tracked``: bit 0 (1), autograd records the dispatch for ``x``; bit 1 (2), for ``topk_weights`` (the
        backward collectives that will run: every rank must agree); bit 2 (4), grad mode was on at the call (the
        rows are copies whenever a bit is set).  ``graph``: under ``torch.compile``,
        rows of their own (a compiled graph keeps them past the next dispatch).  Returns ``(step, tokens,
        weights, scales, grad_rows)``; ``scales`` for fp8 dispatch, ``grad_rows`` when it is also tracked."""
        pre, total = x_scales is not None, None if ngt == -1 else ngt  # (-1: not given)
        xin = (x, x_scales) if pre else x
        err = self._routing_error(xin, topk_idx, topk_weights)
        if err is None and total is not None and total < 0:  # (compiled code passes the int unchecked)
            err = f"num_global_tokens: expected an int >= 0, got {total}"
        wire = None
        if err is None and self.fp8 and not self._backend.lazy_input_errors:
            # host backends quantise before the call's header: a non-finite x is refused on every rank
            try:
                wire = self._backend.wire_rows(xin, self.pow2_scales)
            except ValueError as exc:
                err = str(exc)
        sig, describe = (), None
        if err is None:
            tx, tw = bool(tracked & 1), bool(tracked & 2)
            # the weights' dtype, and which backward collectives will run (rank-local otherwise)
            sig = (_dt(topk_weights), tx, tw, ngt, int(pre))
            describe = lambda: [("topk_weights", f"dtype {topk_weights.dtype}"),  # noqa: E731
                                ("x", f"requires_grad={tx}"), ("topk_weights", f"requires_grad={tw}"),
                                ("num_global_tokens", repr(total)),
                                ("x", "a pre-quantised pair (x_fp8, scales)" if pre else "a tensor")]
        with self._collective("dispatch", error=err, sig=sig, describe=describe):
            # rows of their own: compiled graphs keep them, and once async calls run, the next dispatch may
            # overwrite the receive buffer while the caller still reads this one's rows
            with self._backend.copied_rows() if graph or self._async_used else nullcontext():
                out = (self._dispatch_fp8(xin, x, wire, topk_idx, topk_weights, total, tracked) if self.fp8 else
                       self._dispatch_rows(x, topk_idx, topk_weights, total, tracked))
        self._after_call()
        return out

    def _plan(self, x, topk_idx, topk_weights, num_global_tokens):
        plan, st = self._backend.plan_step(x, topk_idx, topk_weights, num_global_tokens)
        st.step, st.instance = self._guard.seq, self._guard.instance
        return Step(*self._backend.slots(plan, st), plan, st)

    def _dispatch_rows(self, x, topk_idx, topk_weights, num_global_tokens, tracked: int):
        """The body of a dispatch in the token dtype (inside its collective): plan, move the rows."""
        step = self._plan(x, topk_idx, topk_weights, num_global_tokens)
        tokens, weights = self._backend.dispatch(x, topk_weights, step.routing, tracked != 0)
        return step, tokens, weights, None, None

    def _dispatch_fp8(self, x, xs, wire, topk_idx, topk_weights, num_global_tokens, tracked: int):
        """The body of an fp8 dispatch (inside its collective): quantise (NVLink: here, its non-finite flag
        joins the routing flags of plan_step), plan, move the wire rows.  ``grad_rows`` (tracked only) is the
        stride-0 zero through which the dequantised rows' gradient comes back (:func:`moonep.fp8.grad_anchor`)."""
        backend = self._backend
        if wire is None:
            wire = backend.wire_rows(x, self.pow2_scales)
        step = self._plan(xs, topk_idx, topk_weights, num_global_tokens)
        rows, weights = backend.dispatch(wire, topk_weights, step.routing, tracked != 0)
        q, scales = fp8.split_wire(rows, self.hidden)
        anchor = fp8.grad_anchor(rows.shape[0], self.hidden, self.dtype, rows.device) if tracked & 3 else None
        return step, q, weights, scales, anchor

    def _launch(self, op: str, async_op, previous_event, call, inputs, backward: bool = False):
        """Run ``call()`` (one collective call) now or asynchronously: what ``async_op`` and ``previous_event``
        mean for every collective method.

        Args:
            async_op: ``True``: return a :class:`moonep.Work` at once; ``work.wait()`` returns the call's result
                (see :mod:`moonep.work`).  On CUDA the call's kernels run on the device's communication
                stream, on the host backends on the process's worker thread, in the order the calls were made.
            previous_event: CUDA only, a ``torch.cuda.Event`` the call's kernels wait for (default: the current
                stream's work so far).  ``None`` on CPU tensors.
            call: ``call(traced_async)``; ``traced_async`` (under ``torch.compile``): the op's async form,
                returning a :class:`moonep.work.CompiledWork` (see :mod:`moonep.ops_async`).
        Bad values are refused on every rank (``ValueError``); so is the call after a :class:`moonep.Work` was
        dropped without ``wait()``."""
        err = None
        if not isinstance(async_op, bool):
            err = f"async_op: expected True or False, got {async_op!r}"
        elif previous_event is not None and self.device.type != "cuda":
            err = (f"previous_event: expected None on {self.device} (a CUDA event orders GPU streams), "
                   f"got {type(previous_event).__name__}")
        elif previous_event is not None and not isinstance(previous_event, torch.cuda.Event):
            err = f"previous_event: expected None or a torch.cuda.Event, got {type(previous_event).__name__}"
        elif previous_event is not None and torch.compiler.is_compiling():
            err = ("previous_event: expected None under torch.compile (the compiled graph orders its streams), got "
                   f"{type(previous_event).__name__}")
        if err is not None:
            self._refuse(op, err, backward)
        if not async_op:
            torch.cuda.current_stream(self.device).wait_event(previous_event)
            return call(False)
        if torch.compiler.is_compiling():  # the op's async form and moonep::wait_work (moonep/ops_async.py)
            return call(True)
        self._going_async()
        return self._overlap.submit(op, lambda: call(False), inputs, previous_event)

    def _going_async(self) -> None:
        """An async call is being made: no dispatch returns views of the receive buffer from now on, and on CUDA
        the communication stream joins (every collective notes its stream, see :class:`moonep.work.Chain`)."""
        self._async_used = True
        if self.device.type == "cuda" and not self._streams:
            self.queued_on(torch.cuda.current_stream(self.device))

    def _start_async(self, op: str, fn, empty_outputs, inputs, mutated: list, guarded: bool = True):
        """The body of ``moonep::<op>_async``: :meth:`moonep.work.Overlap.start_compiled` of ``fn()``."""
        self._going_async()
        return self._overlap.start_compiled(op, fn, empty_outputs, inputs, mutated, guarded)

    @eager_only  # under torch.compile: one graph break per collective (moonep.ops: none)
    def sync(self) -> None:
        """A collective that moves nothing: every rank reaches this point of its calls together, or every rank
        raises :class:`moonep.MoonepError` (a peer that makes another call instead is reported at once, one
        that makes none after the timeout).  Ends a section whose call counts must agree (``generate()``)."""
        with self._collective("sync"):
            pass

    @eager_only  # a refusal: host work only, never part of a graph
    def refuse(self, op: str, message: str) -> None:
        """Refuse this rank's part of collective ``op`` (``"dispatch"``, ``"combine"``, ``"prefetch"`` or
        ``"reduce_grad"``) while the peers make that call with their own arguments: every rank raises
        ``ValueError`` (``message`` here, ``"message (on rank r)"`` on the peers) and the instance stays
        usable.  For layers whose own input checks run before the collective (``LatentMoE``)."""
        expect(op in ("dispatch", "combine", "prefetch", "reduce_grad"), "op",
               '"dispatch", "combine", "prefetch" or "reduce_grad"', repr(op))
        self._refuse(op, message)

    @eager_only  # a refusal: host work only, never part of a graph
    def _refuse(self, op: str, message: str, backward: bool = False) -> None:
        """:meth:`refuse` for moonep's own calls, also in a backward (``op`` ``"prefetch.backward"``: the
        header is exchanged only where the backend checks backward passes, as the call's own would be)."""
        with self._collective(op, error=str(message), backward=backward):
            pass

    def _handle_error(self, h, **tensors):
        """Why ``h`` and the named arguments cannot be passed to an op (not a handle of this instance, not
        tensors), or ``None``."""
        tensors = dict(tensors, **{"h.step": getattr(h, "step", None), "h.weights": getattr(h, "weights", None)})
        if (isinstance(h, Dispatched) and h.op_id == self.op_id
                and all(isinstance(t, torch.Tensor) and not t.is_meta for t in tensors.values())):
            return None  # (the common case, without building any message)
        try:
            self._check_routed(h)
            for name, t in tensors.items():  # (a meta tensor would run the op's fake implementation)
                expect(isinstance(t, torch.Tensor) and not t.is_meta, name, f"a torch.Tensor on {self.device}",
                       f"a tensor on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__)
        except ValueError as exc:
            return str(exc)
        return None

    def combine(self, expert_out: torch.Tensor, h: Dispatched, *, async_op: bool = False,
                previous_event=None) -> torch.Tensor | Work:
        """Return each token's weighted sum of its experts' outputs. Collective.

        Args:
            expert_out: ``[cap, H]`` (any float dtype), row ``i`` is the expert output for ``h.tokens[i]``.
            h: the :class:`Dispatched` of the same step.
            async_op, previous_event: see :meth:`_launch`.
        Returns:
            ``[s, H]`` in ``expert_out``'s dtype; ``sum_k w_k * out_k`` (or the plain sum with
            ``apply_weights="dispatch"``). Rows of tokens whose choices are all masked are zero.
            Differentiable with respect to ``expert_out`` and ``h.weights`` (the backward is a dispatch).

        The op ``moonep::combine``, eagerly and as one node of a ``torch.compile`` graph.
        """
        if async_op is not False or previous_event is not None:
            return self._launch("combine", async_op, previous_event,
                                lambda traced: self._combine(expert_out, h, traced), (expert_out, h))
        return self._combine(expert_out, h, False)

    def _combine(self, expert_out, h, traced_async: bool):
        err = self._handle_error(h, expert_out=expert_out)
        if err is not None:
            self.refuse("combine", err)
        return call_combine(expert_out, h, traced_async)

    def _combine_body(self, expert_out, weights, token, tracked: int, graph: bool):
        """The body of ``moonep::combine``: ``expert_out [cap, H]`` -> ``[s, H]`` (``tracked``: bit 0, autograd
        records it for ``expert_out``; bit 1, for ``weights``)."""
        step, err = self._lookup(token)
        err = err or _local_error(self._check_combine, expert_out, step, weights, graph)
        sig, describe = (), None
        if err is None:
            st = step.routing
            to, tw = bool(tracked & 1), self.apply_weights == "combine" and bool(tracked & 2)
            sig = (_dt(expert_out), expert_out.shape[1], st.step, to, tw)
            describe = lambda: [("expert_out", f"dtype {expert_out.dtype}"),  # noqa: E731
                                ("expert_out", f"shape {list(expert_out.shape)}"), ("h", f"dispatch #{st.step}"),
                                ("expert_out", f"requires_grad={to}"), ("h.weights", f"requires_grad={tw}")]
        with self._collective("combine", error=err, sig=sig, describe=describe):
            y = self._backend.combine(expert_out, weights if self.apply_weights == "combine" else None,
                                      step.routing, expert_out.dtype)
        self._after_call()
        return y

    def prefetch(self, h: Dispatched, local_weight: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Weights of all ``2*epn`` slots: this rank's home experts, then the replicas the plan placed here.

        A copy of the home weights each step: :class:`moonep.ReplicaPool` with :func:`moonep.expert_matmul`
        reads them in place instead (the way to bring replica weights).

        Args:
            local_weight: ``[epn, *D]`` this rank's home expert weights (one projection).
            out: removed (refused on every rank): fetch replicas through a :class:`moonep.ReplicaPool`.
        Returns:
            ``[2*epn, *D]``; empty replica slots are zero. Differentiable: the gradient of the replica
            slots flows back to their home rank (see ``reduce_grad``). Collective.

        The op ``moonep::prefetch``, eagerly and as one node of a ``torch.compile`` graph.
        """
        err = self._handle_error(h, local_weight=local_weight)
        if out is not None:
            err = ("out: expected None (prefetch(out=...) was removed: fetch replicas through a moonep.ReplicaPool, "
                   f"pool.fetch(ep, h, home_weight, name), and multiply with moonep.expert_matmul), got "
                   f"{type(out).__name__}")
        if err is not None:
            self.refuse("prefetch", err)
        return call_prefetch(h, local_weight)

    def _prefetch_body(self, local_weight, token, tracked: int):
        """The body of ``moonep::prefetch``: ``[epn, *D]`` -> ``[2*epn, *D]`` (``tracked``: the backward reduce
        will run)."""
        step, err = self._lookup(token)
        err = err or _local_error(self._check_prefetch, step, local_weight)
        sig, describe = (), None
        if err is None:
            n = step.routing.step
            sig = (_dt(local_weight), _shape_key(local_weight.shape), n, bool(tracked))
            describe = lambda: [("local_weight", f"dtype {local_weight.dtype}"),  # noqa: E731
                                ("local_weight", f"shape {list(local_weight.shape)}"), ("h", f"dispatch #{n}"),
                                ("local_weight", f"requires_grad={bool(tracked)}")]
        with self._collective("prefetch", error=err, sig=sig, describe=describe):
            return self._backend.prefetch(step.plan, local_weight)

    @eager_only  # under torch.compile: one graph break per collective (moonep.ops: none)
    def prefetch_replicas(self, h: Dispatched, local_weight: torch.Tensor, out: torch.Tensor, *,
                          in_backward: bool = False) -> torch.Tensor:
        """Deprecated: use :class:`moonep.ReplicaPool` (``pool.fetch(ep, h, local_weight, name)``), which
        owns the buffers.  Fetches this step's replica slots of ``local_weight [epn, *D]`` into ``out [epn,
        *D]`` (contiguous, not requiring grad); returns ``out``. Collective."""
        _deprecated("ExpertParallel.prefetch_replicas is deprecated: fetch through a moonep.ReplicaPool "
                    "(pool.fetch(ep, h, home_weight, name), the pool made once per model)")
        return self._fetch_replicas(h, [local_weight], [out], in_backward=in_backward)[0]

    def _fetch_replicas(self, h, local_weights: list, outs: list, *, in_backward: bool = False,
                        fresh: bool = False, names=None) -> list:
        """This step's replica slots of several projections, in one collective (``moonep::fetch_replicas``): the
        building block of :class:`moonep.ReplicaPool` and ``moonep.ops``.

        Args:
            h: the :class:`Dispatched` of the step.
            local_weights: ``[epn, *D_i]`` this rank's home expert weights of each projection; only read (the
                home rows of a slot GEMM multiply them in place).
            outs: ``[epn, *D_i]`` buffers like them (contiguous, not requiring grad): slot ``j`` receives the
                weights of expert ``h.slot_experts[epn + j]`` (zero where that is ``-1``).
            in_backward: the call runs inside an autograd backward (checked with the peers only where the
                backend checks backward passes).
            fresh: ``outs`` are new tensors that no later call passes again (``moonep.ops``): every empty
                slot is zeroed and the backend keeps nothing of them; else persistent pool buffers, whose
                slots that stayed empty are not zeroed again.
            names: the projections' names (:class:`moonep.ReplicaPool`'s), checked with the peers: two ranks
                passing equal-shaped projections in another order are refused.
        Returns:
            ``outs``. Not differentiable by itself (see :func:`moonep.expert_matmul`). Collective.
        """
        op = "prefetch.backward" if in_backward else "prefetch"
        err = self._handle_error(h, **{f"local_weights[{i}]": w for i, w in enumerate(local_weights)},
                                 **{f"out[{i}]": o for i, o in enumerate(outs)})
        if err is not None:
            self._refuse(op, err, in_backward)
        op_state.call(torch.ops.moonep.fetch_replicas.default, list(local_weights), list(outs), h.step, h.op_id,
                      fresh, in_backward, list(names or ()))
        return list(outs)

    def _fetch_body(self, local_weights: list, outs: list, token, fresh: bool, in_backward: bool,
                    names: list) -> list:
        """The body of ``moonep::fetch_replicas`` (``token``: the step token, or the :class:`Step` itself)."""
        h, err = self._lookup(token)
        if err is None and len(outs) != len(local_weights):
            err = f"out: expected {len(local_weights)} tensors (one per local weight), got {len(outs)}"
        for w, out in zip(local_weights, outs):
            err = err or _local_error(self._check_replicas, w, out, "out")
        sig, describe = (), None
        if err is None:
            step = h.routing.step
            shapes = tuple((_dt(w), _shape_key(w.shape)) for w in local_weights)
            sig = (len(local_weights), _shape_key(shapes), step, names_key(names))
            describe = lambda: [("local_weights", f"{len(local_weights)} projections"),  # noqa: E731
                                ("local_weights", "dtypes and shapes " + ", ".join(
                                    f"{w.dtype} {list(w.shape)}" for w in local_weights)),
                                ("h", f"dispatch #{step}"), ("name", f"projections {names}")]
        op = "prefetch.backward" if in_backward else "prefetch"
        with self._collective(op, error=err, sig=sig, describe=describe, backward=in_backward):
            return self._backend.prefetch_replicas(h.plan, local_weights, outs, fresh=fresh)

    def reduce_replicas(self, h: Dispatched, home_grad: torch.Tensor, replica_grad: torch.Tensor, *,
                        in_backward: bool = False, async_op: bool = False,
                        previous_event=None) -> torch.Tensor | Work:
        """:meth:`reduce_grad` with the halves apart: ``home_grad [epn, *D]`` (this rank's home slots) plus
        the replica slots' gradients of every rank (``replica_grad [epn, *D]`` here) that belong to this
        rank's experts, added in rank order -> ``[epn, *D]`` in ``home_grad``'s dtype. Collective
        (``moonep::reduce_replicas``).  ``in_backward``: called from a backward (named so in errors) with
        ``home_grad`` that backward's own scratch, which then holds the sum (no copy of the home gradients).
        ``async_op``, ``previous_event``: see :meth:`_launch`."""
        if async_op is not False or previous_event is not None:
            return self._launch("prefetch.backward" if in_backward else "reduce_grad", async_op, previous_event,
                                lambda traced: self._reduce_replicas(h, home_grad, replica_grad, in_backward, traced),
                                (h, home_grad, replica_grad), backward=in_backward)
        return self._reduce_replicas(h, home_grad, replica_grad, in_backward, False)

    def _reduce_replicas(self, h, home_grad, replica_grad, in_backward: bool, traced_async: bool):
        if isinstance(h, Step):  # inside an op's body: the step is at hand
            return self._reduce_body(home_grad, replica_grad, h, in_backward)
        op = "prefetch.backward" if in_backward else "reduce_grad"
        err = self._handle_error(h, home_grad=home_grad, replica_grad=replica_grad)
        if err is not None:
            self._refuse(op, err, in_backward)
        home = home_grad if in_backward else home_grad.detach().clone()
        if traced_async:
            work = torch.ops.moonep.reduce_replicas_async.default(home, replica_grad, h.step, h.op_id, in_backward)
            return CompiledWork("prefetch.backward" if in_backward else "reduce_grad", [home], work, h.op_id, _first,
                                (replica_grad,))
        op_state.call(torch.ops.moonep.reduce_replicas.default, home, replica_grad, h.step, h.op_id, in_backward)
        return home

    def _reduce_body(self, home_grad, replica_grad, token, in_backward: bool):
        """The body of ``moonep::reduce_replicas``: the sum made in ``home_grad`` (``token``: the step token, or
        the :class:`Step` itself); returns it."""
        h, err = self._lookup(token)
        err = err or _local_error(self._check_replicas, home_grad, replica_grad, "replica_grad")
        sig, describe = _weights_signature("home_grad", home_grad, h) if err is None else ((), None)
        op = "prefetch.backward" if in_backward else "reduce_grad"
        with self._collective(op, error=err, sig=sig, describe=describe, backward=in_backward):
            out = self._backend.reduce_replicas(h.plan, home_grad, replica_grad, scratch=True)
        if out.data_ptr() != home_grad.data_ptr():  # (the backend summed a contiguous copy)
            home_grad.copy_(out.view(home_grad.shape))
        return home_grad

    def _check_replicas(self, home, other, name: str) -> None:
        """``home [epn, *D]`` and ``other`` (named ``name``) of the same shape, dtype and device."""
        what = "local_weight" if name == "out" else "home_grad"
        expect_tensor(home, what, device=self.device)
        if home.dim() < 1 or home.shape[0] != self.epn:  # (messages are built only on failure)
            fail(what, f"shape [epn={self.epn}, ...]", list(home.shape))
        expect(isinstance(other, torch.Tensor), name, "a torch.Tensor", type(other).__name__)
        if not (other.shape == home.shape and other.dtype == home.dtype and other.device == home.device):
            fail(name, f"a tensor like {what} ({list(home.shape)}, {home.dtype}, {home.device})",
                 f"{list(other.shape)}, {other.dtype}, {other.device}")
        if name == "out":
            if not other.is_contiguous():
                fail("out", "a contiguous tensor", f"strides {tuple(other.stride())}")
            expect(not other.requires_grad, "out", "a tensor that does not require grad", "requires_grad=True")

    def _check_prefetch(self, step, local_weight) -> None:
        self._check_step(step)
        expect_tensor(local_weight, "local_weight", device=self.device)
        expect(local_weight.dim() >= 1 and local_weight.shape[0] == self.epn, "local_weight",
               f"shape [epn={self.epn}, ...]", list(local_weight.shape))

    def reduce_grad(self, h: Dispatched, grad_view: torch.Tensor, *, async_op: bool = False,
                    previous_event=None) -> torch.Tensor | Work:
        """Sum replica gradients into their home experts: ``[2*epn, *D] -> [epn, *D]``. Collective
        (``moonep::reduce_grad``).

        Replica slot gradients are sent to their home rank and added to the home gradient in rank order.
        ``async_op``, ``previous_event``: see :meth:`_launch`.
        """
        if async_op is not False or previous_event is not None:
            return self._launch("reduce_grad", async_op, previous_event,
                                lambda traced: self._reduce_grad(h, grad_view, traced), (h, grad_view))
        return self._reduce_grad(h, grad_view, False)

    def _reduce_grad(self, h, grad_view, traced_async: bool):
        err = self._handle_error(h, grad_view=grad_view)
        if err is not None:
            self.refuse("reduce_grad", err)
        if traced_async:
            out, work = torch.ops.moonep.reduce_grad_async.default(grad_view, h.step, h.op_id)
            return CompiledWork("reduce_grad", [out], work, h.op_id, _first, (grad_view,))
        return op_state.call(torch.ops.moonep.reduce_grad.default, grad_view, h.step, h.op_id)

    def _reduce_grad_body(self, grad_view, token):
        """The body of ``moonep::reduce_grad``: ``[2*epn, *D]`` -> ``[epn, *D]`` (a tensor of its own)."""
        h, err = self._lookup(token)
        err = err or _local_error(self._check_reduce_grad, grad_view)
        sig, describe = _weights_signature("grad_view", grad_view, h) if err is None else ((), None)
        with self._collective("reduce_grad", error=err, sig=sig, describe=describe):
            return op_state.fresh_output(self._backend.reduce_grad(h.plan, grad_view), grad_view)

    def _check_reduce_grad(self, grad_view) -> None:
        expect_tensor(grad_view, "grad_view", device=self.device)
        expect(grad_view.dim() >= 1 and grad_view.shape[0] == 2 * self.epn, "grad_view",
               f"shape [2*epn={2 * self.epn}, ...]", list(grad_view.shape))
