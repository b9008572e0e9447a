#!/usr/bin/env bash
# Nsight Compute on the NVLink transport's local kernels with one rank (no peer to time out while ncu
# replays a kernel): dispatch send (all rows local), combine reduce and sum.  Usage: ncu_ep_r1.sh OUTDIR
set -uo pipefail
cd "$(dirname "$0")/.."
source tools/gpu_env.sh
o=${1:?OUTDIR}; mkdir -p "$o"
timeout 300 ncu --clock-control none --set full \
  -k regex:"moonep_combine_reduce|moonep_dispatch_send|moonep_combine_sum" --launch-skip 12 --launch-count 3 \
  -o "$o/ncu_r1" python3 benchmarks/bench_ep_gpu.py --fused route --sms 32 --iters 3 --warmup 2 --out /tmp/ncu_bench > "$o/ncu_r1.log" 2>&1
echo "ncu exit $?"
ncu -i "$o/ncu_r1.ncu-rep" --page details > "$o/ncu_r1_details.txt" 2>&1
grep -E "^  moonep|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Theoretical Occupancy|L2 Hit|Eligible|Issued Warp|No Eligible|Stall|warp cycles per issued|One or More|Local Memory" "$o/ncu_r1_details.txt" | head -80
