#!/usr/bin/env bash
# Bootstrap smoke test on a multi-GPU machine: NCCL on NGPU ranks under torchrun and under mpirun.
# Usage: bash tools/gpu_smoke.sh [OUTDIR]   (writes smoke_*.txt there)
set -uo pipefail
cd "$(dirname "$0")/.."
source tools/gpu_env.sh
out=${1:-.}
n=$(python3 -c "import torch; print(torch.cuda.device_count())")
{ echo "\$ nvidia-smi --query-gpu=name,driver_version --format=csv"; nvidia-smi --query-gpu=name,driver_version --format=csv
  echo "\$ nvidia-smi topo -m"; nvidia-smi topo -m
  echo "\$ python3 -c 'import torch, cupy, mpi4py; ...'"
  python3 -c "import torch, cupy, mpi4py; print('torch', torch.__version__, 'cupy', cupy.__version__, 'mpi4py', mpi4py.__version__, 'nccl', torch.cuda.nccl.version())"
  echo "\$ torchrun --standalone --nproc-per-node $n examples/hello_ranks.py"
  timeout 180 torchrun --standalone --nproc-per-node "$n" examples/hello_ranks.py; echo "exit code $?"
  echo "\$ mpirun --allow-run-as-root -n $n python3 examples/hello_ranks.py"
  timeout 180 mpirun --allow-run-as-root -n "$n" python3 examples/hello_ranks.py; echo "exit code $?"
  echo "\$ mpirun --allow-run-as-root --oversubscribe -n $((2 * n)) python3 examples/hello_ranks.py  # 2 ranks per GPU"
  timeout 180 mpirun --allow-run-as-root --oversubscribe -n "$((2 * n))" python3 examples/hello_ranks.py; echo "exit code $?"
} 2>&1 | tee "$out/smoke_bootstrap.txt"
