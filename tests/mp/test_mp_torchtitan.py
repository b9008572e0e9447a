from moonep.testing.mp import mp_cases

# torchtitan's MoE models with moonep against torchtitan's all-to-all dispatcher (tests/mp/cases_torchtitan.py).
test_torchtitan = mp_cases("tests/mp/cases_torchtitan.py", nranks=[1, 2, 4], case_timeout=600)
