"""The shared ReplicaPool and expert_matmul (tests/mp/cases_pool.py) on CUDA ranks, NVLink backend, fp32 and
bf16 (bf16 takes the grouped GEMMs).  Skipped without CUDA.  Rank counts: MOONEP_GPU_NRANKS (default 2 4)."""
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from tests.harness.mp import GPU_ENV, gpu_nranks, mp_cases  # noqa: E402

pytestmark = [pytest.mark.gpu]

test_pool_gpu = mp_cases("tests/mp/cases_pool.py", nranks=gpu_nranks(),
                         env=dict(GPU_ENV, MOONEP_TEST_DTYPES="float32,bfloat16"), case_timeout=300)
