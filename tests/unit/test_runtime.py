"""Launch detection and bootstrap outside mpirun: single process and torchrun."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moonep.runtime import detect_launcher

ROOT = Path(__file__).resolve().parents[2]  # the repository root (tests/unit/ is two levels down)


@pytest.mark.parametrize("env,want", [
    ({}, "single"),
    ({"PMI_RANK": "0", "PMI_SIZE": "2"}, "mpi"),
    ({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1"}, "mpi"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "x", "MASTER_PORT": "1"}, "torchrun"),
    ({"TORCHELASTIC_RUN_ID": "a", "RANK": "0", "WORLD_SIZE": "1"}, "torchrun"),
])
def test_detect_launcher(env, want):
    assert detect_launcher(env) == want


def _run(cmd, timeout=120):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    for k in ("PMI_RANK", "PMI_SIZE", "RANK", "WORLD_SIZE", "MASTER_ADDR", "OMPI_COMM_WORLD_SIZE"):
        env.pop(k, None)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def test_single_process():
    r = _run([sys.executable, "examples/hello_ranks.py"])
    assert r.returncode == 0, r.stderr
    assert "rank 0/1 launcher=single backend=gloo" in r.stdout


def test_torchrun_two_ranks():
    # --standalone picks a free port itself, so parallel jobs do not collide.
    r = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
              "examples/hello_ranks.py"])
    assert r.returncode == 0, r.stderr[-3000:]
    for k in range(2):
        assert f"rank {k}/2 launcher=torchrun backend=gloo device=cpu all_reduce=1 all_to_all=ok" in r.stdout


def test_existing_group_is_used():
    code = ("import torch.distributed as dist, moonep;"
            "dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1);"
            "rt = moonep.init(); assert rt.launcher == 'external' and rt.group is dist.group.WORLD;"
            "g = dist.new_group([0]); rt2 = moonep.init(g); assert rt2.group is g; print('ok')")
    r = _run([sys.executable, "-c", code])
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


def test_a_mesh_gives_the_device_type():
    """moonep.init(mesh) runs on the mesh's device type; a device or backend of another type is refused,
    naming the argument."""
    code = ("import torch.distributed as dist, moonep, pytest;"
            "from torch.distributed.device_mesh import init_device_mesh;"
            "dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1);"
            "mesh = init_device_mesh('cpu', (1,), mesh_dim_names=('ep',));"
            "assert moonep.init(mesh['ep']).device.type == 'cpu';"
            "e1 = pytest.raises(ValueError, moonep.init, mesh['ep'], device='cuda');"
            "e2 = pytest.raises(ValueError, moonep.init, mesh['ep'], backend='nccl');"
            "assert str(e1.value).startswith('device: expected one that runs on the mesh'), e1.value;"
            "assert str(e2.value).startswith('backend: expected'), e2.value; print('ok')")
    r = _run([sys.executable, "-c", code])
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


def test_bad_backend_is_rejected():
    import moonep
    with pytest.raises(ValueError, match="backend"):
        moonep.init(backend="mpi-please")


def test_gloo_collectives_let_go_of_their_tensors():
    """gloo marks a collective done before its worker thread drops the work's tensors (which takes the GIL):
    a collective just before interpreter exit then aborted the process ("terminate called without an active
    exception").  ``released`` waits until the worker has let go; without it, a fair share of calls return
    with the worker still holding them."""
    code = """
import torch, torch.distributed as dist
from moonep.transport.host_group import all_gather_single, released
dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)
held = 0
for _ in range(300):
    mine, out = torch.ones(4, dtype=torch.int64), torch.empty(4, dtype=torch.int64)
    with released(dist.group.WORLD, out, mine):
        all_gather_single(out, mine)
    held += mine._use_count() > 1 or out._use_count() > 1
print('held', held)
dist.destroy_process_group()
"""
    r = _run([sys.executable, "-c", code])
    assert r.returncode == 0 and "held 0" in r.stdout, (r.stdout, r.stderr[-2000:])
