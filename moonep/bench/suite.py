"""The sweep driver behind ``python -m moonep.bench``.

For every configuration (tokens per rank, hidden, E, K), popularity placement and target maxvio it
builds one routing (the same on every path) and measures, in this order:

1. moonep, for every ``slack``: ``dispatch`` (validation, counts exchange, planning and the token
   exchange: everything ``ep.dispatch`` does), ``combine`` (identity experts), the replica fetch
   (``ReplicaPool.fetch``, called "prefetch") of three ``[H, ffn]`` projections, and dispatch + prefetch as
   one timed region;
2. on GPU the ceiling (:class:`moonep.bench.baselines.PeerStoreCeiling`) moving the bytes moonep put on
   the wire, in each direction; on CPU a reference (the transport's plain all-to-all of the same rows);
3. the Megatron-style all-to-all (:class:`moonep.bench.baselines.MegatronA2A`) on ``all_to_all_single``;
4. the MoE layer's training step (:mod:`moonep.bench.training_step`) and inference step
   (:mod:`moonep.bench.layer_step`) on both paths, paired (:meth:`Timer.paired`), and each rank's expert
   GEMMs alone;
5. after every point above (so that a failure there cannot cost the rest), PyTorch's NVSHMEM
   ``all_to_all_vdev_2d`` pair on GPU, or "unavailable: <reason>".

Timing: on GPU, CUDA events around each call, calls back to back after one barrier (the GPU queue runs
ahead unless the path itself synchronises with the host, as the Megatron path must); on CPU, wall clock
with a barrier before every call. A figure is the median over ``iters`` calls of the slowest rank.  The
layer steps are paired instead: moonep and the baseline alternate inside every iteration (each call after a
barrier, the GPU drained around it), and their ratio is taken per iteration.
"""
from __future__ import annotations

import gc
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

import moonep
from moonep.bench.baselines import MegatronA2A, PeerStoreCeiling, SymmMemA2A
from moonep.bench.layer_step import ExpertWeights, megatron_step, moonep_experts, moonep_step, swiglu_experts
from moonep.bench.training_step import (TrainingLayer, differentiable, megatron_train_step, moonep_train_step,
                                        torch_all_to_all)
from moonep.bench.routing import make_routing, maxvio, zipf_exponent
from moonep.fp8 import dequantize_rows, wire_bytes as fp8_wire_bytes

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
META_BYTES_PER_CHOICE = 8  # a token's K-aligned row list (int32) and routing weights (fp32) travel with it


@dataclass
class Timing:
    us: float            # median of the slowest rank
    per_rank_us: list    # every rank's median
    out: object = None   # the last call's result


class Timer:
    def __init__(self, rt, iters: int, warmup: int):
        self.rt, self.iters, self.warmup = rt, max(1, iters), max(0, warmup)
        self.cuda = rt.device.type == "cuda"

    def __call__(self, fn) -> Timing:
        rt = self.rt
        out = None
        if self.cuda:
            rt.barrier()
            for _ in range(self.warmup):
                out = fn()
            torch.cuda.synchronize()
            rt.barrier()
            evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                   for _ in range(self.iters)]
            for a, b in evs:
                a.record()
                out = fn()
                b.record()
            torch.cuda.synchronize()
            samples = [a.elapsed_time(b) * 1e3 for a, b in evs]
        else:
            samples = []
            for i in range(self.warmup + self.iters):
                rt.barrier()
                t0 = time.perf_counter()
                out = fn()
                if i >= self.warmup:
                    samples.append((time.perf_counter() - t0) * 1e6)
        med = sorted(samples)[len(samples) // 2]
        per_rank = gather(rt, round(med, 2))
        return Timing(max(per_rank), per_rank, out)

    def _once(self, fn) -> float:
        """One call of ``fn`` after a barrier, in us (CUDA: events, the queue drained before and after)."""
        if self.cuda:
            torch.cuda.synchronize()
            self.rt.barrier()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            return a.elapsed_time(b) * 1e3
        self.rt.barrier()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6

    def paired(self, fa, fb) -> dict:
        """Time ``fa`` (moonep) and ``fb`` (a baseline) alternately inside every iteration (``fa`` first in
        even iterations, ``fb`` first in odd ones), so that both see the same machine.

        Returns ``a_us``, ``b_us`` (medians over iterations of the slowest rank's time), ``a_per_rank_us``,
        ``b_per_rank_us`` (each rank's median) and ``ratio`` (``b / a`` per iteration, slowest ranks):
        its median, 25th and 75th percentiles."""
        sa, sb = [], []
        for i in range(self.warmup + self.iters):
            for f, samples in (((fa, sa), (fb, sb)) if i % 2 == 0 else ((fb, sb), (fa, sa))):
                t = self._once(f)
                if i >= self.warmup:
                    samples.append(t)
        every = gather(self.rt, (sa, sb))
        slow_a = [max(e[0][i] for e in every) for i in range(len(sa))]
        slow_b = [max(e[1][i] for e in every) for i in range(len(sb))]
        ratio = sorted(b / a for a, b in zip(slow_a, slow_b))
        return dict(a_us=round(_median(slow_a), 2), b_us=round(_median(slow_b), 2),
                    a_per_rank_us=[round(_median(e[0]), 2) for e in every],
                    b_per_rank_us=[round(_median(e[1]), 2) for e in every],
                    ratio=_sig(_median(ratio), 3), ratio_p25=_sig(_quantile(ratio, 0.25), 3),
                    ratio_p75=_sig(_quantile(ratio, 0.75), 3))


def _brief(exc: BaseException) -> str:
    """An exception's type and first line, at most 300 characters (recorded in the JSON)."""
    first = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {first}"[:300]


def _median(v) -> float:
    return _quantile(sorted(v), 0.5)


def _quantile(sorted_v, q: float) -> float:
    """Linear interpolation between order statistics (numpy's default)."""
    pos = q * (len(sorted_v) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_v) - 1)
    return sorted_v[lo] + (sorted_v[hi] - sorted_v[lo]) * (pos - lo)


def gather(rt, obj) -> list:
    out = [None] * rt.world_size
    dist.all_gather_object(out, obj, group=rt.cpu_group)
    return out


class Progress:
    """Rank 0's progress over the sweep's points, a tqdm bar on stderr (nothing on the other ranks)."""

    def __init__(self, total: int, enabled: bool):
        from tqdm import tqdm  # the bench extra; the command line checks it before anything runs

        self.bar = tqdm(total=max(total, 1), disable=not enabled, unit="point", file=sys.stderr,
                        dynamic_ncols=True, desc="moonep-bench")

    def step(self, label: str) -> None:
        self.bar.set_postfix_str(label, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def _shape(cfg) -> str:
    """A configuration in words, for the progress bar."""
    s, H, E, K = cfg
    return f"{s} tokens, hidden {H}, top-{K} of {E}"


def pairs_per_peer(step, R: int) -> list[int]:
    """Rows this rank sends to each rank (one per token and destination rank) in ``step`` (a
    :class:`moonep.handles.Step`): host ints (may sync)."""
    st = step.routing
    if hasattr(st, "send_splits"):
        return [int(v) for v in st.send_splits]
    dr = st.dst_rank
    return torch.stack([(dr == p).any(dim=1).sum() for p in range(R)]).tolist()


def _gpu_share(rt) -> int:
    """Ranks of this node that share one GPU (``> 1``: oversubscribed)."""
    if rt.device.type != "cuda":
        return 1
    return max(1, -(-rt.local_world_size // torch.cuda.device_count()))


def _avail_bytes(rt) -> int:
    if rt.device.type == "cuda":
        return torch.cuda.mem_get_info(rt.device)[0] // _gpu_share(rt)
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES") // max(1, rt.local_world_size)
    except (ValueError, OSError):
        return 1 << 62


def _sig(v: float, digits: int = 4) -> float:
    """Round to significant digits (GB/s spans 0.001 on tiny CPU runs to 1000s on GPUs)."""
    return float(f"{v:.{digits}g}")


def _rel_err(y, ref) -> float:
    ref = ref.float()
    return float((y.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)) if ref.numel() else 0.0


class Suite:
    def __init__(self, args, emit, checkpoint=None):
        """``emit(doc)``: rank 0 saves the document (after every point); ``checkpoint(doc)``: rank 0, once
        before the symm_mem phase (NVSHMEM start-up is the riskiest step: save tables and charts first)."""
        self.args, self.emit, self.checkpoint = args, emit, checkpoint
        self.rt = rt = moonep.init(device=None if args.device == "auto" else args.device)
        self.R, self.rank = rt.world_size, rt.rank
        self.cuda = rt.device.type == "cuda"
        self.dtype = DTYPES[args.dtype]
        self.fp8 = getattr(args, "dispatch_dtype", "same") == "fp8"
        self.es = torch.empty((), dtype=self.dtype).element_size()
        self.timer = Timer(rt, args.iters, args.warmup)
        self._zipf: dict = {}
        self.points: list = []
        self.doc: dict = {}

    # -- helpers ---------------------------------------------------------------------------------------
    def zipf(self, target, E, K) -> float:
        key = (target, E, K)
        if key not in self._zipf:
            self._zipf[key] = zipf_exponent(target, E, K)
        return self._zipf[key]

    def routing(self, ci: int, cfg, placement: str, target: float):
        s, H, E, K = cfg
        a = self.zipf(target, E, K)
        seed = 7919 * (ci + 1) + 104729 * self.rank + int(1000 * target)
        idx, w = make_routing(s, E, K, a, seed=seed, device=self.rt.device, placement=placement)
        return a, idx, w

    def tokens(self, ci: int, cfg):
        s, H = cfg[0], cfg[1]
        gen = torch.Generator().manual_seed(31 * (ci + 1) + self.rank)
        return torch.randn(s, H, generator=gen).to(self.dtype).to(self.rt.device)

    # -- the sweep -------------------------------------------------------------------------------------
    def configs(self):
        a = self.args
        return [(s, H, E, K) for s in a.tokens for H in a.hidden for (E, K) in a.ek]

    def run(self) -> dict:
        a, rt = self.args, self.rt
        configs = self.configs()
        n_points = len(configs) * len(a.placement) * len(a.maxvio)
        symm = self.cuda and a.symm
        self.progress = Progress(n_points * (2 if symm else 1), rt.rank == 0)
        self.doc = self.header()
        try:
            with torch.no_grad():
                for ci, cfg in enumerate(configs):
                    self.run_config(ci, cfg)
                if symm and rt.rank == 0 and self.checkpoint is not None:
                    self.checkpoint(self.doc)
                if symm:
                    self.run_symm(configs)
        finally:
            self.progress.close()
        return self.doc

    def shutdown(self) -> None:
        self.rt.shutdown()

    def header(self) -> dict:
        from moonep.bench.provenance import git_commit, machine

        rt, a = self.rt, self.args
        share = _gpu_share(rt)
        return dict(
            benchmark="moonep.bench", time=time.strftime("%Y-%m-%dT%H:%M:%S%z"), git_commit=git_commit(),
            machine=machine(), ranks=self.R, device=rt.device.type, backend=rt.backend, launcher=rt.launcher,
            dtype=a.dtype, oversubscribed=share > 1, ranks_per_gpu=share if self.cuda else None,
            config={k: v for k, v in vars(a).items() if k not in ("out", "plot")},
            definitions=DEFINITIONS, points=self.points)

    def run_config(self, ci: int, cfg) -> None:
        a, rt, R = self.args, self.rt, self.R
        s, H, E, K = cfg
        if E % R:
            for placement in a.placement:
                for target in a.maxvio:
                    self.points.append(dict(tokens=s, hidden=H, experts=E, topk=K, placement=placement,
                                            maxvio_target=target, skipped=f"{E} experts do not divide over {R} ranks"))
                    self.progress.step(f"skipped: {E} experts on {R} ranks")
            return
        epn = E // R
        x = self.tokens(ci, cfg)
        eps = {}
        for slack in a.slack:
            eps[slack] = moonep.ExpertParallel(rt, num_experts=E, topk=K, hidden=H, max_tokens=s, dtype=self.dtype,
                                               slack=slack, transport=a.transport,
                                               tuning=moonep.Tuning(num_sms=a.num_sms),
                                               dispatch_dtype=torch.float8_e4m3fn if self.fp8 else None)
        ep0 = eps[a.slack[0]]
        self.doc["transport"] = ep0.transport_name
        weights, why = None, ""
        if a.ffn > 0:
            # three projections and their replica slots (x2), plus headroom; the training step adds its own
            # three projections, their gradients and replica slots
            need = epn * H * a.ffn * self.es * (2 * 3 + len(a.slack) + 2 + (9 if a.layer else 0))
            ok = gather(rt, need < 0.7 * _avail_bytes(rt))
            if all(ok):
                weights = ExpertWeights(epn, H, a.ffn, self.dtype, rt.device, seed=ci)
            else:
                why = f"skipped: expert weights need about {need / 2**30:.1f} GiB per rank (use a smaller --ffn)"
        ceiling = None
        if ep0.transport_name == "nvlink":
            ceiling = PeerStoreCeiling(rt, s * (H * self.es + K * META_BYTES_PER_CHOICE) + 16,
                                       blocks=a.ceiling_blocks)
        # the baseline on the collective its users run: all_to_all_single on the job's group (gloo, NCCL)
        a2a = torch_all_to_all(rt.group)
        backend = f"all_to_all_single on {dist.get_backend(rt.group)}"
        meg = MegatronA2A(a2a, R, E, K, backend=backend)
        self.meg_train = MegatronA2A(differentiable(a2a), R, E, K, backend=backend)
        self.doc["megatron_backend"] = backend
        if ceiling is not None:
            self.doc["ceiling_kind"] = "peer-store kernel over CUDA IPC"
        else:  # no bound moonep cannot beat exists on the host path: name the reference for what it is
            self.doc["reference_kind"] = (f"the {ep0.transport.name} transport's plain all-to-all of moonep's wire "
                                          "rows (a reference, not a bound: moonep's own exchange can be faster)")
        try:
            for placement in a.placement:
                for target in a.maxvio:
                    pt = self.measure(ci, cfg, placement, target, x, eps, weights, why, ceiling, meg)
                    self.points.append(pt)
                    if rt.rank == 0:
                        self.emit(self.doc)
                    mv = pt.get("maxvio", float("nan"))
                    self.progress.step(f"{_shape(cfg)}, {placement}, maxvio {target:g} (got {mv:.2f})")
        finally:
            for ep in eps.values():
                ep.close()
            if ceiling is not None:
                ceiling.close()
            del weights, eps
            gc.collect()
            if self.cuda:
                torch.cuda.empty_cache()

    def measure(self, ci, cfg, placement, target, x, eps, weights, why, ceiling, meg) -> dict:
        a, rt, R, T = self.args, self.rt, self.R, self.timer
        s, H, E, K = cfg
        es = self.es
        zipf_a, idx, w = self.routing(ci, cfg, placement, target)
        pt = dict(tokens=s, hidden=H, experts=E, topk=K, placement=placement, maxvio_target=target,
                  zipf_a=round(zipf_a, 4))
        logical = s * K * H * es
        # fp8: a row is H e4m3 bytes plus H/128 float32 scales (moonep.fp8.wire_bytes)
        row_bytes = fp8_wire_bytes(H) if self.fp8 else H * es
        row_wire = row_bytes + K * META_BYTES_PER_CHOICE
        w_expert = 3 * H * a.ffn * es  # one replica's three projections
        ref = (x.float() * w.sum(1, keepdim=True)).to(self.dtype)  # identity experts
        local, moon = {}, []
        for slack, ep in eps.items():
            d = T(lambda: ep.dispatch(x, idx, w))
            h = d.out
            rows = dequantize_rows(h) if self.fp8 else h.tokens  # identity experts: combine the rows
            c = T(lambda: ep.combine(rows, h))
            err = _rel_err(c.out, ref)
            pairs = pairs_per_peer(ep._step_of(h), R)
            n_rep = int((h.plan.replica_experts[self.rank] >= 0).sum())
            rec = dict(slack=slack, dispatch_us=d.us, combine_us=c.us, dispatch_per_rank_us=d.per_rank_us,
                       combine_per_rank_us=c.per_rank_us, check_rel_err=err,
                       dispatch_dtype="fp8_e4m3" if self.fp8 else str(self.dtype).replace("torch.", ""),
                       dispatch_logical_bytes=s * K * row_bytes)
            if self.fp8:  # the identity experts' y against the token-dtype path's: the quantisation error
                rec["quant_rel_err_vs_token_dtype"] = err
            if slack == a.slack[0]:
                counts = ep._step_of(h).plan.counts.cpu()
                pt["maxvio"] = round(maxvio(counts), 4)
                pt["rank_load_max_over_mean"] = round(float(counts.sum(0).view(R, -1).sum(1).max() * R
                                                            / counts.sum()), 4)
            if weights is not None:
                p = T(lambda: weights.fetch(ep, h))
                q = T(lambda: weights.fetch(ep, ep.dispatch(x, idx, w)))
                rec.update(prefetch_us=p.us, dispatch_prefetch_us=q.us)
            elif why:
                rec["prefetch"] = why
            moon.append(rec)
            local[slack] = dict(pairs=pairs, recv=int(h.num_rows), replicas=n_rep)
            del h, d, c, rows
        # Megatron-style baseline
        md = T(lambda: meg.dispatch(x, idx))
        mtok, mctx = md.out
        mc = T(lambda: meg.combine(mtok, w, mctx))
        meg_err = _rel_err(mc.out, ref)
        local["meg"] = dict(recv=mctx["n_recv"], send=mctx["send_splits"])
        md.out = mc.out = None
        # dispatch + combine (identity experts) on both paths, paired: the ratio that a shared machine keeps
        ep = eps[a.slack[0]]

        def moonep_dc():
            hh = ep.dispatch(x, idx, w)
            return ep.combine(dequantize_rows(hh) if self.fp8 else hh.tokens, hh)

        def meg_dc():
            tok, ctx = meg.dispatch(x, idx)
            return meg.combine(tok, w, ctx)

        dc = T.paired(moonep_dc, meg_dc)
        # the layer steps (first slack): training (forward and backward), then inference (forward only)
        lay = None
        if weights is not None and a.layer and self.fp8:
            why = why or "the layer step runs the token dtype (--dispatch-dtype fp8)"
        elif weights is not None and a.layer:
            lay = self.layer_steps(ci, cfg, eps[a.slack[0]], meg, x, idx, w, weights)
            local["layer_rows"] = lay.pop("rows")
        # everything per rank, then the ceiling on the exact per-peer bytes
        every = gather(rt, local)
        ceil = self.ceiling(ceiling, eps[a.slack[0]], x, every, row_wire, a.slack[0])
        meg_recv = [e["meg"]["recv"] for e in every]
        meg_wire = [sum(v for p, v in enumerate(e["meg"]["send"]) if p != r) * H * es for r, e in enumerate(every)]
        pt["megatron"] = dict(backend=meg.backend, dispatch_us=md.us, combine_us=mc.us,
                              dispatch_per_rank_us=md.per_rank_us, combine_per_rank_us=mc.per_rank_us,
                              recv_rows_per_rank=meg_recv, recv_rows_max=max(meg_recv), recv_rows_min=min(meg_recv),
                              wire_bytes_per_rank=meg_wire, check_rel_err=meg_err,
                              dispatch_logical_GBps=_sig(logical / md.us / 1e3),
                              combine_logical_GBps=_sig(logical / mc.us / 1e3))
        pt["ceiling" if ceiling is not None else "reference"] = ceil
        for rec in moon:
            sl = rec["slack"]
            pairs = [[e[sl]["pairs"][p] for p in range(R)] for e in every]   # [src][dst]
            sent = [sum(v for p, v in enumerate(pairs[r]) if p != r) for r in range(R)]
            wire = sum(sent) / R * row_wire
            recv = [e[sl]["recv"] for e in every]
            reps = [e[sl]["replicas"] for e in every]
            rep_bytes = sum(reps) * w_expert
            rec.update(
                recv_rows_per_rank=recv, recv_rows_max=max(recv), recv_rows_min=min(recv),
                replicas=sum(reps), replicas_per_rank=reps, replica_weight_bytes=rep_bytes,
                remote_pairs=sum(sent), token_copies=R * s * K, wire_bytes_per_rank=round(wire),
                dispatch_logical_GBps=_sig(logical / rec["dispatch_us"] / 1e3),
                combine_logical_GBps=_sig(logical / rec["combine_us"] / 1e3),
                dispatch_wire_GBps=_sig(wire / rec["dispatch_us"] / 1e3),
                combine_wire_GBps=_sig(wire / rec["combine_us"] / 1e3),
                vs_megatron_dispatch=_sig(md.us / rec["dispatch_us"], 3),
                vs_megatron_combine=_sig(mc.us / rec["combine_us"], 3))
            # the ceiling's time for `b` bytes per rank, scaled from its measurement on this point's bytes
            bound = ceiling is not None  # efficiencies only against a hardware ceiling
            sent, recvd = (ceil["mean_sent_bytes"], ceil["mean_recv_bytes"]) if bound else (0, 0)
            c_d = (lambda b: b / sent * ceil["dispatch_us"]) if sent else None
            c_c = (lambda b: b / recvd * ceil["combine_us"]) if recvd else None
            if c_d:
                rec["dispatch_efficiency"] = _sig(c_d(wire) / rec["dispatch_us"], 3)
            if c_c:
                rec["combine_efficiency"] = _sig(c_c(wire) / rec["combine_us"], 3)
            if "dispatch_prefetch_us" in rec:
                both = wire + rep_bytes / R
                rec["dispatch_prefetch_wire_GBps"] = _sig(both / rec["dispatch_prefetch_us"] / 1e3)
                rec["dispatch_prefetch_logical_GBps"] = _sig(logical / rec["dispatch_prefetch_us"] / 1e3)
                if c_d:
                    rec["dispatch_prefetch_efficiency"] = _sig(c_d(both) / rec["dispatch_prefetch_us"], 3)
        pt["moonep"] = moon
        pt["dispatch_combine"] = dict(slack=a.slack[0], moonep_us=dc["a_us"], megatron_us=dc["b_us"],
                                      speedup=dc["ratio"], speedup_p25=dc["ratio_p25"], speedup_p75=dc["ratio_p75"])
        if lay is not None:
            rows = [e["layer_rows"] for e in every]
            lay.update(moonep_rows_per_rank=rows, megatron_rows_per_rank=meg_recv,
                       megatron_straggler_rank=max(range(R), key=lambda r: meg_recv[r]),
                       megatron_rows_max_over_min=round(max(meg_recv) / max(min(meg_recv), 1), 4))
            pt["layer"] = lay
        elif why:
            pt["layer"] = dict(skipped=why)
        return pt

    def layer_steps(self, ci, cfg, ep, meg, x, idx, w, weights) -> dict:
        """The training and the inference step on both paths, paired (:meth:`Timer.paired`), each rank's
        expert GEMMs alone, and the training step's agreement between the paths."""
        a, rt, T = self.args, self.rt, self.timer
        s, H, E, K = cfg
        with torch.enable_grad():
            layer = TrainingLayer(E // self.R, E, H, a.ffn, self.dtype, rt.device, seed=ci)
            xg = x.detach().clone().requires_grad_()
            gen = torch.Generator().manual_seed(17 * (ci + 1) + self.rank)
            gy = torch.randn(s, H, generator=gen).to(self.dtype).to(rt.device)
            check = self.train_check(ep, layer, xg, idx, gy)
            tr = T.paired(lambda: moonep_train_step(ep, layer, xg, idx, gy),
                          lambda: megatron_train_step(self.meg_train, layer, xg, idx, gy))
            layer.zero_grad()
        inf = T.paired(lambda: moonep_step(ep, x, idx, w, weights), lambda: megatron_step(meg, x, idx, w, weights))
        h = ep.dispatch(x, idx, w)
        reps = weights.fetch(ep, h)
        btok, bctx = meg.dispatch(x, idx)
        # the expert GEMMs alone, paired too: on a shared machine, timed one path after the other, their
        # difference was mostly the machine's
        ex = T.paired(lambda: moonep_experts(h, weights.projections, reps),
                      lambda: swiglu_experts(btok, bctx["cu_seqlens"], *weights.projections))
        out = dict(rows=int(h.num_rows), moonep_expert_us=ex["a_per_rank_us"],
                   megatron_expert_us=ex["b_per_rank_us"], train_check_rel_err=check)
        for name, r in (("train", tr), ("inference", inf)):
            out.update({f"{name}_moonep_us": r["a_us"], f"{name}_megatron_us": r["b_us"],
                        f"{name}_moonep_per_rank_us": r["a_per_rank_us"],
                        f"{name}_megatron_per_rank_us": r["b_per_rank_us"],
                        f"{name}_speedup": r["ratio"], f"{name}_speedup_p25": r["ratio_p25"],
                        f"{name}_speedup_p75": r["ratio_p75"]})
        return out

    def train_check(self, ep, layer, x, idx, gy) -> float:
        """Largest relative difference between the paths' training steps: the output, the input's gradient
        and every weight's gradient (the same computation: only round-off may differ).  All ranks' largest."""
        got = []
        for step, meg in ((moonep_train_step, ep), (megatron_train_step, self.meg_train)):
            y = step(meg, layer, x, idx, gy)
            got.append([y.detach().clone(), x.grad.clone()] + [p.grad.clone() for p in layer.params])
        err = max(_rel_err(m, b) for m, b in zip(*got))
        return max(gather(self.rt, err))

    def ceiling(self, ceiling, ep, x, every, row_wire, slack) -> dict:
        """Time the ceiling on the bytes each rank sends to each peer (dispatch) and back (combine)."""
        R, rank, T = self.R, self.rank, self.timer
        pairs = [[e[slack]["pairs"][p] for p in range(R)] for e in every]
        to = [pairs[rank][p] * row_wire for p in range(R)]
        back = [pairs[p][rank] * row_wire for p in range(R)]
        sent = [sum(v for p, v in enumerate(pairs[r]) if p != r) * row_wire for r in range(R)]
        recvd = [sum(pairs[p][r] for p in range(R) if p != r) * row_wire for r in range(R)]
        if ceiling is not None:
            ceiling.set_bytes(to)
            d = T(ceiling)
            ceiling.set_bytes(back)
            c = T(ceiling)
            kind = "peer-store kernel over CUDA IPC"
        else:  # the host path: one transport all-to-all of the rows moonep sent, and back
            tr = ep.transport
            rows_to = [pairs[rank][p] for p in range(R)]
            rows_back = [pairs[p][rank] for p in range(R)]
            buf = torch.zeros(sum(rows_to), row_wire // self.es, dtype=self.dtype, device=x.device)
            d = T(lambda: tr.all_to_all(buf, rows_to, rows_back))
            buf2 = torch.zeros(sum(rows_back), row_wire // self.es, dtype=self.dtype, device=x.device)
            c = T(lambda: tr.all_to_all(buf2, rows_back, rows_to))
            kind = f"plain {tr.name} all-to-all of the same rows (a reference, not a bound)"
        mean_sent, mean_recv = sum(sent) / R, sum(recvd) / R
        return dict(kind=kind, dispatch_us=d.us, combine_us=c.us, dispatch_per_rank_us=d.per_rank_us,
                    bytes_per_rank=sent, mean_sent_bytes=mean_sent, mean_recv_bytes=mean_recv,
                    GBps=_sig(mean_sent / max(d.us, 1e-9) / 1e3),
                    combine_GBps=_sig(mean_recv / max(c.us, 1e-9) / 1e3))

    # -- phase 2: NVSHMEM all_to_all_vdev_2d ------------------------------------------------------------
    def run_symm(self, configs) -> None:
        rt, R, T = self.rt, self.R, self.timer
        reason = None
        for ci, cfg in enumerate(configs):
            s, H, E, K = cfg
            pts = [p for p in self.points if (p["tokens"], p["hidden"], p["experts"], p["topk"]) == cfg]
            if E % R or reason is not None:
                for p in pts:
                    p["symm_mem"] = dict(unavailable=reason or f"{E} experts do not divide over {R} ranks")
                    self.progress.step("symm_mem skipped")
                continue
            symm, err = None, None
            try:
                symm = SymmMemA2A(rt.group, R, E, K, s, H, self.dtype, rt.device)
            except Exception as exc:  # noqa: BLE001 - recorded, never fatal
                err = _brief(exc)
            errs = [e for e in gather(rt, err) if e]
            if errs:
                reason = errs[0]
                for p in pts:
                    p["symm_mem"] = dict(unavailable=reason)
                    self.progress.step("symm_mem unavailable")
                if rt.rank == 0:
                    self.emit(self.doc)
                continue
            x = self.tokens(ci, cfg)
            ref_cache = {}
            for p in pts:
                _, idx, w = self.routing(ci, cfg, p["placement"], p["maxvio_target"])
                ref_cache = (x.float() * w.sum(1, keepdim=True)).to(self.dtype)
                try:
                    d = T(lambda: symm.dispatch(x, idx))
                    ctx = d.out[1]
                    rows = symm.received_rows()
                    c = T(lambda: symm.combine(w, ctx))
                    rec = dict(dispatch_us=d.us, combine_us=c.us, note=symm.note,
                               recv_rows_per_rank=gather(rt, rows), check_rel_err=_rel_err(c.out, ref_cache))
                    meg = p.get("megatron", {})
                    rec["recv_rows_match_megatron"] = rec["recv_rows_per_rank"] == meg.get("recv_rows_per_rank")
                    for m in p.get("moonep", []):
                        m["vs_symm_dispatch"] = _sig(d.us / m["dispatch_us"], 3)
                        m["vs_symm_combine"] = _sig(c.us / m["combine_us"], 3)
                except Exception as exc:  # noqa: BLE001 - a rank that fails here may leave peers waiting
                    rec = dict(unavailable=_brief(exc))
                p["symm_mem"] = rec
                if rt.rank == 0:
                    self.emit(self.doc)
                self.progress.step(f"symm_mem, {_shape(cfg)}, {p['placement']}, maxvio {p['maxvio_target']:g}")
            del symm
            gc.collect()


DEFINITIONS = {
    "dispatch_us": "moonep: ep.dispatch (validation, counts exchange, planning, token exchange, local expansion); "
                   "Megatron: permute + counts exchange + device-to-host copy of the splits + all_to_all_single "
                   "+ regroup by local expert; symm_mem: permute + splits + all_to_all_vdev_2d",
    "combine_us": "identity experts; moonep: ep.combine; Megatron: un-regroup + all_to_all_single + weighted "
                  "scatter-add; symm_mem: all_to_all_vdev_2d_offset + weighted scatter-add",
    "prefetch_us": "ReplicaPool.fetch of three [epn, H, ffn] projections: the replica weights, pushed from "
                   "their home rank into the pool's slots (the home weights are used in place)",
    "dispatch_prefetch_us": "dispatch followed by the three prefetches, one timed region (MoonEP's accounting)",
    "time": "median over iters of the slowest rank; GPU: CUDA events, calls back to back; CPU: wall clock, "
            "barrier before each call",
    "logical_GBps": "tokens*K*H*bytes / time (the MoonEP / DeepEP v2 convention; can exceed the link)",
    "wire_bytes_per_rank": "moonep: rows sent to other ranks (one per token and destination rank) times "
                           "(H*bytes + 8*K bytes of row list and weights), mean over ranks; Megatron: every "
                           "remote copy times H*bytes",
    "dispatch_logical_bytes": "tokens*K*row bytes: H*bytes, or with --dispatch-dtype fp8 H e4m3 bytes plus "
                              "H/128 float32 scales (the wire rows add 8*K bytes of row list and weights)",
    "quant_rel_err_vs_token_dtype": "--dispatch-dtype fp8: relative error of combine(dequantised rows) against "
                                    "the token-dtype result (identity experts)",
    "wire_GBps": "wire_bytes_per_rank / time; dispatch_prefetch adds the replica weight bytes (mean per rank)",
    "efficiency": "time the ceiling needs for the same wire bytes / measured time; the ceiling's rate is "
                  "measured on the exact per-peer bytes of this point",
    "replicas": "occupied replica slots over all ranks; replica_weight_bytes = replicas * 3 * H * ffn * bytes",
    "maxvio": "achieved max_e(T_e / T_mean) - 1 of the global batch; maxvio_target is what the Zipf "
              "exponent was fitted to",
    "rank_load_max_over_mean": "copies homed on the most loaded rank over the mean (what a per-copy all-to-all "
                               "without replication receives)",
    "vs_megatron_*": "Megatron time / moonep time (> 1: moonep faster); vs_symm_* likewise",
    "dispatch_combine": "dispatch then combine (identity experts), moonep (first slack) and Megatron-style timed "
                        "alternately in every iteration; speedup: median over iterations of Megatron / moonep, "
                        "with its 25th and 75th percentiles",
    "layer": "train_*: router, dispatch, replica fetch (moonep), SwiGLU experts, combine, forward and backward "
             "(the replica gradient reduce included); inference_*: the same forward only; both paths timed "
             "alternately in every iteration, *_speedup the median per-iteration ratio Megatron / moonep; "
             "*_expert_us: each rank's expert GEMMs alone (forward), which follow its received rows; "
             "moonep's and the baseline's timed alternately, as the steps are",
}
