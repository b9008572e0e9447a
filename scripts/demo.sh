#!/usr/bin/env bash
# Sets up ./.venv if needed, then trains a tiny expert-parallel LatentMoE model on NP CPU ranks (default 4)
# under mpiexec: loss, MaxVio, replicas and the (equal) per-rank receive counts are printed every step.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/mpiexec -n "${NP:-4}" .venv/bin/python examples/train_tiny_moe.py "$@"
