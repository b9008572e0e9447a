#!/usr/bin/env bash
# NVLink transport on a 2-GPU machine, in < 10 minutes: nvcc check, GPU cases at 2 ranks, benchmark,
# killed-rank check, GPU cases at 4 ranks (2 per GPU).  Usage: bash tools/run_ep_gpu.sh OUTDIR
set -uo pipefail
cd "$(dirname "$0")/.."
source tools/gpu_env.sh
out=${1:-${OUT:-benchmarks/results}}
mkdir -p "$out"
sum="$out/summary.txt"
{ nvidia-smi --query-gpu=name,driver_version --format=csv; nvidia-smi topo -m
  python3 -c "import torch, cupy; print('torch', torch.__version__, 'cupy', cupy.__version__)"
  for f in dispatch combine; do nvcc -arch=sm_90 -std=c++17 --ptx csrc/$f.cu -o /tmp/$f.ptx && echo "nvcc ok $f"; done
} > "$out/env.txt" 2>&1
run() {  # name timeout cmd...
  local name=$1 t=$2; shift 2
  local t0=$SECONDS
  timeout "$t" "$@" > "$out/$name.txt" 2>&1
  echo "$name: exit $? in $((SECONDS - t0))s" >> "$sum"
}
MOONEP_GPU_NRANKS=2 run pytest_np2 200 python3 -m pytest -q -rA tests/gpu/test_mp_ep_gpu.py -k "test_ep_gpu"
MOONEP_BENCH_COMMAND="mpirun --allow-run-as-root -n 2 python3 benchmarks/bench_ep_gpu.py --sms 16,24,32 --iters 30 --out \$OUT" \
  run bench_np2 120 mpirun --allow-run-as-root -n 2 python3 benchmarks/bench_ep_gpu.py --sms 16,24,32 --iters 30 --out "$out"
MOONEP_GPU_NRANKS=2 run kill_np2 80 python3 -m pytest -q -rA tests/gpu/test_mp_ep_gpu.py -k "killed"
MOONEP_GPU_NRANKS=4 run pytest_np4 170 python3 -m pytest -q -rA tests/gpu/test_mp_ep_gpu.py
cat "$sum"
