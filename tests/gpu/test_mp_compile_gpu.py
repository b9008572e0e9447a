"""torch.compile of moonep on CUDA ranks over IPC (NVLink backend, float32): tests/mp/cases_compile.py with
fullgraph=True, CUDA graphs and new routing every step.  Skipped without CUDA.  Rank counts:
MOONEP_GPU_NRANKS (default 2 4)."""
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from tests.harness.mp import GPU_ENV, gpu_nranks, mp_cases  # noqa: E402

pytestmark = [pytest.mark.gpu]

# A rank that (re)compiles reaches the step's first collective late (by its compile time, up to minutes
# with four ranks compiling on one host's cores), and its peers wait for it there: a collective timeout
# well above that, below the case timeout so that a hang is still reported as one.
test_compile_gpu = mp_cases("tests/mp/cases_compile.py", nranks=gpu_nranks(), env={**GPU_ENV, "MOONEP_TIMEOUT": "300"},
                            case_timeout=500)
