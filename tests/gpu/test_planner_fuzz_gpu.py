"""GPU planner fuzz: 1,000 routings from the CPU fuzz generator, plan and layout bit-equal to the CPU path.

Each routing (families of ``tests/unit/test_planner_fuzz.py``: corpus families, all-to-one, cold rank, zeros,
random masking) is planned on CPU and on CUDA with ``slack = 0`` and one ``slack > 0``; every Plan field,
``cu_seqlens`` of every rank and ``token_destinations`` of every source rank (int64 and int32 routing,
``align`` 1 or 8) must be identical, and the CUDA plan must satisfy the contract itself (``verify_plan``).
Skips without CUDA (and CuPy).
"""
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("cupy")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))  # the CPU fuzz generator
from test_planner_fuzz import SLACKS, fuzz_routing  # noqa: E402

from moonep.layout import cu_seqlens, token_destinations  # noqa: E402
from moonep.planner import plan_balanced  # noqa: E402
from tests.harness.planner_corpus import counts_from_topk, verify_plan  # noqa: E402

FIELDS = ("assignment", "replica_experts", "replica_source", "recv_counts", "expert_counts")
N_ROUTINGS = int(os.environ.get("MOONEP_FUZZ_GPU_N", 1000))


def test_gpu_planner_fuzz_bit_equal():
    rng = np.random.default_rng(20261202)
    for n in range(N_ROUTINGS):
        fam, E, tk = fuzz_routing(rng)
        c = counts_from_topk(tk, E)
        R = c.shape[0]
        align = 8 if n % 2 else 1
        dt = torch.int32 if n % 3 == 0 else torch.int64
        for slack in (0.0, SLACKS[n % len(SLACKS)]):
            ctx = f"routing {n} ({fam}, R={R}, E={E}, K={tk.shape[2]}, s={tk.shape[1]}, slack={slack})"
            pc = plan_balanced(torch.from_numpy(c), slack=slack)
            pg = plan_balanced(torch.from_numpy(c).to(dt).cuda(), slack=slack)
            for f in FIELDS:
                a, b = getattr(pc, f), getattr(pg, f).cpu()
                assert a.dtype == b.dtype and torch.equal(a, b), f"{f}: {ctx}"
            assert int(pg.error) == 0, ctx
            verify_plan(pg, c, slack)
            assert torch.equal(cu_seqlens(pc, None, align), cu_seqlens(pg, None, align).cpu()), ctx
            for src in range(R):
                a = token_destinations(pc, src, torch.from_numpy(tk[src]), align)
                b = token_destinations(pg, src, torch.from_numpy(tk[src]).to(dt).cuda(), align)
                assert torch.equal(a[0], b[0].cpu()) and torch.equal(a[1], b[1].cpu()), f"layout src {src}: {ctx}"
