"""moonep.quant: FP8 (e4m3fn) quantiser, one float32 scale per token per 128 channels.

The oracle is a reference written here in numpy, independently of moonep and of torch's fp8 cast: the e4m3
rounding is a nearest-value search in the table of all e4m3 values (ties to the even code), the power-of-two
exponent a brute-force search for the smallest ``e`` with ``a <= 448 * 2**e`` in float64. moonep must agree
with it **bitwise** (fp8 bytes and float32 scale bits). The arithmetic it mirrors is the rule of the module
docstring: ``scale = max(amax, 448 * 2**-126) / 448`` (or the power of two), ``q = e4m3(clamp(x * (1 /
scale), -448, 448))``, and a group with inf/nan gets scale nan and every byte 0x7F.

Round-trip bound, from e4m3's 3 mantissa bits: in its normal range (``|y| >= 2**-6``, ``y = x / scale``)
rounding to nearest moves ``y`` by at most half an ulp, ``2**(E-4) <= 2**-4 * |y|``; in its subnormal range
the spacing is ``2**-9``, half of it ``2**-10``. So ``|float(q) * scale - x| <= max(2**-4 * |x|,
2**-10 * scale)``, plus float32 rounding of ``1 / scale``, ``x * (1 / scale)`` and ``q * scale`` (three
relative ``2**-24`` each, bounded here by ``2**-20 * |x|``) and an absolute ``2**-149`` where ``q * scale``
lands in float32's subnormals.

The CUDA tests (marker ``gpu``, skipped without CUDA) compare the kernel of ``csrc/quant.cu`` with the CPU
path bit for bit, and check that it neither syncs the host nor breaks CUDA-graph capture. Without a GPU,
the kernel's e4m3 conversion and scale helpers are compiled for the host with nvcc (when present) and
checked against torch's cast for every float32 in [0, 448].
"""
from __future__ import annotations

import ctypes
import shutil
import subprocess

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moonep import cuda_runtime
from moonep.quant import dequantize_fp8, quantize_fp8

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
FLOOR = np.float32(448.0 * 2.0 ** -126)
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")


# ------------------------------------------------------------------------------------------- reference
def _e4m3_values() -> np.ndarray:
    """float64 value of every non-negative finite e4m3fn code 0..126 (increasing), from the format's
    definition: 4 exponent bits (bias 7), 3 mantissa bits, subnormals for exponent 0."""
    c = np.arange(127)
    e, m = c >> 3, c & 7
    return np.where(e == 0, m * 2.0 ** -9, (1 + m / 8) * 2.0 ** (e - 7))


TABLE = _e4m3_values()


def ref_e4m3(y: np.ndarray) -> np.ndarray:
    """uint8 e4m3fn codes of float32 ``y`` (finite, |y| <= 448): nearest table value, ties to the even code."""
    a = np.abs(y).astype(np.float64)
    hi = np.minimum(np.searchsorted(TABLE, a, side="left"), 126)
    lo = np.maximum(hi - 1, 0)
    dlo, dhi = a - TABLE[lo], TABLE[hi] - a
    code = np.where((dhi < dlo) | ((dhi == dlo) & (hi % 2 == 0)), hi, lo)
    return (code | (np.signbit(y).astype(np.int64) << 7)).astype(np.uint8)


def ref_quantize(x: torch.Tensor, pow2: bool, block: int = 128):
    """(uint8 codes [s, H], float32 scales [s, H/block]) as numpy arrays."""
    s, H = x.shape
    xs = x.float().numpy().reshape(s, H // block, block)
    with np.errstate(all="ignore"):
        amax = np.abs(xs).max(-1) if s else np.zeros((0, H // block), np.float32)
        bad = ~np.isfinite(amax)
        a = np.where(bad, np.float32(1), np.maximum(amax, FLOOR)).astype(np.float32)
        if pow2:  # smallest e with a <= 448 * 2**e: start below it, step up (float64: exact)
            a64 = a.astype(np.float64)
            e = np.floor(np.log2(a64)).astype(np.int64) - 12
            for _ in range(16):
                e += a64 > np.ldexp(448.0, e)
            scale = np.ldexp(1.0, e).astype(np.float32)
        else:
            scale = a / np.float32(448.0)
        inv = np.float32(1.0) / scale
        y = np.clip(xs * inv[..., None], np.float32(-448.0), np.float32(448.0))
        y = np.where(bad[..., None], np.float32(0), y)
    codes = ref_e4m3(y)
    codes[bad] = 0x7F
    scale[bad] = np.float32("nan")
    return codes.reshape(s, H), scale


def assert_bitwise(x: torch.Tensor, pow2: bool, q=None, scales=None):
    if q is None:
        q, scales = quantize_fp8(x, pow2_scales=pow2, check_finite=False)
    rq, rs = ref_quantize(x.cpu(), pow2)
    assert q.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
    assert q.shape == x.shape and scales.shape == (x.shape[0], x.shape[1] // 128)
    got_q, got_s = q.cpu().view(torch.uint8).numpy(), scales.cpu().numpy()
    if not np.array_equal(got_q, rq):
        i = np.argwhere(got_q != rq)[0]
        raise AssertionError(f"q differs at {tuple(i)}: x={x[tuple(i)].item()!r} got {got_q[tuple(i)]:#x} "
                             f"want {rq[tuple(i)]:#x} (scale {rs[i[0], i[1] // 128]!r})")
    assert np.array_equal(got_s.view(np.int32), rs.view(np.int32)), (got_s, rs)


def rows(s, H, dtype, log2_mag=0.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(s, H, generator=g, dtype=torch.float64) * 2.0 ** log2_mag).to(dtype)


def special_rows(dtype):
    """[12, 512]: zero groups, -0.0, near the dtype's max, its tiny normals and subnormals, mixtures."""
    fi = torch.finfo(dtype)
    x = rows(12, 512, torch.float64, seed=1)
    x[0] = 0.0                                                   # a zero row
    x[1, 128:256] = 0.0                                          # one zero group
    x[2, :128] = -0.0                                            # negative zeros
    x[3] = x[3].sign() * fi.max                                  # every value at the max
    x[4] = x[4] * (fi.max / 8)                                   # large, clamped by the dtype below
    x[4, 7] = fi.max
    x[5] = x[5] * fi.tiny                                        # around the smallest normal
    x[6] = x[6].sign() * fi.tiny * fi.eps                       # the smallest subnormal
    x[7] = x[7] * 1e-3
    x[7, 300] = 1e3                                              # one large value among small ones
    x[8, :256] = x[8, :256] * fi.max / 4                         # huge and tiny groups in one row
    x[8, 256:] = x[8, 256:] * fi.tiny
    x[9] = x[9] * 448.0 / x[9].abs().max()                       # amax exactly 448 (scale 1)
    x[10] = torch.linspace(-1.0, 1.0, 512, dtype=torch.float64)
    x[11, 1::2] = 0.0
    return x.clamp(-fi.max, fi.max).to(dtype)


# ------------------------------------------------------------------------------------------- CPU, bitwise
def test_reference_rounding_is_torch_cast_on_every_midpoint():
    """The table reference and torch's cast agree on every e4m3 value, midpoint and its float32 neighbours
    (so a disagreement below is moonep's, not the reference's)."""
    mids = (TABLE[1:] + TABLE[:-1]) / 2
    y = np.concatenate([TABLE, mids]).astype(np.float32)
    y = np.concatenate([y, np.nextafter(y, np.float32(0)), np.nextafter(y, np.float32(448))])
    y = np.concatenate([y, -y])
    ref = ref_e4m3(y)
    assert np.array_equal(torch.from_numpy(y).to(torch.float8_e4m3fn).view(torch.uint8).numpy(), ref)
    assert ref[np.float32(2.0 ** -10) == y][0] == 0 and ref[np.float32(3 * 2.0 ** -10) == y][0] == 2  # ties


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,mag", [((0, 128), 0), ((1, 128), 0), ((3, 384), 4), ((64, 1024), -7),
                                       ((17, 7168), 2)])
def test_bitwise_random(dtype, pow2, shape, mag):
    assert_bitwise(rows(*shape, dtype, mag, seed=shape[0]), pow2)


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_bitwise_special_rows(dtype, pow2):
    x = special_rows(dtype)
    assert_bitwise(x, pow2)
    q, scales = quantize_fp8(x, pow2_scales=pow2)
    zero = torch.tensor(2.0 ** -126)
    assert torch.equal(scales[0], zero.expand(4)) and scales[1, 1] == zero and scales[2, 0] == zero
    assert not q.view(torch.uint8)[0].any() and (q.view(torch.uint8)[2, :128] == 0x80).all()
    assert torch.isfinite(scales).all() and (scales > 0).all()


def test_ties_round_to_even():
    """amax = 448 * 2**k gives scale 2**k in both modes, so x = midpoint * 2**k lands exactly on e4m3 ties."""
    mids = (TABLE[1:] + TABLE[:-1]) / 2
    vals = np.concatenate([[448.0], mids, -mids])
    vals = np.concatenate([vals, np.zeros(-len(vals) % 128)])
    for k, dtype in ((0, torch.float32), (-3, torch.float32), (5, torch.bfloat16), (-20, torch.float16)):
        x = torch.from_numpy(vals * 2.0 ** k).reshape(1, -1)
        if dtype != torch.float32:  # keep only the values the dtype holds exactly (the first stays amax)
            x = torch.where(x.to(dtype).double() == x, x, torch.zeros_like(x))
        x = x.to(dtype)
        for pow2 in (False, True):
            assert_bitwise(x, pow2)
            assert quantize_fp8(x, pow2_scales=pow2)[1][0, 0] == 2.0 ** k


def test_pow2_scale_rule():
    """pow2: the smallest power of two with amax <= 448 * scale, exactly, on both sides of each boundary."""
    amax = torch.tensor([448.0, 448.0 * 1.0000001, 447.99997, 224.0, 224.00002, 1.0, 1e-30, 3e38])
    x = torch.zeros(len(amax), 128)
    x[:, 3] = amax
    scales = quantize_fp8(x, pow2_scales=True)[1][:, 0]
    a = amax.double()
    e = torch.log2(scales.double())
    assert torch.equal(e, e.round()) and (a <= 448 * scales.double()).all() and (a > 224 * scales.double()).all()
    assert scales[:5].tolist() == [1.0, 2.0, 1.0, 0.5, 1.0]


SET = settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


@SET
@given(s=st.integers(0, 6), groups=st.integers(1, 5), dtype=st.sampled_from(DTYPES), pow2=st.booleans(),
       mag=st.floats(-40, 40), seed=st.integers(0, 2**31 - 1), zero_groups=st.integers(0, 3),
       spread=st.floats(0, 30))
def test_property_bitwise_and_round_trip(s, groups, dtype, pow2, mag, seed, zero_groups, spread):
    """Random rows whose magnitudes spread over ``2**spread`` around ``2**mag`` (clamped to the dtype), some
    whole groups zero: bitwise equal to the reference, and within the round-trip bound."""
    g = torch.Generator().manual_seed(seed)
    H = 128 * groups
    x = torch.randn(s, H, generator=g, dtype=torch.float64)
    x = x * torch.exp2(mag + spread * (torch.rand(s, H, generator=g, dtype=torch.float64) - 0.5))
    fi = torch.finfo(dtype)
    x = x.clamp(-fi.max, fi.max).to(dtype)
    if s:
        for _ in range(zero_groups):
            r, c = torch.randint(s, (1,), generator=g).item(), torch.randint(groups, (1,), generator=g).item()
            x[r, 128 * c:128 * (c + 1)] = 0
    q, scales = quantize_fp8(x, pow2_scales=pow2)
    assert_bitwise(x, pow2, q, scales)
    check_round_trip(x, q, scales)


def check_round_trip(x, q, scales, block=128):
    """The bound of the module docstring, per element."""
    xd = x.double()
    sd = scales.double().repeat_interleave(block, dim=1)
    deq = dequantize_fp8(q, scales, block=block, dtype=torch.float32).double()
    err = (deq - xd).abs()
    bound = torch.maximum(2.0 ** -4 * xd.abs(), 2.0 ** -10 * sd) + 2.0 ** -20 * xd.abs() + 2.0 ** -149
    # past 2**127, float(q) * scale may overflow float32 (e.g. pow2: 256 * 2**120): inf of x's sign is allowed
    over = (xd.abs() >= 2.0 ** 127) & (deq == xd.sign() * float("inf"))
    assert (over | (err <= bound)).all(), (err - bound).max()


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_bound(dtype, pow2):
    x = torch.cat([special_rows(dtype), rows(32, 512, dtype, 3)])
    q, scales = quantize_fp8(x, pow2_scales=pow2)
    check_round_trip(x, q, scales)
    # the relative bound is nearly reached on random data, in e4m3's normal range
    xd, sd = x.double()[12:], scales.double()[12:].repeat_interleave(128, dim=1)
    normal = (xd / sd).abs() >= 2.0 ** -6
    rel = ((dequantize_fp8(q, scales, dtype=torch.float32).double()[12:] - xd).abs() / xd.abs())[normal]
    assert 2.0 ** -5 < rel.max() <= 2.0 ** -4 * (1 + 2.0 ** -18)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize(dtype):
    x = rows(5, 256, torch.float32, 2)
    q, scales = quantize_fp8(x)
    want = q.float().reshape(5, 2, 128) * scales[..., None]
    out = dequantize_fp8(q, scales, dtype=dtype)
    assert out.dtype == dtype and out.shape == (5, 256)
    assert torch.equal(out, want.reshape(5, 256).to(dtype))
    assert dequantize_fp8(*quantize_fp8(torch.zeros(0, 256)), dtype=dtype).shape == (0, 256)


def test_other_block_sizes_follow_the_same_rule():
    x = rows(4, 256, torch.bfloat16, 1)
    q, scales = quantize_fp8(x, block=64)
    assert scales.shape == (4, 4)
    q2, s2 = quantize_fp8(x.reshape(8, 128)[:, :64].contiguous(), block=64)  # group by group
    assert torch.equal(scales.reshape(-1)[::2], s2.reshape(-1))
    check_round_trip(x, q, scales, block=64)


# ------------------------------------------------------------------------------------------- refusals
def raises_named(fn, name):
    with pytest.raises(ValueError) as e:
        fn()
    msg = str(e.value)
    assert msg.startswith(name + ":") and "expected" in msg, msg
    return msg


@pytest.mark.parametrize("bad", [float("inf"), -float("inf"), float("nan")])
@pytest.mark.parametrize("dtype", DTYPES)
def test_non_finite_refused(dtype, bad):
    x = rows(3, 384, dtype)
    x[1, 200] = bad
    assert "1 non-finite" in raises_named(lambda: quantize_fp8(x), "x")
    raises_named(lambda: quantize_fp8(x, check_finite=True, pow2_scales=True), "x")
    # unchecked: that group is nan (scale and every byte), the others exact; the flag gets 1, no raise
    flag = torch.full((1,), 8, dtype=torch.int32)
    q, scales = quantize_fp8(x, check_finite=False, flag=flag)
    assert flag.item() == 9
    assert_bitwise(x, False, q, scales)
    assert torch.isnan(scales[1, 1]) and (q.view(torch.uint8)[1, 128:256] == 0x7F).all()
    assert torch.isfinite(scales[1, [0, 2]]).all() and torch.isfinite(scales[[0, 2]]).all()
    clean = torch.zeros(1, dtype=torch.int32)
    quantize_fp8(rows(3, 384, dtype), flag=clean)
    assert clean.item() == 0


@pytest.mark.parametrize("H", [100, 129, 64, 0])
def test_hidden_not_multiple_of_128_refused(H):
    msg = raises_named(lambda: quantize_fp8(torch.zeros(2, H)), "hidden")
    assert "128" in msg and f"got {H}" in msg
    raises_named(lambda: dequantize_fp8(torch.zeros(2, H).to(torch.float8_e4m3fn), torch.ones(2, 1)), "hidden")


def test_bad_arguments_refused():
    raises_named(lambda: quantize_fp8(torch.zeros(2, 128, dtype=torch.float64)), "x")
    raises_named(lambda: quantize_fp8(torch.zeros(256)), "x")
    raises_named(lambda: quantize_fp8([[0.0] * 128]), "x")
    raises_named(lambda: quantize_fp8(torch.zeros(2, 128), block=0), "block")
    raises_named(lambda: quantize_fp8(torch.zeros(2, 128), flag=torch.zeros(1)), "flag")
    raises_named(lambda: quantize_fp8(torch.zeros(2, 128), flag=torch.zeros(2, dtype=torch.int32)), "flag")
    q, s = quantize_fp8(torch.zeros(2, 256))
    raises_named(lambda: dequantize_fp8(q.view(torch.uint8), s), "q")
    raises_named(lambda: dequantize_fp8(q, s[:, :1]), "scales")
    raises_named(lambda: dequantize_fp8(q, s.double()), "scales")
    raises_named(lambda: dequantize_fp8(q, s, dtype=torch.int32), "dtype")


def test_input_not_changed_and_not_differentiated():
    x = rows(2, 256, torch.float32).requires_grad_(True)
    before = x.detach().clone()
    q, scales = quantize_fp8(x)
    assert torch.equal(x.detach(), before) and not q.requires_grad and not scales.requires_grad
    xt = rows(256, 2, torch.float32).t()  # non-contiguous
    assert_bitwise(xt, False)


# ------------------------------------------------------------------------------------------- kernel code on the host
@pytest.fixture(scope="module")
def host_lib(tmp_path_factory):
    """csrc/quant.cu's e4m3 conversion and scale helpers compiled for the host (they are __host__ __device__)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None or not (shutil.which("g++") or shutil.which("c++")):
        pytest.skip("needs nvcc and a host C++ compiler")
    d = tmp_path_factory.mktemp("q8host")
    (d / "h.cu").write_text(
        f'#include "{cuda_runtime.csrc_dir() / "quant.cu"}"\n'
        'extern "C" void q8_cvt(const float* y, unsigned char* o, long n) {\n'
        '  for (long i = 0; i < n; ++i) o[i] = (unsigned char)q8_e4m3_soft(y[i]); }\n'
        'extern "C" void q8_scales(const float* a, int pow2, float* s, float* inv, long n) {\n'
        '  for (long i = 0; i < n; ++i) s[i] = q8_scale(a[i], pow2 != 0, &inv[i]); }\n')
    so = d / "libq8.so"
    r = subprocess.run([nvcc, "-std=c++17", "-O2", "-arch=sm_90", "-shared", "-Xcompiler", "-fPIC",
                        str(d / "h.cu"), "-o", str(so)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return ctypes.CDLL(str(so))


def _p(a):
    return ctypes.c_void_p(a.ctypes.data)


def test_kernel_e4m3_conversion_is_torch_cast_for_every_float(host_lib):
    """q8_e4m3_soft (the kernel's conversion below sm_89, and the spec of the sm_89+ instruction) against
    torch's cast: every float32 in [0, 448], and every 61st one in [-448, 0)."""
    top, chunk = 0x43E00000, 1 << 24
    for sign, step in ((0, 1), (0x80000000, 61)):
        for start in range(0, top + 1, chunk * step):
            bits = np.arange(start, min(start + chunk * step, top + 1), step, dtype=np.uint32) | np.uint32(sign)
            y = bits.view(np.float32)
            out = np.empty(len(y), np.uint8)
            host_lib.q8_cvt(_p(y), _p(out), ctypes.c_long(len(y)))
            ref = torch.from_numpy(y).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
            assert np.array_equal(out, ref), hex(bits[np.argmax(out != ref)])


@pytest.mark.parametrize("pow2", [False, True])
def test_kernel_scale_is_torch_path(host_lib, pow2):
    """q8_scale and the torch path give the same scales, and 1/scale as torch.reciprocal, for amaxes across
    float32's whole range (subnormals and the floor included)."""
    g = torch.Generator().manual_seed(3)
    a = torch.cat([torch.exp2(torch.rand(20000, generator=g, dtype=torch.float64) * 276 - 149),
                   torch.tensor([0.0, 1e-45, float(FLOOR), 448.0, 448.00003, 3.4028234e38], dtype=torch.float64)])
    a = a.float().numpy()
    sc, inv = np.empty_like(a), np.empty_like(a)
    host_lib.q8_scales(_p(a), int(pow2), _p(sc), _p(inv), ctypes.c_long(len(a)))
    x = torch.zeros(len(a), 128)
    x[:, 0] = torch.from_numpy(a)
    _, want = quantize_fp8(x, pow2_scales=pow2)
    assert np.array_equal(sc.view(np.int32), want[:, 0].numpy().view(np.int32))
    assert np.array_equal(inv.view(np.int32), torch.reciprocal(want[:, 0]).numpy().view(np.int32))


# ------------------------------------------------------------------------------------------- CUDA
def _cuda_cases():
    out = []
    for dtype in DTYPES:
        for shape, mag in (((0, 128), 0), ((1, 128), 0), ((3, 384), 3), ((5, 896), -9), ((129, 7168), 1)):
            out.append(rows(*shape, dtype, mag, seed=shape[0]))
        x = special_rows(dtype)
        x[7, 3], x[11, 500] = float("inf"), float("nan")
        out.append(x)
    return out


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "torch"])
@pytest.mark.parametrize("pow2", [False, True])
def test_cuda_bitwise_cpu(pow2, kernel, monkeypatch):
    if kernel and not cuda_runtime.available():
        pytest.skip("needs CuPy")
    if not kernel:
        monkeypatch.setattr(cuda_runtime, "available", lambda: False)
    for x in _cuda_cases():
        flag = torch.zeros(1, dtype=torch.int32, device="cuda")
        q, scales = quantize_fp8(x.cuda(), pow2_scales=pow2, flag=flag)
        cq, cs = quantize_fp8(x, pow2_scales=pow2, check_finite=False)
        assert torch.equal(q.cpu().view(torch.uint8), cq.view(torch.uint8))
        assert torch.equal(scales.cpu().view(torch.int32), cs.view(torch.int32))
        assert flag.item() == int(not torch.isfinite(x).all())
        assert_bitwise(x, pow2, q, scales)


@pytest.mark.gpu
@needs_cuda
def test_cuda_no_host_sync_and_graph():
    x = rows(256, 7168, torch.bfloat16).cuda()
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    quantize_fp8(x, flag=flag)  # compile and load outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        q, scales = quantize_fp8(x, flag=flag)
        quantize_fp8(x, pow2_scales=True, flag=flag)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert_bitwise(x.cpu(), False, q, scales)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gq, gs = quantize_fp8(x, flag=flag)
    x.copy_(rows(256, 7168, torch.bfloat16, 5, seed=9).cuda())
    graph.replay()
    assert_bitwise(x.cpu(), False, gq, gs)
    assert flag.item() == 0


@pytest.mark.gpu
@needs_cuda
def test_cuda_check_finite_and_misaligned_input():
    x = rows(4, 256, torch.float16).cuda()
    x[2, 9] = float("inf")
    raises_named(lambda: quantize_fp8(x, check_finite=True), "x")
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    quantize_fp8(x, flag=flag)
    assert flag.item() == 1
    buf = rows(1, 3 * 384 + 1, torch.bfloat16).cuda().reshape(-1)
    xm = buf[1:].view(3, 384)  # 2 bytes past a 16-byte boundary
    assert xm.data_ptr() % 16
    assert_bitwise(xm.cpu(), True, *quantize_fp8(xm, pow2_scales=True))
