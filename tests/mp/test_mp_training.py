from tests.harness.mp import mp_cases

# DDP, accumulation, FSDP2, clipping, checkpoints (DCP 4 <-> 2 at 4 ranks), autocast, generation: each
# patched model against the unpatched one; about 40 s at 2 ranks.  At 4 CPU ranks only the cases that need 4
# ranks or more than 2 (a (2, 2) mesh, DCP 4 <-> 2, a global norm, ranks that disagree) run: the others take
# no path there that 2 ranks do not (cases_training._two_ranks_suffice); CUDA ranks run all of them at 4.
test_training = mp_cases("tests/mp/cases_training.py", nranks=[2, 4], group="core", case_timeout=300)
# The recipes of docs/training.md (examples/training/*.py), each run in-process on 2 ranks.
test_examples = mp_cases("tests/mp/cases_examples.py", nranks=[2], group="core", case_timeout=300)
