"""A rank killed in the middle of a dispatch, combine, prefetch or QB step on CUDA ranks.

mpirun tears a job down when one rank exits, so this starts the ranks itself (torchrun-style
environment) and watches them:

    python tests/gpu/gpu_fault_kill.py --nranks 2 --op combine --timeout 5     # exit code 0 = pass

NVLink ops: the victim launches the op's kernels and exits at once (``os._exit``, no sync), so its peers'
kernels are left waiting mid-op; every survivor keeps stepping and must raise MoonepError within
``timeout + slack`` seconds.  ``--op qb``: the victim exits instead of joining the QuantileBalancer's
NCCL all-reduce; NCCL reports asynchronously, so a survivor passes if it raises MoonepError or its
process is ended by NCCL's watchdog (non-zero exit) within the process-group timeout, never hangs.
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


def _say(**kw):
    print(json.dumps(dict(kw, t=time.time())), flush=True)


def child(args) -> None:
    import torch

    import moonep

    rt = moonep.init(timeout=args.timeout if args.op == "qb" else None)
    R, rank, d = rt.world_size, rt.rank, rt.device
    g = torch.Generator().manual_seed(rank)
    victim = rank == args.victim
    if args.op == "qb":
        qb = moonep.QuantileBalancer(num_experts=16, topk=2).to(d)
        try:
            for step in range(100000):
                qb.route(torch.rand(256, 16, generator=g).to(d))
                if step == 3 and victim:
                    torch.cuda.synchronize()
                    _say(rank=rank, event="dying")
                    os._exit(VICTIM_EXIT)
                qb.step()
                if step < 3:
                    torch.cuda.synchronize()
        except moonep.MoonepError as exc:
            _say(rank=rank, event="raised", msg=str(exc))
            os._exit(0)
        os._exit(3)
    E, K, H, S = 4 * R, 4, 256, 128
    x = torch.randn(S, H, generator=g).to(d)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(S)]).to(d)
    w = torch.rand(S, K, generator=g).to(d)
    home = torch.randn(E // R, H, generator=g).to(d)
    ep = moonep.ExpertParallel(rt, num_experts=E, topk=K, hidden=H, max_tokens=S, transport="nvlink",
                               timeout=args.timeout)
    t_start = None
    try:
        with torch.no_grad():
            for step in range(100000):
                kill = step == 3 and victim
                if kill and args.op == "dispatch":
                    ep.dispatch(x, idx, w)
                    _say(rank=rank, event="dying")
                    os._exit(VICTIM_EXIT)  # kernels in flight, peers mid-dispatch
                h = ep.dispatch(x, idx, w)
                if kill and args.op == "prefetch":
                    ep.prefetch(h, home)
                    _say(rank=rank, event="dying")
                    os._exit(VICTIM_EXIT)
                ep.prefetch(h, home)
                if kill:  # combine
                    ep.combine(h.tokens, h)
                    _say(rank=rank, event="dying")
                    os._exit(VICTIM_EXIT)
                ep.combine(h.tokens, h)
                if step < 3:
                    ep.synchronize()
                if step == 3:
                    t_start = time.time()
                if t_start is not None and time.time() - t_start > args.timeout * 4 + 60:
                    break
            ep.synchronize()
    except moonep.MoonepError as exc:
        _say(rank=rank, event="raised", msg=str(exc))
        os._exit(0)
    _say(rank=rank, event="no-error")
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
                                       "--op", args.op, "--timeout", str(args.timeout)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    deadline = time.time() + args.timeout * 6 + 180
    outputs = {}
    for r, p in enumerate(procs):
        try:
            outputs[r] = p.communicate(timeout=max(1, deadline - time.time()))[0]
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            outputs[r] = (p.communicate()[0] or "") + "\n<killed: launcher deadline (a hang)>"
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
    report = {"op": args.op, "nranks": args.nranks, "victim": args.victim, "timeout": args.timeout,
              "survivors": {}}
    for r, p in enumerate(procs):
        if r == args.victim:
            continue
        ev = events.get(r, {})
        delay = ev.get("t", float("inf")) - t_dead
        good = p.returncode == 0 and ev.get("event") == "raised" and delay <= args.timeout * 2 + 30
        if args.op == "qb" and not good:  # NCCL's watchdog ended the process: acceptable, not a hang
            good = p.returncode not in (0, None) and "<killed" not in outputs[r]
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
    ap.add_argument("--op", choices=["dispatch", "combine", "prefetch", "qb"], default="combine")
    ap.add_argument("--timeout", type=float, default=5.0)
    ap.add_argument("--child", action="store_true")
    args = ap.parse_args()
    if args.child:
        child(args)
        return 0
    return launcher(args)


if __name__ == "__main__":
    sys.exit(main())
