"""Interrupts, ranks in different collectives and empty ranks on CUDA ranks; skipped without CUDA.

The CPU cases files again, with CUDA tensors: the torch transport (NCCL when every rank has its own GPU,
gloo staging through the host when ranks share one), plus the nvlink backend for empty ranks:

* tests/mp/cases_interrupts.py: an interrupt at every wait of a step, on every rank; the instance refuses,
  a fresh one on a new group works;
* tests/mp/cases_disagree.py: a rank building an instance (or closing and rebuilding) while the others
  dispatch, an exception in a backward hook, a LatentMoE rank that skips part of a backward: MoonepError on
  every rank, every process alive (a rank leaving a call part way is skipped on NCCL: docs/reliability.md);
* tests/mp/cases_empty_ranks.py: the hypothesis property over token counts (0 included) and layouts.

    MOONEP_GPU_NRANKS=2 python3 -m pytest -q tests/gpu/test_mp_reliability_gpu.py   # 2 ranks on one GPU
"""
import pytest
import torch

from tests.harness.mp import GPU_ENV, gpu_nranks, mp_cases

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
NRANKS = gpu_nranks()

test_interrupts_gpu = mp_cases("tests/mp/cases_interrupts.py", nranks=NRANKS, env=GPU_ENV, case_timeout=300,
                               group="reliability_gpu")
test_disagree_gpu = mp_cases("tests/mp/cases_disagree.py", nranks=NRANKS, env=GPU_ENV, case_timeout=300,
                             group="reliability_gpu")
test_empty_ranks_gpu = mp_cases("tests/mp/cases_empty_ranks.py", nranks=NRANKS, env=GPU_ENV, case_timeout=600,
                                group="reliability_gpu")
