"""Models and loops for the training-stack cases: each patched model next to the same unpatched model.

``pair(kind, rt)`` builds the unpatched model and its patched twin from the same seed on every rank:
tiny transformers MoE causal LMs (Mixtral, DeepSeek-V3, Qwen3-MoE, GPT-OSS) and a stack of LatentMoE
layers (its "unpatched" twin holds every expert on every rank: a one-rank runtime, no expert parallelism).
"""
import torch
import torch.distributed as dist
from torch import nn

import moonep
from moonep.balance import normalise_topk
from moonep.runtime import local_runtime

HF_KINDS = ("mixtral", "deepseek_v3", "qwen3_moe", "gpt_oss")
KINDS = HF_KINDS + ("latent",)
VOCAB, SEQ, BATCH = 64, 6, 2


class LatentLM(nn.Module):
    """Embedding, ``layers`` residual LatentMoE blocks, a head: a language model of LatentMoE layers."""

    def __init__(self, group, layers: int = 2, d: int = 32, num_experts: int = 8, device="cpu", **kw):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d, device=device)
        self.layers = nn.ModuleList(
            moonep.LatentMoE(d, d // 2, num_experts, 2, 24, num_shared=1, d_shared=16, group=group, balancer=None,
                             device=device, **kw) for _ in range(layers))
        self.head = nn.Linear(d, VOCAB, bias=False, device=device)

    def forward(self, input_ids, labels=None):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = x + layer(x)
        logits = self.head(x)
        out = type("Out", (), {})()
        out.logits = logits
        out.loss = None if labels is None else nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, VOCAB).float(), labels[:, 1:].reshape(-1))
        return out


def hf_class(kind: str) -> str:
    from moonep.integrations import hf_tiny

    return dict(hf_tiny.moe_model_types())[kind]


def unpatched(kind: str, seed: int = 0, eager: bool = False, dtype=torch.float32, device="cpu"):
    """The unpatched model of ``kind`` in ``dtype`` on ``device``, train mode, identical on every rank.
    ``eager``: the transformers experts' eager implementation (F.linear per expert; forced for float64, which
    the default grouped_mm implementation does not take)."""
    if kind == "latent":
        torch.manual_seed(seed)
        return LatentLM(local_runtime(device), device=device).to(dtype).train()
    from moonep.integrations import hf_tiny

    m = hf_tiny.build(kind, hf_class(kind), seed=seed).to(device=device, dtype=dtype)
    if eager or dtype == torch.float64:
        m.set_experts_implementation("eager")
    return m.train()


def patched(kind: str, rt, seed: int = 0, eager: bool = False, dtype=torch.float32, device=None, **kw):
    """The same model with moonep expert parallelism over ``rt`` (a Runtime or a mesh; prepared for DDP),
    on ``device`` (default: ``rt``'s)."""
    device = device or getattr(rt, "device", None) or "cpu"
    if kind == "latent":
        torch.manual_seed(seed)
        model = LatentLM(rt, max_tokens=BATCH * SEQ * 4, device=device, **kw).to(device=device, dtype=dtype)
        return moonep.training.prepare(model.train())
    from moonep.integrations import patch_hf_moe

    return patch_hf_moe(unpatched(kind, seed, eager, dtype, device), rt, max_tokens=BATCH * SEQ * 4, **kw)


def batch(step: int, rank: int, world: int = 1, *, global_batch: bool = False, device="cpu"):
    """int64 ``[BATCH, SEQ]`` token ids of ``rank`` at ``step``; ``global_batch``: the rows of one global batch
    of ``4 * BATCH`` sequences split evenly over ``world`` ranks (the same data at any ``world``)."""
    if global_batch:
        g = torch.Generator().manual_seed(1000 + step)
        ids = torch.randint(0, VOCAB, (4 * BATCH, SEQ), generator=g)
        n = 4 * BATCH // world
        return ids[rank * n:(rank + 1) * n].to(device)
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g).to(device)


def loss_of(model, ids):
    return model(input_ids=ids, labels=ids).loss


def mean_over_ranks(rt, v: torch.Tensor) -> float:
    t = v.detach().double().reshape(1).cpu()
    dist.all_reduce(t, group=rt.cpu_group)
    return float(t) / rt.world_size


def full_params(model) -> dict:
    """Every parameter as one process would hold it (DDP's ``module.`` prefix dropped; collective)."""
    inner = model.module if hasattr(model, "module") else model
    return {k: v.detach().double() for k, v in moonep.training.full_state_dict(inner).items()
            if k in dict(inner.named_parameters())}


def full_grads(model) -> dict:
    """Every parameter's gradient, full (DTensors gathered; collective), by parameter name."""
    inner = model.module if hasattr(model, "module") else model
    out = {}
    for k, p in inner.named_parameters():
        g = p.grad
        if g is None:
            g = torch.zeros(p.shape, dtype=p.dtype)
        elif hasattr(g, "full_tensor"):
            g = moonep.training.sharding.full_tensor(g)
        out[k] = g.detach().double().cpu()
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12)) if b.numel() else 0.0


def assert_close_dicts(got: dict, want: dict, tol: float, what: str) -> None:
    assert got.keys() == want.keys(), (what, sorted(set(got) ^ set(want)))
    worst = max(((rel(got[k], want[k]), k) for k in want), default=(0.0, None))
    assert worst[0] <= tol, f"{what}: {worst[1]} differs by {worst[0]:.3g} (relative; tolerance {tol})"


def twins(kind: str, rt, seed: int = 0, eager: bool = False, dtype=torch.float32, **kw):
    """``(unpatched, patched)`` models of ``kind`` with the same weights, on ``rt``'s device."""
    return unpatched(kind, seed, eager, dtype, rt.device), patched(kind, rt, seed, eager, dtype, **kw)


def blocks(model):
    """The transformer blocks of a model (HF ``model.model.layers``, LatentLM ``layers``)."""
    inner = model.module if hasattr(model, "module") else model
    return inner.layers if isinstance(inner, LatentLM) else inner.model.layers


def route_as(ref, mine) -> dict:
    """Make the LatentLM ``mine`` route each token to the experts that ``ref`` chose for it in the same call
    (``ref`` runs its forwards first, ``mine`` the same ones after). Returns the running counts ``{"tokens":
    routed by mine, "flips": those that would have chosen other experts on their own, "pending": ref's
    routings not replayed yet}``: check them after training.

    In bf16 two models that differ only in round-off still pick different top-k experts for a token whose
    k-th and (k+1)-th scores are within a rounding. That token's gradients then differ by O(1), which is not
    round-off. Both models route as LatentMoE does without a balancer (its own score helpers, top-k, weights
    normalised), and the weights stay differentiable functions of each model's own scores."""
    from moonep.layers.latent_moe import _project, _sigmoid

    chosen = []
    stats = {"tokens": 0, "flips": 0, "pending": chosen}

    def select(layer, x, replay):
        scores = _sigmoid(_project(layer.router, x))
        w, idx = scores.topk(layer.topk, dim=1)
        if replay:
            want = chosen.pop(0)
            stats["tokens"] += idx.shape[0]
            stats["flips"] += int((idx.sort(1).values != want.sort(1).values).any(1).sum())
            idx, w = want, scores.gather(1, want)
        else:
            chosen.append(idx)
        return idx, normalise_topk(w), None

    for model, replay in ((ref, False), (mine, True)):
        for layer in blocks(model):
            assert layer.balancer is None
            layer._select = lambda x, layer=layer, replay=replay: select(layer, x, replay)
    return stats
