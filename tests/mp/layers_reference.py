"""Dense single-process float64 LatentMoE written from the formulas (no moonep code), plus tiny MoE models."""
import torch
from torch import nn


def situ(g, u):
    return 4.0 * torch.tanh(g / 4.0) * torch.sigmoid(g) * 25.0 * torch.tanh(u / 25.0)


def dense_latent_moe(p: dict, x: torch.Tensor, topk: int, bias=None, eps: float = 1e-6):
    """``p``: full float64 parameters (state-dict names, may require grad); ``x [T, d]`` -> ``[T, d]``."""
    E = p["router.weight"].shape[0]
    s = torch.sigmoid(x @ p["router.weight"].T)                           # [T, E]
    b = torch.zeros(E, dtype=x.dtype) if bias is None else bias.to(x.dtype)
    sel = torch.topk(s.detach() + b, topk, dim=1).indices
    w = s.gather(1, sel)
    w = w / w.sum(1, keepdim=True)
    z = x @ p["down.weight"].T                                            # [T, l]
    u = torch.zeros_like(z)
    Fe = p["experts.w_out"].shape[1]
    for e in range(E):
        for k in range(topk):
            rows = (sel[:, k] == e).nonzero().squeeze(1)
            if rows.numel():
                gu = z[rows] @ p["experts.w_in"][e]
                out = situ(gu[:, :Fe], gu[:, Fe:]) @ p["experts.w_out"][e]
                u = u.index_add(0, rows, w[rows, k, None] * out)
    un = u * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + eps) * p["norm.weight"]
    y = un @ p["up.weight"].T
    Fs = p["shared_w_out"].shape[1]
    for j in range(p["shared_w_in"].shape[0]):
        gu = x @ p["shared_w_in"][j]
        y = y + situ(gu[:, :Fs], gu[:, Fs:]) @ p["shared_w_out"][j]
    return y


class PlainMoE(nn.Module):
    """A user-written MoE block: softmax router, top-k renormalised, a ModuleList of MLP experts."""

    def __init__(self, hidden, num_experts, topk, ffn):
        super().__init__()
        self.topk = topk
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden))
                                     for _ in range(num_experts))

    def forward(self, x):
        p = torch.softmax(self.router(x).float(), dim=-1)
        w, idx = torch.topk(p, self.topk, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        y = torch.zeros_like(x)
        for k in range(self.topk):
            for e, ex in enumerate(self.experts):
                m = idx[..., k] == e
                if m.any():
                    y[m] = y[m] + w[..., k][m, None] * ex(x[m])
        return y


class PlainLM(nn.Module):
    def __init__(self, vocab=32, hidden=16, num_experts=24, topk=3, ffn=20, layers=2):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(PlainMoE(hidden, num_experts, topk, ffn) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids):
        h = self.emb(ids)
        for b in self.blocks:
            h = h + b(torch.tanh(h))
        return self.head(h)


def tiny_hf(kind: str, num_experts: int = 24):
    """A randomly initialised tiny transformers MoE causal LM (no download), eager experts (float64-able)."""
    model = _tiny_hf(kind, num_experts)
    model.set_experts_implementation("eager")
    return model.eval()


def _tiny_hf(kind, num_experts):
    import transformers as tf

    common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, head_dim=8)
    if kind == "mixtral":
        cfg = tf.MixtralConfig(intermediate_size=24, num_local_experts=num_experts, num_experts_per_tok=2,
                               **common)
        return tf.MixtralForCausalLM(cfg)
    if kind == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(intermediate_size=48, moe_intermediate_size=16, num_experts=num_experts,
                                num_experts_per_tok=4, norm_topk_prob=True, **common)
        return tf.Qwen3MoeForCausalLM(cfg)
    if kind == "qwen2_moe":
        cfg = tf.Qwen2MoeConfig(intermediate_size=48, moe_intermediate_size=16, num_experts=num_experts,
                                num_experts_per_tok=3, norm_topk_prob=False, shared_expert_intermediate_size=24,
                                **common)
        return tf.Qwen2MoeForCausalLM(cfg)
    raise ValueError(kind)


class RoutedMoE(nn.Module):
    """A user-written MoE block with its own ``route`` method (for ``patch_generic``); ``kind`` is its routing:

    * ``"sigmoid_bias"``: sigmoid scores, experts chosen by score + a bias buffer, weights = the chosen
      scores renormalised times a scale (DeepSeek-V3 style);
    * ``"softmax"``: softmax top-k, not renormalised; ``"renorm"``: softmax top-k, renormalised;
    * ``"capacity"``: softmax top-1 where each expert takes at most ``capacity`` tokens (in order) and
      drops the rest, which ``route`` does not model: a routing patch_generic cannot reproduce.

    ``shared=True`` adds a shared expert MLP to every token.
    """

    def __init__(self, kind="renorm", hidden=16, num_experts=8, topk=2, ffn=12, shared=False, capacity=3):
        super().__init__()
        self.kind, self.topk, self.capacity = kind, (1 if kind == "capacity" else topk), capacity
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.register_buffer("score_bias", torch.linspace(-0.5, 0.5, num_experts))
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(hidden, ffn), nn.SiLU(), nn.Linear(ffn, hidden))
                                     for _ in range(num_experts))
        self.shared = nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden)) if shared else None

    def route(self, x):
        logits = self.router(x)
        if self.kind == "sigmoid_bias":
            s = torch.sigmoid(logits)
            idx = torch.topk(s.detach() + self.score_bias, self.topk, dim=-1).indices
            w = s.gather(-1, idx)
            return idx, 2.5 * w / w.sum(-1, keepdim=True)
        w, idx = torch.topk(torch.softmax(logits, dim=-1), self.topk, dim=-1)
        return idx, (w / w.sum(-1, keepdim=True) if self.kind == "renorm" else w)

    def forward(self, x):
        idx, w = self.route(x)
        if self.kind == "capacity":  # tokens past an expert's capacity are dropped
            pos = torch.zeros_like(idx)
            for e in range(len(self.experts)):
                m = idx == e
                pos[m] = torch.arange(int(m.sum()))
            w = w * (pos < self.capacity)
        y = torch.zeros_like(x)
        for k in range(self.topk):
            for e, ex in enumerate(self.experts):
                m = idx[:, k] == e
                if m.any():
                    y = y.index_add(0, m.nonzero().squeeze(1), w[m, k, None].to(x.dtype) * ex(x[m]))
        return y if self.shared is None else y + self.shared(x)
