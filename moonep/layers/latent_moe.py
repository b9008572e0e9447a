"""LatentMoE: routed experts in a latent space, exactly balanced across ranks (BRIEF section 3).

    s = sigmoid(W_r x)                  [s, E] router scores; top-K of s + b (QB bias), weights s/sum
    z = W_down x                        [s, l]  experts see the latent width l (K3: l = d/2)
    u = sum_k p_k SiTU-GLU_e(z)         [s, l]  dispatch -> 2*epn slot GEMMs -> combine
    y = sum_j Shared_j(x) + W_up RMSNorm(u)

The RMSNorm comes after combine because it must see the fully reduced ``u`` (a sum of normed parts is
not the norm of the sum). Dispatching ``z`` rather than ``x`` halves the bytes on the wire at l = d/2.
"""
from __future__ import annotations

import contextlib

import torch
import torch.utils.checkpoint  # noqa: F401  (its early-stop exception, below)
from torch import nn

from ..balance import QuantileBalancer, normalise_topk
from ..errors import RefusedEverywhere, expect, expect_device, expect_tensor, fail
from ..experts import ReplicaPool, default_pool, expert_matmul
from ..eager_math import autocast_on, keep_eager
from .activations import situ_glu_fused
from ..training.sharding import shard_experts_param
from .parallel import EPProvider, ShardedExperts, home_range, resolve_group

# (torch.utils.checkpoint, use_reentrant=False, stops a recomputed forward by raising this once it has what the
# backward needs)
_STOP_RECOMPUTATION = getattr(torch.utils.checkpoint, "_StopRecomputationError", ())

_FLOAT = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


class _FanOut(torch.autograd.Function):
    """``x`` handed to ``n`` consumers as ``n`` views, their gradients summed in one fixed order.

    ``x`` feeding the router, the down projection and the shared experts directly would have its gradient
    accumulated in the order the backward reaches them, which eager autograd and AOTAutograd (torch.compile)
    choose differently: not bitwise equal.  A single node whose backward adds them itself fixes the order,
    without copying anything."""

    @staticmethod
    def forward(ctx, x, n: int):
        return tuple(x.view_as(x) for _ in range(n))

    @staticmethod
    def backward(ctx, *grads):
        return _sum_in_order(*[g for g in grads if g is not None]), None


def _add(*ts: torch.Tensor) -> torch.Tensor:
    total = ts[0]
    for t in ts[1:]:
        total = total + t  # rounded to the dtype after each add, as eager autograd's accumulation is
    return total


# The layer's own math: fused by inductor when compiled, or, inside moonep.eager_math.bitwise() (tests), run as
# eager runs it, so that a compiled layer's outputs and gradients are eager's bit for bit (inductor regenerates
# the elementwise code, adds bf16 terms in float32 before one rounding, and on CPU lowers small GEMMs itself).
_sigmoid = keep_eager(torch.sigmoid, "latent_moe.sigmoid")
_situ_glu = keep_eager(situ_glu_fused, "latent_moe.situ_glu")
_rms_norm = keep_eager(lambda u, w, eps: nn.functional.rms_norm(u, (u.shape[-1],), w, eps), "latent_moe.rms_norm")
_sum_in_order = keep_eager(_add, "latent_moe.fan_out_sum")
_linear = keep_eager(lambda x, w: nn.functional.linear(x, w), "latent_moe.linear")
_shared_in = keep_eager(lambda x, w: torch.einsum("sd,ndf->nsf", x, w), "latent_moe.shared_in")
_shared_out = keep_eager(lambda h, w: torch.einsum("nsf,nfd->sd", h, w), "latent_moe.shared_out")


def _plain(m: nn.Module, kind: type) -> bool:
    """``m`` is exactly a ``kind`` without hooks (a wrapped or hooked submodule, e.g. LoRA, is called as is)."""
    return type(m) is kind and not (m._forward_hooks or m._forward_pre_hooks)


def _project(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``m(x)`` for the layer's bias-free projections (as eager computes it when compiled inside ``bitwise()``)."""
    return _linear(x, m.weight) if _plain(m, nn.Linear) and m.bias is None else m(x)


def _init(shape, fan_in: int, seed: int) -> torch.Tensor:
    """Deterministic float32 init from its own seed, so a model is the same at every R."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) / fan_in ** 0.5


class LatentExperts(ShardedExperts, nn.Module):
    """The routed SiTU-GLU experts of a :class:`LatentMoE`, this rank's home experts (``epn`` of ``E``).

    Parameters: ``w_in [E, l, 2F]`` (gate ``g`` columns then ``u``) and ``w_out [E, F, l]``, ``Shard(0)``
    DTensors over the expert-parallel mesh (local ``[epn, ...]``; plain tensors without a process group).
    A module of their own so that FSDP2 can give the experts their own mesh
    (:func:`moonep.training.fully_shard_experts`)."""

    sharded_params = ("w_in", "w_out")

    def __init__(self, w_in: torch.Tensor, w_out: torch.Tensor, num_experts: int, rt):
        super().__init__()
        self._rt, self.moonep_num_experts, self.moonep_epn = rt, num_experts, w_in.shape[0]
        self.moonep_rank = 0 if rt is None else rt.rank
        self.w_in = shard_experts_param(w_in, rt, num_experts)
        self.w_out = shard_experts_param(w_out, rt, num_experts)

    def forward(self, ep, z: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, pool=None,
                matmul: str = "auto"):
        """The routed experts on the latent tokens: ``u = sum_k w_k SiTU-GLU_{e_k}(z)``. Collective.

        Args:
            ep: the :class:`moonep.ExpertParallel` of ``z``'s dtype; ``z [s, l]`` latent tokens, in the dtype
                the experts compute in (their weights are cast to it); ``topk_idx`` int64 ``[s, K]``,
                ``topk_weights [s, K]``; ``pool``: the :class:`moonep.ReplicaPool` (default: the process's).
        Returns:
            ``(u [s, l] in z's dtype, stats)``: ``stats`` the figures of :attr:`LatentMoE.last_stats`.
        The weights are read here, inside this module's forward, so that FSDP2 (which shards them over the
        data-parallel ranks) gathers them for exactly this call."""
        dt = z.dtype
        w_in, w_out = (w if w.dtype == dt else w.to(dt) for w in map(self.expert_weight, ("w_in", "w_out")))
        # one code path, eager and compiled: each collective is an op of moonep/ops.py (one node of a compiled
        # graph)
        h = ep.dispatch(z, topk_idx, topk_weights)
        # both projections' replicas into the shared pool (CUDA: overlapping the first home-rows GEMM)
        pool = pool or default_pool()
        r_in, r_out = pool.fetch(ep, h, [w_in, w_out], ["w_in", "w_out"])  # one collective
        cu = h.cu_seqlens
        with torch.autocast(z.device.type, enabled=False):  # the experts' dtype is decided: z's
            a = _situ_glu(expert_matmul(h.tokens, cu, w_in, r_in, impl=matmul))         # [cap, F]
            out = expert_matmul(a, cu, w_out, r_out, impl=matmul)                        # [cap, l]
        plan = h.plan
        stats = dict(expert_load=plan.assignment.sum(1), recv_counts=plan.recv_counts,
                     replicas=(plan.replica_experts >= 0).sum(1))
        return ep.combine(out, h), stats                                                 # [s, l]

    def extra_repr(self) -> str:
        return f"num_experts={self.moonep_num_experts}, home experts={self.moonep_epn}"


class LatentMoE(nn.Module):
    """Latent-space Mixture-of-Experts layer with expert parallelism.

    Args:
        d_model: ``d``, input and output width.
        d_latent: ``l <= d``, width the routed experts see (and the wire carries).
        num_experts: ``E``, a multiple of the group size ``R``.
        topk: ``K <= E`` experts per token.
        d_expert: hidden width ``F`` of each routed SiTU-GLU expert.
        num_shared: shared full-width experts (``0`` for none).
        d_shared: hidden width of each shared expert (default ``d_expert``).
        group: a :class:`moonep.Runtime`, a ProcessGroup, or ``None`` (the launcher's job; a plain single
            process runs with ``R = 1`` and no process group).
        balancer: ``"qb"`` (a :class:`moonep.balance.QuantileBalancer`, the default), ``None`` (plain top-K of
            the scores) or a QuantileBalancer instance.
        max_tokens: ``S`` for static EP buffers; ``None`` sizes them from the largest ``s`` seen.
        dtype, device: of the parameters (device defaults to the runtime's device).
        eps: RMSNorm epsilon.
        matmul: ``"auto"``, ``"grouped"`` or ``"loop"`` (see :func:`moonep.expert_matmul`).
        replica_pool: the :class:`moonep.ReplicaPool` the routed experts' replicas are fetched into (default:
            the process's shared pool, :func:`moonep.experts.default_pool`); give one with
            ``backward="keep"`` to trade memory for the backward's second fetch.
        ep_kwargs: passed to :class:`moonep.ExpertParallel` (``align``, ``slack``, ``transport``).

    Parameters (float ``dtype``): ``router.weight [E, d]``, ``down.weight [l, d]``, ``norm.weight [l]``,
    ``up.weight [d, l]``, ``shared_w_in [Ns, d, 2*Fs]``, ``shared_w_out [Ns, Fs, d]`` (replicated), and the
    routed experts ``experts.w_in [E, l, 2F]``, ``experts.w_out [E, F, l]`` (:class:`LatentExperts`: each rank
    holds its home experts). The model is initialised identically at every ``R`` from the default RNG (one
    seed is drawn and broadcast from rank 0).
    """

    def __init__(self, d_model: int, d_latent: int, num_experts: int, topk: int, d_expert: int,
                 num_shared: int = 2, d_shared: int | None = None, group=None, balancer="qb", *,
                 max_tokens: int | None = None, dtype: torch.dtype = torch.float32, device=None,
                 eps: float = 1e-6, matmul: str = "auto", replica_pool: ReplicaPool | None = None, **ep_kwargs):
        super().__init__()
        d_shared = d_expert if d_shared is None else d_shared
        for name, v in (("d_model", d_model), ("d_latent", d_latent), ("num_experts", num_experts),
                        ("topk", topk), ("d_expert", d_expert), ("d_shared", d_shared)):
            expect(isinstance(v, int) and not isinstance(v, bool) and v > 0, name, "a positive int", repr(v))
        expect(d_latent <= d_model, "d_latent", f"<= d_model ({d_model}), a compression of the model width",
               d_latent)
        expect(topk <= num_experts, "topk", f"<= num_experts ({num_experts})", topk)
        expect(isinstance(num_shared, int) and not isinstance(num_shared, bool) and num_shared >= 0, "num_shared",
               "an int >= 0", repr(num_shared))
        expect(dtype in _FLOAT, "dtype", "float32, float64, bfloat16 or float16", dtype)
        expect(matmul in ("auto", "grouped", "loop"), "matmul", '"auto", "grouped" or "loop"', repr(matmul))
        expect(isinstance(eps, (int, float)) and not isinstance(eps, bool) and 0 <= eps < float("inf"), "eps",
               "a finite float >= 0", repr(eps))
        expect(replica_pool is None or isinstance(replica_pool, ReplicaPool), "replica_pool",
               "None or a moonep.ReplicaPool", type(replica_pool).__name__)
        if device is not None:
            device = expect_device(device)
        expect(max_tokens is None or (isinstance(max_tokens, int) and max_tokens > 0), "max_tokens",
               "None or a positive int", repr(max_tokens))
        rt = resolve_group(group)
        home = home_range(num_experts, rt)  # raises for E % R != 0
        self._rt = rt
        self.world_size = 1 if rt is None else rt.world_size
        self.d_model, self.d_latent, self.num_experts, self.topk = d_model, d_latent, num_experts, topk
        self.d_expert, self.num_shared, self.d_shared = d_expert, num_shared, d_shared
        self.matmul, self.eps = matmul, eps
        dev = torch.device(device) if device is not None else (rt.device if rt is not None else torch.device("cpu"))

        seed = int(torch.randint(0, 2**62, (1,)))
        if rt is not None and rt.world_size > 1:  # one seed for the whole job, whatever each rank's RNG
            box = [seed]
            dist_bcast(box, rt)
            seed = box[0]
        E, d, l, Fe, Fs = num_experts, d_model, d_latent, d_expert, d_shared
        mk = lambda t: nn.Parameter(t.to(device=dev, dtype=dtype))  # noqa: E731
        self.router = nn.Linear(d, E, bias=False, device=dev, dtype=dtype)
        self.down = nn.Linear(d, l, bias=False, device=dev, dtype=dtype)
        self.norm = nn.RMSNorm(l, eps=eps, device=dev, dtype=dtype)
        self.up = nn.Linear(l, d, bias=False, device=dev, dtype=dtype)
        with torch.no_grad():
            self.router.weight.copy_(_init((E, d), d, seed))
            self.down.weight.copy_(_init((l, d), d, seed + 1))
            self.up.weight.copy_(_init((d, l), l, seed + 2))
        self.shared_w_in = mk(_init((num_shared, d, 2 * Fs), d, seed + 3))
        self.shared_w_out = mk(_init((num_shared, Fs, d), Fs, seed + 4))
        # Each expert from its own seed: the shards of any R assemble into the same full model.
        local = lambda t: t.to(device=dev, dtype=dtype)  # noqa: E731
        self.experts = LatentExperts(local(torch.stack([_init((l, 2 * Fe), l, seed + 10 + 2 * e) for e in home])),
                                     local(torch.stack([_init((Fe, l), Fe, seed + 11 + 2 * e) for e in home])),
                                     E, rt)

        if balancer == "qb":
            # K = E selects every expert: nothing to balance, and QB needs a (K+1)-th score.
            balancer = (QuantileBalancer(E, topk, group=None if rt is None else rt.group, device=dev)
                        if topk < E else None)
        expect(balancer is None or isinstance(balancer, QuantileBalancer), "balancer",
               '"qb", None or a QuantileBalancer', type(balancer).__name__)
        if balancer is not None:
            expect(balancer.num_experts == E and balancer.topk == topk, "balancer",
                   f"a QuantileBalancer with num_experts={E}, topk={topk}",
                   f"num_experts={balancer.num_experts}, topk={balancer.topk}")
        self.balancer = balancer
        self._ep = EPProvider(rt, E, max_tokens=max_tokens, **ep_kwargs)
        self.replica_pool = replica_pool
        self.last_stats: dict = {}

    # ------------------------------------------------------------------------------------------ parts
    @staticmethod
    def _inputs(x: torch.Tensor):
        """``x [s, d]`` for its three consumers (router, down projection, shared experts): views whose
        gradients are summed in one order, eagerly and compiled (:class:`_FanOut`)."""
        return _FanOut.apply(x, 3) if x.requires_grad else (x, x, x)

    def _norm(self, u: torch.Tensor) -> torch.Tensor:
        """``self.norm(u)`` for ``u [s, l]`` (as eager computes it when compiled inside ``bitwise()``); under
        autocast in float32, as autocast runs a layer norm (the ``up`` projection then casts it back)."""
        if u.dtype != self.norm.weight.dtype and autocast_on(u.device.type):
            u = u.float()
        if not _plain(self.norm, nn.RMSNorm) or self.norm.eps is None or self.norm.weight is None:
            return self.norm(u)
        return _rms_norm(u, self.norm.weight.to(u.dtype), self.norm.eps)

    def route(self, x: torch.Tensor):
        """``x [s, d]`` -> ``(topk_idx int64 [s, K], weights [s, K] in x.dtype)``; weights sum to 1."""
        idx, w, pending = self._select(x)
        self._record_routing(pending)
        return idx, w

    def _select(self, x: torch.Tensor):
        """:meth:`route` without recording in the balancer: ``(topk_idx, weights, pending)``; the forward
        records ``pending`` once its collectives went through, so a refused forward changes nothing."""
        scores = _sigmoid(_project(self.router, x))
        if self.balancer is not None:
            return self.balancer.select(scores)
        w, idx = scores.topk(self.topk, dim=1)
        return idx, normalise_topk(w), None

    def _record_routing(self, pending) -> None:
        if pending is not None:
            self.balancer.record(pending)

    def shared(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of the shared SiTU-GLU experts on ``x [s, d]`` -> ``[s, d]``."""
        if self.num_shared == 0:
            return torch.zeros_like(x)
        h = _situ_glu(_shared_in(x, self.shared_w_in))  # [Ns, s, Fs]
        return _shared_out(h, self.shared_w_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Args: ``x [..., d_model]`` in the parameters' dtype. Returns ``[..., d_model]``.

        Under ``torch.autocast`` the layer computes as autocast has it: its projections in the autocast dtype,
        and so the routed experts too (the latent rows travel and the expert GEMMs run in that dtype, the
        expert weights cast to it as autocast casts a linear layer's); ``x`` may then be of any float dtype.

        Collective under EP: every rank calls it (with any number of tokens, 0 included).
        """
        # (the body stays in this frame: a host collective's graph break in a called function would count
        # twice under torch.compile)
        pdt, dev = self.down.weight.dtype, self.down.weight.device
        amp = isinstance(x, torch.Tensor) and autocast_on(x.device.type)
        dt = torch.get_autocast_dtype(x.device.type) if amp else pdt  # what the latent rows are computed in
        try:  # a bad input on one rank is refused by every rank together, in the dispatch's header
            expect_tensor(x, "x")
            # (messages are built only on failure: formatting a dtype or a device costs µs on every step)
            if x.dim() < 1 or x.shape[-1] != self.d_model:
                fail("x", f"shape [..., d_model={self.d_model}]", list(x.shape))
            if not (x.dtype == pdt or (amp and x.is_floating_point())):  # (any float dtype under torch.autocast)
                fail("x", f"dtype {pdt} (the layer's parameters)", x.dtype)
            if x.device.type != dev.type:
                fail("x", f"device {dev} (the layer's parameters)", x.device)
            shape = x.shape
            x = x.reshape(-1, self.d_model)
            x_r, x_d, x_s = self._inputs(x)
            idx, w, pending = self._select(x_r)
        except Exception as exc:  # noqa: BLE001 - whatever stops this rank here stops every rank's call
            if isinstance(exc, _STOP_RECOMPUTATION):
                raise  # activation checkpointing's early stop: every rank stops at the same op, nothing refused
            ep = self._ep.get(0, self.topk, self.d_latent, dt, dev)
            if isinstance(exc, ValueError):  # a bad argument: refused on every rank (refuse raises here too)
                msg = str(exc)
                if msg.startswith("scores:"):  # the router's scores of x: named for the argument the user gave
                    msg = ("x: expected tokens with valid router scores (a NaN in x or in router.weight makes "
                           f"them NaN); {msg}")
                ep.refuse("dispatch", msg)
            with contextlib.suppress(RefusedEverywhere):  # the peers raise ValueError naming it
                ep.refuse("dispatch", f"{type(exc).__name__}: {exc}")
            raise  # here, the error itself
        z = _project(self.down, x_d)  # [s, l], in dt
        ep = self._ep.get(x.shape[0], self.topk, self.d_latent, dt, dev)
        u, self.last_stats = self.experts(ep, z, idx, w, self.replica_pool, self.matmul)      # [s, l]
        self._record_routing(pending)  # the step's collectives went through on every rank
        return (_project(self.up, self._norm(u)) + self.shared(x_s)).reshape(shape)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        for old, new in (("expert_w_in", "experts.w_in"), ("expert_w_out", "experts.w_out")):
            if prefix + old in state_dict:  # checkpoints written before the experts had their own module
                state_dict[prefix + new] = state_dict.pop(prefix + old)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, d_latent={self.d_latent}, num_experts={self.num_experts}, "
                f"topk={self.topk}, d_expert={self.d_expert}, num_shared={self.num_shared}, "
                f"d_shared={self.d_shared}, R={self.world_size}")


def dist_bcast(box: list, rt) -> None:
    from ..guard import SEED

    # rank 0's int seed, in one header exchange (a rank in another moonep collective fails cleanly)
    box[0] = rt.host.agree(SEED, box[0], what="LatentMoE construction (seed)")[0]
