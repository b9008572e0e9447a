#!/usr/bin/env bash
# One device call's worth of GPU checks, everything logged under /tmp/o and packed into $OUT/run.tgz
# (the device tool returns at most 8 files). Usage: bash tools/device_run.sh STEP...
#   steps: layer_ab layer_entries layer_aa layer_prof cpu_ranks_bench overlap_bench overlap_bench1 overlap_np2 balance_gpu compile_mp2 ncu_fp8_time (ncu durations of the fused dispatch, per wire format) fp8_try (each .prof/try/*.patch applied alone and measured) fp8_diag (the fp8 bench without the row stores, tools/diag_nvlink.patch) fp8_ab (A/B: the tree, then .prof/ab/*.patch reverted one by one) ep_np1 fp8_threads ncu_fp8 training_keep examples_np4 training_bench2 host_before_after training_np2 training_np4 training_bench training_bench1 training_prof torchtitan_gpu reliability_np2 numerics compile compile_gpu compile_prof compile_ab slot_gemm compile_np2 compile_np4 compile_speed fp8 fp8_np2 fp8_np4 fp8_single fp8_speed fp8_words pool_np2 pool_np4 pool_mem pool_trace ncu_plan_ep ep_r1 host_prof stamps_r12 stamps_cold api_fuzz diag diag_quick fused_gpu planner_clocks ncu_t2 planner_stamps fuzz_gpu faults_gpu faults_np2 faults_np4 faults_np4_check soak_gpu planner_prof ncu_planner ncu_ep suite_np4 planner_gpu planner_qb qb_timing planner_bench ep_np2 ep_bench ep_kill ep_np4 mp_gpu layers_gpu examples suite smoke
set -uo pipefail
cd "$(dirname "$0")/.."
source tools/gpu_env.sh
# The tree arrives without .git: the caller writes HEAD into .git_commit and carries it.
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o 'H[0-9]00' | tr H h); gpu=${gpu:-gpu}
ngpu=$(nvidia-smi -L | wc -l); pfx=${gpu}x$ngpu  # result files' prefix: h100x1, h200x2...
# The commit the results record: .git_commit, written by the caller (moonep.bench.provenance reads it when git
# has no answer). A .git left on the machine is not this tree's: git is pointed away from it.
export GIT_DIR=$PWD/.no-git
o=/tmp/o; rm -rf $o; mkdir -p $o  # a warm machine keeps /tmp: start each run empty
# inductor's caches do not key on how moonep's ops are registered (e.g. as side-effecting): none reused
export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d /tmp/inductor.XXXXXX)
step() {  # name timeout cmd...
  local name=$1 t=$2; shift 2; local t0=$SECONDS
  timeout "$t" "$@" > "$o/$name.txt" 2>&1; local rc=$?
  echo "$name: exit $rc in $((SECONDS - t0))s" | tee -a "$o/summary.txt"
  tar czf "${OUT:-/tmp}/run.tgz" -C $o .  # after every step, so a run cut off by the call limit keeps what ran
}
host_profiles() {  # tree|old...: the nvlink host times of the library in the tree or of .old/moonep, in order
  local lib pp lab
  for lib in "$@"; do
    pp=$PYTHONPATH lab="the tree"; [ $lib = old ] && pp=$PWD/.old:$PYTHONPATH lab="moonep at $(cat .old/COMMIT)"
    PYTHONPATH=$pp step host_${lib}_$SECONDS 150 mpirun --allow-run-as-root -n 1 python3 tools/host_profile_ep.py \
      --library "$lab" --out $o/host_${lib}_$SECONDS
  done
}
# groups of steps
set -- $(for s in "$@"; do case $s in fp8) echo fp8_np2 fp8_np4 fp8_single fp8_speed ;; *) echo "$s" ;; esac; done)
for s in "$@"; do case $s in
  balance_gpu) step balance_gpu 150 python3 -m pytest -q -rA tests/gpu/test_balance_gpu.py ;;
  planner_qb) step planner_qb 150 python3 -m pytest -q -rA tests/gpu/test_planner_gpu.py tests/gpu/test_balance_gpu.py ;;
  planner_gpu) step planner_gpu 240 python3 -m pytest -q -rA tests/gpu/test_planner_gpu.py ;;
  fused_gpu) step fused_gpu 90 python3 -m pytest -q -rA -x tests/gpu/test_planner_gpu.py -k plan_and_destinations ;;
  qb_timing) step qb_timing 90 python3 benchmarks/bench_balance.py gpu --out $o ;;
  planner_bench) step planner_bench 150 python3 benchmarks/bench_planner.py --no-oracle --reps 30 --out $o/planner_gpu.json ;;
  layers_gpu) step layers_gpu 120 python3 -m pytest -q -rA tests/unit/test_layers.py ;;
  ep_np2) MOONEP_GPU_NRANKS=2 step ep_np2 200 python3 -m pytest -q -rA tests/gpu/test_mp_ep_gpu.py -k "test_ep_gpu" ;;
  ep_bench) step ep_bench 120 mpirun --allow-run-as-root -n 2 python3 benchmarks/bench_ep_gpu.py --sms 16,24,32 --iters 30 --out $o ;;
  ep_kill) MOONEP_GPU_NRANKS=2 step ep_kill 200 python3 -m pytest -q -rA tests/gpu/test_mp_faults_gpu.py -k killed ;;
  ep_np4) MOONEP_GPU_NRANKS=4 step ep_np4 200 python3 -m pytest -q -rA tests/gpu/test_mp_ep_gpu.py ;;
  mp_gpu) step mp_gpu 300 python3 -m pytest -q -rA tests/gpu/test_mp_gpu.py ;;
  smoke) step smoke 200 bash tools/gpu_smoke.sh $o ;;
  examples) step train_tiny_moe 150 mpirun --allow-run-as-root -n 2 python3 examples/train_tiny_moe.py --steps 30
            step hf_mixtral_ep 150 mpirun --allow-run-as-root -n 2 python3 examples/hf_mixtral_ep.py ;;
  diag_quick) step diag_quick 400 bash tools/diag_nvlink.sh $o/diagq 24,32,48 unfused fused_dispatch fused_ch2 fused_ch8 fused_nvlink_only ;;
  diag) step diag 480 bash tools/diag_nvlink.sh $o/diag 24,32,64 ;;
  planner_prof) step planner_prof 150 python3 tools/profile_planner.py --out $o/planner_prof.json ;;
  planner_clocks) step planner_clocks 120 python3 tools/profile_planner.py --clocks --out $o/planner_clocks.json ;;
  ncu_t2) step ncu_t2 200 bash tools/ncu_planner_src.sh $o/ncu "896,64,16 theorem2 plan" ;;
  ep_r1) step ep_r1 120 mpirun --allow-run-as-root -n 1 python3 benchmarks/bench_ep_gpu.py --sms 24 --iters 20 --out $o ;;
  host_prof) step host_prof 120 mpirun --allow-run-as-root -n 1 python3 tools/host_profile_ep.py --out $o ;;
  stamps_r12) step stamps_r12 120 python3 tools/profile_planner.py --stamps --clocks --configs "256,2,8;256,1,8" \
                 --families uniform,zipf1.5 --out $o/planner_stamps_R2_R1.json ;;
  stamps_cold) step stamps_cold 120 python3 tools/profile_planner.py --stamps --clocks --cold --configs "256,2,8;256,1,8" \
                 --families uniform --out $o/planner_stamps_cold.json ;;
  ncu_plan_ep) step ncu_plan_ep 500 bash tools/ncu_plan_in_ep.sh $o ;;
  ncu_plan_stalls) NCU_STALLS=1 step ncu_plan_stalls 500 bash tools/ncu_plan_in_ep.sh $o ;;
  api_fuzz) step api_fuzz 200 python3 -m pytest -q -rA tests/unit/test_fuzz_api.py ;;
  planner_stamps) step planner_stamps 120 python3 tools/profile_planner.py --stamps --out $o/planner_stamps.json ;;
  ncu_planner) step ncu_planner 200 ncu --clock-control none --metrics gpu__time_duration.sum -k regex:moonep --csv \
                 --launch-skip 40 --launch-count 60 python3 tools/profile_planner.py --families zipf1.5 ;;
  ncu_src) for c in "256,8,8 uniform plan" "896,64,16 theorem2 plan" "896,64,16 zipf1.5 plan" "256,8,8 uniform layout"; do set -- $c
              step ncu_src_$1_$2_$3 150 ncu --clock-control none --set full --import-source yes \
                -k regex:moonep_$3 --launch-skip 10 -c 1 -o $o/ncu_$1_$2_$3 python3 tools/profile_planner.py --lineinfo --configs "$1" --families $2
              ncu --import $o/ncu_$1_$2_$3.ncu-rep --page source --csv --print-source cuda > $o/src_$1_$2_$3.csv 2>&1
              ncu --import $o/ncu_$1_$2_$3.ncu-rep --page details > $o/details_$1_$2_$3.txt 2>&1; done ;;
  ncu_fp8) for wr in bf16 fp8 fp8_pre; do  # one dispatch_fused launch per wire format, full set, source lines
              step ncu_fp8_$wr 150 ncu --clock-control none --set full --import-source yes \
                -k regex:moonep_dispatch_fused --launch-skip 5 -c 1 -o $o/ncu_fp8_$wr python3 tools/profile_fp8_dispatch.py --lineinfo --wire $wr
              ncu --import $o/ncu_fp8_$wr.ncu-rep --page details > $o/details_fp8_$wr.txt 2>&1
              ncu --import $o/ncu_fp8_$wr.ncu-rep --page source --csv --print-source cuda > $o/src_fp8_$wr.csv 2>&1; done ;;
  ncu_fp8_time) for wr in bf16 fp8 fp8_pre; do  # the fused dispatch's own duration, 20 launches per wire format
              step ncu_fp8_time_$wr 150 ncu --clock-control none --metrics gpu__time_duration.sum --csv \
                -k regex:moonep_dispatch_fused --launch-skip 5 --launch-count 20 python3 tools/profile_fp8_dispatch.py \
                --wire $wr --calls 30; done ;;
  ncu_import) mkdir -p /tmp/src; for r in .prof/*.ncu-rep; do b=$(basename $r .ncu-rep)  # reports carried in .prof/
              n=$(ncu --import $r --page source --csv --print-source cuda 2>&1 | grep -o '[0-9a-f]*\.cubin\.cu' | head -1)
              cp csrc/planner.cu /tmp/src/$n; ncu --import $r --page source --csv --print-source cuda --import-source yes --source-folders /tmp/src > $o/src_$b.csv 2>&1
              ncu --import $r --page source --csv --print-source sass > $o/sass_$b.csv 2>&1; done ;;
  ncu_ep) step ncu_ep 150 mpirun --allow-run-as-root -n 2 bash -c 'if [ $OMPI_COMM_WORLD_RANK = 0 ]; then exec ncu --clock-control none --csv \
            --metrics gpu__time_duration.sum,launch__grid_size,launch__block_size,dram__bytes.sum,lts__t_bytes.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed \
            --launch-skip 300 --launch-count 40 --log-file '$o'/ncu_ep_r0.csv python3 benchmarks/bench_ep_gpu.py --sms 24 --iters 10 --warmup 3 --out '$o'; \
            else exec python3 benchmarks/bench_ep_gpu.py --sms 24 --iters 10 --warmup 3 --out '$o'; fi' ;;
  suite_np4) step suite_np4 300 mpirun --allow-run-as-root --oversubscribe -n 4 python3 -m moonep.bench --device cuda \
               --preset h200 --placement clustered --maxvio 0 1 4 --iters 10 --warmup 2 --no-symm --plot --out $o/suite_h200_np4.json ;;
  fuzz_gpu) step fuzz_gpu 150 python3 -m pytest -q -rA tests/gpu/test_planner_fuzz_gpu.py ;;
  faults_np2) MOONEP_GPU_NRANKS=2 step faults_np2 300 python3 -m pytest -q -rA tests/gpu/test_mp_faults_gpu.py ;;
  faults_np4) MOONEP_GPU_NRANKS=4 step faults_np4 300 python3 -m pytest -q -rA tests/gpu/test_mp_faults_gpu.py ;;
  faults_np4_check) MOONEP_BOARD_CHECK=1 MOONEP_GPU_NRANKS=4 step faults_np4_check 300 python3 -m pytest -q -rA tests/gpu/test_mp_faults_gpu.py ;;
  faults_gpu) MOONEP_GPU_NRANKS="2 4" step faults_gpu 420 python3 -m pytest -q -rA tests/gpu/test_mp_faults_gpu.py ;;
  soak_gpu) step soak_gpu 200 mpirun --allow-run-as-root -n 2 python3 benchmarks/soak_gpu.py --out $o/soak_gpu_nvlink.json ;;
  fp8_np2) MOONEP_GPU_NRANKS=2 step fp8_np2 300 python3 -m pytest -q -rA tests/gpu/test_mp_fp8_gpu.py ;;
  fp8_np4) MOONEP_GPU_NRANKS=4 step fp8_np4 300 python3 -m pytest -q -rA tests/gpu/test_mp_fp8_gpu.py ;;
  fp8_single) step fp8_single 200 python3 -m pytest -q -rA tests/gpu/test_fp8_gpu.py tests/unit/test_quant.py ;;
  fp8_speed) step fp8_speed 200 python3 benchmarks/bench_fp8_dispatch.py --out $o/${pfx}_fp8_dispatch.json ;;
  fp8_words) for w in 0 2 8; do step fp8_words${w}_speed 200 python3 benchmarks/bench_fp8_dispatch.py \
                --switch MOONEP_FP8_WORDS=$w --out $o/${pfx}_fp8_dispatch_words$w.json; done ;;
  fp8_ab) step fp8_ab_0 200 python3 benchmarks/bench_fp8_dispatch.py --out $o/fp8_ab_0.json  # the tree as carried
          for p in .prof/ab/*.patch; do patch -s -p1 -R < $p; b=$(basename $p .patch)  # then each patch taken out, cumulatively
            step fp8_ab_no$b 200 python3 benchmarks/bench_fp8_dispatch.py --out $o/fp8_ab_no$b.json; done
          for p in $(ls -r .prof/ab/*.patch); do patch -s -p1 < $p; done  # back to the tree, measured again last
          step fp8_ab_0again 200 python3 benchmarks/bench_fp8_dispatch.py --out $o/fp8_ab_0again.json ;;
  fp8_try) for p in .prof/try/*.patch; do b=$(basename $p .patch)  # each patch on its own: applied, measured, taken out
             patch -s -p1 < $p && step fp8_try_$b 200 python3 benchmarks/bench_fp8_dispatch.py --out $o/fp8_try_$b.json
             patch -s -p1 -R < $p; done ;;
  fp8_diag) step fp8_diag_no_rows 200 python3 benchmarks/bench_fp8_dispatch.py --patch tools/diag_nvlink.patch \
              --switch MOONEP_DIAG=1 --out $o/fp8_diag_no_rows.json
            step fp8_diag_tree 200 python3 benchmarks/bench_fp8_dispatch.py --out $o/fp8_diag_tree.json ;;  # loads, quantisation, metadata: no row stores; then the tree
  fp8_threads) for t in 768 640 512 768; do step fp8_threads${t}_$SECONDS 200 \
                 python3 benchmarks/bench_fp8_dispatch.py --switch MOONEP_DISPATCH_THREADS=$t --out $o/fp8_threads${t}_$SECONDS.json; done ;;
  ep_np1) MOONEP_GPU_NRANKS=1 step ep_np1 300 python3 -m pytest -q -rA tests/gpu/test_mp_ep_gpu.py ;;
  compile) step compile_r1 500 python3 -m pytest -q -rA tests/unit/test_ops.py tests/gpu/test_slot_gemm_gpu.py tests/gpu/test_compile_gpu.py ;;
  numerics) step compile_numerics 300 python3 tools/compile_numerics.py --out $o/${pfx}_compile_numerics.json ;;
  compile_np2) step ops_dce 120 python3 -m pytest -q -rA tests/unit/test_ops.py -k nothing_reads
               MOONEP_GPU_NRANKS=2 step compile_np2 460 python3 -m pytest -q -rA tests/gpu/test_mp_compile_gpu.py ;;
  compile_mp2) MOONEP_GPU_NRANKS=2 step compile_np2 460 python3 -m pytest -q -rA tests/gpu/test_mp_compile_gpu.py ;;
  compile_np4) MOONEP_GPU_NRANKS=4 step compile_np4 560 python3 -m pytest -q -rA tests/gpu/test_mp_compile_gpu.py ;;
  compile_prof) step compile_prof 300 mpirun --allow-run-as-root -n 1 python3 benchmarks/bench_compile.py \
                  --modes default,default+bitwise,reduce-overhead,reduce-overhead+bitwise --profile $o/compile_prof \
                  --out $o/${pfx}_compile_prof.json ;;
  compile_ab) for lib in tree old tree old; do  # the tree and .old/moonep alternately, one process each
                # (.old/.git_commit, written by the caller, names the old library's commit in its JSON)
                pp=$PYTHONPATH lab="the tree"; [ $lib = old ] && pp=$PWD/.old:$PYTHONPATH lab="moonep at $(cat .old/COMMIT)"
                PYTHONPATH=$pp step compile_${lib}_$SECONDS 150 mpirun --allow-run-as-root -n 1 python3 \
                  benchmarks/bench_compile.py --modes default,reduce-overhead --library "$lab" \
                  --out $o/${pfx}_compile_${lib}_$SECONDS.json
              done ;;
  slot_gemm) step slot_gemm 120 python3 -m pytest -q -rA tests/gpu/test_slot_gemm_gpu.py ;;
  compile_gpu) step compile_gpu 400 python3 -m pytest -q -rA tests/gpu/test_compile_gpu.py ;;
  compile_speed) step compile_speed 400 mpirun --allow-run-as-root -n 1 python3 benchmarks/bench_compile.py --out $o/${pfx}_compile_r1.json ;;
  overlap_bench1) step overlap_bench 150 mpirun --allow-run-as-root -n 1 python3 benchmarks/bench_overlap.py --iters 10 ${OVERLAP_ARGS:-} --out $o/${pfx}_overlap.json ;;
  overlap_bench) step overlap_bench 150 mpirun --allow-run-as-root -n 1 python3 benchmarks/bench_overlap.py --out $o/${pfx}_overlap.json
                 step overlap_bench_fwd 100 mpirun --allow-run-as-root -n 1 python3 benchmarks/bench_overlap.py --forward-only --out $o/${pfx}_overlap_fwd.json
                 step overlap_bench_np2 120 mpirun --allow-run-as-root -n 2 python3 benchmarks/bench_overlap.py --tokens 2048 --ffn 1024 --iters 10 --out $o/${pfx}_overlap_np2.json ;;
  overlap_np2) MOONEP_GPU_NRANKS=2 step overlap_np2 180 python3 -m pytest -q -rA tests/gpu/test_mp_overlap_gpu.py ;;
  pool_np2) MOONEP_GPU_NRANKS=2 step pool_np2 300 python3 -m pytest -q -rA tests/gpu/test_mp_pool_gpu.py ;;
  pool_np4) MOONEP_GPU_NRANKS=4 step pool_np4 300 python3 -m pytest -q -rA tests/gpu/test_mp_pool_gpu.py ;;
  pool_mem) for n in 2 4; do for dt in fp32 bf16; do step pool_mem_np${n}_$dt 200 mpirun --allow-run-as-root --oversubscribe -n $n \
              python3 benchmarks/bench_pool_memory.py --device cuda --dtype $dt --out $o/${pfx}_pool_memory_np${n}_$dt.json; done; done ;;
  pool_trace) step pool_trace 200 mpirun --allow-run-as-root -n 2 python3 benchmarks/trace_pool_overlap.py --out $o/${pfx}_pool_overlap_np2.json ;;
  training_keep) for n in 2 4; do  # every case runs even after one fails (diagnosis with little device time)
                   MOONEP_TEST_DEVICE=cuda OMP_NUM_THREADS=1 step training_keep_np$n 200 mpirun --allow-run-as-root \
                     --oversubscribe -n $n python3 -m tests.harness.mprun \
                     tests/mp/cases_training.py,tests/mp/cases_examples.py --out $o --case-timeout 120 --keep-going 40
                   mkdir -p $o/keep_np$n; mv $o/rank*.jsonl $o/keep_np$n/ 2>/dev/null; done ;;
  examples_np4) MOONEP_TEST_DEVICE=cuda OMP_NUM_THREADS=1 step examples_np4 200 mpirun --allow-run-as-root \
                  --oversubscribe -n 4 python3 -m tests.harness.mprun tests/mp/cases_examples.py --out $o \
                  --case-timeout 120 --keep-going 40
                mkdir -p $o/examples_np4; mv $o/rank*.jsonl $o/examples_np4/ 2>/dev/null ;;
  training_np2) MOONEP_GPU_NRANKS=2 step training_np2 420 python3 -m pytest -q -rA tests/gpu/test_mp_training_gpu.py ;;
  training_np4) MOONEP_GPU_NRANKS=4 step training_np4 500 python3 -m pytest -q -rA tests/gpu/test_mp_training_gpu.py ;;
  training_prof) step training_prof 200 mpirun --allow-run-as-root -n 1 python3 benchmarks/bench_training.py \
                   --setups moonep,moonep_fsdp2,plain_fsdp2 --iters 5 --profile $o/training_prof ;;
  torchtitan_gpu) python3 -m pip install -q --no-index --no-deps --target /tmp/tt_site .whl/*.whl  # carried wheels
                  PYTHONPATH=/tmp/tt_site:$PYTHONPATH MOONEP_GPU_NRANKS=2 step torchtitan_gpu 240 \
                    python3 -m pytest -q -rA tests/gpu/test_mp_torchtitan_gpu.py ;;
  reliability_np2) MOONEP_GPU_NRANKS=2 step reliability_np2 300 python3 -m pytest -q -rA tests/gpu/test_mp_reliability_gpu.py ;;
  training_bench) for n in 1 2; do step training_bench_np$n 300 mpirun --allow-run-as-root -n $n python3 \
                    benchmarks/bench_training.py --out $o/${pfx}_training_np$n.json; done ;;
  training_bench2) step training_bench_np2 200 mpirun --allow-run-as-root -n 2 python3 \
                    benchmarks/bench_training.py --out $o/${pfx}_training_np2.json ;;
  cpu_ranks_bench) for n in 2 4 8; do  # the CPU-rank sweep of cpu_bench_8epr_np*.json with a core per rank (16 here)
                     OMP_NUM_THREADS=1 CUDA_VISIBLE_DEVICES= step cpu_ranks_np$n 400 mpirun --allow-run-as-root \
                       --bind-to core -n $n python3 -m moonep.bench --tokens 256 1024 --hidden 256 --ek $((8 * n))x4 \
                       --ffn 256 --maxvio 0 2 --iters 30 --slack 0 --dtype fp32 --device cpu \
                       --out $o/cpu16_bench_8epr_np$n; done ;;
  host_before_after) host_profiles tree old tree old ;;  # the tree and .old/moonep alternately
  fp8_quick) step fp8_quick 120 python3 -m pytest -q -rA tests/gpu/test_fp8_gpu.py -k "bitwise and not child" ;;
  host_pair) host_profiles tree old ;;
  layer_ab) step layer_ab 300 python3 tools/layer_ab.py --old .old --profile $o/ab --out $o/${pfx}_layer_ab.json ;;  # .old vs the tree, one process
  layer_entries) step layer_entries 300 python3 tools/layer_ab.py --old .old --steps 50 --entries 200 --out $o/${pfx}_layer_entries.json ;;  # host µs per entry point, old and new
  layer_aa) step layer_aa 300 python3 tools/layer_ab.py --old . --out $o/${pfx}_layer_aa.json ;;  # the tree against itself
  layer_prof) step prof_new 200 python3 tools/time_ep.py --profile $o/prof_new
              PYTHONPATH=$PWD/.old:$PYTHONPATH step prof_old 200 python3 tools/time_ep.py --profile $o/prof_old ;;
  diag_build) step diag_build 120 python3 tools/profile_fp8_dispatch.py --patch tools/diag_nvlink.patch \
                --switch MOONEP_DIAG=1 --calls 3 ;;  # a patched profiling build compiles and runs
  training_bench1) step training_bench_np1 200 mpirun --allow-run-as-root -n 1 python3 \
                    benchmarks/bench_training.py --out $o/${pfx}_training_np1.json ;;
  suite) step suite 300 mpirun --allow-run-as-root -n 2 python3 -m moonep.bench --device cuda --preset h200 --plot --out $o/suite_h200.json ;;
esac; done
tar czf "${OUT:-/tmp}/run.tgz" -C $o .
