from tests.harness.mp import mp_cases

test_ep = mp_cases("tests/mp/cases_ep.py", nranks=[1, 2, 3, 4, 8], group="core")
# ranks without tokens and inputs of any layout, every op and backward (a hypothesis property)
test_empty_ranks = mp_cases("tests/mp/cases_empty_ranks.py", nranks=[2, 3], group="core")
