"""moonep's data path as ``torch.library`` custom ops (namespace ``moonep``): what ``torch.compile`` sees.

    h = moonep.ops.dispatch(ep, x, topk_idx, topk_weights)         # moonep::dispatch
    r_in, r_out = moonep.ops.prefetch_replicas(h, w_in, w_out)      # moonep::fetch_replicas
    a = act(moonep.ops.expert_matmul(h, h.tokens, w_in, r_in))      # moonep::expert_matmul
    y = moonep.ops.combine(moonep.ops.expert_matmul(h, a, w_out, r_out), h)   # moonep::combine

``ExpertParallel.dispatch``, ``combine``, ``prefetch``, ``reduce_grad``, ``reduce_replicas`` and ``ReplicaPool.fetch``
call ``moonep::dispatch``, ``combine``, ``prefetch``, ``reduce_grad``, ``reduce_replicas`` and ``fetch_replicas`` in
eager and compiled code alike (the wrappers here call the same ops).  Each op's body is
:class:`moonep.ExpertParallel`'s (argument checks, the call header with the peers, the backend), so Dynamo never
traces host work, host syncs or kernel launches: the op is one node of the graph, whatever the backend.  Its
fake implementation gives the static output shapes (``cap = moonep.layout.capacity(max_tokens, topk, R, E,
align, slack)`` rows).  Each backward is an op too, whose body runs the one backward rule
(``moonep.ep.dispatch_grads``, ``combine_grads``, ``prefetch_grad``; ``moonep.experts.expert_matmul_grads``,
``expert_bias_grad``, ``slot_matmul_grads``); combine's product rule (``moonep.ep.combine_products``) runs after
its op, as graph code that inductor fuses.  Every op is defined with :func:`_define`, and the differentiable
ones' autograd with :func:`_autograd` (``register_autograd``'s contract, at a lower cost per call).  The ops
that make a collective are side-effecting: a compiler never drops one whose output nothing reads (a rank with no tokens), which would
leave its peers waiting.

State (see docs/design.md, "moonep under torch.compile"): the instance is the int ``ep.op_id``; the step
(plan and backend state of one dispatch) is the *step token* ``h.step``, an int64 tensor that
``moonep::dispatch`` returns and the later ops take (:mod:`moonep.op_state` finds the step's host record by
it).  Compiled, on the NVLink backend the token *is* the step's device state (destinations, row lists, replica
tables: ``Backend.pack_step``, :mod:`moonep.backends.nvlink_token`), which the later ops read from it
(:func:`_lookup`): every device tensor that outlives an op is an output of the op that made it and an input of
the ops that read it, as CUDA graph trees require; nothing on the host holds one.

What only compiled code does, for the compiler's sake: the replica fetch fills fresh tensors (no pool
buffers), and :func:`expert_matmul` keeps the step's replicas until its backward instead of refetching them
(the same values, so the same bits); the NVLink backend copies the rows out of its receive buffer (as eager
training does), and the handle's tables are tensors of their own.  With ``apply_weights="dispatch"`` the op
moves the rows unscaled and ``ExpertParallel.dispatch`` scales them after it (``moonep.ep.scale_rows``), so
that autograd sees the product, in both modes.
"""
from __future__ import annotations

import contextlib
from typing import NamedTuple, Optional

import torch
from torch import Tensor
from torch.fx import traceback as fx_traceback
from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import compile_order, experts, op_state
from .op_state import fresh_output as _fresh
from .ep import call_combine, call_prefetch, combine_grads, combine_products, dispatch_grads, prefetch_grad
from .errors import fail
from .fp8 import grad_anchor
from .handles import Dispatched, Fetched, Routed, weights_key  # noqa: F401  (Fetched, Routed: this module's API)
from .experts import (_gather_slots, _operands, _row_slots, _rows_grouped, _rows_loop, _run, _two_grouped, _two_loop,
                      expert_bias_grad, expert_matmul_grads, call_expert_matmul, fetch_op, kept_replicas,
                      slot_matmul_grads)

__all__ = ["Routed", "Fetched", "Planned", "dispatch", "combine", "prefetch", "prefetch_replicas", "reduce_grad",
           "reduce_replicas", "expert_matmul", "slot_matmul", "plan_and_destinations", "qb_record"]


# --------------------------------------------------------------------------------------------- helpers
_LIB = torch.library.Library("moonep", "FRAGMENT")


def _define(schema: str, body, fake, *, collective: bool = True, lib: torch.library.Library = _LIB):
    """Define the op ``<lib's namespace>::<schema>`` (``moonep::``): ``body`` its kernel on every device,
    ``fake`` its output shapes.  Returns its ``OpOverload``.

    ``collective``: the schema gets a last argument ``Tensor? after=None``, which only a compiled graph passes
    (:mod:`moonep.compile_order`: the previous collective's output, so that no compiler reorders them), and
    the op is registered as side-effecting.  Every rank must run each collective, also a rank whose result
    nothing reads: with no tokens its outputs are empty, inductor's loads from an empty buffer are no-ops, and it
    would drop the op as dead code (docs/design.md, "Collectives are never dead code"); FX's and inductor's
    dead-code elimination keep an op registered with ``torch.fx.node.has_side_effect``.  An op that mutates an
    argument (``Tensor(a!)`` in ``schema``) does not bump its version counter: no autograd graph may save what
    such an op writes (the replica pool's buffers, a backward's own gradient, the balancer's state)."""
    name = schema.split("(", 1)[0]
    if collective and _AFTER not in schema:
        head, tail = schema.rsplit(") ->", 1)
        schema = f"{head}, {_AFTER}) ->{tail}"
    lib.define(schema)
    op = getattr(getattr(torch.ops, lib.ns), name).default
    op_state.register_kernel(op, body)  # (eager calls without `after`)
    if collective:  # the kernels never see `after` (an ordering dependency only)
        n = len(op._schema.arguments) - 1
        body, fake = _without_after(body, n), _tracing(_without_after(fake, n))
    lib.impl(name, body, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{lib.ns}::{name}", fake, lib=lib)
    if collective:
        torch.fx.node.has_side_effect(op)
        compile_order.COLLECTIVES.add(op)
    return op


_AFTER = "Tensor? after=None"


def _tracing(fake):
    """``fake``, which first makes sure that moonep's ordering pass is in inductor's config (added here, at the
    first trace, so that importing moonep imports no compiler; a pass the user configured is kept and called
    first, see :mod:`moonep.compile_order`): a compiler traces the fake implementations before it runs its
    joint-graph passes."""
    def call(*args, **kwargs):
        compile_order.install()
        return fake(*args, **kwargs)
    return call


def _without_after(fn, n: int):
    """``fn`` called with the first ``n`` arguments: a collective op's trailing ``after`` (see
    :mod:`moonep.compile_order`) dropped."""
    def call(*args, after=None):
        return fn(*args[:n])
    return call


def _autograd(op, body, setup_context, backward, *, inputs: tuple, tracked: Optional[int],
              lib: torch.library.Library = _LIB) -> None:
    """Register the autograd of ``op``: ``setup_context(ctx, inputs, output)`` and ``backward(ctx, *grads)``,
    with ``torch.library.register_autograd``'s contract, as the op's ``Autograd`` kernel.

    ``inputs``: the positions of the differentiable tensor arguments; ``tracked``: the position of the int
    argument through which the kernel tells the body which of them autograd records (bit ``i``:
    ``inputs[i]``), so that every rank agrees on the backward collectives that will run (``None``: an op
    without one, whose body does not need to know).  A compiled graph's
    forward keeps the bits its trace saw.  On plain tensors with no dispatch mode active (not tracing), the
    kernel runs ``body`` (the op's kernel) itself: the same work without a second pass through the dispatcher
    (docs/performance.md, "Eager calls through custom ops": a few µs per eager call over an
    ``autograd.Function``, against about 10 µs for ``register_autograd``'s own wrapper)."""
    name = op._schema.name.split("::")[1]
    n = len(op._schema.arguments) - (op._schema.arguments[-1].name == "after")

    def forward(ctx, *args):
        out = body(*args) if _eager(args[inputs[0]]) else _below_autograd(op, args)
        setup_context(ctx, args, out)
        return out

    node = type(f"{name}_autograd", (torch.autograd.Function,),
                {"forward": staticmethod(forward), "backward": staticmethod(backward)})
    apply = _c_apply(node, op)

    def kernel(*args, after=None):
        args = args[:n]  # (`after` orders a compiled graph's collectives: nothing to do here)
        bits = 0
        if torch.is_grad_enabled():
            for i, k in enumerate(inputs):
                if args[k] is not None and args[k].requires_grad:
                    bits |= 1 << i
        if bits:
            return apply(*args) if tracked is None else apply(*args[:tracked], bits, *args[tracked + 1:])
        return body(*args) if _eager(args[inputs[0]]) else _below_autograd(op, args)

    lib.impl(name, kernel, "Autograd")
    op_state.register_kernel(op, kernel)


def _c_apply(node, op):
    """``node.apply`` without ``autograd.Function.apply``'s Python wrapper (a few µs per eager call, most of it
    a pass over every argument): the C++ ``apply`` itself, after the wrapper's one step that matters here, the
    unwrapping of dead functorch wrappers, done on the op's tensor arguments only.  Under an active functorch
    transform the wrapper runs (it refuses, as for any Function without ``setup_context``)."""
    c_apply = torch._C._FunctionBase.__dict__["apply"].__get__(None, node)
    unwrap = torch._C._functorch.unwrap_if_dead
    positions = op_state.tensor_positions(op)

    def apply(*args):
        if torch._C._are_functorch_transforms_active():
            return node.apply(*args)
        args = list(args)
        for i in positions:
            if args[i] is not None:
                args[i] = unwrap(args[i])
        return c_apply(*args)
    return apply


def _eager(t) -> bool:
    """A plain tensor and no dispatch mode (no tracing): an op's body may run without the dispatcher."""
    return type(t) is torch.Tensor and _get_current_dispatch_mode() is None


def _below_autograd(op, args):
    with torch._C._AutoDispatchBelowAutograd():
        return op(*args)


def _none_or(t: Tensor, wanted: bool):
    return t if wanted else None


def _backward_only():
    """Context for the collective of a backward rule while AOTAutograd traces the joint graph: its nodes get
    the partitioner tag "must_be_in_backward" (read by torch's min-cut and default partitioners since 2.5).
    Without it, a rank whose tangents are empty (no tokens) gets backward collectives that depend on no
    tangent, which the partitioner may move into the forward graph: that rank would then run them in another
    order than its peers (a deadlock).  Outside tracing (no node metadata being recorded) it does nothing."""
    return _tagged_backward() if fx_traceback.has_preserved_node_meta() else _NOTHING


_NOTHING = contextlib.nullcontext()


@contextlib.contextmanager
def _tagged_backward():
    meta = fx_traceback.current_meta
    saved = meta.get("partitioner_tag")
    meta["partitioner_tag"] = "must_be_in_backward"
    try:
        yield
    finally:
        meta["partitioner_tag"] = saved


def _lookup(token: Tensor, op_id: int):
    """``(ep, step)``: the instance and the :class:`moonep.handles.Step` of ``token``."""
    ep = op_state.instance(op_id)
    return ep, ep._token_step(token)


# --------------------------------------------------------------------------------------------- dispatch
def _dispatch_impl(x, topk_idx, topk_weights, x_scales, num_global_tokens, op_id, capacity, num_experts, world_size,
                   state_words, fp8, dtype, graph, tracked):
    """``ExpertParallel._dispatch_body``, then the step token and the handle's tensors (see :data:`dispatch_op`)."""
    ep = op_state.instance(op_id)
    sizes = (capacity, num_experts, world_size, state_words, fp8, dtype)
    if (ep.capacity, ep.num_experts, ep.world_size, ep._backend.token_state_words, ep.fp8, ep.dtype) != sizes:
        fail("moonep::dispatch", f"the sizes of ExpertParallel op id {op_id}", sizes)
    step, tokens, weights, scales, anchor = ep._dispatch_body(x, topk_idx, topk_weights, x_scales,
                                                              num_global_tokens, tracked, graph)
    dev, plan = x.device, step.plan
    token, kept = ep._backend.pack_step(step, dev, graph)
    op_state.put_step(token, op_id, kept)
    weights = _fresh(weights, topk_weights)
    if graph:  # tensors of their own: a compiled graph (a CUDA graph's pool) holds them past this step
        step.routing.issued = None
        if fp8:  # views of the wire rows, as tensors of their own
            tokens, scales = (t.clone(memory_format=torch.contiguous_format) for t in (tokens, scales))
        else:
            tokens = _fresh(tokens, x)
        tables = (step.cu_seqlens.to(dev, torch.int32, copy=True), step.slot_experts.to(dev, torch.int64, copy=True),
                  plan.assignment.to(dev, torch.int64, copy=True), plan.replica_experts.to(dev, torch.int64, copy=True),
                  plan.recv_counts.to(dev, torch.int64, copy=True))
    else:  # eager: what the step holds (zero-copy rows stay views of the receive buffer)
        step.routing.issued = weights_key(weights)  # combine refuses any other tensor
        tokens = _fresh(tokens, x)
        tables = (step.cu_seqlens.to(torch.int32), step.slot_experts.to(torch.int64), plan.assignment,
                  plan.replica_experts, plan.recv_counts)
    if not fp8:
        scales = x.new_empty(0, dtype=torch.float32)
    return (tokens, weights, *tables, token, scales, x.new_empty(0) if anchor is None else anchor)


def _dispatch_fake(x, topk_idx, topk_weights, x_scales, num_global_tokens, op_id, capacity, num_experts, world_size,
                   state_words, fp8, dtype, graph, tracked):
    E, R, epn, cap, H = num_experts, world_size, num_experts // world_size, capacity, x.shape[1]
    words = state_words + 2 * x.shape[0] * topk_idx.shape[1] if state_words and graph else 1
    i64 = dict(dtype=torch.int64)
    token = x.new_empty(words, **i64) if graph else torch.empty(1, dtype=torch.int64)  # (eager: on the host)
    if fp8:
        tokens, scales = x.new_empty(cap, H, dtype=torch.float8_e4m3fn), x.new_empty(cap, H // 128, dtype=torch.float32)
    else:
        tokens, scales = x.new_empty(cap, H), x.new_empty(0, dtype=torch.float32)
    anchor = grad_anchor(cap, H, dtype, x.device) if fp8 and tracked & 3 else x.new_empty(0)
    return (tokens, topk_weights.new_empty(cap), x.new_empty(2 * epn + 1, dtype=torch.int32),
            x.new_empty(2 * epn, **i64), x.new_empty(E, R, **i64), x.new_empty(R, epn, **i64), x.new_empty(R, **i64),
            token, scales, anchor)


dispatch_op = _define(
    "dispatch(Tensor x, Tensor topk_idx, Tensor topk_weights, Tensor? x_scales, int num_global_tokens, int op_id, "
    "int capacity, int num_experts, int world_size, int state_words, bool fp8, ScalarType dtype, bool graph, "
    "int tracked) -> "
    "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)", _dispatch_impl, _dispatch_fake)
dispatch_op.__doc__ = """``moonep::dispatch``: :meth:`moonep.ExpertParallel.dispatch` of instance ``op_id``. Collective.

Returns (tokens ``[cap, H]``, weights ``[cap]``, cu_seqlens int32 ``[2epn+1]``, slot_experts int64 ``[2epn]``,
assignment int64 ``[E, R]``, replica_experts int64 ``[R, epn]``, recv_counts int64 ``[R]``, the step token int64
(``[1]``; with ``graph`` on NVLink ``[state_words + 2*s*K]``), then scales float32 ``[cap, H/128]`` (fp8; else
``[0]``) and ``grad_rows``, fp8 and tracked: a stride-0 zero ``[cap, H]`` in ``x``'s dtype through which the
dequantised rows' gradient comes back; else ``[0]``).  ``x_scales``: ``x`` is a pre-quantised fp8 pair's rows.
``num_global_tokens``: -1, or the sum of ``s`` over ranks (checked).  ``capacity``, ``num_experts``,
``world_size``, ``state_words`` (``Backend.token_state_words``), ``fp8``, ``dtype`` (the token dtype): the
instance's (checked), so that the fake implementation needs no lookup.  ``graph``: called from a compiled graph (outputs of their own).
``tracked``: bits 0 and 1 set by the op's autograd (see :func:`_autograd`); callers pass 4 when grad mode is on
(a backward may keep the rows though autograd records no dispatch: the rows are copies), else 0."""


def _dispatch_setup(ctx, inputs, output):
    x, idx, w = inputs[:3]
    # the token dtype (a pre-quantised pair's x is fp8)
    ctx.op_id, ctx.num_tokens, ctx.x_dtype, ctx.w_dtype = inputs[5], x.shape[0], inputs[11], w.dtype
    ctx.sizes = (x.shape[1], idx.shape[1], inputs[6])
    ctx.fp8, ctx.device = inputs[10], x.device
    # only tokens and weights (and fp8's grad_rows) carry gradients: no zeros for the other eight outputs
    ctx.set_materialize_grads(False)
    if ctx.fp8:  # the fp8 rows and their scales carry no gradient: it comes back through grad_rows
        ctx.mark_non_differentiable(output[0], output[8])
    _save(ctx, output[7], inputs[12])


def _save(ctx, token, graph: bool, *tensors) -> None:
    """``ctx.save_for_backward(*tensors)``, and the step token.  Eagerly the token is an attribute: the registry
    finds the step by the token's address, which a saved-tensor hook that copies (``save_on_cpu``) would
    change; a compiled graph saves it as an activation (on NVLink it is the step's device state)."""
    if graph:
        ctx.save_for_backward(*tensors, token)
    else:
        ctx.save_for_backward(*tensors)
        ctx.token = token


def _saved(ctx) -> tuple:
    """What :func:`_save` kept: ``(*tensors, token)``."""
    return ctx.saved_tensors + ((ctx.token,) if hasattr(ctx, "token") else ())


def _dispatch_bwd(ctx, g_tokens, g_weights, *rest):
    (token,) = _saved(ctx)
    if ctx.fp8:  # the dequantised rows' gradient, straight through
        g_tokens = rest[-1]
    want_x, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
    if g_tokens is None and g_weights is None:  # (the op takes the device from one of them: every rank runs it)
        g_weights = torch.zeros(ctx.sizes[2], dtype=ctx.w_dtype, device=ctx.device)
    with _backward_only():
        gx, gw = op_state.call(dispatch_backward_op, g_tokens, g_weights, token, ctx.op_id, ctx.num_tokens,
                               *ctx.sizes, ctx.x_dtype, ctx.w_dtype, want_x, want_w)
    return (_none_or(gx, want_x), None, _none_or(gw, want_w)) + (None,) * 11


def _dispatch_backward(g_tokens, g_weights, token, op_id, num_tokens, hidden, topk, capacity, x_dtype, w_dtype,
                       want_x, want_w):
    """``dispatch_grads``: ``g_tokens [cap, H]``, ``g_weights [cap]`` -> (``gx [s, H]``, ``gw [s, K]``); an
    unwanted gradient is an empty placeholder. Collective."""
    ep, step = _lookup(token, op_id)
    dev = token.device if token.numel() > 1 else (g_tokens if g_tokens is not None else g_weights).device
    if g_tokens is None:  # eager autograd materialises the unused output's gradient as zeros too
        g_tokens = torch.zeros(capacity, hidden, dtype=x_dtype, device=dev)
    if g_weights is None:
        g_weights = torch.zeros(capacity, dtype=w_dtype, device=dev)
    gx, gw = dispatch_grads(ep, step.routing, g_tokens, g_weights, want_x, want_w, x_dtype, w_dtype)
    return (_fresh(gx, g_tokens) if want_x else torch.empty(0, dtype=x_dtype, device=dev),
            _fresh(gw, g_weights) if want_w else torch.empty(0, dtype=w_dtype, device=dev))


def _dispatch_backward_fake(g_tokens, g_weights, token, op_id, num_tokens, hidden, topk, capacity, x_dtype, w_dtype,
                            want_x, want_w):
    like = g_tokens if g_tokens is not None else g_weights
    return (like.new_empty((num_tokens, hidden) if want_x else (0,), dtype=x_dtype),
            like.new_empty((num_tokens, topk) if want_w else (0,), dtype=w_dtype))


dispatch_backward_op = _define(
    "dispatch_backward(Tensor? g_tokens, Tensor? g_weights, Tensor step, int op_id, int num_tokens, int hidden, "
    "int topk, int capacity, ScalarType x_dtype, ScalarType w_dtype, bool want_x, bool want_w) -> (Tensor, Tensor)",
    _dispatch_backward, _dispatch_backward_fake)
_autograd(dispatch_op, _dispatch_impl, _dispatch_setup, _dispatch_bwd, inputs=(0, 2), tracked=13)


def dispatch(ep, x: Tensor, topk_idx: Tensor, topk_weights: Tensor) -> Dispatched:
    """:meth:`moonep.ExpertParallel.dispatch` (the op ``moonep::dispatch``). Collective."""
    return ep.dispatch(x, topk_idx, topk_weights)


# --------------------------------------------------------------------------------------------- combine
def _combine(expert_out, weights, token, op_id, num_tokens, graph, tracked):
    """``ExpertParallel._combine_body``: ``expert_out [cap, H]``, ``weights [cap]`` -> ``[s, H]``."""
    y = op_state.instance(op_id)._combine_body(expert_out, weights, token, tracked, graph)
    return _fresh(y, expert_out, weights)


def _combine_fake(expert_out, weights, token, op_id, num_tokens, graph, tracked):
    return expert_out.new_empty(num_tokens, expert_out.shape[1])


combine_op = _define(
    "combine(Tensor expert_out, Tensor weights, Tensor step, int op_id, int num_tokens, bool graph, int tracked) -> "
    "Tensor", _combine, _combine_fake)


def _combine_setup(ctx, inputs, output):
    expert_out, weights, token, op_id = inputs[:4]
    ctx.op_id, ctx.graph = op_id, inputs[5]
    # apply_weights="dispatch": a plain sum (combine's weights are not an input then: no gradient reaches them)
    ctx.weighted = op_state.instance(op_id).apply_weights == "combine"
    _save(ctx, token, ctx.graph, expert_out, weights)


def _combine_bwd(ctx, gy):
    expert_out, weights, token = _saved(ctx)
    want_o, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    with _backward_only():
        g_rows = op_state.call(combine_backward_op, gy, token, ctx.op_id, expert_out.shape[0], ctx.graph)
    # the products outside the op: compiled, inductor fuses them (one pass over the rows)
    g_out, g_w = combine_products(g_rows, expert_out, weights if ctx.weighted else None, want_o, want_w)
    return g_out, g_w, None, None, None, None, None


def _combine_backward(gy, token, op_id, capacity, graph):
    """``combine_grads``: ``gy [s, H]`` -> the rows' gradient ``[cap, H]`` in ``gy``'s dtype (``graph``: a
    tensor of its own; eagerly it may be a view of the backend's receive buffer, which the products read
    at once; also a tensor of its own once the instance made async calls, as the next collective may then run on
    the communication stream while the products still read). Collective."""
    ep, step = _lookup(token, op_id)
    # (the replica pool's side stream waits for the caller's stream before it fetches; an async call may wait for
    # a previous_event alone)
    return _fresh(combine_grads(ep, step.routing, gy, graph or ep._async_used), gy)


combine_backward_op = _define(
    "combine_backward(Tensor gy, Tensor step, int op_id, int capacity, bool graph) -> Tensor", _combine_backward,
    lambda gy, token, op_id, capacity, graph: gy.new_empty(capacity, gy.shape[1]))
_autograd(combine_op, _combine, _combine_setup, _combine_bwd, inputs=(0, 1), tracked=6)


def combine_rows_grad(gy: Tensor, h: Dispatched, capacity: int) -> Tensor:
    """The collective half of combine's backward, for schedules that place its halves apart
    (:func:`moonep.layers.two_batch_moe`): ``gy [s, H]`` -> the rows' gradient ``[capacity, H]`` in ``gy``'s
    dtype, a tensor of its own; :func:`moonep.ep.combine_products` makes the inputs' gradients from it (the
    other half, compute).  Collective."""
    return op_state.call(combine_backward_op, gy, h.step, h.op_id, capacity, True)


def combine(expert_out: Tensor, h: Dispatched) -> Tensor:
    """:meth:`moonep.ExpertParallel.combine` of ``h``'s instance: the op ``moonep::combine``. Collective."""
    return call_combine(expert_out, h)


# --------------------------------------------------------------------------------------------- weights
def _prefetch(local_weight, token, op_id, graph, tracked):
    """``ExpertParallel._prefetch_body``: ``[epn, *D]`` -> ``[2*epn, *D]``. Collective."""
    return _fresh(op_state.instance(op_id)._prefetch_body(local_weight, token, tracked), local_weight)


prefetch_op = _define(
    "prefetch(Tensor local_weight, Tensor step, int op_id, bool graph, int tracked) -> Tensor", _prefetch,
    lambda local_weight, token, op_id, graph, tracked: local_weight.new_empty(2 * local_weight.shape[0],
                                                                              *local_weight.shape[1:]))


def _prefetch_setup(ctx, inputs, output):
    ctx.op_id = inputs[2]
    _save(ctx, inputs[1], inputs[3])


def _prefetch_bwd(ctx, g):
    (token,) = _saved(ctx)
    with _backward_only():
        return op_state.call(prefetch_backward_op, g, token, ctx.op_id), None, None, None, None


def _prefetch_backward(g, token, op_id):
    """``prefetch_grad``: ``[2*epn, *D]`` slot gradients -> ``[epn, *D]`` at home. Collective."""
    ep, step = _lookup(token, op_id)
    return _fresh(prefetch_grad(ep, step.plan, g), g)


prefetch_backward_op = _define("prefetch_backward(Tensor g, Tensor step, int op_id) -> Tensor", _prefetch_backward,
                               lambda g, token, op_id: g.new_empty(g.shape[0] // 2, *g.shape[1:]))
_autograd(prefetch_op, _prefetch, _prefetch_setup, _prefetch_bwd, inputs=(0,), tracked=4)


def prefetch(h: Dispatched, local_weight: Tensor) -> Tensor:
    """:meth:`moonep.ExpertParallel.prefetch` (the op ``moonep::prefetch``): ``local_weight [epn, *D]`` ->
    ``[2*epn, *D]`` (home experts, then replicas; empty slots zero).  Differentiable (the backward is
    ``reduce_grad``). Collective."""
    return call_prefetch(h, local_weight)


def _fetch_replicas(local_weights, outs, token, op_id, fresh, backward, names):
    op_state.instance(op_id)._fetch_body(local_weights, outs, token, fresh, backward, names)


fetch_replicas_op = _define(
    "fetch_replicas(Tensor[] local_weights, Tensor(a!)[] outs, Tensor token, int op_id, bool fresh, bool backward, "
    "str[] names) -> ()", _fetch_replicas, lambda *args: None)
fetch_replicas_op.__doc__ = """``moonep::fetch_replicas``: the replica slots of each ``local_weights[i] [epn, *D_i]`` into
``outs[i]`` (like it, contiguous), in one collective (``ExpertParallel._fetch_replicas``).  ``fresh``: ``outs`` are
new tensors (every empty slot zeroed), else a pool's buffers; ``backward``: called from a backward; ``names``:
the projections' names (or none), checked with the peers."""


def prefetch_replicas(h: Dispatched, *local_weights: Tensor) -> list:
    """The replica slots of each ``local_weight [epn, *D]`` (one collective for all) -> a list of ``[epn, *D]``
    (slot ``j``: expert ``h.slot_experts[epn+j]``, zero if ``-1``).  Not differentiable:
    :func:`expert_matmul` sends the replica rows' gradient home."""
    return [f.replicas for f in fetch_op(h, list(local_weights))]


def _reduce_grad(grad, token, op_id):
    return op_state.instance(op_id)._reduce_grad_body(grad, token)


def _reduce_grad_fake(grad, token, op_id):
    return grad.new_empty(grad.shape[0] // 2, *grad.shape[1:])


reduce_grad_op = _define("reduce_grad(Tensor grad, Tensor token, int op_id) -> Tensor", _reduce_grad,
                         _reduce_grad_fake)
reduce_grad_op.__doc__ = """``moonep::reduce_grad``: ``ExpertParallel.reduce_grad``, ``[2*epn, *D]`` -> ``[epn, *D]``.
Collective; not differentiable."""


def reduce_grad(h: Dispatched, grad: Tensor) -> Tensor:
    """:meth:`moonep.ExpertParallel.reduce_grad` (``moonep::reduce_grad``): ``[2*epn, *D]`` -> ``[epn, *D]``.
    Collective; not differentiable."""
    return op_state.call(reduce_grad_op, grad, h.step, h.op_id)


def _reduce_replicas(home_grad, replica_grad, token, op_id, backward):
    op_state.instance(op_id)._reduce_body(home_grad, replica_grad, token, backward)


reduce_replicas_op = _define(
    "reduce_replicas(Tensor(a!) home_grad, Tensor replica_grad, Tensor token, int op_id, bool backward) -> ()",
    _reduce_replicas, lambda *args: None)
reduce_replicas_op.__doc__ = """``moonep::reduce_replicas``: ``home_grad [epn, *D]`` plus every rank's replica gradients
(``replica_grad [epn, *D]``) of this rank's experts, summed in ``home_grad`` (``ExpertParallel.reduce_replicas``).
Collective."""


def reduce_replicas(h: Dispatched, home_grad: Tensor, replica_grad: Tensor) -> Tensor:
    """:meth:`moonep.ExpertParallel.reduce_replicas` (``moonep::reduce_replicas``): ``[epn, *D]`` twice ->
    ``[epn, *D]``, a tensor of its own. Collective."""
    home = home_grad.detach().clone()  # (the op sums in place, without autograd)
    op_state.call(reduce_replicas_op, home, replica_grad, h.step, h.op_id, False)
    return home


# --------------------------------------------------------------------------------------------- GEMMs
def _expert_matmul(a, cu_seqlens, home_weight, replicas, home_bias, bias_replicas, token, op_id, transpose, impl,
                   replicas_id, bias_replicas_id):
    """``moonep.expert_matmul``'s product: ``a [cap, D]`` -> ``[cap, N]`` in ``a``'s dtype (home rows times
    ``home_weight``, replica rows times ``replicas``, both ``[epn, D, N]`` or ``[epn, N, D]`` transposed),
    plus each row's slot bias when ``home_bias [epn, N]`` (and ``bias_replicas``) are given."""
    wh, wr = _operands(home_weight, replicas, transpose)
    out = _run(impl, _two_grouped, _two_loop, a, cu_seqlens, wh, wr)
    if home_bias is not None:
        out = out + _gather_slots(_row_slots(cu_seqlens, out.shape[0]), home_bias, bias_replicas).to(out.dtype)
    return out


expert_matmul_op = _define(
    "expert_matmul(Tensor a, Tensor cu_seqlens, Tensor home_weight, Tensor replicas, Tensor? home_bias, "
    "Tensor? bias_replicas, Tensor step, int op_id, bool transpose, str impl, int replicas_id, "
    "int bias_replicas_id) -> Tensor", _expert_matmul,
    lambda a, cu_seqlens, home_weight, replicas, home_bias, bias_replicas, token, op_id, transpose, impl, *ids:
    a.new_empty(a.shape[0], home_weight.shape[-2] if transpose else home_weight.shape[-1]), collective=False)
expert_matmul_op.__doc__ = """``moonep::expert_matmul``: see :func:`_expert_matmul`.  ``replicas_id``, ``bias_replicas_id``:
``op_state.replicas_id`` of an eager pool's :class:`moonep.Replicas` (whose backward fetches reused slots
again), or -1: ``replicas`` and ``bias_replicas`` are kept until the backward (compiled code)."""


def _expert_matmul_setup(ctx, inputs, output):
    a, cu, home, rep, hb, rb, token, op_id, transpose, impl, rep_id, bias_rep_id = inputs
    ctx.op_id, ctx.transpose, ctx.impl = op_id, transpose, impl
    if rep_id >= 0:  # an eager pool's slots: the backward asks the pool again (a later layer may reuse them)
        ctx.pool_replicas = (op_state.replicas(rep_id), op_state.replicas(bias_rep_id) if hb is not None else None)
        _save(ctx, token, False, a, cu, home, hb)
    else:  # kept until the backward
        ctx.pool_replicas = None
        _save(ctx, token, not _eager(a), a, cu, home, rep, hb, rb)


def _expert_matmul_bwd(ctx, g):
    if ctx.pool_replicas is None:
        a, cu, home, rep, hb, rb, token = _saved(ctx)
    else:
        a, cu, home, hb, token = _saved(ctx)
        r, br = ctx.pool_replicas
    want_a, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
    if ctx.pool_replicas is not None:
        # the weights' slots again where a gradient reads them (fetched again if reused: collective); the bias
        # slots are not read
        rep = r.weights_for_backward() if want_a or want_w else r.buffer
        rb = None if br is None else br.buffer
    want_b = hb is not None and ctx.needs_input_grad[4]
    with _backward_only():
        ga, gw, gb = op_state.call(expert_matmul_backward_op, g, a, cu, home, rep, hb, rb, token, ctx.op_id,
                                   ctx.transpose, ctx.impl, want_a, want_w, want_b)
    return (_none_or(ga, want_a), None, _none_or(gw, want_w), None, _none_or(gb, want_b)) + (None,) * 7


_autograd(expert_matmul_op, _expert_matmul, _expert_matmul_setup, _expert_matmul_bwd, inputs=(0, 2, 4), tracked=None)


def _expert_matmul_backward(g, a, cu_seqlens, home_weight, replicas, home_bias, bias_replicas, token, op_id,
                            transpose, impl, want_a, want_w, want_b):
    """``expert_matmul_grads``, then ``expert_bias_grad``: ``g [cap, N]`` -> (``ga [cap, D]``, ``gw`` like
    ``home_weight``, ``gb`` like ``home_bias``), the replica slots' parts added at home (collective: the
    weights', then the biases', in one op so that no compiler can order them differently on two ranks); an
    unwanted gradient is an empty placeholder."""
    ep, h = _lookup(token, op_id)
    # the replicas as the forward read them (kept, or fetched again by the caller), and the collective reduce
    # of their gradients
    ga, gw = expert_matmul_grads(g, a, home_weight, cu_seqlens, kept_replicas(ep, h, home_weight, replicas),
                                 transpose, impl, want_a, want_w)
    gb = None
    if want_b:
        gb = expert_bias_grad(g, _row_slots(cu_seqlens, g.shape[0]), cu_seqlens,
                              kept_replicas(ep, h, home_bias, bias_replicas))
    return (_fresh(ga, g, a) if want_a else a.new_empty(0),
            _fresh(gw, home_weight, replicas) if want_w else home_weight.new_empty(0),
            _fresh(gb, home_bias, bias_replicas) if want_b else a.new_empty(0))


def _expert_matmul_backward_fake(g, a, cu_seqlens, home_weight, replicas, home_bias, bias_replicas, token, op_id,
                                 transpose, impl, want_a, want_w, want_b):
    return (a.new_empty(a.shape if want_a else (0,)), home_weight.new_empty(home_weight.shape if want_w else (0,)),
            home_bias.new_empty(home_bias.shape) if want_b else a.new_empty(0))


expert_matmul_backward_op = _define(
    "expert_matmul_backward(Tensor g, Tensor a, Tensor cu_seqlens, Tensor home_weight, Tensor replicas, "
    "Tensor? home_bias, Tensor? bias_replicas, Tensor step, int op_id, bool transpose, str impl, bool want_a, "
    "bool want_w, bool want_b) -> (Tensor, Tensor, Tensor)", _expert_matmul_backward, _expert_matmul_backward_fake)


def expert_matmul(h: Dispatched, a: Tensor, home_weight: Tensor, replicas: Tensor, *, transpose: bool = False,
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
    experts.check_matmul_args(home_weight, transpose, impl, bias, bias_replicas)
    if not torch.compiler.is_compiling():  # (compiled dispatches copy their rows)
        op_state.instance(h.op_id).check_live_rows(h, a, "a")  # a zero-copy h.tokens a later dispatch overwrote
    return call_expert_matmul(h, a, home_weight, replicas, transpose, impl, bias, bias_replicas)


def _slot_matmul(a, cu_seqlens, w, impl):
    """``moonep.slot_matmul``: ``a [cap, D]``, ``w [G, D, N]`` -> ``[cap, N]`` in ``a``'s dtype."""
    return _run(impl, _rows_grouped, _rows_loop, a, cu_seqlens, w)


slot_matmul_op = _define("slot_matmul(Tensor a, Tensor cu_seqlens, Tensor w, str impl) -> Tensor", _slot_matmul,
                         lambda a, cu_seqlens, w, impl: a.new_empty(a.shape[0], w.shape[-1]), collective=False)


def _slot_matmul_setup(ctx, inputs, output):
    a, cu, w, impl = inputs
    ctx.impl = impl
    ctx.save_for_backward(a, cu, w)


def _slot_matmul_bwd(ctx, g):
    a, cu, w = ctx.saved_tensors
    want_a, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
    ga, gw = op_state.call(slot_matmul_backward_op, g, a, cu, w, ctx.impl, want_a, want_w)
    return _none_or(ga, want_a), None, _none_or(gw, want_w), None


_autograd(slot_matmul_op, _slot_matmul, _slot_matmul_setup, _slot_matmul_bwd, inputs=(0, 2), tracked=None)


def _slot_matmul_backward(g, a, cu_seqlens, w, impl, want_a, want_w):
    """``slot_matmul_grads``: ``g [cap, N]`` -> (``ga [cap, D]``, ``gw [G, D, N]``), empty when unwanted."""
    ga, gw = slot_matmul_grads(g, a, w, cu_seqlens, impl, want_a, want_w)
    return (_fresh(ga, g, a) if want_a else a.new_empty(0), _fresh(gw, w) if want_w else w.new_empty(0))


slot_matmul_backward_op = _define(
    "slot_matmul_backward(Tensor g, Tensor a, Tensor cu_seqlens, Tensor w, str impl, bool want_a, bool want_w) -> "
    "(Tensor, Tensor)", _slot_matmul_backward, lambda g, a, cu_seqlens, w, impl, want_a, want_w: (
        a.new_empty(a.shape if want_a else (0,)), w.new_empty(w.shape if want_w else (0,))), collective=False)


def slot_matmul(a: Tensor, cu_seqlens: Tensor, w: Tensor, impl: str = "auto") -> Tensor:
    """:func:`moonep.slot_matmul` as ``moonep::slot_matmul`` (``a [cap, D]``, int32 ``cu_seqlens [G+1]``,
    ``w [G, D, N]`` -> ``[cap, N]``); differentiable with respect to ``a`` and ``w``.  Not collective."""
    return experts.slot_matmul(a, cu_seqlens, w, impl)


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


def _plan_and_destinations(counts, topk_idx, rank, slack, align):
    """``moonep.layout.plan_and_destinations`` (one kernel launch on CUDA); fresh outputs (on CUDA the plan's
    tensors share one workspace, and a custom op's outputs may not alias)."""
    from .layout import plan_and_destinations as run
    plan, dst_rank, dst_row = run(counts, rank, topk_idx, slack=slack, align=align)
    err = plan.error if plan.error is not None else torch.zeros((), dtype=torch.int32, device=counts.device)
    return tuple(t.to(torch.int64 if i < 7 else torch.int32).clone() for i, t in enumerate(
        (plan.assignment, plan.replica_experts, plan.replica_source, plan.recv_counts, plan.expert_counts,
         dst_rank, dst_row, err.reshape(()))))


def _plan_and_destinations_fake(counts, topk_idx, rank, slack, align):
    R, E = counts.shape
    i64 = dict(dtype=torch.int64, device=counts.device)
    return (torch.empty(E, R, **i64), torch.empty(R, E // R, **i64), torch.empty(R, **i64), torch.empty(R, **i64),
            torch.empty(E, **i64), torch.empty(topk_idx.shape, **i64), torch.empty(topk_idx.shape, **i64),
            torch.empty((), dtype=torch.int32, device=counts.device))


plan_and_destinations_op = _define(
    "plan_and_destinations(Tensor counts, Tensor topk_idx, int rank, float slack, int align) -> "
    "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)", _plan_and_destinations,
    _plan_and_destinations_fake, collective=False)


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
    return Planned(*op_state.call(plan_and_destinations_op, counts, topk_idx, int(rank), float(slack), int(align)))


# --------------------------------------------------------------------------------------------- balancer
def _qb_record(raw, values, bias, lo, width, counts, work, balancer_id, first, check):
    """``QuantileBalancer._record_cuda`` (one kernel, CUDA): required biases of ``raw [s, E]`` (cutoffs in
    column K of ``values [s, K+1]``) into ``counts`` int32 ``[E*B+1+31]``; ``first``: this micro-batch sets the
    range ``lo``/``width`` (0-d) from ``bias [E]``; ``check``: count bad scores (flags in ``work``)."""
    # the tensors the compiled graph passed (functionalisation may pass copies of the balancer's buffers)
    op_state.instance(balancer_id).record_kernel(raw, values, check, bias, lo, width, counts, work, first)


qb_record_op = _define(
    "qb_record(Tensor raw, Tensor values, Tensor bias, Tensor(a!) lo, Tensor(b!) width, Tensor(c!) counts, "
    "Tensor(d!) work, int balancer_id, bool first, bool check) -> ()", _qb_record, lambda *args: None,
    collective=False)


def qb_record(balancer, raw: Tensor, values: Tensor, check: bool) -> None:
    """Record one micro-batch of :class:`moonep.QuantileBalancer` on CUDA through ``moonep::qb_record`` (what
    ``route`` does when compiled, so that it traces without a graph break; ``step`` stays eager).

    Args:
        raw: ``[s, E]`` scores (float32/bf16/fp16/fp64); values: ``[s, K+1]`` top-(K+1) biased scores.
    """
    op_state.call(qb_record_op, raw, values, balancer.bias, balancer._lo, balancer._width, balancer._counts,
                  balancer._work, balancer._op_id, not balancer._recording, bool(check))
    balancer._recording = True

