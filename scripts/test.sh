#!/usr/bin/env bash
# Sets up ./.venv if needed, then runs the whole test suite (multi-rank tests launch mpiexec themselves).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
