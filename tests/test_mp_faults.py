"""Fault injection on CPU ranks under mpiexec: mismatched collective order, stalls, killed ranks, and
resource hygiene (create/close ExpertParallel 100 times).  See docs/reliability.md."""
from moonep.testing.mp import mp_cases

test_faults = mp_cases("tests/mp/cases_faults.py", nranks=[3], case_timeout=60)
test_hygiene = mp_cases("tests/mp/cases_hygiene.py", nranks=[2], case_timeout=120)
