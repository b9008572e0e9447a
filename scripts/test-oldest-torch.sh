#!/usr/bin/env bash
# The compile tests on the oldest torch that moonep supports (the lower bound of `torch>=` in pyproject.toml),
# in ./.venv-torch<version>; extra arguments go to pytest (`--setup-only`: build the venv and stop).  CI runs
# this after scripts/test.sh, which tests the newest supported torch (scripts/setup.sh's TORCH_SPEC).
#  - PyPI's torch of that version is the CUDA build (about 4.6 GB with its CUDA libraries, a minute to
#    install from a local mirror); it runs on a machine without a GPU.
#  - The tests are the ones that compile: the custom ops, the layer's math, the multi-rank compiled steps (at 2
#    ranks: 3 ranks adds compile time and no path that 2 ranks do not run) and the asynchronous calls, compiled
#    and not (at 1, 2 and 4 ranks: inductor's reordering showed at 4).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OLDEST=$(sed -n 's/^dependencies = .*"torch>=\([0-9.]*\)".*/\1/p' pyproject.toml)
if [ -z "$OLDEST" ]; then
  echo "scripts/test-oldest-torch.sh: expected a torch>=X.Y lower bound in pyproject.toml's dependencies" >&2
  exit 2
fi
VENV=.venv-torch$OLDEST
stamp=$VENV/.moonep-setup-$(sha1sum pyproject.toml | cut -c1-12)
if [ ! -f "$stamp" ]; then
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q "torch==$OLDEST.*"
  # moonep's other dependencies and the test tools, not moonep itself: pytest imports it from the checkout
  # (pyproject's pythonpath), and nothing is built in the tree while scripts/test.sh may be installing
  "$VENV/bin/python" - > "$VENV/deps.txt" <<'PY'
import tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
print("\n".join(d for d in p["dependencies"] + p["optional-dependencies"]["test"] if not d.startswith("torch")))
PY
  "$VENV/bin/python" -m pip install -q -r "$VENV/deps.txt"
  rm -f "$VENV"/.moonep-setup-*
  touch "$stamp"
fi
if [ "${1:-}" = --setup-only ]; then exit 0; fi
"$VENV/bin/python" -c "import torch; print('compile tests on torch', torch.__version__)"
exec "$VENV/bin/python" -m pytest -q tests/unit/test_ops.py tests/unit/test_eager_math.py tests/mp/test_mp_compile.py \
  tests/mp/test_mp_overlap.py \
  -k "not np3" "$@"
