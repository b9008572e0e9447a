from tests.harness.mp import mp_cases

test_pool = mp_cases("tests/mp/cases_pool.py", nranks=[1, 2, 3, 4, 8], group="core")
