// FP8 (e4m3fn) quantisation of token rows, one float32 scale per token per 128 channels (moonep/quant.py).
//
// Compiled at run time by NVRTC as the "quant" program of moonep/cuda_runtime.py, after common.cuh (its
// dtype codes, unpack16 and warp indices); also compiles alone: `nvcc -std=c++17 -arch=sm_90 -c csrc/quant.cu`.
// The per-group helpers (q8_scale, q8_pack2) are meant to be reused by a dispatch kernel that quantises the
// tokens it reads (issue #23): add this file to the "ep" program after common.cuh.
//
// Every floating operation is the torch path of moonep/quant.py one for one (explicit round-to-nearest
// intrinsics, no FMA contraction, no reciprocal approximation), so q and the scales are bit-identical:
//   amax  = max |x| over the group (exact in any order); a group holding inf/nan is "bad"
//   a     = max(amax, Q8_AMAX_MIN)            (448 * 2^-126: scale >= 2^-126, so 1/scale stays finite)
//   scale = a / 448                           or, pow2: 2^e, the smallest e with a <= 448 * 2^e (exact)
//   q     = e4m3fn(clamp(x * (1/scale), -448, 448)), 1/scale and the product rounded to nearest float32,
//           the cast to nearest even
//   bad group: scale = NaN, every q = 0x7F (NaN), and 1 ORed into *flag (when flag is not null).
#include "common.cuh"

#define Q8_GROUP 128                 // channels per scale
#define Q8_MAX 448.0f                // largest finite e4m3fn
#define Q8_AMAX_MIN_BITS 0x04E00000u // 448 * 2^-126 = 1.75 * 2^-118 (float32 bits)
#define Q8_NAN_BITS 0x7fc00000u      // the scale of a bad group (torch's float('nan'))
#define Q8_NAN_CODE 0x7Fu            // e4m3fn NaN, positive (torch's cast of float('nan'))
#define Q8_FLT_MAX 3.40282347e38f

__host__ __device__ __forceinline__ unsigned q8_f2u(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  unsigned u;
  __builtin_memcpy(&u, &f, 4);
  return u;
#endif
}

__host__ __device__ __forceinline__ float q8_u2f(unsigned u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
#endif
}

// Scale of a group from its amax (finite, >= 0); *inv = 1/scale, both rounded to nearest.
__host__ __device__ __forceinline__ float q8_scale(float amax, bool pow2, float* inv) {
  const float a = fmaxf(amax, q8_u2f(Q8_AMAX_MIN_BITS));
  float s;
  if (pow2) {
    // a = f * 2^E, f in [1, 2): a <= 448 * 2^e = 1.75 * 2^(e+8) holds first at e = E - 8 when f <= 1.75
    // (mantissa bits <= 0x600000), else at e = E - 7. a >= 1.75 * 2^-118 keeps e >= -126 (a normal float).
    const unsigned b = q8_f2u(a);
    const int e = (int)(b >> 23) - 127 - 8 + ((b & 0x7fffffu) > 0x600000u ? 1 : 0);
    s = q8_u2f((unsigned)(e + 127) << 23);
  } else {
#ifdef __CUDA_ARCH__
    s = __fdiv_rn(a, Q8_MAX);
#else
    s = a / Q8_MAX;
#endif
  }
#ifdef __CUDA_ARCH__
  *inv = __frcp_rn(s);
#else
  *inv = 1.0f / s;
#endif
  return s;
}

// e4m3fn code of a finite y with |y| <= 448, round to nearest even (the sign of zero kept): the portable
// conversion, bit-equal to torch's cast (tests/unit/test_quant.py checks it on the host against torch).
__host__ __device__ __forceinline__ unsigned q8_e4m3_soft(float y) {
  const unsigned u = q8_f2u(y), sign = (u >> 24) & 0x80u, a = u & 0x7fffffffu;
  unsigned m;
  if (a >= 0x3c800000u) {  // |y| >= 2^-6: a normal e4m3 value; drop 20 mantissa bits, ties to even
    m = ((a + 0x7ffffu + ((a >> 20) & 1u)) >> 20) - ((127u - 7u) << 3);  // a carry moves into the exponent
  } else {                 // subnormal e4m3 (steps of 2^-9): |y| * 2^9 = f * 2^-sh, rounded to an integer
    const unsigned e = a >> 23, f = (a & 0x7fffffu) | (e ? 0x800000u : 0u);
    const int sh = 141 - (int)(e ? e : 1);  // >= 21, as e <= 120
    if (sh > 24) {
      m = 0;  // |y| * 2^9 < 1/2
    } else {
      const unsigned r = f & ((1u << sh) - 1u), half = 1u << (sh - 1);
      m = f >> sh;
      m += (r > half || (r == half && (m & 1u))) ? 1u : 0u;  // may reach 8: 2^-6, the smallest normal
    }
  }
  return sign | m;
}

// Two clamped values -> 16 bits (lo in the low byte). sm_89+: one hardware conversion, round to nearest even
// as well (satfinite never triggers after the clamp); MOONEP_QUANT_SOFT_CVT forces the portable one.
__device__ __forceinline__ unsigned q8_pack2(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890 && !defined(MOONEP_QUANT_SOFT_CVT)
  unsigned short d;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(d) : "f"(hi), "f"(lo));  // a -> high byte, b -> low
  return d;
#else
  return q8_e4m3_soft(lo) | (q8_e4m3_soft(hi) << 8);
#endif
}

// v * inv rounded once, clamped.  The GPU may flush a subnormal v (bf16/fp32 inputs below 2^-126) to zero;
// that matters only in a group of tiny amax (inv > 2^100: otherwise |v * inv| < 2^-26 rounds to a signed
// zero in e4m3 anyway, and flushing keeps the sign).  There (`tiny`, uniform over the group's lanes)
// v = m * 2^-149 is multiplied as (m * 2^-100) * (inv * 2^-49): both factors normal and exact, one rounding.
__device__ __forceinline__ float q8_quant1(float v, float inv, bool tiny) {
  const unsigned u = __float_as_uint(v);
  float y;
  if (tiny && (u & 0x7f800000u) == 0u && (u & 0x007fffffu) != 0u) {
    const float m = __fmul_rn((float)(u & 0x007fffffu), 7.888609052210118e-31f);  // m * 2^-100
    y = copysignf(__fmul_rn(m, __fmul_rn(inv, 1.7763568394002505e-15f)), v);        // * inv * 2^-49
  } else {
    y = __fmul_rn(v, inv);
  }
  return fminf(fmaxf(y, -Q8_MAX), Q8_MAX);
}

// |v|, with inf/nan turned into +inf: the max over a group is then +inf exactly when the group is bad
// (fmaxf alone would drop a NaN).
__device__ __forceinline__ float q8_abs(float v) {
  const float m = fabsf(v);
  return m <= Q8_FLT_MAX ? m : __uint_as_float(0x7f800000u);
}

// The grid quantises `nwords` 16-byte words of a contiguous [s, H] input (H % 128 == 0, 16-byte aligned):
// lane l of a warp takes word base + u*32 + l, so one group of 128 channels is L = 128 / VEC consecutive
// lanes (16 for bf16/fp16, 32 for fp32) and its amax is an xor-shuffle reduction among them. Four words per
// lane are loaded before any is used, to keep enough bytes in flight for HBM.
// q: e4m3fn bytes [s, H]; scales: float32 [s, H/128]; flag: int32 [1] or null.
// Wire layout (wb > 0, fp8 dispatch): row t of the output is wb = H + 4 * H/128 bytes, its H codes then its
// H/128 scales (float32), written through `q` (`scales` unused); `code` is the value ORed into *flag.
template <int DT>
__device__ __forceinline__ void q8_rows(const int4* __restrict__ x, unsigned char* __restrict__ q,
                                        float* __restrict__ scales, i64 nwords, bool pow2, int* flag, int code = 1,
                                        i64 H = 0, i64 wb = 0) {
  constexpr int VEC = DT == DT_F32 ? 4 : 8;  // elements per 16-byte word
  constexpr int L = Q8_GROUP / VEC;          // lanes per group
  constexpr int U = 4;                       // words per lane in flight
  const int lane = threadIdx.x & 31;
  const i64 step = (i64)num_warps_global() * 32 * U;
  bool bad_seen = false;
  for (i64 base = (i64)warp_id_global() * 32 * U; base < nwords; base += step) {  // warp-uniform
    int4 w[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const i64 i = base + u * 32 + lane;
      w[u] = i < nwords ? __ldg(x + i) : make_int4(0, 0, 0, 0);  // whole groups are out of range together
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const i64 i = base + u * 32 + lane;
      float v[VEC];
      unpack16<DT>(w[u], v);
      float amax = 0.f;
#pragma unroll
      for (int j = 0; j < VEC; ++j) amax = fmaxf(amax, q8_abs(v[j]));
#pragma unroll
      for (int o = L / 2; o; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(FULL_MASK, amax, o));
      const bool bad = !(amax <= Q8_FLT_MAX);
      float inv, scale = q8_scale(amax, pow2, &inv);
      const bool tiny = inv > 1.2676506002282294e30f;  // 2^100: subnormal inputs count (see q8_quant1)
      unsigned c[VEC / 4];  // VEC codes, four per word
#pragma unroll
      for (int j = 0; j < VEC; j += 4) {
        const unsigned lo = q8_pack2(q8_quant1(v[j], inv, tiny), q8_quant1(v[j + 1], inv, tiny));
        const unsigned hi = q8_pack2(q8_quant1(v[j + 2], inv, tiny), q8_quant1(v[j + 3], inv, tiny));
        c[j / 4] = bad ? Q8_NAN_CODE * 0x01010101u : lo | (hi << 16);
      }
      if (bad) scale = __uint_as_float(Q8_NAN_BITS);
      if (i < nwords && wb) {  // wire rows are 4-byte aligned only (wb = 132 * H/128 bytes)
        const i64 e = i * VEC, t = e / H, col = e - t * H;
        unsigned* d = (unsigned*)(q + t * wb + col);
#pragma unroll
        for (int j = 0; j < VEC / 4; ++j) d[j] = c[j];
        if ((lane & (L - 1)) == 0) *(float*)(q + t * wb + H + 4 * (col / Q8_GROUP)) = scale;
        bad_seen |= bad;
      } else if (i < nwords) {
        if constexpr (VEC == 8) ((uint2*)q)[i] = make_uint2(c[0], c[1]);
        else ((unsigned*)q)[i] = c[0];
        if ((lane & (L - 1)) == 0) scales[i / L] = scale;
        bad_seen |= bad;
      }
    }
  }
  if (__any_sync(FULL_MASK, bad_seen) && lane == 0 && flag != nullptr) atomicOr(flag, code);
}

#define Q8_KERNEL(NAME, DT)                                                                                \
  extern "C" __global__ void __launch_bounds__(256) NAME(const int4* __restrict__ x, unsigned char* q,  \
                                                         float* scales, i64 nwords, int pow2, int* flag) { \
    q8_rows<DT>(x, q, scales, nwords, pow2 != 0, flag);                                                    \
  }
Q8_KERNEL(moonep_quant_f32, DT_F32)
Q8_KERNEL(moonep_quant_bf16, DT_BF16)
Q8_KERNEL(moonep_quant_f16, DT_F16)

// FP8 dispatch (moonep/fp8.py): x [s, H] -> wire rows [s, H + 4 * H/128] bytes (codes, then scales) in one
// pass, so the dispatch kernels move each token's codes and scales as one row of bytes. code: the input-error
// bit ORed into *flag for a non-finite group (the NVLink backend passes its routing flags word).
#define Q8_WIRE_KERNEL(NAME, DT)                                                                           \
  extern "C" __global__ void __launch_bounds__(256) NAME(const int4* __restrict__ x, unsigned char* out, \
                                                         i64 nwords, int pow2, int* flag, int code, i64 H) { \
    q8_rows<DT>(x, out, nullptr, nwords, pow2 != 0, flag, code, H, H + 4 * (H / Q8_GROUP));                \
  }
Q8_WIRE_KERNEL(moonep_quant_wire_f32, DT_F32)
Q8_WIRE_KERNEL(moonep_quant_wire_bf16, DT_BF16)
Q8_WIRE_KERNEL(moonep_quant_wire_f16, DT_F16)
