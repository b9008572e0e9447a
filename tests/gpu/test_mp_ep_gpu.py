"""The NVLink transport (tests/gpu/cases_ep_gpu.py) on CUDA ranks (killed ranks: tests/gpu/test_mp_faults_gpu.py).

Skipped as a whole, without launching mpiexec, on machines without CUDA.  Rank counts: 2 (one per GPU on
2 GPUs) and 4 (two ranks per GPU; CUDA IPC works between processes sharing a GPU).
"""
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from tests.harness.mp import GPU_ENV as ENV, gpu_nranks, mp_cases  # noqa: E402

pytestmark = [pytest.mark.gpu]
NRANKS = gpu_nranks()

test_ep_gpu = mp_cases("tests/gpu/cases_ep_gpu.py", nranks=NRANKS, env=ENV, case_timeout=300)
