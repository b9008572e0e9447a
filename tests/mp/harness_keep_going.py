"""Cases for mprun --keep-going, launched by tests/mp/test_harness.py."""
import torch
import torch.distributed as dist


def case_fails_on_every_rank(rt):
    assert False, "deliberate failure on every rank"


def case_after_a_uniform_failure(rt):
    t = torch.ones(1)
    dist.all_reduce(t, group=rt.group)
    assert float(t) == rt.world_size


def case_one_rank_fails(rt):
    if rt.rank == 1:
        assert False, "deliberate failure on rank 1"
    dist.all_reduce(torch.ones(1), group=rt.group)  # the others wait for rank 1, which never comes


def case_never_reached(rt):
    pass
