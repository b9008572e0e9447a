"""Peer-store ceiling on this machine: the plain copy kernel of ``moonep.bench.baselines.PeerStoreCeiling``
storing ``--mbytes`` into the peer, one way (rank 0 only) and both ways at once, over CTA counts.

    mpirun --allow-run-as-root -n 2 python3 tools/probe_peer_store.py --out DIR

The suite's efficiency divides by this kernel's time on the same bytes; the brief's ~360 GB/s is one way.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

import moonep
from moonep.bench.baselines import PeerStoreCeiling
from moonep.bench.provenance import git_commit, machine


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mbytes", type=float, default=58.7)
    ap.add_argument("--blocks", default="8,16,24,32,48,64,132")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    rt = moonep.init()
    R, rank = rt.world_size, rt.rank
    nbytes = int(a.mbytes * 1e6)
    rows = []
    for blocks in [int(b) for b in a.blocks.split(",")]:
        ceil = PeerStoreCeiling(rt, nbytes, blocks=blocks)
        for mode in ("one_way", "both_ways"):
            send = nbytes if (mode == "both_ways" or rank == 0) else 0
            ceil.set_bytes([send if p != rank else 0 for p in range(R)])
            for _ in range(3):
                ceil()
            torch.cuda.synchronize()
            rt.barrier()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(a.iters):
                ceil()
            e1.record()
            e1.synchronize()
            us = e0.elapsed_time(e1) * 1e3 / a.iters
            if send:
                rows.append(dict(rank=rank, blocks=blocks, mode=mode, bytes=send, us=round(us, 1),
                                 GBps=round(send / us / 1e3, 1)))
        ceil.close()
    import torch.distributed as dist

    per_rank = [None] * R
    dist.all_gather_object(per_rank, rows, group=rt.cpu_group)
    every = [r for per in per_rank for r in per]
    if rank == 0:
        for r in every:
            print(r)
        res = dict(benchmark="probe_peer_store", git_commit=git_commit(),
                   command=os.environ.get("MOONEP_BENCH_COMMAND", " ".join(sys.argv)),
                   machine=machine(),
                   results=every)
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "probe_peer_store.json").write_text(json.dumps(res, indent=1))
    rt.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
