from tests.harness.mp import mp_cases

test_overlap = mp_cases("tests/mp/cases_overlap.py", nranks=[1, 2, 4], group="core")
