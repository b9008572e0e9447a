"""Bootstrap cases: run on every rank by tests.harness.mprun (see tests/mp/test_mp_bootstrap.py)."""
import torch
import torch.distributed as dist


def case_world(rt):
    assert rt.world_size == dist.get_world_size(rt.group)
    assert rt.rank == dist.get_rank(rt.group)
    assert 0 <= rt.local_rank < rt.local_world_size
    assert rt.launcher in ("mpi", "external")


def case_all_reduce(rt):
    x = torch.full((3,), float(rt.rank + 1), device=rt.collective_device, dtype=torch.float64)
    dist.all_reduce(x, group=rt.group)
    n = rt.world_size
    assert torch.equal(x.cpu(), torch.full((3,), n * (n + 1) / 2, dtype=torch.float64))


def case_all_to_all_uneven(rt):
    # Rank r sends (r + d + 1) rows to rank d, each row tagged with (src, dst, index).
    r, n = rt.rank, rt.world_size
    send_splits = [r + d + 1 for d in range(n)]
    recv_splits = [s + r + 1 for s in range(n)]
    send = torch.cat([torch.tensor([[r, d, i] for i in range(send_splits[d])], dtype=torch.int64)
                      for d in range(n)]).to(rt.collective_device)
    recv = torch.empty(sum(recv_splits), 3, dtype=torch.int64, device=rt.collective_device)
    dist.all_to_all_single(recv, send, recv_splits, send_splits, group=rt.group)
    want = torch.cat([torch.tensor([[s, r, i] for i in range(recv_splits[s])], dtype=torch.int64)
                      for s in range(n)])
    assert torch.equal(recv.cpu(), want)


def case_all_to_all_empty_splits(rt):
    # Some pairs exchange nothing at all; rank 0 sends nothing anywhere.
    r, n = rt.rank, rt.world_size
    send_splits = [0 if r == 0 or (r + d) % 2 else 2 for d in range(n)]
    recv_splits = [0 if s == 0 or (s + r) % 2 else 2 for s in range(n)]
    send = torch.full((sum(send_splits), 4), float(r), device=rt.collective_device)
    recv = torch.empty(sum(recv_splits), 4, device=rt.collective_device)
    dist.all_to_all_single(recv, send, recv_splits, send_splits, group=rt.group)
    srcs = [s for s in range(n) for _ in range(recv_splits[s])]
    assert torch.equal(recv[:, 0].cpu(), torch.tensor(srcs, dtype=torch.float32))


def case_mpi_comm(rt):
    # Under mpirun the runtime keeps the mpi4py communicator for the MPI transport.
    assert rt.comm is not None and rt.comm.Get_size() == rt.world_size


def _transports(rt, timeout: float = 60.0):
    """The host transports over this job: MPI (under mpirun) and torch.distributed (gloo)."""
    from moonep.transport.torchdist import TorchDistTransport

    out = [TorchDistTransport(rt.group, rt.cpu_group, timeout=timeout)]
    if rt.comm is not None:
        from moonep.transport.mpi import MPITransport

        out.append(MPITransport(rt.comm, timeout=timeout))
    return out


def case_all_to_all_sized_learns_the_splits(rt):
    """all_to_all_sized: the receivers learn how many rows each peer sent (on MPI from the message itself),
    for uneven and empty splits, 1-D to 3-D rows, and calls interleaved with all_to_all on one instance."""
    if rt.device.type != "cpu":
        return
    r, n = rt.rank, rt.world_size
    for tr in _transports(rt):
        for step in range(3):
            for dtype, row in ((torch.float32, ()), (torch.bfloat16, (5,)), (torch.uint8, (2, 3)),
                               (torch.float32, (0,))):  # rows of no bytes: their count is still learned
                # rank 0 sends nothing anywhere; others send (r + d + step) % 3 rows to rank d
                send_splits = [0 if r == 0 else (r + d + step) % 3 for d in range(n)]
                want_splits = [0 if s == 0 else (s + r + step) % 3 for s in range(n)]
                send = torch.cat([torch.full((send_splits[d], *row), 10 * r + d, dtype=dtype)
                                  for d in range(n)])
                recv, splits = tr.all_to_all_sized(send, send_splits)
                assert splits == want_splits, (tr.name, splits, want_splits)
                want = torch.cat([torch.full((want_splits[s], *row), 10 * s + r, dtype=dtype) for s in range(n)])
                assert recv.dtype == dtype and torch.equal(recv, want), tr.name
                # a plain all_to_all on the same instance in between keeps the pairing
                back = tr.all_to_all(recv, want_splits, send_splits)
                assert torch.equal(back, send), tr.name


def case_all_to_all_sized_names_a_missing_peer(rt):
    """A peer that never makes the call: every rank that did raises MoonepError naming it, within the
    timeout (MPI transport: nothing was posted for the missing message)."""
    import moonep

    from moonep.transport.mpi import MPITransport

    if rt.device.type != "cpu" or rt.comm is None or not 2 <= rt.world_size <= 4:
        return  # 8 ranks on 2 cores: a 3 s window is too tight to be sure every rank makes the good call
    # its own communicator: the abandoned send to the missing rank must not hold COMM_WORLD at finalize
    tr = MPITransport(rt.comm.Dup(), timeout=3.0)
    tr.all_to_all_sized(torch.zeros(rt.world_size, 1), [1] * rt.world_size)  # a good call first
    if rt.rank == rt.world_size - 1:
        return  # the last rank skips the next call
    try:
        tr.all_to_all_sized(torch.zeros(rt.world_size, 1), [1] * rt.world_size)
    except moonep.MoonepError as exc:
        assert f"rank {rt.world_size - 1}" in str(exc) and "all_to_all" in str(exc), str(exc)
    else:
        raise AssertionError("all_to_all_sized returned without the last rank")
