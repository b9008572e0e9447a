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
