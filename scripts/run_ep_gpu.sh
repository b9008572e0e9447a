#!/usr/bin/env bash
# NVLink transport on a GPU machine: nvcc compile check, GPU tests (2 and 4 ranks), killed-rank check,
# micro-benchmark.  Usage: bash scripts/run_ep_gpu.sh OUTDIR   (logs and JSON land in OUTDIR)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
out=${1:-${OUT:-benchmarks/results}}
mkdir -p "$out"
{ nvidia-smi --query-gpu=name,driver_version --format=csv; nvidia-smi topo -m
  python3 -c "import torch, cupy; print('torch', torch.__version__, 'cupy', cupy.__version__)"
  for f in dispatch combine; do nvcc -arch=sm_90 -std=c++17 --ptx csrc/$f.cu -o /tmp/$f.ptx && echo "nvcc ok $f"; done
} > "$out/env.txt" 2>&1
# 1. one-process smoke: compile with NVRTC and run every kernel once on 2 ranks, verbose
timeout 300 mpirun --allow-run-as-root -n 2 python3 -m moonep.testing.mprun tests/mp/cases_ep_gpu.py \
  --out "$out" --case-timeout 240 > "$out/mprun_np2.txt" 2>&1; echo "mprun np2 exit $?" >> "$out/summary.txt"
# 2. the pytest suite (cases at 2 and 4 ranks, killed rank)
timeout 1500 python3 -m pytest -q -x -rA tests/test_mp_ep_gpu.py > "$out/pytest_ep_gpu.txt" 2>&1
echo "pytest exit $?" >> "$out/summary.txt"
# 3. benchmark (2 ranks, 4096 tokens, hidden 7168, bf16, top-8 of 256)
MOONEP_BENCH_COMMAND="mpirun --allow-run-as-root -n 2 python3 benchmarks/bench_ep_gpu.py --out $out" \
  timeout 600 mpirun --allow-run-as-root -n 2 python3 benchmarks/bench_ep_gpu.py --out "$out" \
  > "$out/bench_ep_gpu.txt" 2>&1; echo "bench exit $?" >> "$out/summary.txt"
cat "$out/summary.txt"
