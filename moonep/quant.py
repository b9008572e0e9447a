"""FP8 (e4m3fn) quantisation of token rows, one float32 scale per token per 128 channels.

The rule, computed with the same float32 operations by the torch path below (CPU, and CUDA without CuPy), by
the CUDA kernel of ``csrc/quant.cu`` and by the NVLink fp8 dispatch, which quantises while it sends (their
shared helpers are in ``csrc/common.cuh``), so that all give the same bits:

* ``amax`` = max ``|x|`` over a group of ``block`` consecutive channels of one token (exact in any order);
* ``a = max(amax, AMAX_MIN)`` with ``AMAX_MIN = 448 * 2**-126``;
* ``scale = a / 448`` (float32 division, rounded to nearest), or with ``pow2_scales`` (UE8M0-style)
  ``scale = 2**e`` for the smallest integer ``e`` with ``a <= 448 * 2**e``, i.e. ``2**ceil(log2(a / 448))``
  evaluated exactly (no rounding of ``a / 448`` first), so that no value of the group is clipped;
* ``q = e4m3fn(clamp(x * (1 / scale), -448, 448))``: ``1 / scale`` and the product rounded to nearest
  float32, the cast to nearest even (the clamp only catches ``x * (1 / scale)`` rounding a hair above 448);
* dequantised: ``float(q) * scale``.

Zero groups: ``AMAX_MIN`` makes an all-zero group's scale ``2**-126`` (the smallest normal float32, also a
UE8M0 value) in both modes, and its ``q`` zero (``-0.0`` stays ``0x80``). The floor keeps ``1 / scale``
finite (a zero or subnormal scale would overflow it), so no group needs a special case; a group whose
amax is below ``5.3e-36`` is quantised against the floor.

Non-finite input: a group holding ``inf`` or ``nan`` gets ``scale = nan`` and every ``q = nan`` (``0x7F``),
never a finite value. ``check_finite`` raises ``ValueError`` naming ``x`` instead; it is on by default on
CPU (it reads the group maxima, ``1/block`` of the input) and off on CUDA, where the check is a host sync
(``check_finite=True`` there waits for the kernel once). For a no-sync caller such as a CUDA dispatch,
``flag`` (int32 ``[1]`` on ``x``'s device) gets 1 ORed in when any group is non-finite, on the stream, to
be read lazily (e.g. by the call-header/guard machinery) after the step.

Range: ``float(q) * scale`` can overflow float32 for ``|x| >= 2**127`` (with ``pow2_scales``, e.g.
``256 * 2**120``), i.e. only for bf16/fp32 values within a factor 1.2 of float32's largest.

Precision: e4m3 keeps 3 mantissa bits, so in its normal range (``|x / scale| >= 2**-6``) rounding moves a
value by at most half an ulp, ``2**-4 * |x / scale|``; below it the steps are ``2**-9``, half is
``2**-10``. Hence ``|float(q) * scale - x| <= max(2**-4 * |x|, 2**-10 * scale)``, plus float32 rounding
(``~2**-22 * |x|``).
"""
from __future__ import annotations

import torch

from . import cuda_runtime
from .errors import expect, expect_tensor, fail

__all__ = ["quantize_fp8", "dequantize_fp8", "E4M3_MAX", "AMAX_MIN"]

E4M3_MAX = 448.0                 # largest finite float8_e4m3fn
AMAX_MIN = 448.0 * 2.0 ** -126   # floor of a group's amax (csrc/quant.cu: Q8_AMAX_MIN_BITS)
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_KERNEL = {torch.float32: "moonep_quant_f32", torch.bfloat16: "moonep_quant_bf16", torch.float16: "moonep_quant_f16"}
_THREADS = 256


def _check(x: torch.Tensor, block: int) -> None:
    expect_tensor(x, "x", dim=2, dtypes=_DTYPES)
    expect(isinstance(block, int) and not isinstance(block, bool) and block > 0, "block", "an int > 0", repr(block))
    H = x.shape[1]
    expect(H > 0 and H % block == 0, "hidden", f"a positive multiple of block={block} (x.shape[1])", H)


def quantize_fp8(x: torch.Tensor, *, block: int = 128, pow2_scales: bool = False, check_finite: bool | None = None,
                 flag: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise token rows to e4m3fn with one float32 scale per token per ``block`` channels (module docstring).

    Args:
        x: bf16, fp16 or fp32 ``[s, H]``, ``H`` a positive multiple of ``block`` (else ``ValueError`` naming
            ``hidden``); ``s`` may be 0. Not differentiated (the caller's straight-through estimator).
        block: channels per scale. CUDA runs the kernel for 128, the torch path for others.
        pow2_scales: power-of-two (UE8M0-style) scales instead of ``amax / 448``.
        check_finite: raise ``ValueError`` naming ``x`` on inf/nan. ``None``: on CPU, off on CUDA (a check
            there is a host sync).
        flag: int32 ``[1]`` on ``x``'s device, or ``None``: 1 is ORed into it when a group is non-finite
            (no host sync).

    Returns:
        ``(q, scales)``: ``q`` float8_e4m3fn ``[s, H]``, ``scales`` float32 ``[s, H / block]``, contiguous, on
        ``x``'s device.
    """
    _check(x, block)
    if flag is not None:
        expect_tensor(flag, "flag", dtypes=torch.int32, device=x.device, shape=(1,))
    if check_finite is None:
        check_finite = x.device.type == "cpu"
    x = x.detach()
    if x.is_cuda and block == 128 and cuda_runtime.available():
        q, scales, bad = _quantize_cuda(x, pow2_scales, flag, check_finite)
    else:
        q, scales, bad = _quantize_torch(x, block, pow2_scales)
        if flag is not None:
            flag.bitwise_or_(bad.to(torch.int32))
    if check_finite and bool(bad):
        fail("x", "finite values (no inf or nan)", f"{int((~torch.isfinite(x)).sum())} non-finite element(s)")
    return q, scales


def _quantize_torch(x: torch.Tensor, block: int, pow2: bool):
    """The reference path, plain torch ops (no host sync on CUDA). Returns (q, scales, bad: bool tensor [])."""
    s, H = x.shape
    xf = x.float().reshape(s, H // block, block)
    amax = xf.abs().amax(-1)                                  # [s, G]; nan propagates, inf stays
    bad = ~torch.isfinite(amax)
    a = amax.clamp_min(AMAX_MIN)                              # nan stays nan
    if pow2:
        # a = f * 2**E, f in [1, 2): the smallest e with a <= 1.75 * 2**(e+8) is E - 8, or E - 7 if f > 1.75
        b = a.view(torch.int32)
        e = (b >> 23) - (127 + 8) + ((b & 0x7FFFFF) > 0x600000).to(torch.int32)
        scale = ((e + 127) << 23).view(torch.float32)
    else:
        # a tensor divisor: CUDA turns a division by a Python scalar into a product with its reciprocal
        scale = a / torch.full_like(a, E4M3_MAX)
    inv = torch.reciprocal(scale)
    y = (xf * inv[..., None]).clamp_(-E4M3_MAX, E4M3_MAX)
    y.masked_fill_(bad[..., None], float("nan"))              # a bad group: every q is nan (0x7F)
    scale = scale.masked_fill(bad, float("nan"))
    return y.view(s, H).to(torch.float8_e4m3fn), scale.contiguous(), bad.any()


def _quantize_cuda(x: torch.Tensor, pow2: bool, flag, check: bool):
    """The kernel of csrc/quant.cu on torch's current stream. Returns (q, scales, bad: int32 [1] or None)."""
    s, H = x.shape
    x = x.contiguous()
    if x.data_ptr() % 16:                                     # the kernel reads 16-byte words
        x = x.clone()
    q = torch.empty(s, H, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(s, H // 128, dtype=torch.float32, device=x.device)
    own = torch.zeros(1, dtype=torch.int32, device=x.device) if check else None
    nwords = s * H * x.element_size() // 16
    if nwords:
        di = x.device.index
        k = cuda_runtime.kernels("quant", di)
        p, i32, i64 = cuda_runtime.ptr, cuda_runtime.i32, cuda_runtime.i64
        # one pass of the grid-stride loop per block (4 words per lane), up to 2**20 blocks
        grid = min(-(-nwords // (_THREADS * 4)), 1 << 20)
        k.launch(_KERNEL[x.dtype], (grid,), (_THREADS,),
                 (p(x), p(q), p(scales), i64(nwords), i32(bool(pow2)), p(own if check else flag)), 0, True)
    if check and flag is not None:
        flag.bitwise_or_(own)
    return q, scales, own


def dequantize_fp8(q: torch.Tensor, scales: torch.Tensor, *, block: int = 128,
                   dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``float(q) * scale`` per group of ``block`` channels, rounded once more to ``dtype``.

    Args:
        q: float8_e4m3fn ``[s, H]``, ``H`` a positive multiple of ``block``.
        scales: float32 ``[s, H / block]`` on ``q``'s device.
        dtype: the result's dtype (bf16, fp16 or fp32).

    Returns:
        ``dtype`` ``[s, H]`` on ``q``'s device.
    """
    expect_tensor(q, "q", dim=2, dtypes=torch.float8_e4m3fn)
    expect(isinstance(block, int) and not isinstance(block, bool) and block > 0, "block", "an int > 0", repr(block))
    s, H = q.shape
    expect(H > 0 and H % block == 0, "hidden", f"a positive multiple of block={block} (q.shape[1])", H)
    expect_tensor(scales, "scales", dtypes=torch.float32, device=q.device, shape=(s, H // block))
    expect(dtype in _DTYPES, "dtype", f"one of {[str(d) for d in _DTYPES]}", dtype)
    out = q.float().view(s, H // block, block) * scales[..., None]
    return out.view(s, H).to(dtype)
