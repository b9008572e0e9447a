"""Every multi-rank CPU case file, run again on CUDA devices (NCCL); skipped without CUDA.

Rank counts come from MOONEP_GPU_NRANKS (default "2 4": one rank per GPU on 2 GPUs, then two ranks per
GPU). On an 8-GPU machine: MOONEP_GPU_NRANKS="8 16".
"""
import pytest
import torch

from tests.harness.mp import GPU_ENV as CUDA, gpu_nranks, mp_cases

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
NRANKS = gpu_nranks()

test_bootstrap_gpu = mp_cases("tests/mp/cases_bootstrap.py", nranks=NRANKS, env=CUDA)
test_balance_gpu = mp_cases("tests/mp/cases_balance.py", nranks=NRANKS, env=CUDA)
# The NCCL path (host-known splits, for ranks without peer access): the whole CPU EP suite on GPUs, with
# NCCL's peer-to-peer transport switched off as it would be across nodes.
NCCL_PATH = dict(CUDA, MOONEP_TEST_TRANSPORT="torch", NCCL_P2P_DISABLE="1")
test_ep_nccl_path = mp_cases("tests/mp/cases_ep.py", nranks=NRANKS, env=NCCL_PATH)
test_layers_gpu = mp_cases("tests/mp/cases_layers.py", nranks=NRANKS, env=CUDA)
