from tests.harness.mp import mp_cases

# The model-type survey dominates: about 10 s at 2 ranks and 25 s at 4 on 2 CPU cores.
test_integrations = mp_cases("tests/mp/cases_integrations.py", nranks=[2, 4], group="core")
