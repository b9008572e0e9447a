source scripts/gpu_env.sh
for v in new old; do
  if [ $v = old ]; then cp csrc/combine.cu /tmp/combine_new.cu; cp variants/combine_old.cu csrc/combine.cu; fi
  MOONEP_NVLINK_FUSED=route timeout 120 mpirun --allow-run-as-root -n 1 python3 benchmarks/bench_ep_gpu.py --sms 32 --iters 20 --warmup 5 --out /tmp/ab_$v > /tmp/ab_$v.log 2>&1; echo "$v exit $?"
  python3 - $v <<'PY'
import json,glob,sys
v=sys.argv[1]; fs=glob.glob(f'/tmp/ab_{v}/ep_gpu*.json')
for x in json.load(open(fs[0]))['results']:
    print(v,'sms%d full %.0f disp %.0f comb %.0f step %.0f copy %.0f/%.0f'%(x['sms'],x['dispatch_full_us'],x['dispatch_us'],x['combine_us'],x['step_us'],x['copy_dispatch_us'],x['copy_combine_us']), x['phases_us'])
PY
done
cp /tmp/combine_new.cu csrc/combine.cu
tail -3 /tmp/ab_old.log
