"""Kill one rank mid-step on the NVLink transport; the survivors must raise MoonepError, not hang.

mpirun tears the whole job down when one rank exits, so this launches the ranks itself (torchrun-style
environment, one process per rank) and watches them:

    python tests/gpu_kill_rank.py --nranks 2 --timeout 5        # exit code 0 = survivors raised in time

The victim calls ``os._exit`` between dispatch and combine of step 3.  Each survivor keeps stepping (no
host sync: the hang can only surface through the kernels' timeout) and must get ``moonep.MoonepError``
within ``timeout + slack`` seconds of the victim's death.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

VICTIM_EXIT = 17


def child(args) -> None:
    import torch

    import moonep
    from moonep.ep import ExpertParallel

    rt = moonep.init()
    R, rank, d = rt.world_size, rt.rank, rt.device
    E, K, H, S = 4 * R, 4, 256, 128
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(S, H, generator=g).to(d)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(S)]).to(d)
    w = torch.rand(S, K, generator=g).to(d)
    ep = ExpertParallel(rt, num_experts=E, topk=K, hidden=H, max_tokens=S, transport="nvlink",
                               timeout=args.timeout)
    t_start = None
    try:
        with torch.no_grad():
            for step in range(100000):
                h = ep.dispatch(x, idx, w)
                if step == 3 and rank == args.victim:
                    torch.cuda.synchronize()
                    print(json.dumps({"rank": rank, "event": "dying", "t": time.time()}), flush=True)
                    os._exit(VICTIM_EXIT)
                if step == 3:
                    t_start = time.time()
                ep.combine(h.tokens, h)
                if step < 3:
                    ep.synchronize()
                if t_start is not None and time.time() - t_start > args.timeout * 4 + 60:
                    break
            ep.synchronize()
    except moonep.MoonepError as exc:
        print(json.dumps({"rank": rank, "event": "raised", "t": time.time(), "msg": str(exc)}), flush=True)
        os._exit(0)
    print(json.dumps({"rank": rank, "event": "no-error", "t": time.time()}), flush=True)
    os._exit(3)


def launcher(args) -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = []
    for r in range(args.nranks):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(args.nranks), LOCAL_RANK=str(r),
                   LOCAL_WORLD_SIZE=str(args.nranks), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1",
                   PYTHONUNBUFFERED="1")
        procs.append(subprocess.Popen([sys.executable, __file__, "--child", "--victim", str(args.victim),
                                       "--timeout", str(args.timeout)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    deadline = time.time() + args.timeout * 6 + 180
    outputs = {}
    for r, p in enumerate(procs):
        try:
            outputs[r] = p.communicate(timeout=max(1, deadline - time.time()))[0]
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            outputs[r] = (p.communicate()[0] or "") + "\n<killed: launcher deadline>"
    events = {}
    for r, text in outputs.items():
        for line in text.splitlines():
            if line.startswith("{"):
                try:
                    ev = json.loads(line)
                    events[ev["rank"]] = ev
                except ValueError:
                    pass
    ok = procs[args.victim].returncode == VICTIM_EXIT and args.victim in events
    t_dead = events.get(args.victim, {}).get("t", 0.0)
    report = {"nranks": args.nranks, "victim": args.victim, "timeout": args.timeout, "survivors": {}}
    for r, p in enumerate(procs):
        if r == args.victim:
            continue
        ev = events.get(r, {})
        delay = ev.get("t", float("inf")) - t_dead
        good = p.returncode == 0 and ev.get("event") == "raised" and delay <= args.timeout * 2 + 30
        report["survivors"][r] = {"returncode": p.returncode, "event": ev.get("event"),
                                  "seconds_after_death": round(delay, 2), "msg": ev.get("msg", "")[:300]}
        ok = ok and good
    print(json.dumps(report, indent=1))
    if not ok:
        for r, text in outputs.items():
            print(f"--- rank {r} output (exit {procs[r].returncode}) ---\n{text[-3000:]}")
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nranks", type=int, default=2)
    ap.add_argument("--victim", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=5.0)
    ap.add_argument("--child", action="store_true")
    args = ap.parse_args()
    if args.child:
        child(args)
        return 0
    return launcher(args)


if __name__ == "__main__":
    sys.exit(main())
