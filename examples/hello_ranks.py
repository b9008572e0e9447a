"""Smallest moonep program: bootstrap from any launcher, then one all-reduce and one uneven all-to-all.

    mpiexec -n 4 python examples/hello_ranks.py
    torchrun --standalone --nproc-per-node 2 examples/hello_ranks.py
    python examples/hello_ranks.py
"""
import torch
import torch.distributed as dist

import moonep

rt = moonep.init()
x = torch.tensor([float(rt.rank)], device=rt.collective_device)
dist.all_reduce(x, group=rt.group)
# Rank r sends r+1 rows to every peer: uneven splits.
send = torch.full((rt.world_size * (rt.rank + 1), 1), float(rt.rank), device=rt.collective_device)
recv = torch.empty(sum(s + 1 for s in range(rt.world_size)), 1, device=rt.collective_device)
dist.all_to_all_single(recv, send, [s + 1 for s in range(rt.world_size)], [rt.rank + 1] * rt.world_size,
                       group=rt.group)
want = torch.tensor([float(s) for s in range(rt.world_size) for _ in range(s + 1)], device=rt.collective_device)
ok = bool(torch.equal(recv[:, 0], want)) and x.item() == rt.world_size * (rt.world_size - 1) / 2
print(f"rank {rt.rank}/{rt.world_size} launcher={rt.launcher} backend={rt.backend} device={rt.device} "
      f"all_reduce={x.item():g} all_to_all={'ok' if ok else 'WRONG'}", flush=True)
rt.shutdown()
raise SystemExit(0 if ok else 1)
