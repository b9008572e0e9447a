"""Faults and resource hygiene on CUDA ranks; skipped as a whole without CUDA (see docs/reliability.md).

    MOONEP_GPU_NRANKS="2 4" python3 -m pytest tests/gpu/test_mp_faults_gpu.py
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from tests.harness.mp import GPU_ENV as ENV, gpu_nranks, mp_cases  # noqa: E402

pytestmark = [pytest.mark.gpu]
ROOT = Path(__file__).resolve().parents[2]  # the repository root
NRANKS = gpu_nranks()

test_faults_gpu = mp_cases("tests/gpu/cases_faults_gpu.py", nranks=NRANKS, env=ENV, case_timeout=300)


@pytest.mark.parametrize("op", ["dispatch", "combine", "prefetch", "qb"])
@pytest.mark.parametrize("n", NRANKS, ids=lambda n: f"np{n}")
def test_killed_rank_mid_op(n, op):
    env = dict(os.environ, **ENV)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "gpu" / "gpu_fault_kill.py"), "--nranks", str(n),
                           "--victim", str(n - 1), "--op", op, "--timeout", "5"], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=400)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
