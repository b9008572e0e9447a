"""A case for MOONEP_TEST_BUILD, launched by tests/mp/test_harness.py."""
from moonep import cuda_runtime


def case_the_test_build_is_in_force(rt):
    assert cuda_runtime.compile_options("plan") == ("-std=c++17", "-DMOONEP_PLAN_CLOCKS=1")
    assert cuda_runtime.compile_options("ep")[-1] == "-DMOONEP_DISPATCH_THREADS=768"
