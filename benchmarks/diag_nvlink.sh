#!/usr/bin/env bash
# Where the NVLink dispatch/combine time goes, on a 2-GPU machine, without hardware counters: the
# peer-store ceiling one way and both ways, then bench_ep_gpu.py's per-kernel phases for the two-kernel and
# the fused paths, and for variants compiled with MOONEP_NVLINK_DIAG (csrc/common.cuh) that leave one stage
# of a kernel out.  Usage: bash benchmarks/diag_nvlink.sh OUTDIR [SMS]
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
out=${1:?OUTDIR}; sms=${2:-24,32,48}
mkdir -p "$out"
b() {  # label env... : one bench_ep_gpu run
  local label=$1; shift
  mkdir -p "$out/$label"
  local t0=$SECONDS
  env "$@" timeout 150 mpirun --allow-run-as-root -n 2 -x MOONEP_NVLINK_FUSED -x MOONEP_NVLINK_DIAG \
    -x MOONEP_NVLINK_CHUNKS python3 benchmarks/bench_ep_gpu.py --sms "$sms" --iters 20 --warmup 5 \
    --out "$out/$label" > "$out/$label/log.txt" 2>&1
  echo "$label: exit $? in $((SECONDS - t0))s" | tee -a "$out/diag_summary.txt"
}
timeout 120 mpirun --allow-run-as-root -n 2 python3 benchmarks/probe_peer_store.py --out "$out" > "$out/probe.txt" 2>&1
echo "probe: exit $?" | tee -a "$out/diag_summary.txt"
export MOONEP_NVLINK_FUSED=route MOONEP_NVLINK_DIAG=0 MOONEP_NVLINK_CHUNKS=4
b unfused
b unfused_remote_only MOONEP_NVLINK_DIAG=32
b unfused_reduce_local MOONEP_NVLINK_DIAG=8
b unfused_reduce_noload MOONEP_NVLINK_DIAG=16
b fused MOONEP_NVLINK_FUSED=route,dispatch,combine
b fused_no_own MOONEP_NVLINK_FUSED=route,dispatch MOONEP_NVLINK_DIAG=1
b fused_no_expand MOONEP_NVLINK_FUSED=route,dispatch MOONEP_NVLINK_DIAG=2
b fused_nvlink_only MOONEP_NVLINK_FUSED=route,dispatch MOONEP_NVLINK_DIAG=3
b fused_local_only MOONEP_NVLINK_FUSED=route,dispatch MOONEP_NVLINK_DIAG=4
b fused_ch1 MOONEP_NVLINK_FUSED=route,dispatch MOONEP_NVLINK_CHUNKS=1
b fused_ch8 MOONEP_NVLINK_FUSED=route,dispatch MOONEP_NVLINK_CHUNKS=8
