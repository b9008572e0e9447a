#!/usr/bin/env bash
# Sets up ./.venv if needed, then runs the main job on CPU ranks under mpiexec (NP ranks, default 4).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/mpiexec -n "${NP:-4}" .venv/bin/python examples/hello_ranks.py "$@"
