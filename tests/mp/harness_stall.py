"""A rank that stalls forever: the per-case timeout must end the job."""
import time

import torch
import torch.distributed as dist


def case_rank1_stalls(rt):
    if rt.rank == 1:
        time.sleep(3600)
    dist.all_reduce(torch.ones(1), group=rt.group)
