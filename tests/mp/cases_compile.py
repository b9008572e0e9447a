"""torch.compile of moonep (the custom ops of moonep/ops.py) against eager, on every rank.

CPU (host backends, float64): a plain MoE function through the ops compiled with inductor is bitwise equal to
the eager ExpertParallel path; a LatentMoE compiled with ``aot_eager`` and with inductor gives bitwise the
eager output, ``x``'s gradient and the parameter gradients (its own math runs as eager runs it:
moonep/eager_math.py); token counts differ per rank (0 included) and change between steps (recompiles); the
graph breaks are counted with ``torch._dynamo.explain``.  A patched transformers Mixtral block likewise,
under ``aot_eager`` and inductor (its router and the experts' activation run as eager runs them).  The
bitwise comparisons compile inside ``moonep.eager_math.bitwise()``; the default (the layer's math fused by
inductor) is compared within the dtype's tolerance.

CUDA (``MOONEP_TEST_DEVICE=cuda``, NVLink backend, float32; tests/gpu/test_mp_compile_gpu.py): the same with
``fullgraph=True``, plus CUDA graphs (``backend="cudagraphs"`` and ``mode="reduce-overhead"``: bitwise) with
new routing every step.
"""
import contextlib
import importlib.util
import sys
import time

import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend

import moonep
from moonep import eager_math, ops
from moonep.layers import LatentMoE
from tests.harness.mp import SkipCase

D, L, K, FE, FS = 12, 6, 3, 10, 4
H, F = 16, 24


def _cuda(rt):
    return rt.device.type == "cuda"


def _dtype(rt):
    return torch.float32 if _cuda(rt) else torch.float64  # the NVLink kernels move no float64


def _sizes(R, step, graphs=False):
    """Tokens per rank at ``step``: different on every rank, 0 on one rank (R > 1), changing every step.

    ``graphs`` (CUDA graphs): the same count on every rank, repeated, so that each graph is warmed up, then
    recorded and replayed, with a new count between.  The ranks must go through warm-up, recording and
    replay together: a replay runs no Python, so it skips the host-side call-order check (the order board)
    that a peer warming up or recording would wait for."""
    if graphs:
        return [(12, 12, 12, 9, 12)[step % 5]] * R
    base = [16, 17, 9, 5, 12, 3, 7, 11]
    sizes = [base[(r + step) % len(base)] for r in range(R)]
    if R > 1:
        sizes[step % R] = 0
    return sizes


def _routing(rt, s, E, seed):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(s)]) if s else \
        torch.zeros(0, 2, dtype=torch.int64)
    return idx.to(rt.device), torch.rand(s, 2, generator=g, dtype=_dtype(rt)).to(rt.device)


def _equal(name, got, want, ctx):
    assert got.shape == want.shape and torch.equal(got, want), \
        f"{name} {ctx}: max diff {(got.double() - want.double()).abs().max().item() if got.numel() else 0}"


# CUDA graphs with new token counts every step: one static graph per count (dynamic=False).  torch's CUDA graph
# trees key their recordings of a dynamic-shape graph on its int inputs only, and moonep's graphs take the token
# count as a tensor size: a recording would be replayed for another count (a size-mismatch error).
_REDUCE_OVERHEAD = dict(mode="reduce-overhead", fullgraph=True, dynamic=False)
_CUDAGRAPHS = dict(backend="cudagraphs", fullgraph=True, dynamic=False)


def _check_results(names, got, want, ctx: str, exact: bool = True) -> None:
    """A compiled step's output and gradients (``got``) against eager's, by name: bitwise (``exact``), else
    within the dtype's tolerance (the layer's math fused by inductor, the default)."""
    for name, a, b in zip(names, got, want):
        if exact:
            _equal(name, a, b, ctx)
        else:
            tol = {} if a.dtype == torch.float64 else dict(rtol=1e-4, atol=1e-4)  # float32: a layer's sums
            torch.testing.assert_close(a, b, msg=lambda m, name=name: f"{name} {ctx}: {m}", **tol)


def _breaks(fn, *args):
    """Dynamo graph breaks of ``fn(*args)`` (runs it once: collective)."""
    torch._dynamo.reset()
    return torch._dynamo.explain(fn)(*args).graph_break_count


# --------------------------------------------------------------------------------------------- plain MoE
def _moe(rt, apply_weights="combine"):
    """``y = combine(slot_matmul(dispatch(x), prefetch(W)))``, eagerly and through the ops."""
    R, dt = rt.world_size, _dtype(rt)
    E = 2 * R
    ep = moonep.ExpertParallel(rt, num_experts=E, topk=2, hidden=H, max_tokens=20, dtype=dt,
                               apply_weights=apply_weights)
    g = torch.Generator().manual_seed(5)
    W = torch.randn(E, H, H, generator=g, dtype=dt)[rt.rank * 2:rt.rank * 2 + 2].to(rt.device).requires_grad_()

    def eager(x, idx, w):
        h = ep.dispatch(x, idx, w)
        return ep.combine(moonep.slot_matmul(h.tokens, h.cu_seqlens, ep.prefetch(h, W)), h)

    def through_ops(x, idx, w):
        h = ops.dispatch(ep, x, idx, w)
        return ops.combine(ops.slot_matmul(h.tokens, h.cu_seqlens, ops.prefetch(h, W)), h)

    return ep, W, eager, through_ops


def _moe_step(rt, fn, W, s, seed):
    g = torch.Generator().manual_seed(1000 + seed)
    x = torch.randn(s, H, generator=g, dtype=_dtype(rt)).to(rt.device).requires_grad_()
    idx, w = _routing(rt, s, 2 * rt.world_size, seed)
    w.requires_grad_()
    W.grad = None
    y = fn(x, idx, w)
    y.square().sum().backward()
    return y.detach(), x.grad, w.grad, W.grad


def _compare_moe(rt, compiled, tag, graphs=False, apply_weights="combine"):
    _, W, eager, through_ops = _moe(rt, apply_weights)
    fn = compiled(through_ops)
    for step in range(5 if graphs else 3):
        s = _sizes(rt.world_size, step, graphs)[rt.rank]
        want = _moe_step(rt, eager, W, s, step)
        with eager_math.bitwise():
            got = _moe_step(rt, fn, W, s, step)
        for name, a, b in zip(("y", "dx", "dw", "dW"), got, want):
            _equal(name, a, b, f"{tag} rank {rt.rank} step {step} s={s}")
    return through_ops


def case_moe_function_compiled_matches_eager(rt):
    """Inductor (CPU) / fullgraph inductor (CUDA): bitwise equal to eager, recompiling as counts change;
    no graph break."""
    torch._dynamo.reset()
    cnt = CompileCounterWithBackend("inductor")
    through_ops = _compare_moe(rt, lambda f: torch.compile(f, backend=cnt, fullgraph=True), "inductor")
    assert cnt.frame_count >= 2, f"expected a recompilation when the token counts change, got {cnt.frame_count}"
    s = _sizes(rt.world_size, 0)[rt.rank]
    idx, w = _routing(rt, s, 2 * rt.world_size, 0)
    n = _breaks(through_ops, torch.randn(s, H, dtype=_dtype(rt), device=rt.device), idx, w)
    assert n == 0, f"graph breaks: {n}"


def case_moe_function_scaled_at_dispatch(rt):
    """apply_weights="dispatch" through the ops, fullgraph under aot_eager: the op moves the rows unscaled and
    the graph scales them, so output and gradients (the weights' through the product) are eager's, bitwise."""
    if not _cuda(rt) and rt.world_size != 2:
        raise SkipCase("CPU: the compile time is paid at 2 ranks only")
    torch._dynamo.reset()
    _compare_moe(rt, lambda f: torch.compile(f, backend="aot_eager", fullgraph=True), "aot_eager, scaled",
                 apply_weights="dispatch")


def case_fp8_dispatch_compiled(rt):
    """fp8 dispatch (float32 tokens quantised in the send) through the eager API under aot_eager with
    fullgraph=True: fp8 rows out of moonep::dispatch, dequantised in the graph, the gradient straight through;
    output and gradients bitwise eager's, token counts changing per rank and step (0 included)."""
    if not _cuda(rt) and rt.world_size != 2:
        raise SkipCase("CPU: the compile time is paid at 2 ranks only")
    torch._dynamo.reset()
    Hq, E, dt = 128, 2 * rt.world_size, torch.float32
    ep = moonep.ExpertParallel(rt, num_experts=E, topk=2, hidden=Hq, max_tokens=20, dtype=dt,
                               dispatch_dtype=torch.float8_e4m3fn)
    g = torch.Generator().manual_seed(7)
    W = (torch.randn(E, Hq, Hq, generator=g, dtype=dt) * 0.05)[rt.rank * 2:rt.rank * 2 + 2].to(rt.device)
    W.requires_grad_()

    def layer(x, idx, w):
        h = ep.dispatch(x, idx, w)
        return ep.combine(moonep.slot_matmul(h, h.cu_seqlens, ep.prefetch(h, W)), h)

    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    for step in range(3):
        s = _sizes(rt.world_size, step)[rt.rank]
        got = []
        for fn in (layer, compiled):
            gx = torch.Generator().manual_seed(3000 + step)
            x = torch.randn(s, Hq, generator=gx, dtype=dt).to(rt.device).requires_grad_()
            idx, w = _routing(rt, s, E, step)
            w = w.to(dt).requires_grad_()
            W.grad = None
            y = fn(x, idx, w)
            y.square().sum().backward()
            got.append((y.detach(), x.grad, w.grad, W.grad))
        for name, a, b in zip(("y", "dx", "dw", "dW"), *got):
            _equal(name, b, a, f"fp8 aot_eager rank {rt.rank} step {step} s={s}")
    ep.close()


def case_moe_function_cuda_graphs(rt):
    """CUDA only: the ops under CUDA graphs with new routing every step (cudagraphs backend: bitwise)."""
    if not _cuda(rt):
        raise SkipCase("CUDA graphs: CUDA only")
    torch._dynamo.reset()
    _compare_moe(rt, lambda f: torch.compile(f, **_CUDAGRAPHS), "cudagraphs", graphs=True)


# --------------------------------------------------------------------------------------------- LatentMoE
def _layer(rt, E, max_tokens):
    torch.manual_seed(3)  # the same parameters in every layer built here
    return LatentMoE(D, L, E, K, FE, num_shared=2, d_shared=FS, group=rt, dtype=_dtype(rt), max_tokens=max_tokens)


def _layer_step(rt, m, s, seed):
    g = torch.Generator().manual_seed(2000 + seed)
    x = torch.randn(s, D, generator=g, dtype=_dtype(rt)).to(rt.device).requires_grad_()
    m.zero_grad()
    y = m(x)
    y.square().sum().backward()
    return [y.detach(), x.grad] + [p.grad for _, p in m.named_parameters()], dict(m.last_stats)


def _compare_modules(rt, pair, step_fn, compile_fn, tag: str, steps: int, warmup: bool, graphs: bool,
                     exact: bool = True):
    """An eager module against a compiled copy (``pair``: the two, the same weights) over ``steps`` steps of
    changing counts: ``step_fn(rt, m, s, seed) -> (results, stats)``, the results checked by
    :func:`_check_results` (``exact``: compiled inside ``eager_math.bitwise()``), the stats (routing, plan,
    replicas) equal.  Returns the module compiled."""
    eager, mod = pair
    if warmup:  # builds the module's ExpertParallel eagerly (fullgraph needs it to exist)
        step_fn(rt, eager, 4, 99)
        step_fn(rt, mod, 4, 99)
    compiled = compile_fn(mod)
    names = ["y", "dx"] + ["d" + n for n, _ in mod.named_parameters()]
    for step in range(steps):
        s = _sizes(rt.world_size, step, graphs)[rt.rank]
        want, st_want = step_fn(rt, eager, s, step)
        t0 = time.perf_counter()
        with eager_math.bitwise() if exact else contextlib.nullcontext():
            got, st_got = step_fn(rt, compiled, s, step)
        # a rank's (re)compile time is spent before its first collective of the step: the log shows the skew
        print(f"[rank {rt.rank}] {tag} step {step} s={s}: compiled step {time.perf_counter() - t0:.1f}s",
              file=sys.stderr, flush=True)
        ctx = f"{tag} rank {rt.rank} step {step} s={s}"
        for k in st_want:
            _equal(f"stats[{k}]", st_got[k], st_want[k], ctx)
        _check_results(names, got, want, ctx, exact)
    return mod


def _compare_layer(rt, compile_fn, max_tokens, tag: str, steps=3, warmup=False, graphs=False, exact=True):
    """Eager ``LatentMoE`` vs a compiled copy (its ``last_stats`` too); returns the compiled module."""
    E = 2 * rt.world_size if rt.world_size > 1 else 4
    return _compare_modules(rt, (_layer(rt, E, max_tokens), _layer(rt, E, max_tokens)), _layer_step, compile_fn,
                            tag, steps, warmup, graphs, exact)


def case_latent_moe_aot_eager_bitwise(rt):
    """aot_eager (the custom ops and AOTAutograd, no codegen): bitwise output and parameter gradients;
    graph breaks: 1 with max_tokens=None (the max all-reduce of the token counts), 0 with it fixed."""
    if _cuda(rt):
        raise SkipCase("CPU only: on CUDA case_latent_moe_inductor checks aot_eager with fullgraph=True")
    for max_tokens, want_breaks in ((None, 1), (20, 0)):
        torch._dynamo.reset()
        cnt = CompileCounterWithBackend("aot_eager")
        mod = _compare_layer(rt, lambda m: torch.compile(m, backend=cnt), max_tokens, f"max_tokens={max_tokens}",
                             steps=3 if max_tokens is None else 2)
        assert cnt.frame_count >= 2, f"expected recompilations when the counts change, got {cnt.frame_count}"
        s = _sizes(rt.world_size, 1)[rt.rank]
        n = _breaks(mod, torch.randn(s, D, dtype=_dtype(rt), device=rt.device))
        assert n == want_breaks, f"max_tokens={max_tokens}: {n} graph breaks, expected {want_breaks}"


def case_latent_moe_inductor(rt):
    """Inductor: bitwise equal to eager inside ``eager_math.bitwise()`` (output, ``dx``, every parameter's
    gradient, the routing), and by default (fused) within tolerance with the same routing; on CUDA
    fullgraph=True, then CUDA graphs, bitwise through the cudagraphs backend and with reduce-overhead."""
    cuda = _cuda(rt)
    if not cuda and rt.world_size != 2:
        raise SkipCase("CPU: inductor's compile time is paid at 2 ranks only")
    torch._dynamo.reset()
    _compare_layer(rt, lambda m: torch.compile(m, fullgraph=cuda), 20, "inductor", steps=2, warmup=cuda)
    torch._dynamo.reset()
    _compare_layer(rt, lambda m: torch.compile(m, fullgraph=cuda), 20, "inductor fused", steps=2, warmup=cuda,
                   exact=False)
    if not cuda:
        return
    torch._dynamo.reset()
    _compare_layer(rt, lambda m: torch.compile(m, backend="aot_eager", fullgraph=True), 20, "aot_eager",
                   warmup=True)
    torch._dynamo.reset()
    _compare_layer(rt, lambda m: torch.compile(m, **_CUDAGRAPHS), 20, "cudagraphs", steps=5, warmup=True,
                   graphs=True)
    torch._dynamo.reset()
    _compare_layer(rt, lambda m: torch.compile(m, **_REDUCE_OVERHEAD), 20, "reduce-overhead", steps=5,
                   warmup=True, graphs=True)


# --------------------------------------------------------------------------------------------- HF Mixtral
def _mixtral_blocks(rt):
    """Two patched copies (eager, to compile) of a tiny Mixtral's first sparse MoE block, the same weights."""
    from moonep.integrations import patch_hf_moe
    from tests.mp.layers_reference import tiny_hf

    blocks = []
    for _ in range(2):
        torch.manual_seed(41)
        model = tiny_hf("mixtral", num_experts=4 * rt.world_size).to(_dtype(rt)).to(rt.device)
        patch_hf_moe(model, rt, max_tokens=20)
        blocks.append(model.model.layers[0].mlp)
    return blocks


def _block_step(rt, m, s, seed):
    g = torch.Generator().manual_seed(3000 + seed)
    x = torch.randn(1, s, 32, generator=g, dtype=_dtype(rt)).to(rt.device).requires_grad_()
    m.zero_grad()
    y = m(x)
    y.square().sum().backward()
    return [y.detach(), x.grad] + [p.grad for _, p in m.named_parameters()], {}


def _compare_block(rt, compile_fn, tag: str, steps=3, graphs=False, exact=True):
    """Eager patched Mixtral block vs a compiled copy; returns the compiled module."""
    return _compare_modules(rt, _mixtral_blocks(rt), _block_step, compile_fn, tag, steps, True, graphs, exact)


def case_hf_mixtral_block(rt):
    """A patched transformers Mixtral sparse MoE block compiled with fullgraph=True: bitwise output, ``dx`` and
    parameter gradients under aot_eager, no graph break; under inductor too (CPU at 2 ranks; inside
    ``eager_math.bitwise()`` the router and the experts' activation run as eager runs them:
    moonep/integrations/hf_router.py, hf_experts.py), and by default (fused) within tolerance; on CUDA also
    CUDA graphs (cudagraphs backend and reduce-overhead, bitwise)."""
    if importlib.util.find_spec("transformers") is None:
        raise SkipCase("transformers is not installed (pip install -e .[hf])")
    torch._dynamo.reset()
    mod = _compare_block(rt, lambda m: torch.compile(m, backend="aot_eager", fullgraph=True), "aot_eager")
    s = _sizes(rt.world_size, 1)[rt.rank]
    n = _breaks(mod, torch.randn(1, s, 32, dtype=_dtype(rt), device=rt.device))
    assert n == 0, f"graph breaks: {n}"
    if not _cuda(rt) and rt.world_size != 2:
        return  # CPU: inductor's compile time is paid at 2 ranks only
    torch._dynamo.reset()
    _compare_block(rt, lambda m: torch.compile(m, fullgraph=True), "inductor", steps=2)
    torch._dynamo.reset()  # the default: the router and activation fused by inductor, within tolerance
    _compare_block(rt, lambda m: torch.compile(m, fullgraph=True), "inductor fused", steps=2, exact=False)
    if not _cuda(rt):
        return
    torch._dynamo.reset()
    _compare_block(rt, lambda m: torch.compile(m, **_CUDAGRAPHS), "cudagraphs", steps=5, graphs=True)
    torch._dynamo.reset()
    _compare_block(rt, lambda m: torch.compile(m, **_REDUCE_OVERHEAD), "reduce-overhead", steps=5,
                   graphs=True)


def case_hf_gpt_oss_experts_with_biases(rt):
    """A patched transformers GPT-OSS experts module (expert biases, its own clamped gate) compiled with
    fullgraph=True, under aot_eager and inductor: bitwise output and parameter gradients against the eager
    patched module, replica biases included (their gradient is added at home in the backward); the gate
    runs as eager runs it (moonep/integrations/hf_experts.py)."""
    if importlib.util.find_spec("transformers") is None:
        raise SkipCase("transformers is not installed (pip install -e .[hf])")
    if not _cuda(rt) and rt.world_size != 2:
        raise SkipCase("CPU: the compile time is paid at 2 ranks only")
    import transformers

    from moonep.integrations import hf_tiny, patch_hf_moe

    R, dt = rt.world_size, _dtype(rt)
    mods = []
    for _ in range(2):
        cfg = hf_tiny.tiny_config("gpt_oss")
        cfg.num_local_experts = 4 * R
        torch.manual_seed(43)
        model = transformers.GptOssForCausalLM(cfg).to(dt).to(rt.device)
        patch_hf_moe(model, rt, max_tokens=20)
        mods.append(model.model.layers[0].mlp.experts)
    eager, mod = mods
    Hd = cfg.hidden_size
    assert any(n.endswith("_bias") for n, _ in mod.named_parameters())

    def step(m, s, seed):
        g = torch.Generator().manual_seed(4000 + seed)
        x = torch.randn(s, Hd, generator=g, dtype=dt).to(rt.device).requires_grad_()
        # every rank's choices on rank 0's experts: the other ranks get replicas (and their biases)
        idx = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(s)]) if s else \
            torch.zeros(0, 2, dtype=torch.int64)
        w = torch.rand(s, 2, generator=g, dtype=dt)
        m.zero_grad()
        y = m(x, idx.to(rt.device), w.to(rt.device))
        y.square().sum().backward()
        return [y.detach(), x.grad] + [p.grad for _, p in m.named_parameters()]

    step(eager, 4, 99), step(mod, 4, 99)  # builds the ExpertParallel eagerly
    names = ["y", "dx"] + ["d" + n for n, _ in mod.named_parameters()]
    for backend in ("aot_eager", "inductor"):
        torch._dynamo.reset()
        compiled = torch.compile(mod, backend=backend, fullgraph=True)
        for st in range(3 if backend == "aot_eager" else 2):
            s = _sizes(R, st)[rt.rank]
            with eager_math.bitwise():
                got = step(compiled, s, st)
            for name, a, b in zip(names, got, step(eager, s, st)):
                _equal(name, a, b, f"gpt_oss {backend} rank {rt.rank} step {st} s={s}")
