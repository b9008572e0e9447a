"""The transport interface: the two collectives the host-driven data path needs.

Every implementation moves the same bytes and returns the same result, so outputs are bitwise equal
whichever transport is used. Splits are host-known lists here (the host backend); the nvlink backend
writes into peer memory instead (through :mod:`moonep.transport.ipc`) and needs no host splits.
"""
from __future__ import annotations

import torch


class Transport:
    """Moves rows between the ranks of one group.

    Implementations: :class:`moonep.transport.mpi.MPITransport` (mpi4py, CPU tensors, zero-copy numpy views),
    :class:`moonep.transport.torchdist.TorchDistTransport` (``all_to_all_single`` on gloo or NCCL) and
    :class:`moonep.transport.local.SelfTransport` (one process, no group).
    """

    name = "base"
    rank: int
    world_size: int
    current_op = "a collective"  # set by moonep.guard: named in timeout and peer-failure errors (str() it)
    call = (-1, 0, 0)  # (instance, op code, seq) of that call (moonep.guard), for the headers of object gathers

    def timeout_s(self) -> float:
        """Seconds a collective waits for its peers before raising :class:`moonep.MoonepError`."""
        raise NotImplementedError

    def abandon_call(self, why: str) -> None:
        """A call ended part way on this rank (an interrupt, or an error raised on this rank only, between
        its collectives): its peers may wait in a collective this rank will not make, or still send into
        it.  Every later call of this instance is refused at once, naming ``why`` (the ``"torch"``
        transport: every later moonep call on its gloo group)."""

    def exchange_header(self, header: list[int]) -> list[list[int]]:
        """Swap a small list of ints with every rank: returns ``R`` lists (ours at index ``rank``).

        Raises :class:`moonep.MoonepError` naming ``current_op`` (and the missing peers where the transport
        can tell) when a peer does not take part within :meth:`timeout_s`.
        """
        raise NotImplementedError

    def all_to_all(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
        """Exchange rows: ``send[sum(send_splits[:r]) : ...]`` goes to rank ``r``.

        Args:
            send: ``[n_send, *D]`` contiguous, any dtype; ``n_send == sum(send_splits)``.
            send_splits: ``R`` ints, rows for each destination.
            recv_splits: ``R`` ints, rows from each source.
        Returns:
            ``[sum(recv_splits), *D]``, same dtype and device, rows grouped by source rank in rank order.
        """
        raise NotImplementedError

    def all_to_all_sized(self, send: torch.Tensor, send_splits: list[int]) -> tuple[torch.Tensor, list[int]]:
        """:meth:`all_to_all` when the receivers do not know ``recv_splits`` yet: returns ``(recv,
        recv_splits)``.  Here: the splits are exchanged first (one more collective); a transport whose
        messages carry their size (MPI: a matched probe) saves that round."""
        R = self.world_size
        splits = torch.tensor(list(send_splits), dtype=torch.int64, device=send.device)[:, None]
        recv_splits = self.all_to_all(splits, [1] * R, [1] * R)[:, 0].tolist()
        return self.all_to_all(send, send_splits, recv_splits), recv_splits

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Gather a ``[n]`` int64 tensor from every rank into ``[R, n]`` (identical on every rank)."""
        raise NotImplementedError

    def all_gather_object(self, obj) -> list:
        """Gather a small picklable object from every rank (configuration checks, error messages)."""
        raise NotImplementedError
