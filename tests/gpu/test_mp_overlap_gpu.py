"""async_op=True collectives and the two-micro-batch schedule (tests/mp/cases_overlap.py) on CUDA ranks, NVLink
backend: the communication stream against the synchronous calls, bitwise.  Skipped without CUDA.  Rank counts:
MOONEP_GPU_NRANKS (default 2 4)."""
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from tests.harness.mp import GPU_ENV, gpu_nranks, mp_cases  # noqa: E402

pytestmark = [pytest.mark.gpu]

test_overlap_gpu = mp_cases("tests/mp/cases_overlap.py", nranks=gpu_nranks(), env=GPU_ENV, case_timeout=300)
