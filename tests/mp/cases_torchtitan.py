"""torchtitan's MoE models with moonep against the same models with torchtitan's all-to-all dispatcher.

At every rank count N the models run at EP = N, at N = 2 also at EP = 1 (FSDP2 over both ranks) and at
N = 4 also at EP = 2 (a (dp, ep) mesh: the experts FSDP2-sharded over 2 ranks, moonep over the other 2):
the same weights, a different batch per rank, torchtitan's routing and load-balancing bias update (its
optimizer hook), four forward/backward passes with an SGD step after each of the first three (SGD: no
optimizer state, so that two Qwen3-MoE models of 316M parameters fit 4 ranks on 24 GB).  The losses
are compared at every pass, every parameter's full gradient after the first pass and after three steps,
and the expert biases after every step.

After each step the moonep model takes the reference model's parameters and buffers (once its own expert
biases were found equal): both models then continue from the same point.  Left to themselves they drift
apart by design, not by error: the experts compute in bfloat16 (torchtitan's GroupedExperts casts to it)
and a replica's weight gradient is computed on the rank holding the replica and added at home, where
torchtitan rounds one GEMM over all of an expert's rows, so expert weight gradients agree to bf16 rounding;
an optimizer step turns that into weight differences (AdamW, dividing a near-zero gradient by its own
magnitude, into lr-sized ones), which flip near-tie routings a few steps later (then a whole token's
contribution moves between experts).

Even within one pass the models are not bitwise equal: the experts cast their input to bf16, so an fp32
summation-order difference in one layer's output (moonep's combine against torchtitan's scatter-add) can
round a later layer's expert input differently, a bf16-level difference from there on, and a token whose
K-th and (K+1)-th router scores are that close can pick another expert in one model (a routing flip; on
CPU the router runs in the parameters' dtype: torch's CPU autocast has no float32).  The routers' choices
are therefore compared too: the gradients are compared in passes where no choice flipped; in the others
the flips must stay rare (MAX_FLIPS) and the losses equal; the figures record which passes were which.

Tolerances (max |a - b| / max |a| per parameter): expert weights to bf16 rounding; everything else to fp32
summation order with float32 parameters (plus the bf16 experts' rounding it flows through), bf16 rounding
with torchtitan's default bf16 mixed precision.

``MOONEP_TT_MODELS`` (comma-separated, default: every model) and ``MOONEP_TT_EP`` ("N" or "1,N") choose
what runs: CI runs a lean subset (tests/mp/test_mp_torchtitan.py).
"""
import gc
import os
import sys
import time

import torch
import torch.distributed as dist

from tests.harness.mp import SkipCase

SkipCase = getattr(sys.modules.get("__main__"), "SkipCase", SkipCase)  # noqa: F811  (mprun's own class)

# max |a - b| / max |a| per parameter, by parameter kind and FSDP2 param dtype
TOL = {("float32", "experts"): 2e-2, ("float32", "other"): 1e-2,
       ("bfloat16", "experts"): 5e-2, ("bfloat16", "other"): 5e-2}
LOSS_TOL = {"float32": 1e-5, "bfloat16": 2e-3}
MAX_FLIPS = 0.05  # of the token choices of a pass (see the module's doc); GPT-OSS on CPU: bf16 router, up to 2 %
STEPS, LR, BATCH, SEQ = 4, 0.1, 2, 32
# FSDP2 param dtype per model: float32 (tighter) where torchtitan's own model takes it; GPT-OSS's experts
# return bf16 whatever the activations' dtype, which torchtitan's all-to-all combine refuses under float32.
PARAM_DTYPE = {"gpt_oss": "bfloat16"}


def _tt():
    try:
        from tests.harness import torchtitan as tt
        import torchtitan  # noqa: F401
    except ImportError as exc:
        raise SkipCase(f"torchtitan is not installed (scripts/setup.sh installs it): {exc}")
    return tt


def _models(tt):
    names = os.environ.get("MOONEP_TT_MODELS")
    return names.split(",") if names else list(tt.MODELS)


def _eps(rt):
    env = os.environ.get("MOONEP_TT_EP")
    if env:
        return [int(e) for e in env.split(",") if int(e) <= rt.world_size and rt.world_size % int(e) == 0]
    # EP = 1 with FSDP2 over 2 ranks; EP = 2 on 4 ranks: experts FSDP-sharded over the other 2 (efsdp)
    return {2: [1, 2], 4: [2, 4]}.get(rt.world_size, [rt.world_size])


def _sum(rt, x) -> float:
    t = torch.tensor(float(x), dtype=torch.float64)
    if rt.world_size > 1:
        dist.all_reduce(t, group=rt.group)
    return float(t)


def _watch_routing(model) -> list:
    """A list that each forward of ``model`` appends every MoE layer's chosen experts to (``[B, L, K]``,
    sorted per token)."""
    seen = []
    for layer in model.layers.values():
        if getattr(layer, "moe_enabled", False):
            def hook(mod, args, out):
                ids = out[1].to_local() if hasattr(out[1], "to_local") else out[1]
                seen.append(ids.detach().sort(-1).values)
            layer.moe.router.register_forward_hook(hook)
    return seen


def _flips(a: list, b: list) -> tuple:
    """(token choices routed differently, token choices) over the layers of one forward of each model."""
    assert len(a) == len(b)
    return sum(int((x != y).any(-1).sum()) for x, y in zip(a, b)), sum(x[..., 0].numel() for x in a)


def _mean(rt, t: torch.Tensor) -> float:
    t = t.detach().double().clone()
    if rt.world_size > 1:
        dist.all_reduce(t, group=rt.group)
    return float(t) / rt.world_size


def _loss(model, step: int, rank: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=g)
    out = model(ids[:, :-1])
    return torch.nn.functional.cross_entropy(out.float().reshape(-1, out.shape[-1]), ids[:, 1:].reshape(-1))


def _compare(ref, mine, pdt: str, what: str) -> dict:
    """Every parameter's full gradient, one parameter at a time (Qwen3-MoE's 316M would not fit twice per
    rank on 4 ranks); returns the worst error by kind.  Collective (the gathers)."""
    full = lambda g: (g.full_tensor() if hasattr(g, "full_tensor") else g).float()  # noqa: E731
    pa, pb = dict(ref.named_parameters()), dict(mine.named_parameters())
    assert pa.keys() == pb.keys(), (what, sorted(set(pa) ^ set(pb)))
    worst = {}
    for n, p in pa.items():
        assert (p.grad is None) == (pb[n].grad is None), f"{what}: {n} has a gradient in one model only"
        if p.grad is None:  # a parameter the loss does not reach (in both models)
            continue
        a, b = full(p.grad), full(pb[n].grad)
        kind = "experts" if ".inner_experts." in n else "other"
        err = float((a - b).abs().max() / a.abs().max().clamp_min(1e-30))
        assert err <= TOL[(pdt, kind)], f"{what}: gradient of {n} differs by {err:.2e} (of its max)"
        worst[kind] = max(worst.get(kind, 0.0), err)
    return worst


def _biases(model) -> torch.Tensor:
    full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # noqa: E731
    return torch.stack([full(layer.moe.expert_bias_E) for layer in model.layers.values()
                        if getattr(layer, "moe_enabled", False)])


def run_pair(rt, tt, name: str, ep: int, pdt: str, log=None) -> dict:
    """Both models of ``name`` at ``ep``: losses and gradients compared; returns the figures."""
    ref, dims, spec = tt.build(name, ep, param_dtype=pdt)
    mine, _, _ = tt.build(name, ep, moonep=True, param_dtype=pdt)
    assert type(mine.layers[str(len(mine.layers) - 1)].moe.routed_experts).__name__ == "MoonepRoutedExperts"
    mine.load_state_dict(ref.state_dict())
    vocab = ref.tok_embeddings.num_embeddings
    opts = []
    for m in (ref, mine):
        opts.append(torch.optim.SGD(m.parameters(), lr=LR))
        spec.post_optimizer_build_fn(opts[-1], [m], dims)  # torchtitan's expert-bias update, as in training
    rec = dict(model=name, ep=ep, world=rt.world_size, param_dtype=pdt, losses=[], grad_err=[], routing_flips=[])
    routes = [_watch_routing(m) for m in (ref, mine)]
    for step in range(STEPS):
        losses = []
        for m, seen in zip((ref, mine), routes):
            seen.clear()
            loss = _loss(m, step, rt.rank, vocab)
            loss.backward()
            losses.append(_mean(rt, loss))
        rel = abs(losses[1] - losses[0]) / abs(losses[0])
        what = f"{name} EP={ep} {pdt} step {step}"
        assert rel <= LOSS_TOL[pdt], f"{what}: loss {losses[1]} (moonep) against {losses[0]} (all-to-all)"
        rec["losses"].append(losses)
        flipped, total = (_sum(rt, n) for n in _flips(*routes))  # summed over the ranks: one decision
        rec["routing_flips"].append([int(flipped), int(total)])
        assert flipped <= MAX_FLIPS * total, f"{what}: {flipped} of {total} token choices routed differently"
        if step in (0, STEPS - 1):  # after one pass, and after three optimizer steps
            # a flipped near-tie moves a whole token between experts: gradients compared where none flipped
            rec["grad_err"].append(_compare(ref, mine, pdt, what) if flipped == 0 else None)
        for o in opts:
            o.step()
            o.zero_grad()
        if flipped == 0:  # torchtitan's bias update saw the same expert loads
            assert torch.equal(_biases(ref), _biases(mine)), f"{what}: the expert biases moved differently"
        mine.load_state_dict(ref.state_dict())  # continue from the same point (see the module's doc)
    del ref, mine, opts, routes
    gc.collect()  # FSDP modules hold reference cycles: free this pair before the next is built
    if log is not None:
        log.append(rec)
    return rec


def case_torchtitan_models_match_the_all_to_all_dispatcher(rt):
    tt = _tt()
    log = []
    for name in _models(tt):
        for ep in _eps(rt):
            pdt = os.environ.get("MOONEP_TT_DTYPE") or PARAM_DTYPE.get(name, "float32")
            t0 = time.perf_counter()
            rec = run_pair(rt, tt, name, ep, pdt, log)
            rec["seconds"] = round(time.perf_counter() - t0, 1)
            if rt.rank == 0:
                sys.stderr.write(f"[rank 0] {name} EP={ep} {pdt}: loss rel. diff "
                                 f"{max(abs(a - b) / abs(a) for a, b in rec['losses']):.1e}, gradient diff "
                                 f"{rec['grad_err']}, routing flips {rec['routing_flips']}, {rec['seconds']} s\n")
    out = os.environ.get("MOONEP_TT_RECORD")  # the full run's figures, for benchmarks/results
    if out and rt.rank == 0:
        import json

        from moonep.bench.provenance import git_commit, machine

        path = out.replace("{N}", str(rt.world_size))
        with open(path, "w") as f:
            json.dump(dict(what="torchtitan debug models, moonep against the all-to-all dispatcher, CPU gloo ranks",
                           command=" ".join(f"{k}={os.environ[k]}" for k in ("MOONEP_TT_FULL", "MOONEP_TT_MODELS",
                                                                            "MOONEP_TT_EP", "MOONEP_TT_RECORD")
                                            if k in os.environ) + " python -m pytest tests/mp/test_mp_torchtitan.py",
                           commit=git_commit(), machine=machine(),
                           tolerances={f"{k[0]} {k[1]}": v for k, v in TOL.items()}, loss_tolerance=LOSS_TOL,
                           records=log), f, indent=1)

