"""MoonepRoutedExperts (moonep.integrations.torchtitan) on CUDA ranks sharing the GPUs (CUDA IPC): home and
replica rows through torchtitan's grouped GEMMs, against torchtitan's RoutedExperts.  Skipped without CUDA or
torchtitan.  Rank counts: MOONEP_GPU_NRANKS (default 2 4)."""
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from tests.harness.mp import GPU_ENV, gpu_nranks, mp_cases  # noqa: E402

pytestmark = [pytest.mark.gpu]

test_torchtitan_experts_gpu = mp_cases("tests/mp/cases_torchtitan_experts.py", nranks=gpu_nranks(), env=GPU_ENV,
                                       case_timeout=300)
