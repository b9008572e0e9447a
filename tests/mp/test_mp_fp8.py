from tests.harness.mp import mp_cases

test_fp8 = mp_cases("tests/mp/cases_fp8.py", nranks=[1, 2, 3, 4], group="core")
