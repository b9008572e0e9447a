"""``ExpertParallel``: balanced dispatch, combine, replica weight prefetch and gradient reduce.

    ep = moonep.ExpertParallel(num_experts=E, topk=K, hidden=H, max_tokens=S, dtype=torch.float32)
    h = ep.dispatch(x, topk_idx, topk_weights)      # collective
    w = ep.prefetch(h, local_weight)                 # [epn, ...] -> [2*epn, ...]
                                                     # (or ep.prefetch(h, pool[:epn], out=pool): no copies)
    out = my_experts(h.tokens, h.cu_seqlens, w)      # grouped over the 2*epn slots
    y = ep.combine(out, h)                           # [s, H]

Everything is differentiable: the backward of dispatch is a combine, the backward of combine is a
dispatch over the same plan, and the backward of prefetch is ``reduce_grad``.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from . import cpu_kernels, layout
from .combine import acc_dtype, combine_rows, gather_choices, sum_choices_by_rank
from .dispatch import Routing, build_routing, dispatch_packed, expand, expand_weights, pick_weights, send_tokens
from .errors import MoonepError, expect, expect_device, expect_int, expect_slack, expect_tensor
from .planner import plan_balanced
from .replicas import prefetch_weights, prefetch_weights_into, reduce_replica_grads
from .transport import make_transport
from .transport.guard import CollectiveGuard, mark_failed

_FLOAT = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


@dataclass
class Dispatched:
    """What ``dispatch`` returns; pass it to ``combine``, ``prefetch`` and ``reduce_grad``.

    Attributes:
        tokens: ``[cap, H]`` received rows in slot order (``cap`` depends only on S, K, R, align, slack).
            With ``apply_weights="dispatch"`` the rows are already multiplied by their routing weight.
        weights: ``[cap]`` routing weight of each row (dtype of ``topk_weights``; zero in unused rows).
        cu_seqlens: int32 ``[2*epn + 1]``: slot ``j`` owns rows ``cu_seqlens[j]:cu_seqlens[j+1]``.
        slot_experts: int64 ``[2*epn]``: global expert of each slot, home experts first, ``-1`` if empty.
        num_rows: rows used, ``int(cu_seqlens[-1])`` (equal on every rank with exact balance).  On the
            NVLink transport a 0-d device tensor (reading it as an int is a host sync the path avoids).
        plan: the :class:`moonep.planner.Plan` of this step.
    """

    tokens: torch.Tensor
    weights: torch.Tensor
    cu_seqlens: torch.Tensor
    slot_experts: torch.Tensor
    num_rows: object  # int, or a 0-d device tensor on the NVLink transport
    plan: object
    routing: object  # Routing (host path) or moonep.transport.nvlink.NvStep


class _DispatchFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_weights, ep, routing):
        ctx.ep, ctx.routing = ep, routing
        if routing.recv_rows is None:  # CPU: tokens, row lists and weights travel in one message
            tokens, weights = dispatch_packed(x, topk_weights, routing, ep.transport)
        else:
            recv = send_tokens(x, routing, ep.transport)
            tokens = expand(recv, routing.recv_rows, routing.capacity)
            w_pairs = pick_weights(topk_weights, routing)
            recv_w = ep.transport.all_to_all(w_pairs, routing.send_splits, routing.recv_splits)
            weights = expand_weights(recv_w, routing.recv_rows, routing.capacity)
        ctx.x_dtype, ctx.w_dtype = x.dtype, topk_weights.dtype
        return tokens, weights

    @staticmethod
    def backward(ctx, g_tokens, g_weights):
        ep, routing = ctx.ep, ctx.routing
        with ep._collective("dispatch.backward"):
            return _DispatchFn._backward(ctx, ep, routing, g_tokens, g_weights)

    @staticmethod
    def _backward(ctx, ep, routing, g_tokens, g_weights):
        # Gradient of x: a combine of the rows' gradients without weights (sum of the token's copies).
        gx = None
        if ctx.needs_input_grad[0]:
            gx = combine_rows(g_tokens, None, routing, ep.transport, ctx.x_dtype)
        gw = None
        if ctx.needs_input_grad[1]:
            # Per-choice weight gradients travel back K-aligned; each (token, k) is non-zero on one rank.
            back = gather_choices(g_weights, routing.recv_rows)
            back = ep.transport.all_to_all(back.contiguous(), routing.recv_splits, routing.send_splits)
            gw = sum_choices_by_rank(back, routing).to(ctx.w_dtype)
        return gx, gw, None, None


class _CombineFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, expert_out, weights, ep, routing, out_dtype):
        ctx.ep, ctx.routing = ep, routing
        ctx.save_for_backward(expert_out, weights)
        return combine_rows(expert_out, weights, routing, ep.transport, out_dtype)

    @staticmethod
    def backward(ctx, gy):
        with ctx.ep._collective("combine.backward"):
            return _CombineFn._backward(ctx, gy)

    @staticmethod
    def _backward(ctx, gy):
        ep, routing = ctx.ep, ctx.routing
        expert_out, weights = ctx.saved_tensors
        # The backward of combine is a dispatch of dy over the same plan.
        g_rows = expand(send_tokens(gy.contiguous(), routing, ep.transport), routing.recv_rows, routing.capacity)
        adt = acc_dtype(expert_out.dtype)
        g_rows = g_rows.to(adt)
        g_out = g_w = None
        if ctx.needs_input_grad[0]:
            g_out = (g_rows * weights.to(adt).unsqueeze(-1)).to(expert_out.dtype)
        if ctx.needs_input_grad[1]:
            g_w = (g_rows * expert_out.to(adt)).sum(-1).to(weights.dtype)
        return g_out, g_w, None, None, None


class _PrefetchFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local_weight, ep, plan):
        ctx.ep, ctx.plan = ep, plan
        return prefetch_weights(plan, ep.rank, local_weight, ep.transport)

    @staticmethod
    def backward(ctx, g):
        with ctx.ep._collective("prefetch.backward"):
            return reduce_replica_grads(ctx.plan, ctx.ep.rank, g.contiguous(), ctx.ep.transport), None, None


class _PrefetchIntoFn(torch.autograd.Function):
    """``prefetch(..., out=pool)`` under autograd: writes the pool in place and returns an alias of it
    carrying the graph; the backward is the same ``reduce_grad`` as :class:`_PrefetchFn`'s."""

    @staticmethod
    def forward(ctx, local_weight, ep, plan, holder):
        ctx.ep, ctx.plan = ep, plan
        out = holder[0]  # in a tuple, so autograd does not take the pool for an input
        prefetch_weights_into(plan, ep.rank, local_weight, ep.transport, out)
        return out.detach()

    @staticmethod
    def backward(ctx, g):
        with ctx.ep._collective("prefetch.backward"):
            return (reduce_replica_grads(ctx.plan, ctx.ep.rank, g.contiguous(), ctx.ep.transport),
                    None, None, None)


class ExpertParallel:
    """Balanced expert-parallel dispatch/combine over one process group.

    Args:
        group: a :class:`moonep.Runtime`, a ``torch.distributed`` ProcessGroup, or ``None`` (``moonep.init()``).
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
        transport: ``"auto"``, ``"mpi"``, ``"torch"`` or ``"nvlink"`` (device-initiated GPU kernels over CUDA
            IPC, no host sync, CUDA-graph capturable; see :mod:`moonep.transport.nvlink`).  ``"auto"`` picks
            NVLink on CUDA when every rank is on one node and the GPUs reach each other.
        zero_copy: NVLink only: ``True`` returns ``h.tokens``/``h.weights`` as views of the receive buffer
            (valid until the next dispatch), ``False`` copies; ``"auto"`` copies only when autograd records
            the dispatch.  Results are bitwise identical.
        timeout: seconds a collective waits for a peer before :class:`moonep.MoonepError` is raised, on the
            MPI transport and in the NVLink kernels (default: the runtime's timeout, ``MOONEP_TIMEOUT`` or
            60; ``MOONEP_NVLINK_TIMEOUT`` for NVLink).  The ``"torch"`` transport uses its process group's
            timeout (``moonep.init(timeout=...)``).
        num_sms: NVLink only: blocks used by the kernels that drive NVLink.

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
                 timeout: float | None = None, num_sms: int = 24):
        from .runtime import Runtime, init

        self.rt = group if isinstance(group, Runtime) else init(group)
        R = self.rt.world_size
        self.rank, self.world_size = self.rt.rank, R
        try:  # a bad device fails on every rank, in the collective check below, not as a hang
            self.device, dev_err = (expect_device(device) if device is not None else self.rt.device), None
        except ValueError as exc:
            self.device, dev_err = self.rt.device, str(exc)
        self._engine = None
        self._closed = False
        self._failed = False  # a collective of this instance raised MoonepError: close() must not wait for peers
        expect(transport in ("auto", "mpi", "torch", "nvlink"), "transport", '"auto", "mpi", "torch" or "nvlink"',
               repr(transport))
        self.transport = make_transport("auto" if transport == "nvlink" else transport, self.rt)
        use_nvlink = False
        # "auto" keeps float64 on the host-driven path: the NVLink kernels move 16/32-bit rows only.
        if transport == "nvlink" or (transport == "auto" and self.device.type == "cuda"
                                     and dtype in (torch.float32, torch.bfloat16, torch.float16)):
            from .transport.nvlink import nvlink_available

            ok, why = nvlink_available(self.rt) if self.device.type == "cuda" else (False, "not a CUDA device")
            verdicts = self.transport.all_gather_object((ok, why))
            bad = [(r, w) for r, (o, w) in enumerate(verdicts) if not o]
            if transport == "nvlink" and bad:
                raise ValueError(f"transport: expected every rank to reach its peers over NVLink/P2P, got "
                                 f"rank {bad[0][0]}: {bad[0][1]}")
            use_nvlink = not bad
        config = dict(num_experts=num_experts, topk=topk, hidden=hidden, max_tokens=max_tokens,
                      dtype=str(dtype), align=align, apply_weights=apply_weights,
                      slack=float(slack) if isinstance(slack, (int, float)) else repr(slack),
                      transport="nvlink" if use_nvlink else self.transport.name)
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
            expect(timeout is None or (isinstance(timeout, (int, float)) and 0 < timeout < float("inf")),
                   "timeout", "None or a finite number of seconds > 0", repr(timeout))
            expect_int(num_sms, "num_sms", 1)
            expect(apply_weights in ("combine", "dispatch"), "apply_weights", '"combine" or "dispatch"',
                   repr(apply_weights))
        except ValueError as exc:
            errors.append(str(exc))
        # Every rank checks every rank's configuration, so a mismatch fails everywhere, not as a hang later.
        configs = self.transport.all_gather_object((config, errors))
        for r, (cfg, errs) in enumerate(configs):
            if errs:
                raise ValueError(f"{errs[0]} (on rank {r})")
        for key in config:
            values = [cfg[key] for cfg, _ in configs]
            expect(len(set(values)) == 1, key, "the same value on every rank",
                   "; ".join(f"rank {r}: {v!r}" for r, v in enumerate(values)))
        self.num_experts, self.topk, self.hidden, self.max_tokens = num_experts, topk, hidden, max_tokens
        self.epn = num_experts // R
        self.dtype, self.align, self.slack, self.apply_weights = dtype, align, float(slack), apply_weights
        self.capacity = layout.capacity(max_tokens, topk, R, num_experts, align=align, slack=slack)
        if use_nvlink:
            from .transport.nvlink import NVLinkEngine, default_timeout

            self._engine = NVLinkEngine(self, timeout=default_timeout(self.rt) if timeout is None else timeout,
                                        zero_copy=zero_copy, num_sms=num_sms)
        if timeout is not None and hasattr(self.transport, "timeout"):
            self.transport.timeout = float(timeout)  # the gloo/NCCL group keeps its own (see docstring)
        self._guard = CollectiveGuard(self.transport, self.rt, self.rt.next_instance())

    @contextmanager
    def _collective(self, op: str):
        """Run one collective call: refuse a closed instance, check the call order with the peers (for
        NVLink through host shared memory), and remember a failure so shutdown does not wait for a dead peer."""
        expect(not self._closed, "ExpertParallel", "an open instance", f"{op} called after close()")
        if self._engine is not None:
            self._guard.enter(op, exchange=self._engine.exchange_header)
            self._engine.op_label = f"{op} #{self._guard.seq}"
        else:
            self._guard.enter(op)
        try:
            yield
        except MoonepError:
            self._record_failure()
            raise

    def _record_failure(self) -> None:
        """A collective of this instance raised MoonepError: close() must not wait for peers, and the
        runtime's shutdown skips its barriers (see mark_failed)."""
        self._failed = True
        mark_failed(self.rt, self.transport.timeout_s())

    @property
    def transport_name(self) -> str:
        return "nvlink" if self._engine is not None else self.transport.name

    def synchronize(self) -> None:
        """Wait for this rank's queued work and raise any error the NVLink kernels recorded."""
        if self._engine is not None:
            try:
                self._engine.synchronize()
            except MoonepError:
                self._record_failure()
                raise

    def close(self, check: bool = True) -> None:
        """Release the NVLink buffers (collective unless a peer died) and, with ``check``, raise any error
        the kernels recorded.  Idempotent.  Later collective calls raise ``ValueError``."""
        self._closed = True
        if self._engine is not None:
            eng, self._engine = self._engine, None
            try:
                if check:
                    eng.check()
            finally:
                eng.close(peers_ok=not self._failed)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close(check=exc_type is None)  # don't mask the exception that is already propagating
        return False

    # -- validation ---------------------------------------------------------------------------------
    def _check_inputs(self, x, topk_idx, topk_weights):
        S, K, H, E = self.max_tokens, self.topk, self.hidden, self.num_experts
        expect_tensor(x, "x", dim=2, dtypes=self.dtype, device=self.device)
        s = x.shape[0]
        expect(x.shape[1] == H, "x", f"shape [s, {H}]", list(x.shape))
        expect(s <= S, "x", f"at most max_tokens={S} rows", s)
        expect_tensor(topk_idx, "topk_idx", dtypes=(torch.int32, torch.int64), device=self.device,
                      shape=(s, K))
        expect_tensor(topk_weights, "topk_weights", dtypes=_FLOAT, device=self.device, shape=(s, K))
        if s and topk_idx.device.type == "cpu":
            lo, hi, i = cpu_kernels.check_topk(topk_idx.to(torch.int64).contiguous().numpy())
            expect(lo >= -1 and hi < E, "topk_idx", f"expert ids in [-1, {E})", f"values in [{lo}, {hi}]")
            if i >= 0:
                raise ValueError(f"topk_idx: expected distinct experts per token, got {topk_idx[i].tolist()} "
                                 f"for token {i}")
        elif s:
            lo, hi = int(topk_idx.min()), int(topk_idx.max())
            expect(lo >= -1 and hi < E, "topk_idx", f"expert ids in [-1, {E})", f"values in [{lo}, {hi}]")
            srt = topk_idx.sort(dim=1).values
            dup = ((srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)).any(dim=1)
            if bool(dup.any()):
                i = int(dup.nonzero()[0, 0])
                raise ValueError(f"topk_idx: expected distinct experts per token, got {topk_idx[i].tolist()} "
                                 f"for token {i}")
        if s:
            bad = ~torch.isfinite(topk_weights)
            if bool(bad.any()):
                i = int(bad.any(dim=1).nonzero()[0, 0])
                raise ValueError(f"topk_weights: expected finite values, got {topk_weights[i].tolist()} "
                                 f"for token {i}")

    # -- the data path ------------------------------------------------------------------------------
    def plan_step(self, x, topk_idx, topk_weights, num_global_tokens=None):
        """Validate, all-gather the routing counts and plan. Collective. Returns ``(plan, routing)``."""
        E, R = self.num_experts, self.world_size
        err = None
        try:
            self._check_inputs(x, topk_idx, topk_weights)
            idx = topk_idx.to(torch.int64)
            counts = torch.bincount(idx[idx >= 0], minlength=E).to(torch.int64)
            s = x.shape[0]
        except ValueError as exc:
            err, counts, s = str(exc), torch.zeros(E, dtype=torch.int64, device=self.device), 0
        # One gather carries the counts, s and an error flag, so bad input on one rank fails every rank.
        flag = torch.tensor([s, err is not None], dtype=torch.int64, device=counts.device)
        meta = self.transport.all_gather(torch.cat([counts, flag]))
        if bool(meta[:, -1].any()):
            msgs = self.transport.all_gather_object(err)
            r = next(i for i, m in enumerate(msgs) if m)
            raise ValueError(err if err else f"{msgs[r]} (on rank {r})")
        if num_global_tokens is not None:
            expect_int(num_global_tokens, "num_global_tokens", 0)
            total = int(meta[:, E].sum())
            expect(total == num_global_tokens, "num_global_tokens",
                   f"the sum of tokens over ranks ({total})", num_global_tokens)
        plan = plan_balanced(meta[:, :E].contiguous(), slack=self.slack)
        routing = build_routing(plan, self.rank, topk_idx.to(torch.int64), self.transport, self.capacity,
                                align=self.align, exchange_rows=x.device.type != "cpu")
        return plan, routing

    def dispatch(self, x, topk_idx, topk_weights, *, num_global_tokens=None) -> Dispatched:
        """Send every token to the ranks of its experts, into its final slot rows there. Collective.

        Args:
            x: ``[s, H]`` tokens, ``dtype`` of the constructor, ``s <= max_tokens`` (``s`` may differ
                between ranks and may be 0).
            topk_idx: int32/int64 ``[s, K]`` expert ids, distinct per token; ``-1`` masks a choice.
            topk_weights: float ``[s, K]`` finite routing weights.
            num_global_tokens: optional sum of ``s`` over ranks; checked when given.
        Returns:
            :class:`Dispatched`; differentiable with respect to ``x`` and ``topk_weights``.
        """
        with self._collective("dispatch"):
            return self._dispatch(x, topk_idx, topk_weights, num_global_tokens)

    def _dispatch(self, x, topk_idx, topk_weights, num_global_tokens):
        if self._engine is not None:
            from .transport import nvlink

            return nvlink.dispatch(self, x, topk_idx, topk_weights, num_global_tokens)
        plan, routing = self.plan_step(x, topk_idx, topk_weights, num_global_tokens)
        tokens, weights = _DispatchFn.apply(x, topk_weights, self, routing)
        if self.apply_weights == "dispatch":
            tokens = (tokens.to(acc_dtype(tokens.dtype)) * weights.to(acc_dtype(tokens.dtype))[:, None]).to(tokens.dtype)
        return Dispatched(tokens, weights, layout.cu_seqlens(plan, self.rank, align=self.align),
                          layout.slot_experts(plan, self.rank), int(plan.recv_counts[self.rank]), plan, routing)

    def combine(self, expert_out: torch.Tensor, h: Dispatched) -> torch.Tensor:
        """Return each token's weighted sum of its experts' outputs. Collective.

        Args:
            expert_out: ``[cap, H]`` (any float dtype), row ``i`` is the expert output for ``h.tokens[i]``.
            h: the :class:`Dispatched` of the same step.
        Returns:
            ``[s, H]`` in ``expert_out``'s dtype; ``sum_k w_k * out_k`` (or the plain sum with
            ``apply_weights="dispatch"``). Rows of tokens whose choices are all masked are zero.
        """
        expect_tensor(expert_out, "expert_out", dim=2, dtypes=_FLOAT, device=self.device,
                      shape=(self.capacity, None))
        expect(isinstance(h, Dispatched), "h", "the Dispatched returned by dispatch", type(h).__name__)
        with self._collective("combine"):
            if self._engine is not None:
                from .transport import nvlink

                return nvlink.combine(self, expert_out, h)
            weights = h.weights if self.apply_weights == "combine" else torch.ones_like(h.weights)
            return _CombineFn.apply(expert_out, weights, self, h.routing, expert_out.dtype)

    def prefetch(self, h: Dispatched, local_weight: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Weights of all ``2*epn`` slots: this rank's home experts, then the replicas the plan placed here.

        Args:
            local_weight: ``[epn, *D]`` this rank's home expert weights (one projection).
            out: optional persistent ``[2*epn, *D]`` pool (contiguous, ``local_weight``'s dtype and device,
                not requiring grad) that the caller keeps across steps.  Only the replica slots
                ``out[epn:]`` are written (empty ones zeroed); the home half is copied only when
                ``local_weight`` is not ``out[:epn]`` itself.  Recommended layout, so nothing is copied for
                the home experts::

                    pool = torch.empty(2 * epn, *D, dtype=dtype, device=device)     # once
                    w = torch.nn.Parameter(pool[:epn])   # the home weights ARE the pool's first half
                    ...
                    slots = ep.prefetch(h, w, out=pool)  # every step: only the replicas move

                Keep the home parameters views of the pool (optimizers update them in place; moving or
                re-allocating them only turns the skipped copy back on).  ``local_weight`` must be either
                ``out[:epn]`` or disjoint from ``out`` (other overlaps raise ``ValueError``).  The values are
                bitwise those of the form without ``out``.  The replica slots are overwritten by the next
                ``prefetch`` into the same pool: use one pool per projection (and per layer whose slot
                weights must stay alive at the same time, e.g. until that layer's backward).  On the NVLink
                transport a slot that stays empty is zeroed once, when it becomes empty, not at every
                call (most of a pool of large weights is such slots): don't write into ``out[epn:]``
                between calls, and don't share one pool between two ExpertParallel instances (a new
                tensor as ``out`` starts over).
        Returns:
            ``[2*epn, *D]``; empty replica slots are zero. Differentiable: the gradient of the replica
            slots flows back to their home rank (see ``reduce_grad``). Collective.  With ``out``: ``out``
            itself, or, when autograd records (``local_weight.requires_grad`` and grad enabled), an alias of
            ``out`` (same memory) carrying the graph: the home slots' gradient flows to ``local_weight``
            and the replica slots' gradient goes home through ``reduce_grad``, as without ``out``.  The alias
            shares the pool's version counter: a second ``prefetch`` into the same pool before the backward
            of ops that saved the first result makes that backward raise torch's in-place error instead of
            using overwritten weights.
        """
        expect(isinstance(h, Dispatched), "h", "the Dispatched returned by dispatch", type(h).__name__)
        expect_tensor(local_weight, "local_weight", device=self.device)
        expect(local_weight.dim() >= 1 and local_weight.shape[0] == self.epn, "local_weight",
               f"shape [epn={self.epn}, ...]", list(local_weight.shape))
        if out is not None:
            self._check_pool(local_weight, out)
        with self._collective("prefetch"):
            return self._prefetch(h, local_weight, out)

    def _prefetch(self, h, local_weight, out):
        if out is not None:
            if self._engine is not None:
                from .transport import nvlink

                return nvlink.prefetch(self, h, local_weight, out=out)
            if torch.is_grad_enabled() and local_weight.requires_grad:
                return _PrefetchIntoFn.apply(local_weight, self, h.plan, (out,))
            return prefetch_weights_into(h.plan, self.rank, local_weight, self.transport, out)
        if self._engine is not None:
            from .transport import nvlink

            return nvlink.prefetch(self, h, local_weight)
        return _PrefetchFn.apply(local_weight.contiguous(), self, h.plan)

    def _check_pool(self, local_weight: torch.Tensor, out) -> None:
        """Validate ``prefetch``'s ``out`` pool against ``local_weight`` (raises ``ValueError``)."""
        from .replicas import home_is_view

        shape = (2 * self.epn, *local_weight.shape[1:])
        expect(isinstance(out, torch.Tensor), "out", "a torch.Tensor", type(out).__name__)
        expect(out.dtype == local_weight.dtype, "out", f"dtype {local_weight.dtype} (that of local_weight)",
               out.dtype)
        expect(out.device == local_weight.device, "out", f"device {local_weight.device} (that of local_weight)",
               out.device)
        expect(tuple(out.shape) == shape, "out", f"shape [2*epn={2 * self.epn}, *local_weight.shape[1:]] = "
               f"{list(shape)}", list(out.shape))
        expect(out.is_contiguous(), "out", "a contiguous tensor", f"strides {tuple(out.stride())}")
        expect(not out.requires_grad, "out", "a tensor that does not require grad (prefetch writes it in place; "
               "the gradient flows through the returned tensor)", "requires_grad=True")
        home_is_view(local_weight, out)  # raises on a partial overlap

    def reduce_grad(self, h: Dispatched, grad_view: torch.Tensor) -> torch.Tensor:
        """Sum replica gradients into their home experts: ``[2*epn, *D] -> [epn, *D]``. Collective.

        Replica slot gradients are sent to their home rank and added to the home gradient in rank order.
        """
        expect(isinstance(h, Dispatched), "h", "the Dispatched returned by dispatch", type(h).__name__)
        expect_tensor(grad_view, "grad_view", device=self.device)
        expect(grad_view.dim() >= 1 and grad_view.shape[0] == 2 * self.epn, "grad_view",
               f"shape [2*epn={2 * self.epn}, ...]", list(grad_view.shape))
        with self._collective("reduce_grad"):
            if self._engine is not None:
                from .transport import nvlink

                return nvlink.reduce_grad(self, h, grad_view)
            return reduce_replica_grads(h.plan, self.rank, grad_view.contiguous(), self.transport)
