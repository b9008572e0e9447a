"""Deliberately broken cases, launched by tests/mp/test_harness.py to prove the harness never hangs."""
import os
import time

import torch
import torch.distributed as dist


def case_one_rank_fails(rt):
    if rt.rank == 3:
        assert False, "deliberate failure on rank 3"
    # Every other rank waits in a collective that rank 3 never joins.
    dist.all_reduce(torch.ones(1), group=rt.group)


def case_never_reached(rt):
    pass
