"""moonep's data path as ``torch.library`` custom ops (namespace ``moonep``): what ``torch.compile`` sees.

    h = moonep.ops.dispatch(ep, x, topk_idx, topk_weights)         # moonep::dispatch
    r_in, r_out = moonep.ops.prefetch_replicas(h, w_in, w_out)      # moonep::prefetch_replicas
    a = act(moonep.ops.expert_matmul(h, h.tokens, w_in, r_in))      # moonep::expert_matmul
    y = moonep.ops.combine(moonep.ops.expert_matmul(h, a, w_out, r_out), h)   # moonep::combine

Each op runs the eager code of :class:`moonep.ExpertParallel` (argument checks, the call header with the
peers, the backend) inside its body, so Dynamo never traces host work, host syncs or kernel launches: the
op is one node of the graph, whatever the backend.  Its fake implementation gives the static output shapes
(``cap = moonep.layout.capacity(max_tokens, topk, R, E, align, slack)`` rows).  Autograd is registered
with ``register_autograd``, and each backward is a custom op too whose body calls the backward rule that the
eager autograd Functions call (``moonep.ep.dispatch_grads``, ``combine_grads``, ``prefetch_grad``;
``moonep.experts.expert_matmul_grads``, ``expert_bias_grad``, ``slot_matmul_grads``): one set of rules for eager
and compiled code, the same bits.  The ops that make a
collective are side-effecting (:func:`_collective`): a compiler never drops one whose output nothing reads
(a rank with no tokens), which would leave its peers waiting.

State (see docs/design.md, "moonep under torch.compile"): the instance is the int ``ep.op_id``; the step
(plan and backend state of one dispatch) is the *step token* ``h.step``, an int64 tensor that
``moonep::dispatch`` returns and the later ops take (:mod:`moonep.op_state` finds the step's host state by
it).  On the NVLink backend the token *is* the step's device state (destinations, row lists, replica
tables: ``Backend.pack_step``, :mod:`moonep.backends.nvlink_token`), which the later ops read from it
(:func:`_lookup`): every device tensor that
outlives an op is an output of the op that made it and an input of the ops that read it, as CUDA graph
trees require; nothing on the host holds one.

Differences from the eager API, all for the compiler's sake: no ``out=`` pools (``prefetch`` and
``prefetch_replicas`` return fresh tensors, and :func:`expert_matmul` keeps the step's replicas until its
backward instead of refetching them: the same values, so the same bits); the NVLink backend copies the rows
out of its receive buffer (as eager training does); an fp8 dispatch takes a float ``x`` (not a pre-quantised
pair) and returns the rows and scales as tensors of their own (eager: views of the wire rows).
With ``apply_weights="dispatch"`` the op moves the rows unscaled and :func:`dispatch` scales them in the
graph (``moonep.ep.scale_rows``, as eager dispatch does outside its autograd Function).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from . import op_state
from .op_state import fresh_output as _fresh
from .ep import combine_grads, combine_op, dispatch_grads, dispatch_op, prefetch_grad, prefetch_op
from .errors import expect
from .fp8 import grad_anchor
from .handles import Fetched, Routed, reissue  # noqa: F401  (Fetched: part of this module's API)
from .experts import (_gather_slots, _operands, _row_slots, _rows_grouped, _rows_loop, _run, _two_grouped, _two_loop,
                      expert_bias_grad, expert_matmul_grads, expert_matmul_op, fetch_op, kept_replicas,
                      slot_matmul_grads)

__all__ = ["Routed", "Fetched", "Planned", "dispatch", "combine", "prefetch", "prefetch_replicas", "reduce_grad",
           "reduce_replicas", "expert_matmul", "slot_matmul", "plan_and_destinations", "qb_record"]


# --------------------------------------------------------------------------------------------- helpers
def _collective(name: str):
    """``torch.library.custom_op(name)`` for an op that makes a collective, registered as side-effecting.

    Every rank must run each collective, also a rank whose result nothing reads: with no tokens its outputs
    are empty, inductor's loads from an empty buffer are no-ops, and it would drop the op as dead code
    (docs/design.md, "Collectives are never dead code"); FX's and inductor's dead-code elimination keep an
    op registered with ``torch.fx.node.has_side_effect``."""
    def define(fn):
        op = torch.library.custom_op(name, mutates_args=())(fn)
        torch.fx.node.has_side_effect(op._opoverload)
        return op
    return define


def _none_or(t: Tensor, wanted: bool):
    return t if wanted else None


@contextlib.contextmanager
def _backward_only():
    """Context for the collective of a backward rule while AOTAutograd traces the joint graph: its nodes get
    the partitioner tag "must_be_in_backward" (read by torch's min-cut and default partitioners since 2.5).
    Without it, a rank whose tangents are empty (no tokens) gets backward collectives that depend on no
    tangent, which the partitioner may move into the forward graph: that rank would then run them in another
    order than its peers (a deadlock).  Outside tracing (no node metadata being recorded) it does nothing."""
    from torch.fx import traceback as fx_traceback

    if not fx_traceback.has_preserved_node_meta():
        yield
        return
    meta = fx_traceback.current_meta
    saved = meta.get("partitioner_tag")
    meta["partitioner_tag"] = "must_be_in_backward"
    try:
        yield
    finally:
        meta["partitioner_tag"] = saved


def _state_words(ep) -> int:
    """Words of ``ep``'s step token besides its ``2*s*K`` destination words; 0: the token is int64 ``[1]``
    (the layout is the backend's: ``Backend.pack_step``)."""
    return ep._backend.token_state_words


def _lookup(token: Tensor, op_id: int):
    """``(ep, h)``: the instance and the step's Dispatched (without rows) of ``token``."""
    ep = op_state.instance(op_id)
    return ep, ep._backend.unpack_step(op_state.step(token, op_id), token)


# --------------------------------------------------------------------------------------------- dispatch
@_collective("moonep::dispatch")
def _dispatch(x: Tensor, topk_idx: Tensor, topk_weights: Tensor, op_id: int, capacity: int, num_experts: int,
              world_size: int, state_words: int, fp8: bool = False) -> tuple[
        Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``ExpertParallel.dispatch`` -> (tokens ``[cap, H]``, weights ``[cap]``, cu_seqlens int32 ``[2epn+1]``,
    slot_experts int64 ``[2epn]``, assignment int64 ``[E, R]``, replica_experts int64 ``[R, epn]``,
    recv_counts int64 ``[R]``, step token int64 ``[1]``, NVLink: ``[state_words + 2*s*K]``, then with ``fp8``
    scales float32 ``[cap, H/128]`` and ``grad_rows``, a stride-0 zero ``[cap, H]`` in ``x``'s dtype through
    which the dequantised rows' gradient comes back (tokens then float8_e4m3fn); without, both ``[0]``).
    Collective.

    ``capacity``, ``num_experts``, ``world_size``, ``state_words`` (:func:`_state_words`), ``fp8``: the
    instance's (checked), so that the fake implementation needs no lookup and a compiled graph's cache key
    holds its output shapes."""
    ep = op_state.instance(op_id)
    sizes = (capacity, num_experts, world_size, state_words, fp8)
    expect((ep.capacity, ep.num_experts, ep.world_size, _state_words(ep), ep.fp8) == sizes, "moonep::dispatch",
           f"the sizes of ExpertParallel op id {op_id}", sizes)
    with ep._op_body():  # rows of its own, unscaled
        h = ep.dispatch(x, topk_idx, topk_weights)
    dev = x.device
    token, kept = ep._backend.pack_step(h, dev)
    op_state.put_step(token, op_id, kept)
    plan = h.plan
    if fp8:  # the views of the wire rows, as tensors of their own; the anchor for the rows' gradient
        extra = (h.scales.clone(memory_format=torch.contiguous_format), _grad_anchor(capacity, x))
        tokens = h.tokens.clone(memory_format=torch.contiguous_format)  # (a view of one row is "contiguous")
    else:
        extra = (x.new_empty(0, dtype=torch.float32), x.new_empty(0))
        tokens = _fresh(h.tokens, x)
    return (tokens, _fresh(h.weights, topk_weights), h.cu_seqlens.to(dev, torch.int32, copy=True),
            h.slot_experts.to(dev, torch.int64, copy=True), plan.assignment.to(dev, torch.int64, copy=True),
            plan.replica_experts.to(dev, torch.int64, copy=True), plan.recv_counts.to(dev, torch.int64, copy=True),
            token) + extra


def _grad_anchor(cap: int, x: Tensor) -> Tensor:
    """fp8 dispatch: ``[cap, H]`` stride-0 zeros in ``x``'s dtype (:func:`moonep.fp8.grad_anchor`)."""
    return grad_anchor(cap, x.shape[1], x.dtype, x.device)


@_dispatch.register_fake
def _(x, topk_idx, topk_weights, op_id, capacity, num_experts, world_size, state_words, fp8=False):
    E, R, epn, cap = num_experts, world_size, num_experts // world_size, capacity
    words = state_words + 2 * x.shape[0] * topk_idx.shape[1] if state_words else 1
    i64 = dict(dtype=torch.int64)
    if fp8:
        tokens = x.new_empty(cap, x.shape[1], dtype=torch.float8_e4m3fn)
        extra = (x.new_empty(cap, x.shape[1] // 128, dtype=torch.float32), _grad_anchor(cap, x))
    else:
        tokens, extra = x.new_empty(cap, x.shape[1]), (x.new_empty(0, dtype=torch.float32), x.new_empty(0))
    return (tokens, topk_weights.new_empty(cap), x.new_empty(2 * epn + 1, dtype=torch.int32),
            x.new_empty(2 * epn, **i64), x.new_empty(E, R, **i64), x.new_empty(R, epn, **i64), x.new_empty(R, **i64),
            x.new_empty(words, **i64)) + extra


def _dispatch_setup(ctx, inputs, output):
    x, idx, w, op_id, cap = inputs[:5]
    ctx.op_id, ctx.num_tokens, ctx.x_dtype, ctx.w_dtype = op_id, x.shape[0], x.dtype, w.dtype
    ctx.sizes = (x.shape[1], idx.shape[1], cap)
    ctx.fp8 = len(inputs) > 8 and inputs[8]
    if ctx.fp8:  # the fp8 rows and their scales carry no gradient: it comes back through grad_rows
        ctx.mark_non_differentiable(output[0], output[8])
    ctx.save_for_backward(output[7])


def _dispatch_bwd(ctx, g_tokens, g_weights, *rest):
    (token,) = ctx.saved_tensors
    if ctx.fp8:  # the dequantised rows' gradient, straight through
        g_tokens = rest[-1]
    want_x, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
    with _backward_only():
        gx, gw = _dispatch_backward(g_tokens, g_weights, token, ctx.op_id, ctx.num_tokens, *ctx.sizes, ctx.x_dtype,
                                    ctx.w_dtype, want_x, want_w)
    return _none_or(gx, want_x), None, _none_or(gw, want_w), None, None, None, None, None, None


_dispatch.register_autograd(_dispatch_bwd, setup_context=_dispatch_setup)


@_collective("moonep::dispatch_backward")
def _dispatch_backward(g_tokens: Optional[Tensor], g_weights: Optional[Tensor], token: Tensor, op_id: int,
                       num_tokens: int, hidden: int, topk: int, capacity: int, x_dtype: torch.dtype,
                       w_dtype: torch.dtype, want_x: bool, want_w: bool) -> tuple[Tensor, Tensor]:
    """``dispatch_grads``: ``g_tokens [cap, H]``, ``g_weights [cap]`` -> (``gx [s, H]``, ``gw [s, K]``);
    an unwanted gradient is an empty placeholder. Collective."""
    ep, h = _lookup(token, op_id)
    dev = token.device
    if g_tokens is None:  # eager autograd materialises the unused output's gradient as zeros too
        g_tokens = torch.zeros(capacity, hidden, dtype=x_dtype, device=dev)
    if g_weights is None:
        g_weights = torch.zeros(capacity, dtype=w_dtype, device=dev)
    gx, gw = dispatch_grads(ep, h.routing, g_tokens, g_weights, want_x, want_w, x_dtype, w_dtype)
    empty = torch.empty(0, dtype=x_dtype, device=dev)
    return (_fresh(gx, g_tokens) if want_x else empty,
            _fresh(gw, g_weights) if want_w else torch.empty(0, dtype=w_dtype, device=dev))


@_dispatch_backward.register_fake
def _(g_tokens, g_weights, token, op_id, num_tokens, hidden, topk, capacity, x_dtype, w_dtype, want_x, want_w):
    return (token.new_empty((num_tokens, hidden) if want_x else (0,), dtype=x_dtype),
            token.new_empty((num_tokens, topk) if want_w else (0,), dtype=w_dtype))


def dispatch(ep, x: Tensor, topk_idx: Tensor, topk_weights: Tensor) -> Routed:
    """:meth:`moonep.ExpertParallel.dispatch` as the op ``moonep::dispatch`` (what it runs when compiled).
    Collective.

    Args:
        ep: the :class:`moonep.ExpertParallel`; with ``dispatch_dtype=torch.float8_e4m3fn`` ``x`` is a float
            tensor, quantised in the send (a pre-quantised pair runs eagerly: ``ExpertParallel.dispatch``).
        x: ``[s, H]`` in ``ep.dtype``; topk_idx: int32/int64 ``[s, K]``; topk_weights: float ``[s, K]``.
    Returns:
        :class:`Routed`; ``tokens`` and ``weights`` are differentiable with respect to ``x`` and
        ``topk_weights`` (the backward is a combine, as in eager).
    """
    return dispatch_op(ep, x, topk_idx, topk_weights)


# --------------------------------------------------------------------------------------------- combine
@_collective("moonep::combine")
def _combine(expert_out: Tensor, weights: Tensor, token: Tensor, op_id: int, num_tokens: int) -> Tensor:
    """``ExpertParallel.combine``: ``expert_out [cap, H]``, ``weights [cap]`` -> ``[s, H]`` in
    ``expert_out``'s dtype. Collective."""
    ep, h = _lookup(token, op_id)
    # the graph's weights, handed to combine as issued when they have the shape it reads; otherwise as
    # replaced, so that combine refuses them on every rank
    fits = weights.dim() == 1 and weights.shape[0] == ep.capacity and weights.device.type == ep.device.type
    h = reissue(h, weights=weights) if fits else dataclasses.replace(h, weights=weights)
    return _fresh(ep.combine(expert_out, h), expert_out)


@_combine.register_fake
def _(expert_out, weights, token, op_id, num_tokens):
    return expert_out.new_empty(num_tokens, expert_out.shape[1])


def _combine_setup(ctx, inputs, output):
    expert_out, weights, token, op_id, _ = inputs
    ctx.op_id = op_id
    ctx.save_for_backward(expert_out, weights, token)


def _combine_bwd(ctx, gy):
    expert_out, weights, token = ctx.saved_tensors
    want_o, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    with _backward_only():
        g_out, g_w = _combine_backward(gy, expert_out, weights, token, ctx.op_id, want_o, want_w)
    return _none_or(g_out, want_o), _none_or(g_w, want_w), None, None, None


_combine.register_autograd(_combine_bwd, setup_context=_combine_setup)


@_collective("moonep::combine_backward")
def _combine_backward(gy: Tensor, expert_out: Tensor, weights: Tensor, token: Tensor, op_id: int, want_out: bool,
                      want_w: bool) -> tuple[Tensor, Tensor]:
    """``combine_grads``: ``gy [s, H]`` -> (``g_out [cap, H]``, ``g_w [cap]``); an unwanted gradient is an
    empty placeholder. Collective."""
    ep, h = _lookup(token, op_id)
    # apply_weights="dispatch": a plain sum (combine's weights are not an input then: want_w is False)
    g_out, g_w = combine_grads(ep, h.routing, gy, expert_out, weights if ep.apply_weights == "combine" else None,
                               want_out, want_w)
    return (_fresh(g_out, gy, expert_out) if want_out else expert_out.new_empty(0),
            _fresh(g_w, weights) if want_w else weights.new_empty(0))


@_combine_backward.register_fake
def _(gy, expert_out, weights, token, op_id, want_out, want_w):
    return (expert_out.new_empty(expert_out.shape if want_out else (0,)),
            weights.new_empty(weights.shape if want_w else (0,)))


def combine(expert_out: Tensor, h: Routed) -> Tensor:
    """:meth:`moonep.ExpertParallel.combine` as ``moonep::combine``: ``expert_out [cap, H]`` -> ``[s, H]`` in
    its dtype, ``sum_k w_k out_k`` (the plain sum when ``h.scaled``).  Differentiable with respect to
    ``expert_out`` and ``h.weights`` (unless ``h.scaled``: their gradient then comes through the dispatched rows).
    Collective."""
    return combine_op(expert_out, h)


# --------------------------------------------------------------------------------------------- weights
@_collective("moonep::prefetch")
def _prefetch(local_weight: Tensor, token: Tensor, op_id: int) -> Tensor:
    """``ExpertParallel.prefetch`` without a pool: ``[epn, *D]`` -> ``[2*epn, *D]``. Collective."""
    ep, h = _lookup(token, op_id)
    return _fresh(ep.prefetch(h, local_weight), local_weight)


@_prefetch.register_fake
def _(local_weight, token, op_id):
    return local_weight.new_empty(2 * local_weight.shape[0], *local_weight.shape[1:])


def _prefetch_setup(ctx, inputs, output):
    ctx.op_id = inputs[2]
    ctx.save_for_backward(inputs[1])


def _prefetch_bwd(ctx, g):
    (token,) = ctx.saved_tensors
    with _backward_only():
        return _prefetch_backward(g, token, ctx.op_id), None, None


_prefetch.register_autograd(_prefetch_bwd, setup_context=_prefetch_setup)


@_collective("moonep::prefetch_backward")
def _prefetch_backward(g: Tensor, token: Tensor, op_id: int) -> Tensor:
    """``prefetch_grad``: ``[2*epn, *D]`` slot gradients -> ``[epn, *D]`` at home. Collective."""
    ep, h = _lookup(token, op_id)
    return _fresh(prefetch_grad(ep, h.plan, g), g)


@_prefetch_backward.register_fake
def _(g, token, op_id):
    return g.new_empty(g.shape[0] // 2, *g.shape[1:])


def prefetch(h: Routed, local_weight: Tensor) -> Tensor:
    """:meth:`moonep.ExpertParallel.prefetch` as ``moonep::prefetch``: ``local_weight [epn, *D]`` ->
    ``[2*epn, *D]`` (home experts, then replicas; empty slots zero).  Differentiable (the backward is
    ``reduce_grad``). Collective."""
    return prefetch_op(h, local_weight)


@_collective("moonep::prefetch_replicas")
def _prefetch_replicas(local_weights: list[Tensor], token: Tensor, op_id: int) -> list[Tensor]:
    """The replica slots of each weight ``[epn, *D]``, into fresh ``[epn, *D]`` tensors, in one collective
    (every empty slot zeroed: zero whatever the memory held, also at a CUDA graph replay)."""
    ep, h = _lookup(token, op_id)
    outs = [torch.empty(w.shape, dtype=w.dtype, device=w.device) for w in local_weights]
    return ep._fetch_replicas(h, local_weights, outs, fresh=True)


@_prefetch_replicas.register_fake
def _(local_weights, token, op_id):
    return [w.new_empty(w.shape) for w in local_weights]


def prefetch_replicas(h: Routed, *local_weights: Tensor) -> list:
    """The replica slots of each ``local_weight [epn, *D]`` (one collective for all) -> a list of ``[epn, *D]``
    (slot ``j``: expert ``h.slot_experts[epn+j]``, zero if ``-1``).  Not differentiable:
    :func:`expert_matmul` sends the replica rows' gradient home."""
    return [f.replicas for f in fetch_op(h, list(local_weights))]


@_collective("moonep::reduce_grad")
def _reduce_grad(grad: Tensor, token: Tensor, op_id: int) -> Tensor:
    """``ExpertParallel.reduce_grad``: ``[2*epn, *D]`` -> ``[epn, *D]``. Collective."""
    ep, h = _lookup(token, op_id)
    return _fresh(ep.reduce_grad(h, grad), grad)


@_reduce_grad.register_fake
def _(grad, token, op_id):
    return grad.new_empty(grad.shape[0] // 2, *grad.shape[1:])


def reduce_grad(h: Routed, grad: Tensor) -> Tensor:
    """:meth:`moonep.ExpertParallel.reduce_grad` as ``moonep::reduce_grad``: ``[2*epn, *D]`` -> ``[epn, *D]``.
    Collective; not differentiable."""
    return _reduce_grad(grad, h.step, h.op_id)


@_collective("moonep::reduce_replicas")
def _reduce_replicas(home_grad: Tensor, replica_grad: Tensor, token: Tensor, op_id: int) -> Tensor:
    """``ExpertParallel.reduce_replicas``: ``[epn, *D]`` twice -> ``[epn, *D]``. Collective."""
    ep, h = _lookup(token, op_id)
    return _fresh(ep.reduce_replicas(h, home_grad, replica_grad), home_grad, replica_grad)


@_reduce_replicas.register_fake
def _(home_grad, replica_grad, token, op_id):
    return home_grad.new_empty(home_grad.shape)


def reduce_replicas(h: Routed, home_grad: Tensor, replica_grad: Tensor) -> Tensor:
    """:meth:`moonep.ExpertParallel.reduce_replicas` as ``moonep::reduce_replicas``. Collective."""
    return _reduce_replicas(home_grad, replica_grad, h.step, h.op_id)


# --------------------------------------------------------------------------------------------- GEMMs
@torch.library.custom_op("moonep::expert_matmul", mutates_args=())
def _expert_matmul(a: Tensor, cu_seqlens: Tensor, home_weight: Tensor, replicas: Tensor, home_bias: Optional[Tensor],
                   bias_replicas: Optional[Tensor], token: Tensor, op_id: int, transpose: bool, impl: str) -> Tensor:
    """``moonep.expert_matmul``'s product: ``a [cap, D]`` -> ``[cap, N]`` in ``a``'s dtype (home rows times
    ``home_weight``, replica rows times ``replicas``, both ``[epn, D, N]`` or ``[epn, N, D]`` transposed),
    plus each row's slot bias when ``home_bias [epn, N]`` (and ``bias_replicas``) are given."""
    wh, wr = _operands(home_weight, replicas, transpose)
    out = _run(impl, _two_grouped, _two_loop, a, cu_seqlens, wh, wr)
    if home_bias is not None:
        out = out + _gather_slots(_row_slots(cu_seqlens, out.shape[0]), home_bias, bias_replicas).to(out.dtype)
    return out


@_expert_matmul.register_fake
def _(a, cu_seqlens, home_weight, replicas, home_bias, bias_replicas, token, op_id, transpose, impl):
    return a.new_empty(a.shape[0], home_weight.shape[-2] if transpose else home_weight.shape[-1])


def _expert_matmul_setup(ctx, inputs, output):
    a, cu, home, rep, hb, rb, token, op_id, transpose, impl = inputs
    ctx.op_id, ctx.transpose, ctx.impl = op_id, transpose, impl
    ctx.save_for_backward(a, cu, home, rep, hb, rb, token)


def _expert_matmul_bwd(ctx, g):
    a, cu, home, rep, hb, rb, token = ctx.saved_tensors
    want_a, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
    want_b = hb is not None and ctx.needs_input_grad[4]
    with _backward_only():
        ga, gw, gb = _expert_matmul_backward(g, a, cu, home, rep, hb, rb, token, ctx.op_id, ctx.transpose, ctx.impl,
                                             want_a, want_w, want_b)
    return (_none_or(ga, want_a), None, _none_or(gw, want_w), None, _none_or(gb, want_b), None, None, None, None,
            None)


_expert_matmul.register_autograd(_expert_matmul_bwd, setup_context=_expert_matmul_setup)


@_collective("moonep::expert_matmul_backward")
def _expert_matmul_backward(g: Tensor, a: Tensor, cu_seqlens: Tensor, home_weight: Tensor, replicas: Tensor,
                            home_bias: Optional[Tensor], bias_replicas: Optional[Tensor], token: Tensor, op_id: int,
                            transpose: bool, impl: str, want_a: bool, want_w: bool,
                            want_b: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``expert_matmul_grads``, then ``expert_bias_grad``: ``g [cap, N]`` -> (``ga [cap, D]``, ``gw`` like
    ``home_weight``, ``gb`` like ``home_bias``), the replica slots' parts added at home (collective: the
    weights', then the biases', in one op so that no compiler can order them differently on two ranks); an
    unwanted gradient is an empty placeholder."""
    ep, h = _lookup(token, op_id)
    # the forward's replicas, kept (no refetch), and the collective reduce of their gradients
    ga, gw = expert_matmul_grads(g, a, home_weight, cu_seqlens, kept_replicas(ep, h, home_weight, replicas),
                                 transpose, impl, want_a, want_w)
    gb = None
    if want_b:
        gb = expert_bias_grad(g, _row_slots(cu_seqlens, g.shape[0]), cu_seqlens,
                              kept_replicas(ep, h, home_bias, bias_replicas))
    return (_fresh(ga, g, a) if want_a else a.new_empty(0),
            _fresh(gw, home_weight, replicas) if want_w else home_weight.new_empty(0),
            _fresh(gb, home_bias, bias_replicas) if want_b else a.new_empty(0))


@_expert_matmul_backward.register_fake
def _(g, a, cu_seqlens, home_weight, replicas, home_bias, bias_replicas, token, op_id, transpose, impl, want_a,
      want_w, want_b):
    return (a.new_empty(a.shape if want_a else (0,)), home_weight.new_empty(home_weight.shape if want_w else (0,)),
            home_bias.new_empty(home_bias.shape) if want_b else a.new_empty(0))


def expert_matmul(h: Routed, a: Tensor, home_weight: Tensor, replicas: Tensor, *, transpose: bool = False,
                  impl: str = "auto", bias: Optional[Tensor] = None, bias_replicas: Optional[Tensor] = None) -> Tensor:
    """:func:`moonep.expert_matmul` as ``moonep::expert_matmul``, with :func:`moonep.expert_bias` folded in.

    Args:
        a: ``[cap, D]`` rows grouped by slot (``h.tokens`` or an activation of it), ``home_weight``'s dtype.
        home_weight: ``[epn, D, N]`` (``[epn, N, D]`` with ``transpose``), this rank's home experts.
        replicas: ``[epn, D, N]`` (resp. ``[epn, N, D]``) from :func:`prefetch_replicas`, kept until the
            backward (the eager pool's ``backward="keep"``).
        bias: optional ``[epn, N]`` home experts' biases, with ``bias_replicas [epn, N]`` from
            :func:`prefetch_replicas`; added to each row by its slot (padding rows get none).  One op for both,
            so the backward's two collectives (weights', then biases') keep their order on every rank.
    Returns:
        ``[cap, N]`` in ``a.dtype``; padding rows zero.  Differentiable with respect to ``a``, ``home_weight``
        and ``bias`` (the replica rows' gradients are added at home: collective in the backward).
    """
    expect(impl in ("auto", "grouped", "loop"), "impl", '"auto", "grouped" or "loop"', repr(impl))
    expect((bias is None) == (bias_replicas is None), "bias_replicas", "given exactly when bias is",
           f"bias {'given' if bias is not None else 'None'}, bias_replicas "
           f"{'given' if bias_replicas is not None else 'None'}")
    return expert_matmul_op(h, a, home_weight, replicas, transpose, impl, bias, bias_replicas)


@torch.library.custom_op("moonep::slot_matmul", mutates_args=())
def _slot_matmul(a: Tensor, cu_seqlens: Tensor, w: Tensor, impl: str) -> Tensor:
    """``moonep.slot_matmul``: ``a [cap, D]``, ``w [G, D, N]`` -> ``[cap, N]`` in ``a``'s dtype."""
    return _run(impl, _rows_grouped, _rows_loop, a, cu_seqlens, w)


@_slot_matmul.register_fake
def _(a, cu_seqlens, w, impl):
    return a.new_empty(a.shape[0], w.shape[-1])


def _slot_matmul_setup(ctx, inputs, output):
    a, cu, w, impl = inputs
    ctx.impl = impl
    ctx.save_for_backward(a, cu, w)


def _slot_matmul_bwd(ctx, g):
    a, cu, w = ctx.saved_tensors
    want_a, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
    ga, gw = _slot_matmul_backward(g, a, cu, w, ctx.impl, want_a, want_w)
    return _none_or(ga, want_a), None, _none_or(gw, want_w), None


_slot_matmul.register_autograd(_slot_matmul_bwd, setup_context=_slot_matmul_setup)


@torch.library.custom_op("moonep::slot_matmul_backward", mutates_args=())
def _slot_matmul_backward(g: Tensor, a: Tensor, cu_seqlens: Tensor, w: Tensor, impl: str, want_a: bool,
                          want_w: bool) -> tuple[Tensor, Tensor]:
    """``slot_matmul_grads``: ``g [cap, N]`` -> (``ga [cap, D]``, ``gw [G, D, N]``), empty when unwanted."""
    ga, gw = slot_matmul_grads(g, a, w, cu_seqlens, impl, want_a, want_w)
    return (_fresh(ga, g, a) if want_a else a.new_empty(0), _fresh(gw, w) if want_w else w.new_empty(0))


@_slot_matmul_backward.register_fake
def _(g, a, cu_seqlens, w, impl, want_a, want_w):
    return a.new_empty(a.shape if want_a else (0,)), w.new_empty(w.shape if want_w else (0,))


def slot_matmul(a: Tensor, cu_seqlens: Tensor, w: Tensor, impl: str = "auto") -> Tensor:
    """:func:`moonep.slot_matmul` as ``moonep::slot_matmul`` (``a [cap, D]``, int32 ``cu_seqlens [G+1]``,
    ``w [G, D, N]`` -> ``[cap, N]``); differentiable with respect to ``a`` and ``w``.  Not collective."""
    expect(impl in ("auto", "grouped", "loop"), "impl", '"auto", "grouped" or "loop"', repr(impl))
    return _slot_matmul(a, cu_seqlens, w, impl)


# --------------------------------------------------------------------------------------------- planner
class Planned(NamedTuple):
    """What :func:`plan_and_destinations` returns: the :class:`moonep.planner.Plan` fields and the layout.

    Attributes:
        assignment: int64 ``[E, R]``; replica_experts: int64 ``[R, epn]``; replica_source: int64 ``[R]``;
        recv_counts: int64 ``[R]``; expert_counts: int64 ``[E]`` (see :class:`moonep.planner.Plan`).
        dst_rank, dst_row: int64 ``[s, K]``, every local copy's destination (-1 where ``topk_idx`` is -1).
        error: int32 ``[]``, the plan's device-side validation flags (CUDA; 0 on CPU, where bad counts raise).
    """

    assignment: Tensor
    replica_experts: Tensor
    replica_source: Tensor
    recv_counts: Tensor
    expert_counts: Tensor
    dst_rank: Tensor
    dst_row: Tensor
    error: Tensor


@torch.library.custom_op("moonep::plan_and_destinations", mutates_args=())
def _plan_and_destinations(counts: Tensor, topk_idx: Tensor, rank: int, slack: float, align: int) -> tuple[
        Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``moonep.layout.plan_and_destinations`` (one kernel launch on CUDA); fresh outputs (on CUDA the plan's
    tensors share one workspace, and a custom op's outputs may not alias)."""
    from .layout import plan_and_destinations as run
    plan, dst_rank, dst_row = run(counts, rank, topk_idx, slack=slack, align=align)
    err = plan.error if plan.error is not None else torch.zeros((), dtype=torch.int32, device=counts.device)
    return tuple(t.to(torch.int64 if i < 7 else torch.int32).clone() for i, t in enumerate(
        (plan.assignment, plan.replica_experts, plan.replica_source, plan.recv_counts, plan.expert_counts,
         dst_rank, dst_row, err.reshape(()))))


@_plan_and_destinations.register_fake
def _(counts, topk_idx, rank, slack, align):
    R, E = counts.shape
    i64 = dict(dtype=torch.int64, device=counts.device)
    return (torch.empty(E, R, **i64), torch.empty(R, E // R, **i64), torch.empty(R, **i64), torch.empty(R, **i64),
            torch.empty(E, **i64), torch.empty(topk_idx.shape, **i64), torch.empty(topk_idx.shape, **i64),
            torch.empty((), dtype=torch.int32, device=counts.device))


def plan_and_destinations(counts: Tensor, rank: int, topk_idx: Tensor, *, slack: float = 0.0,
                          align: int = 1) -> Planned:
    """:func:`moonep.layout.plan_and_destinations` as ``moonep::plan_and_destinations``: the balanced plan of a
    step's global routing counts and this rank's token destinations, one node of a compiled graph (not a
    collective: every rank passes the same ``counts``).

    Args:
        counts: int32/int64 ``[R, E]`` (``E % R == 0``), the routing counts of every source rank.
        rank: this rank; topk_idx: int32/int64 ``[s, K]`` its expert ids (-1: masked), counted in ``counts[rank]``.
    Returns:
        :class:`Planned`.  Not differentiable.
    """
    return Planned(*_plan_and_destinations(counts, topk_idx, int(rank), float(slack), int(align)))


# --------------------------------------------------------------------------------------------- balancer
@torch.library.custom_op("moonep::qb_record", mutates_args=("lo", "width", "counts", "work"))
def _qb_record(raw: Tensor, values: Tensor, bias: Tensor, lo: Tensor, width: Tensor, counts: Tensor, work: Tensor,
               balancer_id: int, first: bool, check: bool) -> None:
    """``QuantileBalancer._record_cuda`` (one kernel, CUDA): required biases of ``raw [s, E]`` (cutoffs in
    column K of ``values [s, K+1]``) into ``counts`` int32 ``[E*B+1+31]``; ``first``: this micro-batch sets the
    range ``lo``/``width`` (0-d) from ``bias [E]``; ``check``: count bad scores (flags in ``work``)."""
    # the tensors the compiled graph passed (functionalisation may pass copies of the balancer's buffers)
    op_state.instance(balancer_id).record_kernel(raw, values, check, bias, lo, width, counts, work, first)


@_qb_record.register_fake
def _(raw, values, bias, lo, width, counts, work, balancer_id, first, check):
    return None


def qb_record(balancer, raw: Tensor, values: Tensor, check: bool) -> None:
    """Record one micro-batch of :class:`moonep.QuantileBalancer` on CUDA through ``moonep::qb_record`` (what
    ``route`` does when compiled, so that it traces without a graph break; ``step`` stays eager).

    Args:
        raw: ``[s, E]`` scores (float32/bf16/fp16/fp64); values: ``[s, K+1]`` top-(K+1) biased scores.
    """
    _qb_record(raw, values, balancer.bias, balancer._lo, balancer._width, balancer._counts, balancer._work,
               balancer._op_id, not balancer._recording, bool(check))
    balancer._recording = True
