"""The MoE layer's training step, on moonep and on the Megatron-style path, from the same weights.

Both steps run the same computation, forward and backward, on the routing of the sweep point:

* the router: ``softmax(x @ W_r)`` over the experts, its probabilities at the point's ``topk_idx``
  normalised into ``topk_weights`` (the point fixes *which* experts, so that the imbalance is the one asked
  for; the router's GEMM, softmax and their gradients are in the step);
* moonep: ``ep.dispatch`` -> :meth:`moonep.ReplicaPool.fetch` of the three projections ->
  :func:`moonep.expert_matmul` (SwiGLU) -> ``ep.combine``; the backward runs combine's and dispatch's
  backward and adds the replica rows' weight gradients to their home experts (the replica gradient
  reduce);
* Megatron-style: :class:`moonep.bench.baselines.MegatronA2A` over a differentiable ``all_to_all_single``
  on the job's process group (gloo on CPU ranks, NCCL with one rank per GPU) -> SwiGLU over the home
  experts with :func:`moonep.slot_matmul` -> the weighted scatter-add.

The input ``x`` requires grad (a layer inside a model); the loss gradient ``grad_y`` is fixed.  Gradients are
cleared before each step.  The forward-only (inference) steps are :mod:`moonep.bench.layer_step`'s.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from moonep.bench.layer_step import fetch_replicas, moonep_experts, swiglu_experts
from moonep.experts import ReplicaPool


def torch_all_to_all(group):
    """``a2a(send [n, ...], send_splits, recv_splits) -> recv`` with ``all_to_all_single`` on ``group``:
    what a user of the Megatron-style path runs (CUDA tensors go through the host when the group is gloo)."""
    gloo = dist.get_backend(group) == "gloo"

    def a2a(send, send_splits, recv_splits):
        dev = send.device
        if gloo and dev.type == "cuda":
            send = send.cpu()
        send = send.contiguous()
        recv = send.new_empty((sum(recv_splits), *send.shape[1:]))
        dist.all_to_all_single(recv, send, list(recv_splits), list(send_splits), group=group)
        return recv.to(dev)

    return a2a


class _AllToAll(torch.autograd.Function):
    """The all-to-all of rows, differentiable: the backward sends the gradients back the way they came."""

    @staticmethod
    def forward(ctx, send, a2a, send_splits, recv_splits):
        ctx.a2a, ctx.splits = a2a, (list(send_splits), list(recv_splits))
        return a2a(send, send_splits, recv_splits)

    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits = ctx.splits
        return ctx.a2a(grad.contiguous(), recv_splits, send_splits), None, None, None


def differentiable(a2a):
    """``a2a`` with a backward (the reverse all-to-all)."""
    return lambda send, send_splits, recv_splits: _AllToAll.apply(send, a2a, send_splits, recv_splits)


class TrainingLayer:
    """A router ``W_r [H, E]`` (float32) and this rank's ``epn`` SwiGLU experts, ``w_gate, w_up [epn, H, ffn]``
    and ``w_down [epn, ffn, H]`` in ``dtype``: leaf tensors that require grad, shared by both paths."""

    def __init__(self, epn: int, E: int, H: int, ffn: int, dtype, device, seed: int = 0):
        gen = torch.Generator(device=device).manual_seed(seed)

        def leaf(*shape, fan_in, dt):
            return (torch.randn(*shape, generator=gen, device=device) * fan_in ** -0.5).to(dt).requires_grad_()

        self.router = leaf(H, E, fan_in=H, dt=torch.float32)
        self.w_gate = leaf(epn, H, ffn, fan_in=H, dt=dtype)
        self.w_up = leaf(epn, H, ffn, fan_in=H, dt=dtype)
        self.w_down = leaf(epn, ffn, H, fan_in=ffn, dt=dtype)
        self.pool = ReplicaPool()

    @property
    def projections(self):
        return (self.w_gate, self.w_up, self.w_down)

    @property
    def params(self):
        return (self.router, *self.projections)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def topk_weights(self, x, topk_idx):
        """``[s, K]`` float32: the router's probabilities at ``topk_idx``, normalised over the K choices."""
        probs = torch.softmax(x.float() @ self.router, dim=-1)
        w = probs.gather(1, topk_idx)
        return w / w.sum(dim=1, keepdim=True)


def moonep_train_step(ep, layer: TrainingLayer, x, topk_idx, grad_y):
    """Forward and backward of the layer on moonep. ``x [s, H]`` requires grad; ``grad_y [s, H]``."""
    layer.zero_grad()
    x.grad = None
    w = layer.topk_weights(x, topk_idx)
    h = ep.dispatch(x, topk_idx, w)
    out = moonep_experts(h, layer.projections, fetch_replicas(layer.pool, ep, h, layer.projections))
    y = ep.combine(out, h)
    y.backward(grad_y)
    return y


def megatron_train_step(meg, layer: TrainingLayer, x, topk_idx, grad_y):
    """The same on the Megatron-style path (``meg`` built over :func:`differentiable` all-to-all)."""
    layer.zero_grad()
    x.grad = None
    w = layer.topk_weights(x, topk_idx)
    tokens, ctx = meg.dispatch(x, topk_idx)
    y = meg.combine(swiglu_experts(tokens, ctx["cu_seqlens"], *layer.projections), w, ctx)
    y.backward(grad_y)
    return y
