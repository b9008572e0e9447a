"""Every MoE model type of the installed transformers, patched with :func:`patch_hf_moe` and compared
with the unpatched model: it must match, or be refused at patch time.

    python -m moonep.integrations.hf_survey                      # one process: the table
    mpiexec -n 2 python -m moonep.integrations.hf_survey --markdown   # 2 ranks, as a README table

Per type (tiny random float32 config, :mod:`moonep.integrations.hf_tiny`): every rank builds the same
model and feeds its own batch. Compared with the unpatched model: the logits (eval mode), and the
gradients of one training step (train mode, the same random seed before each batch), the unpatched ones
averaged over the ranks' batches, the patched ones completed by :func:`moonep.training.sync_grads`
(expert shards against their home rows). ``matched`` means both differences are within :data:`RTOL` of
the largest reference value (per parameter, with a floor of 1e-3 of the largest gradient): fp32
round-off from the order of the sums. ``refused``: patch_hf_moe raised at patch time. ``not built``: the
unpatched tiny model itself does not build or run, so the type is not tested.
"""
from __future__ import annotations

import argparse
import copy
import time
from dataclasses import dataclass

import torch

from ..guard import GATHER
from ..training.grads import all_reduce_grads
from .hf import EPDenseExperts, EPExperts, find_moe_modules, patch_hf_moe

RTOL = 1e-4      # |patched - unpatched| <= RTOL * max|unpatched|, logits and every gradient
SEQ, STEP_SEED = 6, 500
MAX_TOKENS = 4 * SEQ * 2   # static capacity (no per-call all-reduce): 2 sequences, Llama-4's top-k rows


@dataclass
class Row:
    """One model type's outcome: ``status`` is matched / refused / MISMATCH / FAILED / not built."""

    model_type: str
    status: str
    reason: str = ""
    logits_diff: float = float("nan")
    grad_diff: float = float("nan")
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status in ("matched", "refused", "not built")


def _batch(r: int):
    g = torch.Generator().manual_seed(100 + r)
    ids = torch.randint(0, 64, (1 + r % 2, SEQ), generator=g)
    return ids, torch.randn(*ids.shape, 64, generator=g)


def _run(model, ids, proj, train: bool, r: int):
    """Output of ``model`` on ``ids`` (``[B, S, V]`` logits or ``[B, S, H]`` hidden states) and, in
    training, the loss ``mean(output * proj)`` with the RNG seeded per batch (dropout, router jitter)."""
    model.train(train)
    torch.manual_seed(STEP_SEED + r)
    kw = dict(input_ids=ids, use_cache=False)
    if getattr(model.config, "is_encoder_decoder", False):
        kw["decoder_input_ids"] = ids
    out = model(**kw)
    y = out.logits if getattr(out, "logits", None) is not None else out[0]
    return y, (y.float() * proj[..., :y.shape[-1]]).mean()


def _rel(a, b, floor: float = 1e-30) -> float:
    """``max|a - b| / max(max|b|, floor)``."""
    return float((a.detach() - b.detach()).abs().max() / b.detach().abs().max().clamp_min(floor)) if b.numel() else 0.0


def _gather_max(rt, v: float) -> float:
    if rt is None or rt.world_size == 1:
        return v
    every = rt.host.all_gather_object(v if v == v else float("inf"), code=GATHER, what="the survey's figures")
    return max(every)


def _mean_over_ranks(model, rt) -> None:
    """Average every gradient of the unpatched ``model`` over the ranks (as DDP does), missing ones as zeros."""
    if rt is None or rt.world_size == 1:
        return
    all_reduce_grads(list(model.parameters()), rt, average=True)


def _grad_diff(ref, model, rt) -> float:
    """Largest relative gradient difference; expert shards against their home rows of the reference."""
    refp = dict(ref.named_parameters())
    owner = {}
    for name, m in model.named_modules():
        if isinstance(m, EPExperts):
            for p in m.sharded_params:
                owner[f"{name}.{p}"] = m
    # a parameter whose gradient is round-off (a router that hash routing never uses) is measured against
    # 1e-3 of the largest gradient of the model, not against its own noise
    floor = 1e-3 * max(float(p.grad.abs().max()) for p in ref.parameters() if p.grad is not None)
    worst = 0.0
    for k, p in model.named_parameters():
        want = refp[k].grad if refp[k].grad is not None else torch.zeros_like(refp[k])
        got = p.grad if p.grad is not None else torch.zeros_like(p)
        got = got.to_local() if hasattr(got, "to_local") else got
        if k in owner:
            m = owner[k]
            lo = m.moonep_rank * m.moonep_epn
            want = want[lo:lo + m.moonep_epn]
        worst = max(worst, _rel(got, want, floor))
    return worst


def check_type(model_type: str, class_name: str, rt=None) -> Row | None:
    """Patch ``model_type``'s tiny model over ``rt`` (``None``: one process) and compare; ``None`` when its
    model holds no MoE block. Collective: every rank calls it for the same types in the same order."""
    from . import hf_tiny
    from ..training import sync_grads

    t0 = time.perf_counter()
    rank = 0 if rt is None else rt.rank
    try:
        ref = hf_tiny.build(model_type, class_name)
    except Exception as e:  # the same on every rank: the tiny config is not one this type accepts
        return Row(model_type, "not built", f"{type(e).__name__}: {str(e).splitlines()[0][:120]}")
    if not any(find_moe_modules(ref)):
        return None
    ids, proj = _batch(rank)
    why = None
    try:
        with torch.no_grad():
            want, _ = _run(ref, ids, proj, False, rank)
    except Exception as e:  # the unpatched tiny model itself does not run
        why = f"unpatched forward: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    if _gather_max(rt, float(why is not None)):  # every rank moves on together
        return Row(model_type, "not built", why or "unpatched forward failed on another rank")
    model = copy.deepcopy(ref)
    try:
        patch_hf_moe(model, rt, max_tokens=MAX_TOKENS)
    except ValueError as e:
        return Row(model_type, "refused", str(e).split(f"{model_type!r}: ", 1)[-1],
                   seconds=time.perf_counter() - t0)
    row = Row(model_type, "matched", describe(model))
    try:
        with torch.no_grad():
            got, _ = _run(model, ids, proj, False, rank)
        row.logits_diff = _rel(got, want)
        _run(ref, ids, proj, True, rank)[1].backward()
        _mean_over_ranks(ref, rt)   # the reference gradient: averaged over every rank's batch
        _run(model, ids, proj, True, rank)[1].backward()
        sync_grads(model)
        row.grad_diff = _grad_diff(ref, model, rt)
    except Exception as e:
        row.status, row.reason = "FAILED", f"{type(e).__name__}: {str(e)[:200]}"
    row.logits_diff, row.grad_diff = _gather_max(rt, row.logits_diff), _gather_max(rt, row.grad_diff)
    if row.status == "matched" and not (row.logits_diff <= RTOL and row.grad_diff <= RTOL):
        row.status = "MISMATCH"
    _close(model)
    row.seconds = time.perf_counter() - t0
    return row


def describe(model) -> str:
    """The experts layouts of a patched model, in words (the table's reason column for matched types)."""
    out = []
    for m in model.modules():
        if isinstance(m, EPExperts):
            gate = getattr(type(m), "_apply_gate", None)
            words = ["dense (Llama-4)" if isinstance(m, EPDenseExperts) else "routed",
                     "transposed" if m.moonep_transposed else "",
                     "biases" if any(n.endswith("_bias") for n in m.sharded_params) else "",
                     "no gate" if not m.moonep_gated else
                     "own gate" if gate is not None and gate.__name__ != "_default_apply_gate" else "",
                     "post-expert norm" if getattr(m, "has_post_expert_norm", False) else ""]
            d = ", ".join(w for w in words if w)
            if d not in out:
                out.append(d)
    return "; ".join(out)


def _close(model) -> None:
    """Close the ExpertParallel instances of a patched model (its collectives end with it)."""
    done = set()
    for m in model.modules():
        prov = getattr(m, "moonep_ep", None) if isinstance(m, EPExperts) else None
        if prov is not None and id(prov) not in done:
            done.add(id(prov))
            for ep in prov._cache.values():
                ep.close()


def survey(rt=None, types=None) -> list[Row]:
    """:func:`check_type` over every discovered type (or ``types``), MoE-less types left out."""
    from .hf_tiny import moe_model_types

    rows, threads = [], torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: intra-op threads only add synchronisation
    try:
        for t, cls in moe_model_types():
            if types is None or t in types:
                row = check_type(t, cls, rt)
                if row is not None:
                    rows.append(row)
    finally:
        torch.set_num_threads(threads)
    return rows


def table(rows, markdown: bool = False, ranks: int = 1) -> str:
    """The rows as text (or a Markdown table with the transformers version and world size above)."""
    import transformers

    def fmt(v):
        return "-" if v != v else f"{v:.1e}"

    head = ["model type", "result", f"max rel. logits diff (R={ranks})", "max rel. grad diff", "reason"]
    body = [[r.model_type, r.status, fmt(r.logits_diff), fmt(r.grad_diff), r.reason] for r in rows]
    if markdown:
        counts = {}
        for r in rows:
            counts[r.status] = counts.get(r.status, 0) + 1
        summary = ", ".join(f"{n} {s}" for s, n in counts.items())
        lines = [f"transformers {transformers.__version__}, {len(rows)} MoE model types, {ranks} rank(s), "
                 f"tolerance {RTOL:g} relative: {summary}", "",
                 "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(c.replace("|", "/") for c in b) + " |" for b in body]
        return "\n".join(lines)
    w = [max(len(str(c)) for c in col) for col in zip(head, *body)]
    return "\n".join("  ".join(str(c).ljust(n) for c, n in zip(b, w[:-1] + [0])) for b in [head] + body)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m moonep.integrations.hf_survey",
                                description="Patch every MoE model type of the installed transformers with "
                                            "moonep and compare it with the unpatched model.")
    p.add_argument("--markdown", action="store_true", help="print a Markdown table (for the README)")
    p.add_argument("types", nargs="*", help="only these model types (default: every one found)")
    args = p.parse_args(argv)
    from ..layers.parallel import resolve_group

    rt = resolve_group(None)
    rows = survey(rt, set(args.types) or None)
    if rt is None or rt.rank == 0:
        print(table(rows, args.markdown, 1 if rt is None else rt.world_size), flush=True)
    if rt is not None:
        rt.shutdown()
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
