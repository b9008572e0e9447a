from moonep.testing.mp import mp_cases

test_ep = mp_cases("tests/mp/cases_ep.py", nranks=[1, 2, 3, 4, 8], group="core")
