#!/usr/bin/env bash
# Why the fused plan+layout launch takes longer inside an EP step (torch profiler, one rank: ~29 us) than
# alone (profile_planner: ~21 us graph-replayed at (256, 1, 8)): Nsight Compute on moonep_plan_layout and
# moonep_route_gather in the one-rank EP benchmark, and on moonep_plan_layout alone. Usage: OUTDIR
set -uo pipefail
cd "$(dirname "$0")/.."
source tools/gpu_env.sh
o=${1:?OUTDIR}; mkdir -p "$o"
if [ "${NCU_STALLS:-0}" != 1 ]; then
m=gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,dram__bytes.sum,lts__t_sector_hit_rate.pct,launch__grid_size,launch__block_size
timeout 200 ncu --clock-control none --metrics $m --csv -k regex:"moonep_plan_layout|moonep_route_gather" \
  --launch-skip 20 --launch-count 6 python3 benchmarks/bench_ep_gpu.py --sms 24 --iters 3 --warmup 2 \
  --out /tmp/ncu_bench > "$o/ncu_plan_in_ep.csv" 2>&1
echo "ep exit $?"
for cc in all none; do
  timeout 200 ncu --clock-control none --cache-control $cc --metrics $m --csv -k regex:"moonep_plan_layout" \
    --launch-skip 10 --launch-count 3 python3 tools/profile_planner.py --stamps --configs "256,1,8;256,2,8" \
    --families uniform > "$o/ncu_plan_alone_cache_$cc.csv" 2>&1
  echo "alone ($cc) exit $?"
done
fi
# Stall reasons of the plan block in the EP step (one launch): "no instruction" stalls point at cold
# instruction fetches (the kernel's code evicted from L2 by the step's 470 MB of rows), others at data
if [ "${NCU_STALLS:-0}" = 1 ]; then
  timeout 200 ncu --clock-control none --section WarpStateStats --section InstructionStats --section MemoryWorkloadAnalysis \
    -k regex:"moonep_plan_layout" --launch-skip 10 --launch-count 1 python3 benchmarks/bench_ep_gpu.py --sms 24 \
    --iters 3 --warmup 2 --out /tmp/ncu_bench > "$o/ncu_plan_in_ep_stalls.txt" 2>&1
  echo "stalls exit $?"
  timeout 200 ncu --clock-control none --cache-control none --section WarpStateStats --section InstructionStats \
    -k regex:"moonep_plan_layout" --launch-skip 10 --launch-count 1 python3 tools/profile_planner.py --stamps \
    --configs "256,1,8" --families uniform > "$o/ncu_plan_alone_warm_stalls.txt" 2>&1
  echo "alone stalls exit $?"
fi
