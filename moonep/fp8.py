"""FP8 dispatch: the wire rows, their pre-quantised form and the straight-through dequantisation of ``h``.

``ExpertParallel(..., dispatch_dtype=torch.float8_e4m3fn)`` moves every token as one **wire row** of bytes:

    [ q: H e4m3fn codes | scales: H/128 float32 | zeros ]   wire_bytes(H) = H + 4 * H/128, rounded up to 128

(:mod:`moonep.quant` gives the quantisation rule).  The padding, 0 to 124 bytes (32 at H 7168, none when
``H % 4096 == 0``), starts every row on a 128-byte line: a row's stores then fill whole lines, and on the
H200 the fp8 dispatch at H 7168 took ~5 % less time than with rows padded to 16 bytes only
(docs/performance.md).  Every backend moves these rows as raw bytes with its
ordinary row machinery (one row per token and destination rank, expanded into the token's slot rows
there), so the plan, the slot layout and the static shapes are those of the token dtype.  ``h.tokens`` and
``h.scales`` are views of the received ``[cap, wire_bytes(H)]`` rows (row stride ``wire_bytes(H)``, not
contiguous).

Autograd is straight-through: ``h.tokens``/``h.scales`` are not differentiable; :func:`dequantize_rows`
(and the expert GEMM helpers given ``h``) return rows in a float dtype whose gradient flows, unchanged,
into ``h.grad_rows`` and from there into the backward of dispatch (a combine of the rows' gradients, cast
to ``x``'s dtype).
"""
from __future__ import annotations

import torch

from . import cuda_runtime
from .errors import expect, expect_tensor, fail
from .quant import dequantize_fp8, quantize_fp8

__all__ = ["FP8", "GROUP", "wire_bytes", "split_wire", "wire_rows", "check_pair", "pack_pair", "quantize_wire",
           "dequantize_rows"]

FP8 = torch.float8_e4m3fn
GROUP = 128   # channels per scale
_WIRE_KERNEL = {torch.float32: "moonep_quant_wire_f32", torch.bfloat16: "moonep_quant_wire_bf16",
                torch.float16: "moonep_quant_wire_f16"}


def wire_bytes(H: int) -> int:
    """Bytes of one wire row: ``H`` fp8 codes, ``H/128`` float32 scales, zeros up to a multiple of 128 bytes
    (``q8_wire_bytes`` in csrc/common.cuh)."""
    return (H + 4 * (H // GROUP) + 127) // 128 * 128


def split_wire(rows: torch.Tensor, H: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of uint8 wire rows ``[n, wire_bytes(H)]``: ``(q float8_e4m3fn [n, H], scales float32 [n, H/128])``."""
    q = rows[:, :H].view(FP8)
    scales = rows[:, H:H + 4 * (H // GROUP)].view(torch.float32)  # row stride wire_bytes(H): a multiple of 128
    return q, scales


def wire_rows(tokens: torch.Tensor) -> torch.Tensor:
    """The uint8 wire rows ``[n, wire_bytes(H)]`` behind ``tokens`` (``h.tokens`` of an fp8 dispatch, fp8 ``[n, H]``
    with row stride ``wire_bytes(H)``), padding included: a view (the inverse of :func:`split_wire`)."""
    n, H = tokens.shape
    wb = wire_bytes(H)
    expect(tokens.dtype == FP8 and tokens.stride() == (wb, 1), "tokens", f"fp8 rows of stride ({wb}, 1) (h.tokens)",
           f"{tokens.dtype}, stride {tuple(tokens.stride())}")
    return tokens.view(torch.uint8).as_strided((n, wb), (wb, 1))


def check_pair(x, H: int, device, max_rows: int) -> None:
    """A pre-quantised ``x = (x_fp8 [s, H], scales float32 [s, H/128])``: raise ``ValueError`` naming the part."""
    expect(isinstance(x, (tuple, list)) and len(x) == 2, "x", "a tensor or a pair (x_fp8, scales)",
           f"{type(x).__name__} of {len(x) if isinstance(x, (tuple, list)) else '?'} items")
    q, sc = x
    expect_tensor(q, "x[0] (x_fp8)", dim=2, dtypes=FP8, device=device)
    expect(q.shape[1] == H, "x[0] (x_fp8)", f"shape [s, {H}]", list(q.shape))
    expect(q.shape[0] <= max_rows, "x[0] (x_fp8)", f"at most max_tokens={max_rows} rows", q.shape[0])
    expect_tensor(sc, "x[1] (scales)", dtypes=torch.float32, device=device, shape=(q.shape[0], H // GROUP))


def pack_pair(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``(q fp8 [s, H], scales float32 [s, H/128])`` -> uint8 wire rows ``[s, wire_bytes(H)]`` (a copy)."""
    s, H = q.shape
    G = H // GROUP
    out = torch.empty((s, wire_bytes(H)), dtype=torch.uint8, device=q.device)
    out[:, :H] = q.view(torch.uint8)
    out[:, H:H + 4 * G] = scales.contiguous().view(torch.uint8)
    if out.shape[1] > H + 4 * G:
        out[:, H + 4 * G:] = 0
    return out


def quantize_wire(x: torch.Tensor, *, pow2_scales: bool = False, check_finite: bool | None = None,
                  flag: torch.Tensor | None = None, code: int = 1) -> torch.Tensor:
    """Quantise ``x`` straight into wire rows (one kernel on CUDA, :func:`moonep.quant.quantize_fp8` + a copy
    elsewhere); bitwise the codes and scales of ``quantize_fp8``.  The host backends send these rows; the
    NVLink backend quantises inside its dispatch kernels instead (same bits).

    Args:
        x: bf16, fp16 or fp32 ``[s, H]``, ``H`` a positive multiple of 128 (else ``ValueError`` naming
            ``hidden``).
        check_finite: raise ``ValueError`` naming ``x`` on inf/nan (``None``: on CPU only; a host sync on CUDA).
        flag: int32 ``[1]`` on ``x``'s device or ``None``: ``code`` is ORed into it when a group is non-finite,
            without a host sync.
    Returns:
        uint8 ``[s, wire_bytes(H)]`` on ``x``'s device.
    """
    expect_tensor(x, "x", dim=2, dtypes=tuple(_WIRE_KERNEL))
    s, H = x.shape
    expect(H > 0 and H % GROUP == 0, "hidden", f"a positive multiple of {GROUP} (x.shape[1])", H)
    if check_finite is None:
        check_finite = x.device.type == "cpu"
    if not (x.is_cuda and cuda_runtime.available()):
        q, sc = quantize_fp8(x, check_finite=check_finite, pow2_scales=pow2_scales)
        if flag is not None:
            flag.bitwise_or_(torch.where(torch.isfinite(sc).all(), 0, code).to(torch.int32))
        return pack_pair(q, sc)
    x = x.detach().contiguous()
    if x.data_ptr() % 16:  # the kernel reads 16-byte words
        x = x.clone()
    out = torch.empty((s, wire_bytes(H)), dtype=torch.uint8, device=x.device)
    own = torch.zeros(1, dtype=torch.int32, device=x.device) if check_finite else None
    nwords = s * H * x.element_size() // 16
    if nwords:
        k = cuda_runtime.kernels("quant", x.device.index)
        p, i32, i64 = cuda_runtime.ptr, cuda_runtime.i32, cuda_runtime.i64
        grid = min(-(-nwords // (256 * 4)), 1 << 20)  # one pass of the grid-stride loop (4 words per lane)
        k.launch(_WIRE_KERNEL[x.dtype], (grid,), (256,),
                 (p(x), p(out), i64(nwords), i32(bool(pow2_scales)), p(own if check_finite else flag), i32(code),
                  i64(H)), 0, True)
    if check_finite:
        if flag is not None:
            flag.bitwise_or_(own)
        if bool(own.item()):
            fail("x", "finite values (no inf or nan)", f"{int((~torch.isfinite(x)).sum())} non-finite element(s)")
    return out


def _straight_through(q, scales, anchor, dtype):
    out = dequantize_fp8(q, scales, dtype=dtype)
    if anchor is None or not anchor.requires_grad:
        return out
    # out + (anchor - anchor.detach()): the values of `out`, the gradient of `anchor` (straight through)
    return out + (anchor - anchor.detach()).to(dtype)


def dequantize_rows(h, start: int = 0, end: int | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Rows ``start:end`` of an fp8 dispatch's ``h``, dequantised: ``float(h.tokens) * h.scales`` per 128 channels.

    Args:
        h: the :class:`moonep.Dispatched` of an ``ExpertParallel(dispatch_dtype=torch.float8_e4m3fn)``:
            ``h.tokens`` float8_e4m3fn ``[cap, H]``, ``h.scales`` float32 ``[cap, H/128]``.
        start, end: a row range (Python ints, ``0 <= start <= end <= cap``; ``end=None``: ``cap``), e.g. a
            slot's ``h.cu_seqlens[j]:h.cu_seqlens[j+1]``.
        dtype: bf16, fp16 or fp32 (default: the constructor's token dtype, ``h.grad_rows.dtype``).
    Returns:
        ``dtype`` ``[end - start, H]``.  Differentiable when the dispatch was recorded by autograd: the gradient
        reaches ``x`` straight through the quantisation (the backward of dispatch combines it).
    """
    expect(getattr(h, "scales", None) is not None, "h", "the Dispatched of an fp8 dispatch (h.scales set)",
           "h.scales is None")
    cap = h.tokens.shape[0]
    end = cap if end is None else end
    expect(isinstance(start, int) and isinstance(end, int) and 0 <= start <= end <= cap, "start, end",
           f"ints with 0 <= start <= end <= {cap}", (start, end))
    anchor = h.grad_rows
    if dtype is None:
        dtype = anchor.dtype if anchor is not None else torch.bfloat16
    return _straight_through(h.tokens[start:end], h.scales[start:end],
                             None if anchor is None else anchor[start:end], dtype)


def grad_anchor(n: int, H: int, dtype: torch.dtype, device) -> torch.Tensor:
    """``grad_rows`` of an fp8 dispatch: ``[n, H]`` zeros in the token dtype, stride 0 (no memory), through
    which the dequantised rows' gradient reaches the backward of dispatch (eager and ``moonep::dispatch``)."""
    return torch.zeros((), dtype=dtype, device=device).expand(n, H)


def _is_handle(a) -> bool:
    return getattr(a, "scales", None) is not None and hasattr(a, "grad_rows")  # an fp8 dispatch's Dispatched


def received_rows(a):
    """The received rows behind what :func:`as_float_rows` takes, before it dequantises them: ``h.tokens`` of
    an fp8 dispatch's handle, the first of a pair; any other ``a`` (a tensor, or what ``as_float_rows`` refuses)
    unchanged."""
    if _is_handle(a):
        return a.tokens
    return a[0] if isinstance(a, (tuple, list)) and len(a) == 2 else a


def as_float_rows(a, dtype: torch.dtype) -> torch.Tensor:
    """The expert GEMMs' fp8 input: ``a`` the handle of an fp8 dispatch (differentiable, see
    :func:`dequantize_rows`) or a pair ``(tokens fp8 [cap, H], scales float32 [cap, H/128])`` (not
    differentiable) -> ``dtype`` ``[cap, H]``; any other ``a`` is returned unchanged."""
    if _is_handle(a):
        return dequantize_rows(a, dtype=dtype)
    if isinstance(a, (tuple, list)):
        expect(len(a) == 2, "a", "a tensor, a Dispatched or a pair (fp8 tokens, scales)", f"{len(a)} items")
        return dequantize_fp8(a[0].contiguous(), a[1].contiguous(), dtype=dtype)
    return a
