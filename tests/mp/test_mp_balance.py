from tests.harness.mp import mp_cases

test_balance = mp_cases("tests/mp/cases_balance.py", nranks=[1, 2, 3, 4, 8], group="core")
