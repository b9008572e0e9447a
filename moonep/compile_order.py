"""Every rank runs the collectives of a compiled graph in the program's order, whatever inductor schedules.

Inductor may run two ops that share no data in either order, and picks one per rank: its reordering for
peak memory weighs each rank's own tensor sizes (a rank without tokens even gets a graph of its own).  Two
collectives of moonep with no data between them (the dispatch of micro-batch B and the replica fetch of A,
or two combines' backwards) could then run in one order on one rank and in the other on a peer: refused on
every rank by the call-order check, or, where none runs (a CUDA graph replay), a hang.

So every collective op of moonep has a last argument ``Tensor? after=None`` that its kernel ignores
(``moonep.ops._define``), and :class:`OrderCollectives`, a joint-graph pass that moonep adds to
``torch._inductor.config.joint_custom_pre_pass``, passes each collective an output of the previous one as
``after`` (its first tensor output; an async op's work tensor): a data dependency, which every scheduler
keeps.  The joint graph holds the traced program in order (the forward's collectives, then the backward's,
in the order autograd runs them); the forward's and the backward's collectives are chained apart (the
backward's are those that depend on a tangent or carry the "must_be_in_backward" tag), so that no forward
tensor is kept for the backward.

The same reordering moves a ``moonep::wait_work`` up to its async call, and nothing would overlap: the pass
also adds to each wait's ``keep`` what the program computes between the call and the wait.
"""
from __future__ import annotations

import functools
import operator
from pathlib import Path

import torch
import torch.fx

COLLECTIVES: set = set()  # the OpOverloads of moonep's collective ops (moonep.ops._define adds them)


def _called_op(node: torch.fx.Node):
    """The op that ``node`` calls, directly or through ``auto_functionalized`` (an op that writes in place),
    or ``None``."""
    if node.op != "call_function":
        return None
    if isinstance(node.target, torch._ops.HigherOrderOperator):
        return node.args[0] if node.args else None
    return node.target


def _target_op(node: torch.fx.Node):
    """The moonep collective that ``node`` calls (see :func:`_called_op`), or ``None``."""
    op = _called_op(node)
    return op if op in COLLECTIVES else None


def _tensor_path(val, path=()):
    """The index path of the first tensor in ``val`` (a node's ``meta["val"]``), or ``None``."""
    if isinstance(val, torch.Tensor):
        return path
    if isinstance(val, (list, tuple)):
        for i, v in enumerate(val):
            p = _tensor_path(v, path + (i,))
            if p is not None:
                return p
    return None


def _dep_output(graph: torch.fx.Graph, node: torch.fx.Node, op):
    """A node whose value is the output of collective ``node`` that the next one takes as ``after`` (a
    ``getitem`` of it, made after it), or ``None``: its first tensor output; for an async op the work tensor,
    which its wait does not write (a tensor the wait writes, read by a later op, would have to be copied
    before the wait)."""
    val = node.meta.get("val")
    if op.name().endswith("_async") and node.target is op:  # (outputs..., work)
        path = (len(val) - 1,) if isinstance(val, (list, tuple)) else ()
    else:  # (through auto_functionalized, an async op's work tensor comes first: (work, *written))
        path = _tensor_path(val)
    if path is None:
        return None
    out = node
    for i in path:
        got = next((u for u in out.users if u.target is operator.getitem and u.args[1] == i), None)
        if got is None:
            with graph.inserting_after(out):
                got = graph.call_function(operator.getitem, (out, i))
            got.meta["val"] = out.meta["val"][i]
        out = got
    return out


def _backward_nodes(graph: torch.fx.Graph) -> set:
    """The nodes of a joint graph that belong to the backward: those depending on a tangent, and the
    collectives tagged "must_be_in_backward" (a rank whose tangents a compiler made constants)."""
    back: set = set()
    for node in graph.nodes:
        if (node.op == "placeholder" and "tangent" in node.name) or \
                node.meta.get("partitioner_tag") == "must_be_in_backward" or \
                any(a in back for a in node.all_input_nodes):
            back.add(node)
    return back


def order_collectives(graph: torch.fx.Graph) -> int:
    """Chain the moonep collectives of ``graph`` in its node order (see the module); returns how many got an
    ``after``."""
    back = _backward_nodes(graph)
    last: dict = {}  # phase -> the output of the previous collective that the next one takes as `after`
    chained = 0
    for node in list(graph.nodes):
        op = _target_op(node)
        if op is None:
            continue
        phase = node in back
        dep = last.get(phase)
        if dep is not None and node.kwargs.get("after") is None:
            node.kwargs = {**node.kwargs, "after": dep}
            if "eager_input_vals" in node.meta:  # (inductor retraces a functionalized op from these values)
                args, kwargs = node.meta["eager_input_vals"]
                node.meta["eager_input_vals"] = (args, {**kwargs, "after": dep.meta.get("val")})
            chained += 1
        out = _dep_output(graph, node, op)
        if out is not None:
            last[phase] = out
    nodes = list(graph.nodes)  # (with the getitems made above)
    order = {n: i for i, n in enumerate(nodes)}
    for node in nodes:
        if _called_op(node) is torch.ops.moonep.wait_work.default:
            _pin_wait(nodes, order, node, back)
    return chained


def _pin_wait(nodes: list, order: dict, wait: torch.fx.Node, back: set) -> None:
    """Add to ``wait``'s ``keep`` what the program computes between its async call and it (the nodes of that
    span, of the same phase, that nothing else in the span reads): a scheduler that weighs memory would
    otherwise move the wait up to the call (inductor does), and nothing would overlap.  ``nodes``: the graph's
    nodes in order, ``order`` their positions."""
    work = wait.kwargs.get("work", wait.args[1] if len(wait.args) > 1 else None)
    start = work.args[0] if work is not None and work.target is operator.getitem else work
    if not isinstance(start, torch.fx.Node):
        return
    lo, hi, phase = order[start], order[wait], wait in back
    span = [n for n in nodes[lo + 1:hi] if n.op == "call_function" and (n in back) == phase
            and isinstance(n.meta.get("val"), torch.Tensor) and n.target is not operator.getitem]
    inside = set(span) | {start, work}
    frontier = [n for n in span if not any(u in inside and u is not n and order[u] < hi for u in n.users)
                and start not in n.all_input_nodes and work not in n.all_input_nodes]
    if not frontier:
        return
    keep = list(wait.kwargs.get("keep", wait.args[3] if len(wait.args) > 3 else []))
    keep += [n for n in frontier if n not in keep]
    if wait.target is torch.ops.moonep.wait_work.default:
        wait.args = tuple(wait.args[:3])
    wait.kwargs = {**wait.kwargs, "keep": keep}
    if "eager_input_vals" in wait.meta:  # (inductor retraces a functionalized op from these values)
        args, kwargs = wait.meta["eager_input_vals"]
        vals = type(wait.kwargs["keep"])(n.meta.get("val") for n in keep)  # (the same list type as the node's)
        wait.meta["eager_input_vals"] = (args, {**kwargs, "keep": vals})


@functools.cache
def _order_collectives_class():
    """:class:`OrderCollectives`, defined at first use: its base class's module imports inductor and dynamo
    (over a second of a process's start, which a process that never compiles should not pay)."""
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

    class OrderCollectives(CustomGraphPass):
        """The joint-graph pass of :func:`order_collectives`, in the form inductor's caches accept (a
        ``CustomGraphPass`` with a ``uuid``), calling any pass that was configured before it."""

        def __init__(self, before=None):
            # the passes configured before (one, or a list as newer torch versions take)
            self.before = [] if before is None else list(before) if isinstance(before, (list, tuple)) else [before]

        def __call__(self, graph: torch.fx.Graph) -> None:
            for p in self.before:
                p(graph)
            order_collectives(graph)

        def uuid(self):
            here = Path(__file__).parent  # what the pass does depends on the ops' schemas too
            mine = get_hash_for_files((__file__, str(here / "ops.py"), str(here / "ops_async.py")))
            theirs = [getattr(p, "uuid", lambda: None)() for p in self.before]
            return None if None in theirs else (mine, *theirs)  # (None: inductor skips its cache, as for theirs)

    OrderCollectives.__module__ = __name__
    return OrderCollectives


def __getattr__(name: str):
    if name == "OrderCollectives":  # (see _order_collectives_class)
        return _order_collectives_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def install() -> None:
    """Add :class:`OrderCollectives` to inductor's joint-graph passes (once; a pass set before is kept).  The
    fake implementations of moonep's collectives call it: a compiler traces them before it runs its joint-graph
    passes."""
    import torch._inductor.config as config
    cls = _order_collectives_class()
    current = config.joint_custom_pre_pass
    if isinstance(current, cls):
        return
    config.joint_custom_pre_pass = cls(current)
