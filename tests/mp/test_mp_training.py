from tests.harness.mp import mp_cases

# DDP, accumulation, FSDP2, clipping, checkpoints (DCP 4 <-> 2 at 4 ranks), autocast, generation: each
# patched model against the unpatched one; about 40 s at 2 ranks and 110 s at 4 on 2 CPU cores.
test_training = mp_cases("tests/mp/cases_training.py", nranks=[2, 4], group="core", case_timeout=300)
# The recipes of docs/training.md (examples/training/*.py), each run in-process on 2 ranks.
test_examples = mp_cases("tests/mp/cases_examples.py", nranks=[2], group="core", case_timeout=300)
