import os

from tests.harness.mp import mp_cases

# torchtitan's MoE models with moonep against torchtitan's all-to-all dispatcher (tests/mp/cases_torchtitan.py).
# CI runs DeepSeek-V3 at EP = 2 (10 to 40 s on 2 cores); MOONEP_TT_FULL=1 runs every MoE debug model at
# EP = 1, 2 and 4 (about 30 minutes; its figures: benchmarks/results/cpu_torchtitan_exactness_np*.json).
FULL = os.environ.get("MOONEP_TT_FULL") == "1"
ENV = ({k: os.environ[k] for k in ("MOONEP_TT_MODELS", "MOONEP_TT_EP") if k in os.environ} if FULL
       else {"MOONEP_TT_MODELS": "deepseek_v3", "MOONEP_TT_EP": "2"})
test_torchtitan = mp_cases("tests/mp/cases_torchtitan.py", nranks=[1, 2, 4] if FULL else [2], case_timeout=1500,
                           timeout=1800, env=ENV, group="torchtitan")
# MoonepRoutedExperts alone with replicas under a skewed routing (tests/mp/cases_torchtitan_experts.py), in the
# same launch at 2 ranks; tests/gpu/test_mp_torchtitan_gpu.py runs it on CUDA ranks.
test_torchtitan_experts = mp_cases("tests/mp/cases_torchtitan_experts.py", nranks=[2, 4], env=ENV,
                                   group="torchtitan")
# moonep.init(mesh["ep"]) of a (dp, ep) mesh: its host group (tests/mp/cases_runtime_mesh.py), in the core launch.
test_runtime_mesh = mp_cases("tests/mp/cases_runtime_mesh.py", nranks=[4], group="core")
