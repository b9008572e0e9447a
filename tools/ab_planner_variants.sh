#!/usr/bin/env bash
# A/B of csrc/planner.cu variants in one device call: each variant runs profile_planner.py (timings) and
# profile_planner.py --clocks (cycles per plan phase) in a copy of the tree with its planner.cu swapped in.
#   mkdir -p variants; git show COMMIT:csrc/planner.cu > variants/A.cu; cp csrc/planner.cu variants/B.cu
#   bash tools/ab_planner_variants.sh OUTDIR A B      (on the device; variants/ travels untracked)
set -uo pipefail
cd "$(dirname "$0")/.."
o=$1; shift
mkdir -p "$o"
for v in "$@"; do
  t=/tmp/v_$v
  rm -rf $t; mkdir -p $t; cp -r moonep tools benchmarks csrc $t/; cp variants/$v.cu $t/csrc/planner.cu
  (cd $t && PYTHONPATH=$t timeout 100 python3 tools/profile_planner.py --out $o/prof_$v.json > $o/prof_$v.txt 2>&1
   PYTHONPATH=$t timeout 100 python3 tools/profile_planner.py --clocks --out $o/clocks_$v.json > $o/clocks_$v.txt 2>&1)
  echo "$v done"
done
