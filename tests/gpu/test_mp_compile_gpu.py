"""torch.compile of moonep on CUDA ranks over IPC (NVLink backend, float32): tests/mp/cases_compile.py with
fullgraph=True, CUDA graphs and new routing every step.  Skipped without CUDA.  Rank counts:
MOONEP_GPU_NRANKS (default 2 4)."""
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from moonep.testing.mp import GPU_ENV, gpu_nranks, mp_cases  # noqa: E402

pytestmark = [pytest.mark.gpu]

# Inductor compiles a rank's graphs for that rank's token counts, so the ranks reach a step's first
# collective minutes apart on the first steps: the collective timeout is NCCL's default (600 s), not 60 s.
test_compile_gpu = mp_cases("tests/mp/cases_compile.py", nranks=gpu_nranks(), env={**GPU_ENV, "MOONEP_TIMEOUT": "600"},
                            case_timeout=500)
