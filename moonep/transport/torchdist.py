"""torch.distributed transport: ``all_to_all_single`` on gloo (CPU) or NCCL (CUDA).

Every collective here waits at most its process group's timeout (``moonep.init(timeout=...)`` /
``MOONEP_TIMEOUT``); this transport polls nothing itself (its ``timeout``, ``ExpertParallel(timeout=)``,
would bound such waits).  gloo reports a dead or stalled peer as a ``RuntimeError``; it is re-raised as
:class:`moonep.MoonepError` naming the op.  After a gloo timeout the group's connections are closed: every
later collective on that group, on every rank, raises at once ("Connection closed by peer"), so the
instance and every other user of the group need a new group.  (NCCL reports asynchronously: its watchdog
ends the process after the timeout.)

Headers and object gathers go through the runtime's gloo group, header first
(:mod:`moonep.transport.host_group`): ranks in different calls, or an instance built on one rank while
another dispatches, fail cleanly together.  The data collectives of a call (on the group: gloo or NCCL)
follow its agreed header, so their sizes match.  A call left part way on one rank (:meth:`abandon_call`)
abandons the gloo group on that rank.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from ..errors import MoonepError
from ..guard import BUILD, GATHER
from ..work import join_host
from .base import Transport
from .host_group import HostGroup, all_gather_single, released


def _named(what: str):
    """Refuse a call on an abandoned group; re-raise a backend failure inside the wrapped collective as
    MoonepError naming op and timeout."""
    def wrap(fn):
        @functools.wraps(fn)
        def inner(self, *args, **kwargs):
            self.host.usable(self.current_op)
            try:
                return fn(self, *args, **kwargs)
            except MoonepError:
                raise
            except RuntimeError as exc:  # gloo: "Timed out waiting ...", "Connection closed by peer ..."
                raise MoonepError(f"rank {self.rank}: {self.current_op}: {what} failed (the process group's "
                                  f"timeout {self.group_timeout:g}s; a peer is dead, stalled or called a "
                                  f"different collective): {str(exc).strip()[:500]}") from exc
        return inner
    return wrap


class TorchDistTransport(Transport):
    name = "torch"

    def __init__(self, group, cpu_group=None, timeout: float = 60.0, group_timeout: float | None = None):
        """``group_timeout``: what the group's collectives wait (the runtime's timeout; default ``timeout``);
        ``timeout``: for waits this transport would poll itself (none today)."""
        self.group = group
        self.cpu_group = cpu_group if cpu_group is not None else group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.backend = dist.get_backend(group)
        self.timeout = float(timeout)
        self.group_timeout = self.timeout if group_timeout is None else float(group_timeout)
        self.host = HostGroup(self.cpu_group, self.group_timeout)

    def timeout_s(self) -> float:
        """What a collective of this transport waits at most: the process group's timeout."""
        return self.group_timeout

    def abandon_call(self, why: str) -> None:
        self.host.abandon(why)

    @_named("all_to_all")
    def all_to_all(self, send, send_splits, recv_splits):
        if send.is_cuda and self.backend == "gloo":  # gloo moves host memory: stage CUDA tensors through it
            return self.all_to_all(send.cpu(), send_splits, recv_splits).to(send.device)
        send = send.contiguous()
        recv = torch.empty((sum(recv_splits), *send.shape[1:]), dtype=send.dtype, device=send.device)
        if send.dtype == torch.bool:  # gloo has no bool all-to-all
            return self.all_to_all(send.view(torch.uint8), send_splits, recv_splits).view(torch.bool)
        with released(self.group, recv, send):
            dist.all_to_all_single(recv, send, list(recv_splits), list(send_splits), group=self.group)
        return recv

    @_named("all_gather")
    def all_gather(self, t):
        if t.is_cuda and self.backend == "gloo":
            return self.all_gather(t.cpu()).to(t.device)
        t = t.to(torch.int64).contiguous()
        out = torch.empty(self.world_size * t.numel(), dtype=torch.int64, device=t.device)
        flat = t.reshape(-1)
        with released(self.group, out, flat):
            all_gather_single(out, flat, group=self.group)
        return out.view(self.world_size, -1)

    def all_gather_object(self, obj):
        """Header first (the size, and the call: this instance's construction or its current call), then
        the bytes: a rank in another call raises :class:`moonep.guard.OrderMismatch` with this one."""
        join_host()  # after the queued async_op=True calls (a no-op on the worker that runs them)
        instance, code, seq = self.call
        return self.host.all_gather_object(obj, code=BUILD if code == BUILD else GATHER, instance=instance,
                                           seq=seq, what=f"{self.current_op}: all_gather_object")

    def exchange_header(self, header):
        # On the gloo (host) group: no device sync on the NCCL path.
        return self.host.exchange(header, f"{self.current_op}: header exchange")
