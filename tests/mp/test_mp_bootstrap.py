from tests.harness.mp import mp_cases

test_bootstrap = mp_cases("tests/mp/cases_bootstrap.py", nranks=[1, 2, 3, 4, 8], group="core")
