"""The adversarial cases of tests/mp/cases_adversarial.py on the nvlink backend (CUDA IPC kernels).

Run by tests/gpu/test_mp_adversarial_gpu.py at 2 and 4 ranks with MOONEP_TEST_DEVICE=cuda and
MOONEP_TEST_TRANSPORT=nvlink: the same cases, with float32 tokens (the nvlink backend moves
fp32/bf16/fp16) checked against the float64 reference at rtol/atol 2e-5 (1e-4 for the LatentMoE output),
and bfloat16 as the "other" dtype of a disagreement (float64 weights are refused by nvlink's local check).
Every case skips on CPU ranks.  Rank 0 prints ``TIMING <case> nvlink <seconds>`` lines.

The nvlink backend checks the routing VALUES on the device and reports them later
(tests/gpu/cases_ep_gpu.py), so ``case_bad_routing_values_on_one_rank`` only runs on the host transports.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "mp"))  # tests/mp: cases_adversarial, ep_reference
import cases_adversarial as A  # noqa: E402
from tests.harness.mp import SkipCase  # noqa: E402


def _need_cuda(rt):
    if rt.device.type != "cuda":
        raise SkipCase("needs CUDA ranks (MOONEP_TEST_DEVICE=cuda)")
    if A.transports(rt) != ["nvlink"]:
        raise SkipCase(f"runs on the nvlink transport only (MOONEP_TEST_TRANSPORT={A.transports(rt)})")


def case_dispatch_weights_dtype_differs(rt):
    _need_cuda(rt)
    A.case_dispatch_weights_dtype_differs(rt)


def case_dispatch_requires_grad_on_one_rank(rt):
    _need_cuda(rt)
    A.case_dispatch_requires_grad_on_one_rank(rt)


def case_dispatch_num_global_tokens_disagree(rt):
    _need_cuda(rt)
    A.case_dispatch_num_global_tokens_disagree(rt)


def case_combine_expert_out_width_differs(rt):
    _need_cuda(rt)
    A.case_combine_expert_out_width_differs(rt)


def case_combine_expert_out_dtype_differs(rt):
    _need_cuda(rt)
    A.case_combine_expert_out_dtype_differs(rt)


def case_combine_handle_of_older_dispatch_on_one_rank(rt):
    _need_cuda(rt)
    A.case_combine_handle_of_older_dispatch_on_one_rank(rt)


def case_prefetch_weight_shape_differs(rt):
    _need_cuda(rt)
    A.case_prefetch_weight_shape_differs(rt)


def case_prefetch_weight_dtype_differs(rt):
    _need_cuda(rt)
    A.case_prefetch_weight_dtype_differs(rt)


def case_prefetch_out_on_one_rank_only(rt):
    _need_cuda(rt)
    A.case_prefetch_out_on_one_rank_only(rt)


def case_reduce_grad_grad_view_disagrees(rt):
    _need_cuda(rt)
    A.case_reduce_grad_grad_view_disagrees(rt)


def case_local_check_fails_on_one_rank_dispatch(rt):
    _need_cuda(rt)
    A.case_local_check_fails_on_one_rank_dispatch(rt)


def case_local_check_fails_on_one_rank_combine(rt):
    _need_cuda(rt)
    A.case_local_check_fails_on_one_rank_combine(rt)


def case_local_check_fails_on_one_rank_prefetch(rt):
    _need_cuda(rt)
    A.case_local_check_fails_on_one_rank_prefetch(rt)


def case_local_check_fails_on_one_rank_reduce_grad(rt):
    _need_cuda(rt)
    A.case_local_check_fails_on_one_rank_reduce_grad(rt)


def case_handle_of_another_instance_on_one_rank(rt):
    _need_cuda(rt)
    A.case_handle_of_another_instance_on_one_rank(rt)


def case_handle_fields_replaced_on_one_rank(rt):
    _need_cuda(rt)
    A.case_handle_fields_replaced_on_one_rank(rt)


def case_bad_routing_values_on_one_rank(rt):
    _need_cuda(rt)
    raise SkipCase("nvlink checks routing values on the device and reports them later (tests/gpu/cases_ep_gpu.py)")


def case_latent_moe_bad_x_on_one_rank(rt):
    _need_cuda(rt)
    A.case_latent_moe_bad_x_on_one_rank(rt)


def case_many_refusals_in_a_row_then_valid_step(rt):
    _need_cuda(rt)
    A.case_many_refusals_in_a_row_then_valid_step(rt)
