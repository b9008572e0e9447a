from tests.harness.mp import mp_cases

# 4 ranks (oversubscribed on a 2-core CI machine): 2 x 150 LatentMoE training steps, about 30 s.
test_soak = mp_cases("tests/mp/cases_soak.py", nranks=[4], case_timeout=300)
