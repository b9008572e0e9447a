"""Which tensors of a compiled LatentMoE step are bitwise equal to eager, per inductor option set (one process).

Diagnosis for docs/performance.md / docs/design.md: inductor regenerates the layer's own elementwise code
(sigmoid, SiTU-GLU, RMSNorm) and may round it differently from eager; moonep's ops are opaque to it.  This
prints, for each option set and dtype, every result tensor as ``=`` (bitwise) or its max abs difference.

    python tools/compile_numerics.py [--device cuda] [--out FILE.json]
"""
import argparse
import json

import torch
import torch._dynamo
import torch._inductor.config as ic

from moonep.bench.provenance import command, git_commit, machine
from moonep.layers import LatentMoE

D, L, E, K, FE, FS = 64, 32, 8, 2, 48, 32


def _options():
    """Inductor option sets to try, the ones this torch knows."""
    known = ic.get_config_copy()
    eager = {k: True for k in ("emulate_precision_casts", "emulate_precision_casts_on_saved_tensors",
                               "eager_numerics.division_rounding", "eager_numerics.disable_ftz",
                               "eager_numerics.use_pytorch_libdevice") if k in known}
    sets = {"default": {}}
    if "emulate_precision_casts" in known:
        sets["emulate_precision_casts"] = {"emulate_precision_casts": True}
    return sets | {"all_eager_knobs": eager}


def _step(m, x):
    x = x.clone().requires_grad_()
    m.zero_grad()
    y = m(x)
    y.square().sum().backward()
    grads = {"d" + n.removeprefix("_orig_mod."): p.grad for n, p in m.named_parameters()}  # compiled: prefixed
    return {"y": y.detach(), "dx": x.grad, **grads}


def _parts(device, dt, opts):
    """The layer's own elementwise pieces alone, forward and backward: which one inductor rounds differently."""
    from moonep.layers.activations import situ_glu_fused
    g = torch.Generator().manual_seed(1)
    norm = torch.nn.RMSNorm(L, eps=1e-6, device=device, dtype=dt)
    fns = {"sigmoid": torch.sigmoid, "situ_glu": situ_glu_fused, "rmsnorm": norm,
           "topk_normalise": lambda s: (lambda w: w / w.sum(1, keepdim=True))(s.topk(K, dim=1)[0])}
    out = {}
    for name, fn in fns.items():
        torch._dynamo.reset()
        x = torch.randn(48, 2 * L, generator=g).to(device, dt) if name != "rmsnorm" else \
            torch.randn(48, L, generator=g).to(device, dt)
        res = []
        for f in (fn, torch.compile(fn, fullgraph=True, options=opts)):
            xi = x.clone().requires_grad_()
            y = f(xi)
            y.square().sum().backward()
            res.append((y.detach(), xi.grad))
        out[name] = ["=" if torch.equal(a, b) else float((a.double() - b.double()).abs().max())
                     for a, b in zip(*res)]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out")
    a = ap.parse_args()
    report = {"command": command(), "commit": git_commit(), "machine": machine(), "torch": torch.__version__,
              "device": a.device, "results": {}}
    for dt in (torch.float32, torch.bfloat16):
        for name, opts in _options().items():
            torch._dynamo.reset()
            mods = []
            for _ in range(2):
                torch.manual_seed(3)
                mods.append(LatentMoE(D, L, E, K, FE, num_shared=2, d_shared=FS, dtype=dt, device=a.device,
                                      max_tokens=64))
            x = torch.randn(48, D, generator=torch.Generator().manual_seed(0)).to(a.device, dt)
            _step(mods[1], x)  # builds the ExpertParallel eagerly (fullgraph needs it to exist)
            compiled = torch.compile(mods[1], fullgraph=True, options=opts)
            want, got = _step(mods[0], x), _step(compiled, x)
            row = {k: "=" if torch.equal(got[k], want[k]) else
                   float((got[k].double() - want[k].double()).abs().max()) for k in want}
            parts = _parts(a.device, dt, opts)
            report["results"][f"{str(dt)[6:]} {name}"] = {"options": opts, "tensors": row, "parts": parts}
            print(f"{str(dt)[6:]:9s} {name:24s}", " ".join(f"{k}:{v if v == '=' else f'{v:.1e}'}"
                                                          for k, v in row.items()), flush=True)
            print(" " * 35, " ".join(f"{k}:{v}" for k, v in parts.items()), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
