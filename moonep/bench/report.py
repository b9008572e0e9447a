"""Output of ``moonep-bench``: the tables (:mod:`moonep.bench.tables`), the JSON document, PNG charts."""
from __future__ import annotations

import json
import os
from pathlib import Path

from moonep.bench.tables import tables

__all__ = ["plot", "tables", "write_json"]


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
        if all("ceiling" in p for p in pts):
            ax.plot(mv, series(lambda p: p["ceiling"]["dispatch_us"]), "k:", label="ceiling (same wire bytes)")
        elif all("reference" in p for p in pts):
            ax.plot(mv, series(lambda p: p["reference"]["dispatch_us"]), "k:",
                    label="plain all-to-all of the same rows (not a bound)")
        ax.set_yscale("log")
        ax.set_xlabel("achieved maxvio")
        ax.set_ylabel("µs (median, slowest rank)")
        s, H, E, K, plc = key
        ax.set_title(f"{doc['ranks']} ranks{over}: {s} tok/rank, H={H}, top-{K} of {E}, {plc} hot experts",
                     fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3, which="both")
        ax = axes[row][1]
        if all("train_moonep_us" in p.get("layer", {}) for p in pts):
            ax.plot(mv, series(lambda p: p["layer"]["train_moonep_us"]), "o-", c="C0", label="moonep training step")
            ax.plot(mv, series(lambda p: p["layer"]["train_megatron_us"]), "o-", c="C3",
                    label="Megatron training step")
            ax.plot(mv, series(lambda p: p["layer"]["inference_moonep_us"]), "s:", c="C0", alpha=0.6,
                    label="moonep inference step")
            ax.plot(mv, series(lambda p: p["layer"]["inference_megatron_us"]), "s:", c="C3", alpha=0.6,
                    label="Megatron inference step")
            ax.plot(mv, series(lambda p: max(p["layer"]["megatron_expert_us"])), "v--", c="C3", alpha=0.6,
                    label="Megatron expert GEMMs (forward), most loaded rank")
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
        ax.set_title("MoE layer step: router, dispatch, experts, combine (training: + backward)", fontsize=9)
        ax.grid(alpha=0.3)
    fig.suptitle(f"moonep.bench  {doc.get('git_commit', '')[:12]}  {doc['device']}  {doc['dtype']}", fontsize=10)
    fig.tight_layout()
    png = path.with_suffix(".png")
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png
