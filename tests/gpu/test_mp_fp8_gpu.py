"""FP8 dispatch (tests/mp/cases_fp8.py) on CUDA ranks: the NVLink backend and the host path over NCCL, against
the dense float64 reference.  Skipped without CUDA.  Rank counts: MOONEP_GPU_NRANKS (default 2 4)."""
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from tests.harness.mp import GPU_ENV, gpu_nranks, mp_cases  # noqa: E402

pytestmark = [pytest.mark.gpu]

test_fp8_gpu = mp_cases("tests/mp/cases_fp8.py", nranks=gpu_nranks(), env=GPU_ENV, case_timeout=300)
