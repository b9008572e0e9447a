// FP8 (e4m3fn) quantisation of token rows, one float32 scale per token per 128 channels (moonep/quant.py).
//
// Compiled at run time by NVRTC as the "quant" program of moonep/cuda_runtime.py, after common.cuh (its
// dtype codes, unpack16, warp indices and the per-group helpers q8_* below); also compiles alone:
// `nvcc -std=c++17 -arch=sm_90 -c csrc/quant.cu`.  The helpers live in common.cuh because the fp8 dispatch
// (csrc/dispatch.cu, warp_quant_fanout) quantises the tokens it sends with the same code.
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

// The grid quantises `nwords` 16-byte words of a contiguous [s, H] input (H % 128 == 0, 16-byte aligned):
// lane l of a warp takes word base + u*32 + l, so one group of 128 channels is L = 128 / VEC consecutive
// lanes (16 for bf16/fp16, 32 for fp32) and its amax is an xor-shuffle reduction among them. Four words per
// lane are loaded before any is used, to keep enough bytes in flight for HBM.
// q: e4m3fn bytes [s, H]; scales: float32 [s, H/128]; flag: int32 [1] or null.
// Wire layout (wb > 0, fp8 dispatch): row t of the output is wb = q8_wire_bytes(H) bytes, its H codes, its
// H/128 scales (float32) and zero padding, written through `q` (`scales` unused); `code` is ORed into *flag.
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
      unsigned c[VEC / 4];  // VEC codes, four per word
      bool bad;
      const float scale = q8_word<DT>(w[u], pow2, c, &bad);
      if (i < nwords && wb) {
        const i64 e = i * VEC, t = e / H, col = e - t * H;
        unsigned* d = (unsigned*)(q + t * wb + col);
#pragma unroll
        for (int j = 0; j < VEC / 4; ++j) d[j] = c[j];
        if ((lane & (L - 1)) == 0) {
          float* sc = (float*)(q + t * wb + H);
          const i64 g = col / Q8_GROUP;
          sc[g] = scale;
          if (g == H / Q8_GROUP - 1)  // the row's last group also zeroes the padding
            for (i64 k = g + 1; k < (wb - H) / 4; ++k) sc[k] = 0.f;
        }
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

// FP8 wire rows (moonep/fp8.py) for the host backends: x [s, H] -> [s, q8_wire_bytes(H)] bytes (codes, scales,
// padding) in one pass, moved by their row machinery as bytes. code: the bit ORed into *flag for a non-finite
// group.  (The NVLink dispatch quantises inside its send instead: warp_quant_fanout.)
#define Q8_WIRE_KERNEL(NAME, DT)                                                                           \
  extern "C" __global__ void __launch_bounds__(256) NAME(const int4* __restrict__ x, unsigned char* out, \
                                                         i64 nwords, int pow2, int* flag, int code, i64 H) { \
    q8_rows<DT>(x, out, nullptr, nwords, pow2 != 0, flag, code, H, q8_wire_bytes(H));                \
  }
Q8_WIRE_KERNEL(moonep_quant_wire_f32, DT_F32)
Q8_WIRE_KERNEL(moonep_quant_wire_bf16, DT_BF16)
Q8_WIRE_KERNEL(moonep_quant_wire_f16, DT_F16)
