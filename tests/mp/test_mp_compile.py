"""torch.compile of moonep's custom ops and of a LatentMoE against eager, at 2 CPU ranks
(tests/mp/cases_compile.py).  Odd rank counts run the same ops eagerly in the core group (3 ranks added
a minute of compile time and no path that 2 ranks do not run)."""
from tests.harness.mp import mp_cases

test_compile = mp_cases("tests/mp/cases_compile.py", nranks=[2], case_timeout=300)
