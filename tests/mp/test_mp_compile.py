"""torch.compile of moonep's custom ops and of a LatentMoE against eager, at 2 and 3 CPU ranks
(tests/mp/cases_compile.py)."""
from tests.harness.mp import mp_cases

test_compile = mp_cases("tests/mp/cases_compile.py", nranks=[2, 3], case_timeout=300)
