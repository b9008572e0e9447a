"""Record what moonep computes on a fixed set of cases, so two versions of the code can be compared bitwise.

Every case builds its inputs from fixed seeds, runs the public API (dispatch, prefetch, grouped expert GEMM,
combine, the backward of all three, reduce_grad, and a LatentMoE layer) and
records a SHA-256 of the bytes of every output and gradient, per rank.  Two recordings of the same cases
are bitwise equal exactly when their ``records`` are equal.

    # CPU, R = 1..4 ranks (both host transports), plus one process without a launcher:
    mpiexec -n 4 python tools/record_behaviour.py --out rec_np4.json
    python tools/record_behaviour.py --out rec_local.json
    # one GPU, R ranks sharing it over CUDA IPC (the NVLink backend), fp32 and bf16:
    mpiexec -n 2 python tools/record_behaviour.py --device cuda --out rec_gpu_np2.json
    # compare two recordings (or two merged files):
    python tools/record_behaviour.py --compare before.json after.json

Only public API is used, so the script runs unchanged against older and newer versions of the package
(``PYTHONPATH`` selects which).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys


def _digest(t) -> dict:
    import torch

    t = t.detach()
    if hasattr(t, "to_local"):  # a DTensor (expert shards): this rank's part
        t = t.to_local()
    if t.dim() == 0:
        t = t.reshape(1)
    b = t.contiguous().cpu().view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return {"sha": hashlib.sha256(b).hexdigest()[:32], "shape": list(t.shape), "dtype": str(t.dtype)}


def _problem(seed, R, E, K, H, S, dtype, kind, rank):
    import torch

    g = torch.Generator().manual_seed(seed)
    sizes = [int(v) for v in torch.randint(0, S + 1, (R,), generator=g)]
    sizes[-1] = S
    if R > 2:
        sizes[1] = 0  # a rank with no token at all
    s = sizes[rank]
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn(s, H, generator=g).to(dtype)
    if kind == "hot":  # everything to expert 0 first, the rest uniform
        rest = [torch.randperm(E - 1, generator=g)[:K - 1] + 1 for _ in range(s)]
        rest = torch.stack(rest) if rest else torch.empty(0, K - 1, dtype=torch.int64)
        idx = torch.cat([torch.zeros(s, 1, dtype=torch.int64), rest], 1)
    else:
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(s)]) if s else \
            torch.empty(0, K, dtype=torch.int64)
        if kind == "masked" and s:
            idx[torch.rand(s, K, generator=g) < 0.25] = -1
    w = torch.rand(s, K, generator=g).to(dtype if dtype != torch.float64 else torch.float64)
    gy = torch.randn(s, H, generator=g).to(dtype)
    return x, idx.reshape(s, K), w, gy


def _cases(device):
    import torch

    cpu = device == "cpu"
    dtypes = [torch.float32, torch.bfloat16] + ([torch.float64] if cpu else [])
    out = []
    for dt in dtypes:
        out.append(dict(name=f"uniform_{str(dt)[6:]}", E=12, K=2, H=64, S=24, dtype=dt, kind="uniform"))
        out.append(dict(name=f"hot_{str(dt)[6:]}", E=24, K=4, H=32, S=40, dtype=dt, kind="hot"))
    out.append(dict(name="masked_align4_dispatchw", E=12, K=3, H=48, S=20, dtype=torch.float32, kind="masked",
                    align=4, apply_weights="dispatch"))
    out.append(dict(name="slack_half", E=12, K=2, H=32, S=16, dtype=torch.float32, kind="hot", slack=0.5))
    return out


def run_ep_case(rt, c, transport, seed=7):
    """One training step through the public ExpertParallel API; returns {name: digest}."""
    import torch

    import moonep
    from moonep.layers.grouped import slot_matmul

    R, rank, dev = rt.world_size, rt.rank, rt.device
    E, K, H, S, dt = c["E"], c["K"], c["H"], c["S"], c["dtype"]
    kw = {k: c[k] for k in ("align", "apply_weights", "slack") if k in c}
    ep = moonep.ExpertParallel(rt, num_experts=E, topk=K, hidden=H, max_tokens=S, dtype=dt, transport=transport,
                               **kw)
    epn = E // R
    rec = {}
    try:
        x, idx, w, gy = (t.to(dev) for t in _problem(seed, R, E, K, H, S, dt, c["kind"], rank))
        g = torch.Generator().manual_seed(99 + rank)
        wh = (torch.randn(epn, H, H, generator=g) / H ** 0.5).to(dt).to(dev)
        for step in range(2):  # the second step reuses every buffer (and the pool)
            xl, wl, whl = x.clone().requires_grad_(), w.clone().requires_grad_(), wh.clone().requires_grad_()
            h = ep.dispatch(xl, idx, wl)
            slots = ep.prefetch(h, whl)
            out = slot_matmul(h.tokens, h.cu_seqlens, slots, impl="loop")
            y = ep.combine(out, h)
            (y.float() * gy.float()).sum().backward()
            for name, t in (("tokens", h.tokens), ("weights", h.weights), ("cu_seqlens", h.cu_seqlens),
                            ("slot_experts", h.slot_experts), ("slots", slots), ("y", y), ("dx", xl.grad),
                            ("dw", wl.grad), ("dW", whl.grad)):
                rec[f"{step}.{name}"] = _digest(t)
            rec[f"{step}.num_rows"] = int(h.num_rows)
        # without autograd: prefetch, reduce_grad, combine of the rows themselves
        with torch.no_grad():
            h = ep.dispatch(x, idx, w)
            p = ep.prefetch(h, wh.clone())  # (the slots prefetch(out=pool) filled in earlier versions)
            rec["nograd.pool"] = _digest(p)
            rec["nograd.reduce_grad"] = _digest(ep.reduce_grad(h, p * 0.5))
            rec["nograd.y"] = _digest(ep.combine(h.tokens.clone(), h))
            rec["nograd.tokens"] = _digest(h.tokens)
    finally:
        ep.close()
    return rec


def run_layer_case(rt, device, seed=3):
    import torch

    import moonep

    torch.manual_seed(seed)
    kw = dict(group=rt) if rt is not None else {}
    layer = moonep.LatentMoE(32, 16, 12, 2, 24, num_shared=1, balancer=None, max_tokens=32, matmul="loop",
                             device=device, **kw)
    rank = 0 if rt is None else rt.rank
    g = torch.Generator().manual_seed(seed * 10 + rank)
    x = torch.randn(20 + rank, 32, generator=g).to(device).requires_grad_()
    y = layer(x)
    y.square().sum().backward()
    rec = {"y": _digest(y), "dx": _digest(x.grad)}
    for n, p in sorted(layer.named_parameters()):
        if p.grad is not None:
            rec[f"grad.{n}"] = _digest(p.grad)
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"))
    ap.add_argument("--merge", nargs="+", metavar="FILE", help="merge recordings into --out, keyed by run")
    ap.add_argument("--note", default="", help="with --merge: recorded in meta (commit, machine, command)")
    args = ap.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    if args.merge:
        return merge(args.out, args.merge, args.note)
    import torch

    torch.use_deterministic_algorithms(False)
    import moonep
    from moonep.runtime import detect_launcher

    records = {}
    if detect_launcher() == "single":  # no launcher: the one-process path (R = 1, no process group)
        records["layer/local"] = [run_layer_case(None, args.device)]
        meta = dict(ranks=1, device=args.device, launcher="single")
    else:
        rt = moonep.init(device=args.device)
        transports = ["mpi", "torch"] if args.device == "cpu" else ["nvlink"]
        mine = {}
        for c in _cases(args.device):
            for tr in transports:
                mine[f"ep/{c['name']}/{tr}"] = run_ep_case(rt, c, tr)
        mine["layer/group"] = run_layer_case(rt, rt.device)
        from mpi4py import MPI

        allr = MPI.COMM_WORLD.gather(mine, root=0)
        if rt.rank == 0:
            for key in mine:
                records[key] = [r[key] for r in allr]
        meta = dict(ranks=rt.world_size, device=args.device, launcher="mpi")
        rt.shutdown()
        if rt.rank != 0:
            return 0
    doc = dict(meta=dict(meta, torch=torch.__version__, moonep=os.path.dirname(moonep.__file__)), records=records)
    text = json.dumps(doc, indent=1, sort_keys=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(f"{len(records)} cases recorded on {meta['ranks']} rank(s), {args.device}")
    return 0


def merge(out: str, files: list, note: str) -> int:
    """One file from several recordings: keys become ``<device>/np<R>/<case>``."""
    records, runs = {}, []
    for path in files:
        doc = json.load(open(path))
        m = doc["meta"]
        runs.append({k: m[k] for k in ("ranks", "device", "launcher", "torch")})
        tag = f"{m['device']}/np{m['ranks']}" + ("/local" if m["launcher"] == "single" else "")
        records.update({f"{tag}/{k}": v for k, v in doc["records"].items()})
    with open(out, "w") as f:
        json.dump(dict(meta=dict(note=note, runs=runs), records=records), f, indent=1, sort_keys=True)
    print(f"{len(records)} cases from {len(files)} recordings -> {out}")
    return 0


def compare(a: str, b: str) -> int:
    """Exit 0 when the two recordings hold the same cases with bitwise equal records."""
    ra, rb = (json.load(open(p))["records"] for p in (a, b))
    diff = sorted(k for k in set(ra) | set(rb) if ra.get(k) != rb.get(k))
    for k in diff[:20]:
        print(f"differs: {k}")
    print(f"{len(ra)} vs {len(rb)} cases, {len(diff)} differ")
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main())
