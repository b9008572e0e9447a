#!/usr/bin/env bash
# Where the NVLink dispatch/combine time goes, on a 2-GPU machine, without hardware counters: the
# peer-store ceiling one way and both ways, then bench_ep_gpu.py's per-kernel phases for the two-kernel and
# the fused paths, and for variants built from tools/diag_nvlink.patch (MOONEP_DIAG=<bits>) that leave one
# stage of a kernel out (wrong results by design: the shipped kernels never hold them).  Usage: bash tools/diag_nvlink.sh OUTDIR [SMS [LABEL...]] (labels: the table below)
set -uo pipefail
cd "$(dirname "$0")/.."
source tools/gpu_env.sh
out=${1:?OUTDIR}; sms=${2:-24,32,48}
mkdir -p "$out"
b() {  # label bench-options... : one bench_ep_gpu run
  local label=$1; shift
  mkdir -p "$out/$label"
  local t0=$SECONDS
  timeout 150 mpirun --allow-run-as-root -n 2 python3 benchmarks/bench_ep_gpu.py --sms "$sms" --iters 20 \
    --warmup 5 "$@" --out "$out/$label" > "$out/$label/log.txt" 2>&1
  echo "$label: exit $? in $((SECONDS - t0))s" | tee -a "$out/diag_summary.txt"
}
# variants: label -> bench_ep_gpu.py options (default: all of them)
d="--patch tools/diag_nvlink.patch --switch MOONEP_DIAG"
declare -A V=(
  [unfused]="--fused route"
  [unfused_remote_only]="--fused route $d=32"
  [unfused_reduce_local]="--fused route $d=8"
  [unfused_reduce_noload]="--fused route $d=16"
  [fused]="--fused route,dispatch,combine"
  [fused_dispatch]="--fused route,dispatch"
  [fused_no_own]="--fused route,dispatch $d=1"
  [fused_no_expand]="--fused route,dispatch $d=2"
  [fused_nvlink_only]="--fused route,dispatch $d=3"
  [fused_local_only]="--fused route,dispatch $d=4"
  [fused_ch1]="--fused route,dispatch --chunks 1"
  [fused_ch2]="--fused route,dispatch --chunks 2"
  [fused_ch8]="--fused route,dispatch --chunks 8"
)
shift 2 2>/dev/null || shift $#
labels=("$@")
if [ ${#labels[@]} -eq 0 ]; then
  labels=(unfused unfused_remote_only unfused_reduce_local unfused_reduce_noload fused fused_dispatch fused_no_own
          fused_no_expand fused_nvlink_only fused_local_only fused_ch1 fused_ch8)
  timeout 120 mpirun --allow-run-as-root -n 2 python3 tools/probe_peer_store.py --out "$out" > "$out/probe.txt" 2>&1
  echo "probe: exit $?" | tee -a "$out/diag_summary.txt"
fi
for l in "${labels[@]}"; do b "$l" ${V[$l]}; done
