"""Output of ``python -m moonep.bench``: NCCL-tests-style tables, the JSON document, PNG charts."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path


def _f(v, fmt="{:.0f}", width=8):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-".rjust(width)
    return fmt.format(v).rjust(width)


def _key(p):
    return f"{p['tokens']:>6} {p['hidden']:>6} {p['experts']:>4} {p['topk']:>3} {p['placement'][:4]:>4} " \
           f"{p['maxvio_target']:>5g} {_f(p.get('maxvio'), '{:.2f}', 6)}"


_KEYHDR = f"{'tokens':>6} {'hidden':>6} {'E':>4} {'K':>3} {'plc':>4} {'mvtgt':>5} {'maxvio':>6}"


def tables(doc) -> str:
    """Two tables: moonep per point and slack; baselines and the layer step per point."""
    out = []
    m = doc.get("machine", {})
    gpu = f" {m.get('gpu')} x{m.get('gpus')}" if m.get("gpu") else f" {m.get('cpu')} {m.get('cores')} cores"
    over = "  (OVERSUBSCRIBED: several ranks per GPU)" if doc.get("oversubscribed") else ""
    out.append(f"# moonep.bench  ranks {doc['ranks']}  device {doc['device']}{gpu}  transport "
               f"{doc.get('transport')}  {doc['dtype']}  Megatron on {doc.get('megatron_backend')}{over}")
    out.append(f"# commit {doc.get('git_commit')}  ceiling: {doc.get('ceiling_kind')}  "
               f"times: median of the slowest rank, us")
    out.append("#")
    out.append("# moonep (dispatch includes planning; d+p = dispatch + prefetch of 3 [H, ffn] projections)")
    out.append(f"# {_KEYHDR} {'slack':>5} {'repl':>5} {'repl_MB':>8} {'rcv_max':>8} {'disp_us':>8} "
               f"{'pref_us':>8} {'d+p_us':>8} {'comb_us':>8} {'d_logGB':>8} {'c_logGB':>8} {'d_wireGB':>8} "
               f"{'eff_d':>6} {'eff_c':>6} {'eff_dp':>6} {'xMeg_d':>6} {'xMeg_c':>6} {'xSym_d':>6} {'xSym_c':>6}")
    for p in doc["points"]:
        if "skipped" in p:
            out.append(f"  {_key(p)}  skipped: {p['skipped']}")
            continue
        for r in p.get("moonep", []):
            out.append(
                f"  {_key(p)} {r['slack']:>5g} {r['replicas']:>5} {_f(r['replica_weight_bytes'] / 1e6, '{:.1f}')} "
                f"{r['recv_rows_max']:>8} {_f(r['dispatch_us'])} {_f(r.get('prefetch_us'))} "
                f"{_f(r.get('dispatch_prefetch_us'))} {_f(r['combine_us'])} "
                f"{_f(r['dispatch_logical_GBps'], '{:.1f}')} {_f(r['combine_logical_GBps'], '{:.1f}')} "
                f"{_f(r['dispatch_wire_GBps'], '{:.1f}')} {_f(r.get('dispatch_efficiency'), '{:.2f}', 6)} "
                f"{_f(r.get('combine_efficiency'), '{:.2f}', 6)} {_f(r.get('dispatch_prefetch_efficiency'), '{:.2f}', 6)} "
                f"{_f(r['vs_megatron_dispatch'], '{:.2f}', 6)} {_f(r['vs_megatron_combine'], '{:.2f}', 6)} "
                f"{_f(r.get('vs_symm_dispatch'), '{:.2f}', 6)} {_f(r.get('vs_symm_combine'), '{:.2f}', 6)}")
    out.append("#")
    out.append("# baselines and the MoE layer step (layer: dispatch [+prefetch] + SwiGLU experts + combine; "
               "expert_us: each rank's GEMMs alone, max/min over ranks)")
    out.append(f"# {_KEYHDR} {'megD_us':>8} {'megC_us':>8} {'meg_rows':>13} {'symD_us':>8} {'symC_us':>8} "
               f"{'ceilD_us':>8} {'ceilGB/s':>8} {'moonL_us':>8} {'megL_us':>8} {'xL':>5} "
               f"{'moon_exp_us':>13} {'meg_exp_us':>13}")
    for p in doc["points"]:
        if "skipped" in p:
            continue
        g, sy, ce, ly = p.get("megatron", {}), p.get("symm_mem", {}), p.get("ceiling", {}), p.get("layer", {})
        rows = f"{g.get('recv_rows_max')}/{g.get('recv_rows_min')}"
        me = ly.get("moonep_expert_us")
        ge = ly.get("megatron_expert_us")
        me = f"{max(me):.0f}/{min(me):.0f}" if me else "-"
        ge = f"{max(ge):.0f}/{min(ge):.0f}" if ge else "-"
        out.append(f"  {_key(p)} {_f(g.get('dispatch_us'))} {_f(g.get('combine_us'))} {rows:>13} "
                   f"{_f(sy.get('dispatch_us'))} {_f(sy.get('combine_us'))} {_f(ce.get('dispatch_us'))} "
                   f"{_f(ce.get('GBps'), '{:.1f}')} {_f(ly.get('moonep_us'))} {_f(ly.get('megatron_us'))} "
                   f"{_f(ly.get('speedup'), '{:.2f}', 5)} {me:>13} {ge:>13}")
    notes = sorted({p["symm_mem"]["unavailable"] for p in doc["points"] if "unavailable" in p.get("symm_mem", {})})
    for n in notes:
        out.append(f"# symm_mem unavailable: {n}")
    notes = sorted({p["symm_mem"].get("note") for p in doc["points"] if p.get("symm_mem", {}).get("note")})
    for n in notes:
        out.append(f"# symm_mem: {n}")
    skipped = sorted({p["layer"]["skipped"] for p in doc["points"] if "skipped" in p.get("layer", {})})
    for n in skipped:
        out.append(f"# prefetch/layer {n}")
    return "\n".join(out)


def write_json(doc, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(path)


def plot(doc, path: Path) -> Path:
    """One row of two panels per (config, placement): times vs achieved maxvio, and the layer step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict = {}
    for p in doc["points"]:
        if "skipped" in p or "moonep" not in p:
            continue
        groups.setdefault((p["tokens"], p["hidden"], p["experts"], p["topk"], p["placement"]), []).append(p)
    n = max(len(groups), 1)
    fig, axes = plt.subplots(n, 2, figsize=(13, 4.2 * n), squeeze=False)
    over = " (oversubscribed)" if doc.get("oversubscribed") else ""
    for row, (key, pts) in enumerate(groups.items()):
        pts = sorted(pts, key=lambda p: p.get("maxvio", 0))
        mv = [p.get("maxvio", p["maxvio_target"]) for p in pts]
        ax = axes[row][0]
        slacks = sorted({r["slack"] for p in pts for r in p["moonep"]})

        def series(get):
            return [get(p) for p in pts]

        def first(p, sl):
            return next(r for r in p["moonep"] if r["slack"] == sl)

        s0 = slacks[0]
        ax.plot(mv, series(lambda p: first(p, s0)["dispatch_us"]), "o-", c="C0", label="moonep dispatch")
        ax.plot(mv, series(lambda p: first(p, s0)["combine_us"]), "s-", c="C1", label="moonep combine")
        if all("dispatch_prefetch_us" in first(p, s0) for p in pts):
            for k, sl in enumerate(slacks):
                ax.plot(mv, series(lambda p: first(p, sl)["dispatch_prefetch_us"]), "^" + ["--", ":", "-."][k % 3],
                        c="C0", alpha=0.8, label=f"moonep dispatch+prefetch, slack {sl:g}")
        ax.plot(mv, series(lambda p: p["megatron"]["dispatch_us"]), "o-", c="C3", label="Megatron dispatch")
        ax.plot(mv, series(lambda p: p["megatron"]["combine_us"]), "s-", c="C5", label="Megatron combine")
        if all("dispatch_us" in p.get("symm_mem", {}) for p in pts):
            ax.plot(mv, series(lambda p: p["symm_mem"]["dispatch_us"]), "o-", c="C2", label="symm_mem dispatch")
            ax.plot(mv, series(lambda p: p["symm_mem"]["combine_us"]), "s-", c="C8", label="symm_mem combine")
        ax.plot(mv, series(lambda p: p["ceiling"]["dispatch_us"]), "k:", label="ceiling (same wire bytes)")
        ax.set_yscale("log")
        ax.set_xlabel("achieved maxvio")
        ax.set_ylabel("µs (median, slowest rank)")
        s, H, E, K, plc = key
        ax.set_title(f"{doc['ranks']} ranks{over}: {s} tok/rank, H={H}, top-{K} of {E}, {plc} hot experts",
                     fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3, which="both")
        ax = axes[row][1]
        if all("moonep_us" in p.get("layer", {}) for p in pts):
            ax.plot(mv, series(lambda p: p["layer"]["moonep_us"]), "o-", c="C0", label="moonep layer step")
            ax.plot(mv, series(lambda p: p["layer"]["megatron_us"]), "o-", c="C3", label="Megatron layer step")
            ax.plot(mv, series(lambda p: max(p["layer"]["megatron_expert_us"])), "v--", c="C3", alpha=0.6,
                    label="Megatron expert GEMMs, most loaded rank")
            ax.plot(mv, series(lambda p: min(p["layer"]["megatron_expert_us"])), "^--", c="C3", alpha=0.4,
                    label="Megatron expert GEMMs, least loaded rank")
            ax.plot(mv, series(lambda p: max(p["layer"]["moonep_expert_us"])), "v--", c="C0", alpha=0.6,
                    label="moonep expert GEMMs, slowest rank")
            ax.set_ylabel("µs")
            ax2 = ax.twinx()
            ax2.plot(mv, series(lambda p: p["megatron"]["recv_rows_max"] / max(p["megatron"]["recv_rows_min"], 1)),
                     "k:", label="Megatron rows max/min (right)")
            ax2.set_ylabel("received rows, max/min over ranks")
            ax2.legend(fontsize=7, loc="lower right")
            ax.legend(fontsize=7, loc="upper left")
        else:
            ax.text(0.5, 0.5, "layer step not run", ha="center", transform=ax.transAxes)
        ax.set_xlabel("achieved maxvio")
        ax.set_title("MoE layer step: dispatch + experts + combine", fontsize=9)
        ax.grid(alpha=0.3)
    fig.suptitle(f"moonep.bench  {doc.get('git_commit', '')[:12]}  {doc['device']}  {doc['dtype']}", fontsize=10)
    fig.tight_layout()
    png = path.with_suffix(".png")
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png
