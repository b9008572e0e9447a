// Float32 slot GEMMs with the slot offsets read on the device: the expert GEMMs of moonep/experts.py for
// float32 on CUDA, where torch has no grouped GEMM.  The alternative, a loop of one cuBLAS GEMM per slot,
// reads the offsets on the host: a sync, and no CUDA-graph capture.
//
// Rows are grouped by slot: slot j owns rows cu[j] .. cu[j+1]-1 of a [cap, D]; rows from cu[G] on are padding.
// A slot's weight is home[j] for j < n_home, else rep[j - n_home] (the home experts in place, the replicas
// in the pool), each read through strides, so transposed views need no copy.
// Every output element is one float32 sum in increasing k (fixed order: the same bits every call).

#define SG_T 64       // output tile: SG_T x SG_T, 256 threads with 4 x 4 each
#define SG_K 16       // k step of one shared-memory stage

typedef long long sg_i64;

struct SgWeights {
  const float* home;
  const float* rep;
  sg_i64 hs0, hs1, hs2;   // home strides (slot, k, n) in elements
  sg_i64 rs0, rs1, rs2;   // replica strides
  int n_home;
};

__device__ __forceinline__ float sg_w(const SgWeights& w, int j, int k, int n) {
  return j < w.n_home ? w.home[j * w.hs0 + k * w.hs1 + n * w.hs2]
                      : w.rep[(j - w.n_home) * w.rs0 + k * w.rs1 + n * w.rs2];
}

// One SG_K step of a thread's 4 x 4 outputs from the shared tiles (k increasing: the fixed summation order).
__device__ __forceinline__ void sg_tile_fma(const float (&As)[SG_K][SG_T + 4], const float (&Bs)[SG_K][SG_T + 4],
                                            float (&acc)[4][4], int tx, int ty) {
#pragma unroll
  for (int kk = 0; kk < SG_K; ++kk) {
    float av[4], bv[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) av[i] = As[kk][ty * 4 + i], bv[i] = Bs[kk][tx * 4 + i];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[i][q] = fmaf(av[i], bv[q], acc[i][q]);
  }
}

// A thread's 4 x 4 outputs into rows row0 + 4*ty + i < row_end, columns n0 + 4*tx + q < N of o (row stride ld).
__device__ __forceinline__ void sg_store(const float (&acc)[4][4], float* o, sg_i64 ld, int row0, int row_end,
                                         int n0, int N, int tx, int ty) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = row0 + ty * 4 + i;
    if (r >= row_end) continue;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int n = n0 + tx * 4 + q;
      if (n < N) o[r * ld + n] = acc[i][q];
    }
  }
}

// out[r, :] = a[r, :] @ W_slot(r) for every row r < cu[G]; rows cu[G] .. cap-1 are set to zero.
// Grid: x = ceil(N / SG_T), y >= ceil(cap / SG_T) + G + 1: block y is the t-th 64-row tile of the slot rows
// (tiles never straddle slots), or after them a tile of padding rows.  Block: 256 threads.
extern "C" __global__ void __launch_bounds__(256) moonep_slot_gemm_f32(
    const float* __restrict__ a, sg_i64 lda, const int* __restrict__ cu, int G, const float* home, sg_i64 hs0,
    sg_i64 hs1, sg_i64 hs2, int n_home, const float* rep, sg_i64 rs0, sg_i64 rs1, sg_i64 rs2,
    float* __restrict__ out, sg_i64 ldo, int cap, int D, int N) {
  __shared__ float As[SG_K][SG_T + 4];
  __shared__ float Bs[SG_K][SG_T + 4];
  const SgWeights w{home, rep, hs0, hs1, hs2, rs0, rs1, rs2, n_home};
  const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4, n0 = blockIdx.x * SG_T;
  int t = blockIdx.y, slot = -1, r0 = 0, r1 = 0;
  for (int j = 0; j < G; ++j) {
    const int lo = cu[j], n = cu[j + 1] - lo, nt = (n + SG_T - 1) / SG_T;
    if (t < nt) {
      slot = j, r0 = lo + t * SG_T, r1 = min(r0 + SG_T, lo + n);
      break;
    }
    t -= nt;
  }
  if (slot < 0) {  // a padding tile
    r0 = cu[G] + t * SG_T;
    r1 = min(r0 + SG_T, cap);
    for (int e = tid; e < SG_T * SG_T; e += 256) {
      const int r = r0 + e / SG_T, n = n0 + e % SG_T;
      if (r < r1 && n < N) out[r * ldo + n] = 0.f;
    }
    return;
  }
  float acc[4][4] = {};
  for (int k0 = 0; k0 < D; k0 += SG_K) {
    for (int e = tid; e < SG_K * SG_T; e += 256) {
      const int kk = e % SG_K, rr = e / SG_K;      // A: k fastest (row-major a)
      const int r = r0 + rr, k = k0 + kk;
      As[kk][rr] = (r < r1 && k < D) ? a[r * lda + k] : 0.f;
      const int nn = e % SG_T, kb = e / SG_T;      // B: n fastest
      const int n = n0 + nn, kw = k0 + kb;
      Bs[kb][nn] = (n < N && kw < D) ? sg_w(w, slot, kw, n) : 0.f;
    }
    __syncthreads();
    sg_tile_fma(As, Bs, acc, tx, ty);
    __syncthreads();
  }
  sg_store(acc, out, ldo, r0, r1, n0, N, tx, ty);
}

// Weight gradient of every slot: out[j] = a[rows of j]^T @ g[rows of j], out float32 [G, D, N] contiguous
// (zero for an empty slot).  a: [cap, D] (row stride lda), g: [cap, N] (row stride ldg).
// Grid: (ceil(N / SG_T), ceil(D / SG_T), G); block: 256 threads.
extern "C" __global__ void __launch_bounds__(256) moonep_slot_wgrad_f32(
    const float* __restrict__ a, sg_i64 lda, const float* __restrict__ g, sg_i64 ldg, const int* __restrict__ cu,
    float* __restrict__ out, int D, int N) {
  __shared__ float As[SG_K][SG_T + 4];
  __shared__ float Bs[SG_K][SG_T + 4];
  const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
  const int n0 = blockIdx.x * SG_T, d0 = blockIdx.y * SG_T, j = blockIdx.z;
  const int lo = cu[j], hi = cu[j + 1];
  float acc[4][4] = {};
  for (int k0 = lo; k0 < hi; k0 += SG_K) {  // k runs over the slot's rows
    for (int e = tid; e < SG_K * SG_T; e += 256) {
      const int c = e % SG_T, kk = e / SG_T;   // both operands: columns fastest (row-major a and g)
      const int r = k0 + kk;
      As[kk][c] = (r < hi && d0 + c < D) ? a[r * lda + d0 + c] : 0.f;
      Bs[kk][c] = (r < hi && n0 + c < N) ? g[r * ldg + n0 + c] : 0.f;
    }
    __syncthreads();
    sg_tile_fma(As, Bs, acc, tx, ty);
    __syncthreads();
  }
  sg_store(acc, out + (sg_i64)j * D * N, N, d0, D, n0, N, tx, ty);
}

// Row moves for the grouped GEMMs of bf16/fp16 expert layers (moonep/experts.py).  A grouped GEMM starts its
// first group at row 0 and writes only its groups' rows: the replica slots' rows, cu[n_home] .. cu[G]-1, go to
// the front of a scratch buffer (moonep_rows_front), and their products in behind the home rows' products
// (moonep_rows_back, which also zeroes the padding rows).  Only those rows move, their count read on the device:
// a step whose replica slots are empty moves nothing but the padding's zeros.  Each row is `words` words of type
// W (16, 8, 4, 2 or 1 bytes: the largest that divides the row size, strides and addresses); strides in bytes.
template <typename W>
__device__ __forceinline__ void sg_move_rows(char* dst, sg_i64 ds, const char* src, sg_i64 ss, sg_i64 first,
                                             sg_i64 n, sg_i64 words) {
  for (sg_i64 r = blockIdx.x; r < n; r += gridDim.x) {
    const W* s = (const W*)(src + (first + r) * ss);
    W* d = (W*)(dst + r * ds);
    for (sg_i64 x = threadIdx.x; x < words; x += blockDim.x) d[x] = s[x];
  }
}

template <typename W>
__device__ __forceinline__ void sg_fill_back(char* out, sg_i64 os, const char* rep, sg_i64 rs, sg_i64 first,
                                             sg_i64 end, sg_i64 cap, sg_i64 words) {
  const W zero{};
  for (sg_i64 r = first + blockIdx.x; r < cap; r += gridDim.x) {
    W* d = (W*)(out + r * os);
    if (r < end) {
      const W* s = (const W*)(rep + (r - first) * rs);
      for (sg_i64 x = threadIdx.x; x < words; x += blockDim.x) d[x] = s[x];
    } else {
      for (sg_i64 x = threadIdx.x; x < words; x += blockDim.x) d[x] = zero;
    }
  }
}

// dst[i] = src[cu[n_home] + i] for i < cu[G] - cu[n_home] (dst's other rows are not written).
extern "C" __global__ void moonep_rows_front(char* dst, sg_i64 ds, const char* src, sg_i64 ss, const int* cu,
                                             int n_home, int G, sg_i64 row_bytes, int vec) {
  const sg_i64 first = cu[n_home], n = (sg_i64)cu[G] - first;
  const sg_i64 words = row_bytes / vec;
  switch (vec) {
    case 16: sg_move_rows<int4>(dst, ds, src, ss, first, n, words); break;
    case 8: sg_move_rows<long long>(dst, ds, src, ss, first, n, words); break;
    case 4: sg_move_rows<int>(dst, ds, src, ss, first, n, words); break;
    case 2: sg_move_rows<short>(dst, ds, src, ss, first, n, words); break;
    default: sg_move_rows<char>(dst, ds, src, ss, first, n, words); break;
  }
}

// out[r] for cu[n_home] <= r < cap: rep[r - cu[n_home]] while r < cu[G], zero after (in place; out's rows before
// cu[n_home] are not touched).  With n_home == G it only zeroes the padding rows.
extern "C" __global__ void moonep_rows_back(char* out, sg_i64 os, const char* rep, sg_i64 rs, const int* cu,
                                            int n_home, int G, sg_i64 cap, sg_i64 row_bytes, int vec) {
  const sg_i64 first = cu[n_home], end = cu[G];
  const sg_i64 words = row_bytes / vec;
  switch (vec) {
    case 16: sg_fill_back<int4>(out, os, rep, rs, first, end, cap, words); break;
    case 8: sg_fill_back<long long>(out, os, rep, rs, first, end, cap, words); break;
    case 4: sg_fill_back<int>(out, os, rep, rs, first, end, cap, words); break;
    case 2: sg_fill_back<short>(out, os, rep, rs, first, end, cap, words); break;
    default: sg_fill_back<char>(out, os, rep, rs, first, end, cap, words); break;
  }
}
