"""moonep.init over one dimension of a DeviceMesh (torchtitan's ``ep`` mesh beside its ``dp`` ranks)."""
import sys

import torch.distributed as dist

from tests.harness.mp import SkipCase

SkipCase = getattr(sys.modules.get("__main__"), "SkipCase", SkipCase)  # noqa: F811  (mprun's own class)


def case_runtime_host_group_of_a_mesh_dimension(rt):
    """moonep.init(mesh["ep"]) of a (dp, ep) mesh: the host (gloo) group has exactly the ep group's ranks
    (on NCCL it is a twin built by every rank; gloo groups are used as they are)."""
    import moonep
    from moonep.runtime import gloo_twin
    from torch.distributed.device_mesh import init_device_mesh

    if rt.world_size != 4:
        raise SkipCase("a (2, 2) mesh needs 4 ranks")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    ep = mesh["ep"].get_group()
    twin = gloo_twin(ep, rt.timeout)
    assert dist.get_process_group_ranks(twin) == dist.get_process_group_ranks(ep)
    sub = moonep.init(mesh["ep"])
    assert (sub.rank, sub.world_size) == (dist.get_rank(ep), 2)
    assert dist.get_process_group_ranks(sub.cpu_group) == dist.get_process_group_ranks(ep)
