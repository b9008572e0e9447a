"""Arguments that disagree across ranks and checks that fail on one rank (tests/mp/cases_adversarial.py):
every rank raises ValueError before data moves, quickly, and the next valid step is correct.  Both host
transports, float64; see docs/reliability.md.  The nvlink backend: tests/gpu/test_mp_adversarial_gpu.py."""
from tests.harness.mp import mp_cases

test_adversarial = mp_cases("tests/mp/cases_adversarial.py", nranks=[2, 3, 4], group="core", case_timeout=120)
