#!/usr/bin/env bash
# Two versions of moonep compared on one GPU, in one device call: bitwise recordings of outputs and
# gradients (tools/record_behaviour.py) at 2 and 4 ranks sharing the GPU over CUDA IPC (the nvlink
# backend, fp32 and bf16), then one-rank dispatch/combine timings (tools/time_ep.py), the two versions
# alternating three times (A B A B A B) so that drift of the machine shows as spread.
#   bash tools/device_ab.sh BEFORE_TREE AFTER_TREE [STEP...]     steps: record time (default both)
# A tree is a folder holding moonep/ and csrc/ (e.g. `git archive REV moonep csrc | tar -x -C DIR`).
# Everything lands in /tmp/o and is packed into $OUT/ab.tgz after every step; summary.txt says what ran.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
B=$(cd "$1" && pwd) A=$(cd "$2" && pwd); shift 2
steps=${*:-record time}
o=/tmp/o; mkdir -p $o
pack() { tar czf "${OUT:-/tmp}/ab.tgz" -C $o .; }
run() {  # name timeout tree cmd...
  local name=$1 t=$2 tree=$3; shift 3; local t0=$SECONDS
  PYTHONPATH=$tree timeout "$t" "$@" > "$o/$name.log" 2>&1; local rc=$?
  echo "$name: exit $rc in $((SECONDS - t0))s" | tee -a $o/summary.txt; pack
}
for s in $steps; do case $s in
  record) for n in 2 4; do
            for v in before after; do tree=$B; [ $v = after ] && tree=$A
              run rec_${v}_np$n 300 $tree mpirun --allow-run-as-root --oversubscribe -n $n \
                python3 tools/record_behaviour.py --device cuda --out $o/${v}_gpu_np$n.json
            done
            python3 tools/record_behaviour.py --compare $o/before_gpu_np$n.json $o/after_gpu_np$n.json \
              2>&1 | tee -a $o/summary.txt
          done ;;
  time) for i in 1 2 3; do for v in before after; do tree=$B; [ $v = after ] && tree=$A
          run time_${v}_$i 240 $tree python3 tools/time_ep.py --label $v --out $o/timings.jsonl
        done; done
        python3 tools/time_ep.py --report $o/timings.jsonl 2>&1 | tee -a $o/summary.txt ;;
esac; done
pack
