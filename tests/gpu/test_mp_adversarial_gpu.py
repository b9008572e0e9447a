"""Arguments that disagree across ranks and checks that fail on one rank, on the nvlink backend
(tests/gpu/cases_adversarial_gpu.py, which runs tests/mp/cases_adversarial.py's cases with float32 tokens).

Skipped as a whole, without launching mpiexec, on machines without CUDA.  Rank counts: 2 (one per GPU on
2 GPUs) and 4 (two ranks per GPU); ``MOONEP_GPU_NRANKS`` overrides them.

    source tools/gpu_env.sh; MOONEP_GPU_NRANKS="2 4" python3 -m pytest -q tests/gpu/test_mp_adversarial_gpu.py
"""
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from tests.harness.mp import GPU_ENV, gpu_nranks, mp_cases  # noqa: E402

pytestmark = [pytest.mark.gpu]
NRANKS = gpu_nranks()
ENV = dict(GPU_ENV, MOONEP_TEST_TRANSPORT="nvlink")

test_adversarial_gpu = mp_cases("tests/gpu/cases_adversarial_gpu.py", nranks=NRANKS, env=ENV, case_timeout=300)
