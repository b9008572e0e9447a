#!/usr/bin/env bash
# Source-level ncu profiles of the planner kernels (one launch each), exported as CSV under $1 (device).
#   bash tools/ncu_planner_src.sh OUTDIR "896,64,16 theorem2 plan" "256,8,8 uniform layout" ...
# CuPy compiles from a temporary file, so the CUDA view is re-attached to csrc/planner.cu by the name
# ncu recorded.
set -uo pipefail
cd "$(dirname "$0")/.."
o=$1; shift; mkdir -p $o /tmp/src
for c in "$@"; do set -- $c; tag=$(echo $1_$2_$3 | tr , x)
  # --warp-sampling-interval 0: a sample every 2^5 cycles (the default interval left ~500 samples per launch)
  timeout 150 ncu --clock-control none --set full --import-source yes --warp-sampling-interval 0 \
    -k regex:"moonep_$3\$" \
    --launch-skip 10 -c 1 -o /tmp/ncu_$tag -f python3 tools/profile_planner.py --lineinfo --configs "$1" --families $2 \
    > $o/log_$tag.txt 2>&1
  n=$(ncu --import /tmp/ncu_$tag.ncu-rep --page source --csv --print-source cuda 2>&1 | grep -o '[0-9a-f]*\.cubin\.cu' | head -1)
  cp csrc/planner.cu /tmp/src/$n
  ncu --import /tmp/ncu_$tag.ncu-rep --page source --csv --print-source cuda --import-source yes --source-folders /tmp/src > $o/src_$tag.csv 2>&1
  ncu --import /tmp/ncu_$tag.ncu-rep --page source --csv --print-source sass > $o/sass_$tag.csv 2>&1
  ncu --import /tmp/ncu_$tag.ncu-rep --page details > $o/details_$tag.txt 2>&1
  head -c 300 $o/src_$tag.csv; echo
  echo "$tag done"
done
