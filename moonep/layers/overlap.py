"""Two micro-batches through one MoE layer, each one's communication hidden behind the other's expert compute.

    forward                                     backward
    dispatch A                                  combine.backward A, then B (the rows' gradients, queued)
    dispatch B  ||  experts A                   experts A backward  ||  combine.backward B
    combine A   ||  experts B                   dispatch.backward A ||  experts B backward
    combine B                                   dispatch.backward B

(``||``: at the same time; the collectives run as ``async_op=True`` calls, see :mod:`moonep.work`.)  The
schedule is an autograd Function whose stages (dispatch, experts, combine of each micro-batch) are graphs of
their own, so its backward can interleave them as above; every stage computes what the serial schedule
computes, so outputs and gradients are bitwise the same (``overlap=False`` runs this very schedule with every
call waited at once).
"""
from __future__ import annotations

import torch

from ..ep import combine_products
from ..errors import expect
from ..ops import combine_rows_grad


def two_batch_moe(ep, batches, experts, params=(), *, fetch=None, overlap: bool = True) -> list:
    """Run two micro-batches through ``dispatch -> experts -> combine`` with their communication overlapped.

    Args:
        ep: the :class:`moonep.ExpertParallel` (``dispatch_dtype`` its token dtype: fp8 dispatch is refused).
        batches: two ``(x [s_i, H], topk_idx int [s_i, K], topk_weights float [s_i, K])``, as
            :meth:`moonep.ExpertParallel.dispatch` takes them.
        experts: ``experts(h) -> expert_out [cap, H]``: the expert compute of one micro-batch's
            :class:`moonep.Dispatched` (it may fetch replicas and call :func:`moonep.expert_matmul`; collectives
            it makes run in the schedule's order on every rank).  Called once per micro-batch, A then B.
        params: the tensors ``experts`` differentiates (the experts' weights): their gradient, summed over
            the micro-batches, reaches them as any other.
        fetch: optional ``fetch(h) -> state`` (the replica fetch, :meth:`moonep.ReplicaPool.fetch`), called as
            soon as a micro-batch's rows are in and before the next collective is issued; ``experts`` is then
            called as ``experts(h, state)``.  On a GPU the collectives of a device run one after the other, so a
            fetch inside ``experts`` would wait for the other micro-batch's dispatch: given apart, A's replicas
            arrive before B's dispatch starts.
        overlap: ``False`` waits for every call at once (the serial schedule; the same bits).
    Returns:
        ``[y_A, y_B]``, ``y_i [s_i, H]`` as :meth:`moonep.ExpertParallel.combine` returns them; differentiable
        with respect to each ``x_i``, ``topk_weights_i`` and ``params``.
    """
    expect(isinstance(batches, (list, tuple)) and len(batches) == 2
           and all(isinstance(b, (list, tuple)) and len(b) == 3 for b in batches), "batches",
           "two (x, topk_idx, topk_weights) tuples", repr(type(batches).__name__))
    expect(not getattr(ep, "fp8", False), "ep", "an ExpertParallel without fp8 dispatch", "dispatch_dtype=float8")
    expect(isinstance(overlap, bool), "overlap", "True or False", repr(overlap))
    params = tuple(params)
    flat = [t for b in batches for t in b]
    expect(fetch is None or callable(fetch), "fetch", "None or a callable fetch(h) -> state", repr(fetch))
    run = experts if fetch is not None else (lambda h, state: experts(h))
    if not torch.is_grad_enabled():
        return _forward(ep, batches, run, fetch, overlap)[0]
    ys = _TwoBatch.apply(ep, run, fetch, overlap, len(params), *params, *flat)
    return list(ys)


def _waited(work, overlap: bool, works: list):
    """A thunk giving ``work``'s result: waited for now (the serial schedule) or when the schedule needs it
    (``works`` keeps it: on an error every Work still pending is let go of without blaming the caller)."""
    works.append(work)
    if not overlap:
        result = work.wait()
        return lambda: result
    return work.wait


def _let_go(works: list) -> None:
    """The schedule stopped on an error: its pending Works are not the caller's to wait for."""
    for w in works:
        w.unguarded()


def _forward(ep, batches, experts, fetch, overlap: bool):
    """The forward schedule (``experts(h, state)``, ``state`` what ``fetch(h)`` returned or ``None``).  Returns
    ``(ys, stages)``: per micro-batch ``(h, expert_out, y)``."""
    (xa, ia, wa), (xb, ib, wb) = batches
    works: list = []
    try:
        ha = _waited(ep.dispatch(xa, ia, wa, async_op=True), overlap, works)()
        sa = fetch(ha) if fetch is not None else None
        hb = _waited(ep.dispatch(xb, ib, wb, async_op=True), overlap, works)  # moves while A's experts compute
        oa = experts(ha, sa)
        hb = hb()
        sb = fetch(hb) if fetch is not None else None
        ya = _waited(ep.combine(oa, ha, async_op=True), overlap, works)       # moves while B's experts compute
        ob = experts(hb, sb)
        ya = ya()
        yb = _waited(ep.combine(ob, hb, async_op=True), overlap, works)()
    except BaseException:
        _let_go(works)
        raise
    return [ya, yb], [(ha, oa, ya), (hb, ob, yb)]


class _TwoBatch(torch.autograd.Function):
    """The schedule under autograd: each stage a graph of its own from detached inputs, joined by hand."""

    @staticmethod
    def forward(ctx, ep, experts, fetch, overlap, n_params, *args):
        params, flat = args[:n_params], args[n_params:]
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(t.requires_grad) if t.is_floating_point() else t for t in flat]
            batches = [leaves[0:3], leaves[3:6]]
            stages = []  # per micro-batch, A then B: (the dispatched rows, their leaf, the experts' output)

            def staged_experts(h, state):  # experts from the rows as a leaf: their backward is a stage of its own
                rows = h.tokens.detach().requires_grad_(h.tokens.requires_grad)
                out = experts(h._replace(tokens=rows), state)
                stages.append((h.tokens, rows, out))
                return out.detach().requires_grad_(out.requires_grad)

            ys, parts = _forward(ep, batches, staged_experts, fetch, overlap)
        ctx.ep, ctx.overlap, ctx.params = ep, overlap, params
        ctx.batches, ctx.parts, ctx.stages = batches, parts, stages
        return tuple(y.detach() for y in ys)

    @staticmethod
    def backward(ctx, gya, gyb):
        works: list = []
        try:
            return _TwoBatch._backward(ctx, gya, gyb, works)
        except BaseException:
            _let_go(works)
            raise

    @staticmethod
    def _backward(ctx, gya, gyb, works):
        overlap, params, sub = ctx.overlap, ctx.params, ctx.ep._overlap.submit

        def combine_back(i, gy):  # combine.backward: gy -> (g_out, g_weights)
            h, out, _ = ctx.parts[i]
            want_w = h.weights.requires_grad and not h.scaled
            if gy is None or not (out.requires_grad or want_w):
                return lambda: [None] * (1 + want_w)
            # only the collective (the rows' gradient) on the communication stream; the products that make
            # g_out and g_weights from it are compute, queued here when the schedule needs them
            rows = _waited(sub("combine.backward", lambda: combine_rows_grad(gy, h, out.shape[0]), [gy]),
                           overlap, works)
            weights = None if h.scaled else h.weights  # (scaled at dispatch: combine was a plain sum)
            return lambda: list(combine_products(rows(), out, weights, out.requires_grad, want_w))[:1 + want_w]

        def experts_back(i, g_out):  # experts.backward: g_out -> (g_rows, g_params...)
            _, rows, out = ctx.stages[i]
            return _grad([out], [rows, *params], [g_out])

        def dispatch_back(i, g_rows, g_w):  # dispatch.backward: (g_rows, g_weights) -> (g_x, g_topk_weights)
            h = ctx.parts[i][0]
            x, _, w = ctx.batches[i]
            outs, grads = [ctx.stages[i][0]], [g_rows]
            if g_w is not None:
                outs.append(h.weights)
                grads.append(g_w)
            return _waited(sub("dispatch.backward", lambda: _grad(outs, [x, w], grads), grads), overlap, works)

        ca, cb = combine_back(0, gya), combine_back(1, gyb)
        ga = ca()
        ea = experts_back(0, ga[0])                                     # while B's combine.backward moves
        gb = cb()
        da = dispatch_back(0, ea[0], ga[1] if len(ga) > 1 else None)    # moves while B's experts.backward runs
        eb = experts_back(1, gb[0])
        db = dispatch_back(1, eb[0], gb[1] if len(gb) > 1 else None)
        (gxa, gwa), (gxb, gwb) = da(), db()
        gparams = [_add(a, b) for a, b in zip(ea[1:], eb[1:])]
        return (None, None, None, None, None, *gparams, gxa, None, gwa, gxb, None, gwb)


def _grad(outputs, inputs, grads):
    """``torch.autograd.grad`` of the outputs that have a gradient, over the inputs that require grad (``None``
    for the others, and for all when nothing flows)."""
    pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
    want = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    if not pairs or not want:
        return [None] * len(inputs)
    got = iter(torch.autograd.grad([o for o, _ in pairs], want, [g for _, g in pairs], allow_unused=True))
    return [next(got) if isinstance(t, torch.Tensor) and t.requires_grad else None for t in inputs]


def _add(a, b):
    if a is None or b is None:
        return b if a is None else a
    return a + b
