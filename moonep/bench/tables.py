"""The tables ``moonep-bench`` prints from a run's JSON document.

Headings are words with their unit underneath, rows are the points of the sweep, and a legend under each
table says what every column is. Columns with no value in the document (the GPU-only baseline on CPU
ranks, fields an older JSON lacks) are left out and named under the legend.
"""
from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass
from typing import Callable


def _sig3(v) -> str:
    """Three significant digits without an exponent (GB/s spans 0.001 on CPU to 1000s on GPUs)."""
    if v == 0 or abs(v) >= 100:
        return f"{v:.0f}"
    return f"{v:.{max(0, 2 - math.floor(math.log10(abs(v))))}f}"


US, RATIO = "{:.0f}", "{:.2f}"


@dataclass(frozen=True)
class Col:
    """A column: ``head`` (words, ``\\n`` between heading lines), ``unit`` (shown under it), ``get(point,
    row)`` its value (``row``: the moonep record of one slack, or the point itself), ``fmt`` a format
    string or function, ``legend`` what the value is."""

    head: str
    unit: str
    get: Callable
    fmt: object
    legend: str

    @property
    def name(self) -> str:
        return self.head.replace("\n", " ") + (f" ({self.unit})" if self.unit else "")

    def cell(self, point, row) -> str:
        try:
            v = self.get(point, row)
        except (KeyError, TypeError, ValueError, ZeroDivisionError):  # a field this document lacks
            v = None
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return "-"
        return self.fmt(v) if callable(self.fmt) else self.fmt.format(v)


@dataclass(frozen=True)
class Table:
    title: str
    per_slack: bool  # one row per (point, moonep slack); else one row per point
    cols: tuple


def _m(key):
    return lambda p, r: r[key]


def _meg(key):
    return lambda p, r: p["megatron"][key]


def _lay(key, pick=None):
    return (lambda p, r: p["layer"][key]) if pick is None else (lambda p, r: pick(p["layer"][key]))


def _paired(field, prefix, moonep, megatron):
    """The four columns of a paired timing: ``p[field][prefix + "moonep_us"]`` and so on (see
    :meth:`moonep.bench.suite.Timer.paired`); ``moonep``, ``megatron``: (heading, legend) of the two times."""
    def get(key):
        return lambda p, r: p[field][prefix + key]

    def spread(p, r):
        return f"{p[field][prefix + 'speedup_p25']:.2f}-{p[field][prefix + 'speedup_p75']:.2f}"

    return (Col(moonep[0], "us", get("moonep_us"), US, moonep[1]),
            Col(megatron[0], "us", get("megatron_us"), US, megatron[1]),
            Col("speed-up", "x", get("speedup"), RATIO,
                "median over iterations of Megatron's time / moonep's, both timed in every iteration"),
            Col("speed-up\n25th-75th\npercentile", "x", spread, "{}", "the spread of that ratio"))


KEY = (
    Col("placement", "", lambda p, r: p["placement"], "{}",
        "where the popular experts live: on random ranks, or clustered on rank 0"),
    Col("maxvio\ntarget", "", lambda p, r: p["maxvio_target"], "{:g}",
        "the routing imbalance asked for: max over experts of (copies routed to it / mean copies) - 1"),
    Col("maxvio\nachieved", "", lambda p, r: p["maxvio"], "{:.2f}",
        "the same measure on the routing generated (the whole batch, all ranks)"),
)
SLACK = Col("slack", "", lambda p, r: r["slack"], "{:g}",
            "moonep's allowed receive imbalance: 0, every rank receives the same rows; 0.05, at most 5% above "
            "the mean, with fewer replicas")

TABLES = (
    Table("moonep: time per call", True, (
        Col("replicas", "", _m("replicas"), "{}", "expert replicas placed this step, over all ranks"),
        Col("replica\nweights", "MB", lambda p, r: r["replica_weight_bytes"] / 1e6, "{:.1f}",
            "bytes of the replicas' three [hidden, ffn] projections, over all ranks"),
        Col("most rows\nreceived", "rows", _m("recv_rows_max"), "{}",
            "token copies received by the most loaded rank (at slack 0 every rank receives the same)"),
        Col("dispatch", "us", _m("dispatch_us"), US,
            "ep.dispatch: input checks, counts exchange, planning, token exchange"),
        Col("prefetch", "us", _m("prefetch_us"), US,
            "ep.prefetch of three [hidden, ffn] expert projections into the replica slots"),
        Col("dispatch\n+ prefetch", "us", _m("dispatch_prefetch_us"), US, "both, one timed region"),
        Col("combine", "us", _m("combine_us"), US,
            "ep.combine: expert outputs (identity experts) back to their tokens, weighted and summed"),
    )),
    Table("moonep: bandwidth", True, (
        Col("dispatch\nlogical", "GB/s", _m("dispatch_logical_GBps"), _sig3,
            "tokens x top-k x hidden x bytes per element / dispatch time (the convention of MoonEP and "
            "DeepEP; it can exceed the link)"),
        Col("combine\nlogical", "GB/s", _m("combine_logical_GBps"), _sig3, "the same over combine time"),
        Col("dispatch\nwire", "GB/s", _m("dispatch_wire_GBps"), _sig3,
            "bytes a rank sends to other ranks (rows and routing metadata, mean over ranks) / dispatch time"),
        Col("combine\nwire", "GB/s", _m("combine_wire_GBps"), _sig3, "the same bytes / combine time"),
    )),
    Table("moonep: speed relative to the ceiling and the baselines (above 1: moonep faster)", True, (
        Col("dispatch\nvs\nceiling", "x", _m("dispatch_efficiency"), RATIO,
            "the ceiling's time for the same wire bytes / moonep's dispatch time (1: as fast as the ceiling)"),
        Col("combine\nvs\nceiling", "x", _m("combine_efficiency"), RATIO, "the same for combine"),
        Col("dispatch\n+ prefetch\nvs ceiling", "x", _m("dispatch_prefetch_efficiency"), RATIO,
            "the same for dispatch + prefetch, replica weight bytes included"),
        Col("dispatch\nvs\nMegatron", "x", _m("vs_megatron_dispatch"), RATIO,
            "Megatron-style dispatch time / moonep's"),
        Col("combine\nvs\nMegatron", "x", _m("vs_megatron_combine"), RATIO, "Megatron-style combine time / moonep's"),
        Col("dispatch\nvs\nsymm_mem", "x", _m("vs_symm_dispatch"), RATIO, "symm_mem dispatch time / moonep's"),
        Col("combine\nvs\nsymm_mem", "x", _m("vs_symm_combine"), RATIO, "symm_mem combine time / moonep's"),
    )),
    Table("dispatch + combine against the Megatron-style path, timed alternately in every iteration", False,
          _paired("dispatch_combine", "",
                  ("moonep\ndispatch\n+ combine", "ep.dispatch then ep.combine (identity experts), the first slack"),
                  ("Megatron\ndispatch\n+ combine", "the same on the Megatron-style path"))),
    Table("baselines: Megatron-style all-to-all, PyTorch symm_mem, ceiling (GPU) or reference (CPU)", False, (
        Col("Megatron\ndispatch", "us", _meg("dispatch_us"), US,
            "permute, counts to the host, all-to-all of every token copy, regroup by local expert"),
        Col("Megatron\ncombine", "us", _meg("combine_us"), US, "un-regroup, all-to-all back, weighted sum"),
        Col("Megatron\nmost rows\nreceived", "rows", _meg("recv_rows_max"), "{}",
            "token copies received by its most loaded rank"),
        Col("Megatron\nfewest rows\nreceived", "rows", _meg("recv_rows_min"), "{}",
            "token copies received by its least loaded rank"),
        Col("symm_mem\ndispatch", "us", lambda p, r: p["symm_mem"]["dispatch_us"], US,
            "torch.ops.symm_mem.all_to_all_vdev_2d with its permute (GPU, NVSHMEM)"),
        Col("symm_mem\ncombine", "us", lambda p, r: p["symm_mem"]["combine_us"], US,
            "all_to_all_vdev_2d_offset and the weighted sum"),
        Col("ceiling\ndispatch", "us", lambda p, r: p["ceiling"]["dispatch_us"], US,
            "moving moonep's wire bytes at the hardware's pace (see 'ceiling' in the header)"),
        Col("ceiling\nrate", "GB/s", lambda p, r: p["ceiling"]["GBps"], _sig3,
            "mean bytes a rank sends / ceiling dispatch time"),
        Col("reference\ndispatch", "us", lambda p, r: p["reference"]["dispatch_us"], US,
            "CPU ranks: moonep's wire rows through the transport's plain all-to-all (not a bound)"),
        Col("reference\ncombine", "us", lambda p, r: p["reference"]["combine_us"], US, "the same rows back"),
    )),
    Table("MoE layer training step: router, dispatch, replica fetch (moonep), SwiGLU experts, combine, "
          "forward and backward", False, _paired(
              "layer", "train_",
              ("moonep\ntraining\nstep", "the step on moonep, the replica gradient reduce included"),
              ("Megatron\ntraining\nstep",
               "the same step on the Megatron-style path (differentiable all_to_all_single)")) + (
        Col("paths\nagree", "rel. err", _lay("train_check_rel_err"), "{:.1e}",
            "largest relative difference between the paths' outputs and gradients"),
    )),
    Table("MoE layer inference step: the same, forward only", False, _paired(
        "layer", "inference_", ("moonep\ninference\nstep", "forward only, on moonep"),
        ("Megatron\ninference\nstep", "forward only, on the Megatron-style path")) + (
        Col("moonep\nexperts\nslowest", "us", _lay("moonep_expert_us", max), US,
            "the expert GEMMs alone (forward) on the slowest rank (they follow its received rows; timed "
            "alternately with the Megatron-style ones)"),
        Col("moonep\nexperts\nfastest", "us", _lay("moonep_expert_us", min), US, "the same on the fastest rank"),
        Col("Megatron\nexperts\nslowest", "us", _lay("megatron_expert_us", max), US,
            "the expert GEMMs alone on the Megatron-style path's slowest rank"),
        Col("Megatron\nexperts\nfastest", "us", _lay("megatron_expert_us", min), US, "the same on its fastest rank"),
    )),
)
GAP = "  "


def _shape(p) -> str:
    return f"{p['tokens']} tokens per rank, hidden {p['hidden']}, top-{p['topk']} of {p['experts']} experts"


def _legend(cols, nkeys: int, first: bool, dropped) -> list[str]:
    """Every column's name and meaning; the row-key columns in full under the first table only."""
    out = ["#  legend:"]
    keys = cols[:nkeys]
    width = max(len(c.name) for c in cols) + 2
    if not first:
        out.append(f"#    {', '.join(c.name for c in keys)}: as in the first table")
    for c in cols if first else cols[len(keys):]:
        text = textwrap.wrap(c.legend, 110 - width) or [""]
        out.append(f"#    {c.name.ljust(width)}{text[0]}")
        out += [f"#    {' ' * width}{t}" for t in text[1:]]
    if dropped:
        text = textwrap.wrap(f"not in this run: {', '.join(c.name for c in dropped)}", 110, subsequent_indent="  ")
        out += [f"#    {t}" for t in text]
    return out


def render(table: Table, points, first: bool) -> list[str]:
    """One table: title, headings, a sub-heading per configuration, rows, legend."""
    rows = [(p, r) for p in points if "skipped" not in p
            for r in (p.get("moonep", []) if table.per_slack else [p])]
    measured = [c for c in table.cols if any(c.cell(p, r) != "-" for p, r in rows)]
    dropped = [c for c in table.cols if c not in measured]
    cols = list(KEY) + ([SLACK] if table.per_slack else []) + measured
    heads = [c.head.split("\n") for c in cols]
    depth = max(len(h) for h in heads)
    heads = [[""] * (depth - len(h)) + h for h in heads]  # bottom-aligned over the unit line
    units = [f"({c.unit})" if c.unit else "" for c in cols]
    cells = {id(r): [c.cell(p, r) for c in cols] for p, r in rows}
    widths = [max([len(u)] + [len(x) for x in h] + [len(cells[id(r)][i]) for _, r in rows])
              for i, (h, u) in enumerate(zip(heads, units))]

    def line(items, lead):
        return (lead + GAP.join(x.rjust(w) for x, w in zip(items, widths))).rstrip()

    out = [f"# {table.title}"]
    out += [line([h[k] for h in heads], "# ") for k in range(depth)]
    if any(units):
        out.append(line(units, "# "))
    shape = None
    for p in points:
        if _shape(p) != shape:
            shape = _shape(p)
            out.append(f"# -- {shape}")
        if "skipped" in p:
            out.append(line([c.cell(p, p) for c in KEY], "  ") + f"{GAP}skipped: {p['skipped']}")
            continue
        for r in (p.get("moonep", []) if table.per_slack else [p]):
            out.append(line(cells[id(r)], "  "))
    return out + _legend(cols, len(cols) - len(measured), first, dropped)


def _header(doc) -> list[str]:
    m, cfg = doc.get("machine", {}), doc.get("config", {})
    where = f"{m.get('gpu')} x{m.get('gpus')}" if m.get("gpu") else f"{m.get('cpu')}, {m.get('cores')} cores"
    over = " (OVERSUBSCRIBED: several ranks per GPU)" if doc.get("oversubscribed") else ""
    iters = f"{cfg['iters']} timed calls" if "iters" in cfg else "the timed calls"
    return [f"# moonep-bench: {doc['ranks']} ranks on {doc['device']} ({where}){over}, {doc['dtype']}",
            f"# moonep transport: {doc.get('transport') or '-'}; Megatron-style path on "
            f"{doc.get('megatron_backend') or '-'}; "
            + (f"ceiling: {doc['ceiling_kind']}" if doc.get("ceiling_kind") else
               f"reference: {doc.get('reference_kind') or '-'}"),
            f"# commit {doc.get('git_commit') or '-'}, {doc.get('time') or '-'}",
            f"# times: median over {iters} of the slowest rank, in microseconds (us)"]


def tables(doc) -> str:
    """Every table of a run's document (an older document's missing fields show as "-" or drop out)."""
    pts = doc.get("points", [])
    out = _header(doc)
    for i, t in enumerate(TABLES):
        out += ["#"] + render(t, pts, i == 0)
    notes = sorted({p["symm_mem"]["unavailable"] for p in pts if "unavailable" in p.get("symm_mem", {})})
    notes = [f"# symm_mem unavailable: {n}" for n in notes]
    notes += [f"# symm_mem: {n}" for n in sorted({p["symm_mem"].get("note") for p in pts
                                                  if p.get("symm_mem", {}).get("note")})]
    notes += [f"# prefetch and layer step {n}" for n in sorted({p["layer"]["skipped"] for p in pts
                                                                if "skipped" in p.get("layer", {})})]
    return "\n".join(out + (["#"] + notes if notes else []))
