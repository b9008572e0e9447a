#!/usr/bin/env bash
# Creates ./.venv with moonep (editable) and its test tools. Idempotent: re-running is a quick no-op.
#  - A machine whose python3 already has torch (a GPU box) keeps that torch: the venv sees system packages.
#  - Otherwise the CPU build is installed first (TORCH_SPEC, default torch==2.13.0), so pip never pulls the
#    multi-GB CUDA build through moonep's unpinned `torch` dependency.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
EXTRAS=${MOONEP_EXTRAS:-test,bench}
stamp=.venv/.moonep-setup-$(cat pyproject.toml scripts/torchtitan-ci.txt | sha1sum | cut -c1-12)-${EXTRAS//,/-}
if [ -f "$stamp" ]; then exit 0; fi
if [ ! -x .venv/bin/python ]; then
  if "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m venv --system-site-packages .venv
  else
    "$PY" -m venv .venv
  fi
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
fi
.venv/bin/python -m pip install -q -e ".[${EXTRAS}]"
# torchtitan (python >= 3.11) for moonep.integrations.torchtitan's tests, without its data stack: see the
# list's comment.  MOONEP_TORCHTITAN=0 skips it (those tests then skip).
if [ "${MOONEP_TORCHTITAN:-1}" != 0 ] && .venv/bin/python -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  .venv/bin/python -m pip install -q --no-deps -r scripts/torchtitan-ci.txt
fi
rm -f .venv/.moonep-setup-*
touch "$stamp"
