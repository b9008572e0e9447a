from tests.harness.mp import mp_cases

test_layers = mp_cases("tests/mp/cases_layers.py", nranks=[1, 2, 3, 4, 8], group="core")
