#!/usr/bin/env bash
# Where the NVLink dispatch/combine time goes, on a 2-GPU machine, without hardware counters: the
# peer-store ceiling one way and both ways, then bench_ep_gpu.py's per-kernel phases for the two-kernel and
# the fused paths, and for variants compiled with MOONEP_NVLINK_DIAG (csrc/common.cuh) that leave one stage
# of a kernel out.  Usage: bash tools/diag_nvlink.sh OUTDIR [SMS [LABEL...]] (labels: the table below)
set -uo pipefail
cd "$(dirname "$0")/.."
source tools/gpu_env.sh
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
# variants: label -> environment (default: all of them)
declare -A V=(
  [unfused]="MOONEP_NVLINK_FUSED=route"
  [unfused_remote_only]="MOONEP_NVLINK_FUSED=route MOONEP_NVLINK_DIAG=32"
  [unfused_reduce_local]="MOONEP_NVLINK_FUSED=route MOONEP_NVLINK_DIAG=8"
  [unfused_reduce_noload]="MOONEP_NVLINK_FUSED=route MOONEP_NVLINK_DIAG=16"
  [fused]="MOONEP_NVLINK_FUSED=route,dispatch,combine"
  [fused_dispatch]="MOONEP_NVLINK_FUSED=route,dispatch"
  [fused_no_own]="MOONEP_NVLINK_FUSED=route,dispatch MOONEP_NVLINK_DIAG=1"
  [fused_no_expand]="MOONEP_NVLINK_FUSED=route,dispatch MOONEP_NVLINK_DIAG=2"
  [fused_nvlink_only]="MOONEP_NVLINK_FUSED=route,dispatch MOONEP_NVLINK_DIAG=3"
  [fused_local_only]="MOONEP_NVLINK_FUSED=route,dispatch MOONEP_NVLINK_DIAG=4"
  [fused_ch1]="MOONEP_NVLINK_FUSED=route,dispatch MOONEP_NVLINK_CHUNKS=1"
  [fused_ch2]="MOONEP_NVLINK_FUSED=route,dispatch MOONEP_NVLINK_CHUNKS=2"
  [fused_ch8]="MOONEP_NVLINK_FUSED=route,dispatch MOONEP_NVLINK_CHUNKS=8"
)
shift 2 2>/dev/null || shift $#
labels=("$@")
if [ ${#labels[@]} -eq 0 ]; then
  labels=(unfused unfused_remote_only unfused_reduce_local unfused_reduce_noload fused fused_dispatch fused_no_own
          fused_no_expand fused_nvlink_only fused_local_only fused_ch1 fused_ch8)
  timeout 120 mpirun --allow-run-as-root -n 2 python3 tools/probe_peer_store.py --out "$out" > "$out/probe.txt" 2>&1
  echo "probe: exit $?" | tee -a "$out/diag_summary.txt"
fi
export MOONEP_NVLINK_FUSED=route MOONEP_NVLINK_DIAG=0 MOONEP_NVLINK_CHUNKS=4
for l in "${labels[@]}"; do b "$l" ${V[$l]}; done
