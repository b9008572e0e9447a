"""GPU without CuPy: the fallback decisions warn once per process, naming the extra to install.

No GPU is needed: CuPy's absence is simulated (``sys.modules["cupy"] = None`` makes ``import cupy`` raise
ImportError) and the decision functions are called directly, as a CUDA run would call them.
"""
from __future__ import annotations

import sys
import types
import warnings

import pytest
import torch

from moonep import cuda_runtime
from moonep.backends.nvlink import nvlink_available


@pytest.fixture
def fresh(monkeypatch):
    """cuda_runtime as in a new process: nothing checked, nothing warned, MOONEP_NO_CUPY unset."""
    monkeypatch.setattr(cuda_runtime, "_AVAILABLE", None)
    monkeypatch.setattr(cuda_runtime, "_IMPORT_ERROR", None)
    monkeypatch.setattr(cuda_runtime, "_WARNED", False)
    monkeypatch.delenv("MOONEP_NO_CUPY", raising=False)
    return monkeypatch


def _cupy_warnings(record):
    return [w for w in record if issubclass(w.category, cuda_runtime.CuPyMissingWarning)]


def _cuda_rank():
    """What nvlink_available reads of a runtime: a CUDA rank of a one-node job (no GPU touched)."""
    return types.SimpleNamespace(device=torch.device("cuda", 0), local_world_size=2, world_size=2)


def test_missing_cupy_warns_once_naming_the_extra(fresh):
    fresh.setitem(sys.modules, "cupy", None)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")  # the once-only is moonep's, not the warnings filter's
        assert cuda_runtime.available_for("torch ops") is False
        assert cuda_runtime.available_for("torch ops") is False
        assert nvlink_available(_cuda_rank())[0] is False
        cuda_runtime.warn_cupy_missing("something else")
    got = _cupy_warnings(record)
    assert len(got) == 1, [str(w.message) for w in got]
    msg = str(got[0].message)
    assert "moonep[cuda12]" in msg or "moonep[cuda13]" in msg
    assert "torch ops" in msg and "CuPy cannot be imported" in msg


def test_transport_fallback_warns(fresh):
    fresh.setitem(sys.modules, "cupy", None)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        ok, why = nvlink_available(_cuda_rank())
    assert not ok and "cupy" in why
    got = _cupy_warnings(record)
    assert len(got) == 1 and "host transport instead of nvlink" in str(got[0].message)


def test_no_warning_when_fallback_was_asked_for_or_cupy_imports(fresh):
    fresh.setitem(sys.modules, "cupy", None)
    fresh.setenv("MOONEP_NO_CUPY", "1")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert cuda_runtime.available_for("torch ops") is False
    assert not _cupy_warnings(record)
    fresh.setattr(cuda_runtime, "_AVAILABLE", None)
    fresh.delenv("MOONEP_NO_CUPY")
    fresh.setitem(sys.modules, "cupy", types.ModuleType("cupy"))  # an importable CuPy
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert cuda_runtime.available_for("torch ops") is True
    assert not _cupy_warnings(record)


def test_install_hint_follows_torch_cuda(monkeypatch):
    for cuda, want in (("12.8", "moonep[cuda12]"), ("13.0", "moonep[cuda13]")):
        monkeypatch.setattr(torch.version, "cuda", cuda)
        assert cuda_runtime.cupy_install_hint() == f"pip install '{want}'"
    monkeypatch.setattr(torch.version, "cuda", None)
    hint = cuda_runtime.cupy_install_hint()
    assert "moonep[cuda12]" in hint and "moonep[cuda13]" in hint


def test_kernels_without_cupy_name_the_extra(fresh):
    """A kernel program loaded anyway fails with the install command, not a bare ``No module named 'cupy'``."""
    fresh.setitem(sys.modules, "cupy", None)
    with pytest.raises(ImportError, match=r"need CuPy: pip install 'moonep\[cuda"):
        cuda_runtime.Kernels("plan", 0)


def test_no_warning_when_kernels_were_switched_off(fresh):
    """A test forcing the torch path (``_AVAILABLE = False``, the import never tried) is not told to install."""
    fresh.setattr(cuda_runtime, "_AVAILABLE", False)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert cuda_runtime.available_for("torch ops") is False
    assert not _cupy_warnings(record)


_GPU_RUN = r"""
import sys, warnings
sys.modules["cupy"] = None                      # CuPy missing
import torch, moonep
from moonep import cuda_runtime
warnings.simplefilter("always")
g = torch.Generator().manual_seed(0)
x = torch.randn(12, 64, generator=g)
idx = torch.rand(12, 8, generator=g).topk(2, dim=1).indices
w = torch.rand(12, 2, generator=g)
out = {}
with warnings.catch_warnings(record=True) as record:
    for dev in ("cpu", "cuda"):
        ep = moonep.ExpertParallel(num_experts=8, topk=2, hidden=64, max_tokens=16, device=dev)
        h = ep.dispatch(x.to(dev), idx.to(dev), w.to(dev))
        out[dev] = (h.tokens.cpu(), ep.combine(h.tokens * 2, h).cpu())
n = sum(issubclass(r.category, cuda_runtime.CuPyMissingWarning) for r in record)
assert n == 1, [str(r.message) for r in record]
assert all(torch.equal(a, b) for a, b in zip(out["cpu"], out["cuda"]))
print("ok", n)
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_run_without_cupy_falls_back_and_warns_once():
    """A real CUDA ExpertParallel without CuPy: the CPU planner and torch ops, the CPU results, one warning."""
    import subprocess

    res = subprocess.run([sys.executable, "-c", _GPU_RUN], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "ok 1" in res.stdout, res.stdout + res.stderr
