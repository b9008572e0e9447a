"""The fp8 dispatch's send path (``warp_quant_fanout`` in csrc/common.cuh: one warp quantises a token row and
stores its wire row into n destination rows) executed on the host: csrc/common.cuh compiled by g++ with a
shim in which 32 threads are the 32 lanes of one warp (every shuffle is an exchange through a barrier).  The
rows it writes must be, byte for byte, the wire rows of the torch path (codes and scales of
``quantize_fp8``, zero padding), in every destination, for every group layout (bf16: two groups per warp
word, fp32: one; batches of 32 scales; a last word half out of range), and it must report inf/nan.  Each
check runs on every compiled variant of ``MOONEP_FP8_WORDS`` (``VARIANTS``): the default fanout (16 codes and
one 16-byte store per lane, four groups per warp-wide store) at its default depth, the deepest and the
shallowest, and the narrow fanout (``0``).  fp16 differs from bf16 only in the unpacking (its conversion is
inline PTX), so it is left to the GPU tests.  CPU only; skipped without g++."""
from __future__ import annotations

import ctypes
import shutil
import subprocess

import numpy as np
import pytest
import torch

from moonep import cuda_runtime, fp8
from moonep.quant import quantize_fp8

SHIM = r'''
#include <cmath>
#include <cstring>
#include <pthread.h>
#define __device__ static inline
#define __host__
#define __forceinline__
#define __shared__ static
struct int4 { int x, y, z, w; };
struct uint2 { unsigned x, y; };
struct uint4 { unsigned x, y, z, w; };
struct float4 { float x, y, z, w; };
static inline int4 make_int4(int a, int b, int c, int d) { return {a, b, c, d}; }
static inline uint2 make_uint2(unsigned a, unsigned b) { return {a, b}; }
static inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
static inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
struct Dim3 { unsigned x, y, z; };
static thread_local Dim3 threadIdx;
static Dim3 blockIdx, blockDim = {32, 1, 1}, gridDim = {1, 1, 1};
static inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
static inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline int __float_as_int(float f) { int u; std::memcpy(&u, &f, 4); return u; }
static inline float __int_as_float(int u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
static inline void __syncthreads() {}
static inline void __threadfence() {}
static inline void __threadfence_system() {}
static inline void __syncwarp(unsigned = 0xffffffffu) {}
static inline int __ffs(unsigned v) { return __builtin_ffs((int)v); }
static inline int __popc(unsigned v) { return __builtin_popcount(v); }
static inline unsigned __vmaxu2(unsigned a, unsigned b) {  // per 16-bit half, unsigned
  return std::max(a & 0xffffu, b & 0xffffu) | (std::max(a >> 16, b >> 16) << 16);
}
template <typename T> static inline T __ldg(const T* p) { return *p; }
template <typename T> static inline T atomicAdd(T* p, T v) { T o = *p; *p += v; return o; }
template <typename T> static inline T atomicCAS(T* p, T c, T v) { T o = *p; if (o == c) *p = v; return o; }
using std::min;
using std::max;
static pthread_barrier_t g_bar;
static unsigned long long g_slot[32];
template <typename T> static inline T warp_xchg(T v, int src) {
  unsigned long long b = 0;
  std::memcpy(&b, &v, sizeof(T));
  g_slot[threadIdx.x & 31] = b;
  pthread_barrier_wait(&g_bar);
  b = g_slot[src & 31];
  T r;
  std::memcpy(&r, &b, sizeof(T));
  pthread_barrier_wait(&g_bar);
  return r;
}
template <typename T> static inline T __shfl_sync(unsigned, T v, int src) { return warp_xchg(v, src); }
template <typename T> static inline T __shfl_xor_sync(unsigned, T v, int o) {
  return warp_xchg(v, (int)(threadIdx.x & 31) ^ o);
}
static inline bool __any_sync(unsigned, bool p) {
  g_slot[threadIdx.x & 31] = p;
  pthread_barrier_wait(&g_bar);
  bool any = false;
  for (int l = 0; l < 32; ++l) any |= g_slot[l] != 0;
  pthread_barrier_wait(&g_bar);
  return any;
}
'''

HARNESS = r'''
struct Job { int dt, H, pow2, n, lane; const void* x; long long wb; char** dsts; int bad; };
static void* run_lane(void* a) {
  Job* j = (Job*)a;
  threadIdx.x = j->lane;
  j->bad = j->dt == DT_F32 ? warp_quant_fanout<DT_F32>(j->dsts, j->n, j->x, j->H, j->wb, j->pow2 != 0, j->lane)
                           : warp_quant_fanout<DT_BF16>(j->dsts, j->n, j->x, j->H, j->wb, j->pow2 != 0, j->lane);
  return nullptr;
}
extern "C" long long wire_bytes(long long H) { return q8_wire_bytes(H); }
extern "C" int fanout_words() { return MOONEP_FP8_WORDS; }
extern "C" void emulate(int dt, const void* x, int H, long long wb, int pow2, int n, unsigned char* out, int* bad) {
  pthread_barrier_init(&g_bar, nullptr, 32);
  char* d[32];
  for (int t = 0; t < n; ++t) d[t] = (char*)out + t * wb;
  Job jobs[32];
  pthread_t th[32];
  for (int l = 0; l < 32; ++l) {
    jobs[l] = Job{dt, H, pow2, n, l, x, wb, d, 0};
    pthread_create(&th[l], nullptr, run_lane, &jobs[l]);
  }
  for (int l = 0; l < 32; ++l) {
    pthread_join(th[l], nullptr);
    bad[l] = jobs[l].bad;
  }
  pthread_barrier_destroy(&g_bar);
}
'''

DT = {torch.float32: 0, torch.bfloat16: 1}  # csrc/common.cuh DT_F32, DT_BF16
# variant -> (the value of -DMOONEP_FP8_WORDS, or None; the MOONEP_FP8_WORDS the fanout compiles with)
VARIANTS = {"default": (None, 4), "words8": (8, 8), "words2": (2, 2), "narrow": (0, 0)}


@pytest.fixture(scope="module", params=list(VARIANTS))
def lib(request, tmp_path_factory):
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("needs g++")
    define, words = VARIANTS[request.param]
    d = tmp_path_factory.mktemp(f"q8send_{request.param}")
    (d / "emu.cpp").write_text(SHIM + f'#include "{cuda_runtime.csrc_dir() / "common.cuh"}"\n' + HARNESS)
    so = d / "libemu.so"
    flags = [] if define is None else [f"-DMOONEP_FP8_WORDS={define}"]
    r = subprocess.run([gxx, "-std=c++17", "-O1", "-ffp-contract=off", "-fPIC", "-shared", "-pthread", *flags,
                        str(d / "emu.cpp"), "-o", str(so)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    lib = ctypes.CDLL(str(so))
    lib.wire_bytes.restype = ctypes.c_longlong
    lib.wire_bytes.argtypes = [ctypes.c_longlong]
    assert lib.fanout_words() == words  # the switch reached the fanout
    return lib


def send(lib, x: torch.Tensor, pow2: bool, n: int):
    """Rows [n, wire_bytes(H)] written by one emulated warp (initialised to 0xA5 so that a byte left unwritten
    shows) and whether it reported inf/nan (the same on every lane)."""
    H = x.shape[0]
    wb = fp8.wire_bytes(H)
    xs = x.contiguous()
    raw = xs.view(torch.int16).numpy() if xs.dtype == torch.bfloat16 else xs.numpy()
    out = np.full((max(n, 1), wb), 0xA5, np.uint8)
    bad = np.zeros(32, np.int32)
    lib.emulate(DT[x.dtype], ctypes.c_void_p(raw.ctypes.data), H, ctypes.c_longlong(wb), int(pow2), n,
                ctypes.c_void_p(out.ctypes.data), ctypes.c_void_p(bad.ctypes.data))
    assert len(set(bad.tolist())) == 1, bad
    return out[:n], bool(bad[0])


def want_row(x: torch.Tensor, pow2: bool) -> np.ndarray:
    q, sc = quantize_fp8(x[None], pow2_scales=pow2, check_finite=False)
    return fp8.pack_pair(q, sc)[0].numpy()


def test_wire_bytes_agree(lib):
    for H in (128, 256, 384, 512, 640, 4224, 7168, 8192 + 384):
        wb = fp8.wire_bytes(H)
        assert lib.wire_bytes(H) == wb and wb % 128 == 0 and 0 <= wb - (H + 4 * (H // 128)) < 128
    assert fp8.wire_bytes(7168) == 7424  # the DeepSeek-V3 hidden size: 7392 bytes of codes and scales, 32 of zeros
    assert fp8.wire_bytes(4096) == 4224  # H % 4096 == 0: no padding


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("H", [128, 256, 384, 512, 640, 4224, 4096 + 384, 7168])
def test_send_rows_are_the_wire_rows(lib, dtype, H):
    g = torch.Generator().manual_seed(H)
    for pow2 in (False, True):
        x = (torch.randn(H, generator=g, dtype=torch.float64) * torch.exp2(torch.randint(-30, 30, (H // 128,),
             generator=g).double()).repeat_interleave(128)).to(dtype)
        if H >= 256:
            x[128:256] = 0  # a zero group
        if H >= 512:
            x[384:512] = x[384:512] * 2.0 ** -122  # a tiny group, subnormal inputs in it
        want = want_row(x, pow2)
        for n in (0, 1, 3):
            rows, bad = send(lib, x, pow2, n)
            assert not bad
            for t in range(n):
                if not np.array_equal(rows[t], want):
                    i = int(np.argmax(rows[t] != want))
                    raise AssertionError(f"H={H} {dtype} pow2={pow2} row {t}: byte {i} is {rows[t][i]:#x}, "
                                         f"want {want[i]:#x} (codes end at {H}, scales at {H + H // 32})")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bad_at", [0, 130, -1])
@pytest.mark.parametrize("H", [640, 4224])
def test_send_reports_non_finite(lib, dtype, bad_at, H):
    # 4224: 33 groups, the last one alone in its scale batch (and in the warp's last word); 640: a last warp
    # word with one group of five (16-channel fanout) or half out of range (narrow fanout, bf16)
    x = torch.randn(H, generator=torch.Generator().manual_seed(5)).to(dtype)
    x[bad_at] = float("nan") if bad_at else float("inf")
    rows, bad = send(lib, x, False, 2)
    assert bad
    want = want_row(x, False)
    assert np.array_equal(rows[0], want) and np.array_equal(rows[1], want)
    g = (bad_at % H) // 128
    assert bool(torch.isnan(fp8.split_wire(torch.from_numpy(rows), H)[1][0, g]))
    assert send(lib, x, False, 0)[1]  # n == 0: checked without storing


@pytest.mark.parametrize("H", [128, 384, 512, 7168])
def test_wire_rows_layout(H):
    """quantize_wire (the host backends' rows) and pack_pair: codes, scales, zero padding; split_wire inverts."""
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(H)).to(torch.bfloat16)
    q, sc = quantize_fp8(x, pow2_scales=True)
    wire = fp8.quantize_wire(x, pow2_scales=True)
    assert wire.shape == (5, fp8.wire_bytes(H)) and wire.dtype == torch.uint8
    assert torch.equal(wire, fp8.pack_pair(q, sc))
    assert not bool(wire[:, H + 4 * (H // 128):].any())
    gq, gs = fp8.split_wire(wire, H)
    assert torch.equal(gq.view(torch.uint8), q.view(torch.uint8)) and torch.equal(gs, sc)
    back = fp8.wire_rows(gq)  # the rows behind the codes view (h.tokens), padding included
    assert back.data_ptr() == wire.data_ptr() and torch.equal(back, wire)
    with pytest.raises(ValueError, match="tokens"):
        fp8.wire_rows(q)  # contiguous codes: no wire rows behind them
