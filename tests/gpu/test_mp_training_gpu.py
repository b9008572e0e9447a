"""The training-stack cases (tests/mp/cases_training.py) and the training recipes (tests/mp/cases_examples.py)
on CUDA ranks sharing the GPUs (CUDA IPC; the process group is gloo when ranks share a GPU).  Skipped
without CUDA.  Rank counts: MOONEP_GPU_NRANKS (default 2 4)."""
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from tests.harness.mp import GPU_ENV, gpu_nranks, mp_cases  # noqa: E402

pytestmark = [pytest.mark.gpu]

test_training_gpu = mp_cases("tests/mp/cases_training.py", nranks=gpu_nranks(), env=GPU_ENV, case_timeout=300,
                             group="training_gpu")
test_examples_gpu = mp_cases("tests/mp/cases_examples.py", nranks=gpu_nranks(), env=GPU_ENV, case_timeout=300,
                             group="training_gpu")
