// moonep NVLink transport: device helpers and the context block shared by the "ep" program's kernels.
//
// Compiled at run time by NVRTC: moonep/cuda_runtime.py concatenates this file in front of route.cu,
// dispatch.cu, combine.cu and replicas.cu (the "ep" program); each of them also compiles alone, e.g.
// `nvcc -std=c++17 -arch=sm_90 --ptx csrc/dispatch.cu`.
// No CUDA headers are needed: bf16/fp16 conversions are written out below.
//
// Synchronisation model (see docs/design.md, "NVLink transport"):
//   * Every rank owns one symmetric allocation with the same layout on all ranks; `Ctx::base[p]` is
//     rank p's allocation as mapped in this process (CUDA IPC).  Offsets are identical on every rank.
//   * Two signal arrays per rank, `esig[R]` (entry) and `dsig[R]` (data ready).  Rank p writes its
//     monotonically increasing epoch into slot `me` of every peer's array with a release store at system
//     scope; a waiter spins with acquire loads until every slot reached the epoch it expects.  Epochs
//     live in device memory (`ctr`), so no reset is ever needed and CUDA-graph replays keep counting.
//   * Every collective kernel sequence starts with an entry barrier (peers finished reading what we are
//     about to overwrite) and publishes its writes with a data-ready signal from the last block to
//     finish (threadfence-reduction pattern).
//   * A wait that exceeds `timeout_ns` (measured with %globaltimer) records a fatal error in a device
//     word and in host-mapped memory, and returns.  Once the fatal word is set every later kernel skips
//     its work, so a dead peer costs one timeout, not one per kernel.
#pragma once

typedef unsigned long long u64;
typedef long long i64;

#define MAXR 64

#define FULL_MASK 0xffffffffu
#define MAX_WARPS 32   // warps per block (per-warp shared-memory scratch)

// Error codes (low 8 bits); bits 8.. carry a rank.
#define ERR_TIMEOUT 1      // fatal: peer (bits 8..) did not signal in time
#define ERR_BAD_IDX 1      // input (bit mask): expert id out of [-1, E)
#define ERR_DUP_IDX 2      // input: repeated expert in one token
#define ERR_NONFINITE 4    // input: non-finite routing weight
#define ERR_TOTAL 8        // input: num_global_tokens disagrees with the sum of s
#define ERR_NONFINITE_X 16 // input: non-finite token (fp8 dispatch quantises x; csrc/quant.cu)

// Dtype codes (moonep/backends/nvlink_abi.py DT).
#define DT_F32 0
#define DT_BF16 1
#define DT_F16 2

// Counter slots in Ctx::ctr (local device memory of this rank).
#define CTR_ENTRY 0
#define CTR_DATA 1
#define CTR_TAG 2
#define CTR_DONE 3
#define CTR_GATHER 4       // counts gathers so far (parity picks the half of the gather area)
#define CTR_CHUNK 8        // 8..15: per-chunk arrival counters of the fused kernels' NVLink blocks
#define CTR_WORDS 16

// Fused dispatch/combine: the NVLink blocks publish their work in MAX_CHUNKS chunks of source tokens,
// chunk(i) = i * nch / S, each with its own signal array csig[chunk][R] (values: the kernel's data epoch).
#define MAX_CHUNKS 8
// Dispatch tags: epoch (bits 63..32) | first row (bits 31..0).

// Context block, one per NVLink backend object, filled by moonep/backends/nvlink.py from the declaration in
// moonep/backends/nvlink_abi.py (CTX_FIELDS; tests/unit/test_cuda_abi.py checks that the two agree, with
// MAXR, CTR_WORDS, MAX_CHUNKS, the error and dtype codes).  Every field is 8 bytes.
struct Ctx {
  i64 rank, R, S, K, H, cap, E2, timeout_ns;                          // 0..7
  u64* ctr;                                                            // 8: local counters [CTR_WORDS]
  int* derr;                                                           // 9: local fatal word
  int* herr;                                                           // 10: host-mapped [0]=fatal, [1]=input
  i64 off_esig, off_dsig, off_gather, off_recv, off_w, off_tag, off_meta, off_msrc, off_acc, off_gwacc;  // 11..20
  i64 off_csig;                                                        // 21: chunk signals [MAX_CHUNKS][R]
  i64 off_flist;                                                       // 22: int [R, S] first rows (fused)
  i64 pad[9];                                                          // 23..31
  char* base[MAXR];                                                    // 32..95   main allocation per rank
  char* gbase[MAXR];                                                   // 96..159  gradient receive buffer
  char* pbase[MAXR];                                                   // 160..223 replica weight pool
};

// ---------------------------------------------------------------------------------------------------
// Memory-model primitives
// ---------------------------------------------------------------------------------------------------
__device__ __forceinline__ u64 ld_acquire_sys(const u64* p) {
  u64 v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys(u64* p, u64 v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ u64 now_ns() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ u64 ld_volatile(const u64* p) { return *(const volatile u64*)p; }

__device__ __forceinline__ bool is_fatal(const Ctx* c) { return *(const volatile int*)c->derr != 0; }

__device__ void set_fatal(const Ctx* c, int code) {
  if (atomicCAS(c->derr, 0, code) == 0) {
    *(volatile int*)&c->herr[0] = code;
    __threadfence_system();
  }
}

__device__ void set_input_error(const Ctx* c, int code) {
  volatile int* h = (volatile int*)&c->herr[1];
  if (*h == 0) {
    *h = code;
    __threadfence_system();
  }
}

// ---------------------------------------------------------------------------------------------------
// Signals.  All functions are called by every thread of the block.
// ---------------------------------------------------------------------------------------------------
// Store `value` into slot `rank` of signal array `off` on every rank (itself included).
__device__ void signal_all(const Ctx* c, i64 off, u64 value) {
  __threadfence_system();  // every thread publishes its own earlier stores (peer memory included)
  __syncthreads();
  for (int p = threadIdx.x; p < (int)c->R; p += blockDim.x)
    st_release_sys((u64*)(c->base[p] + off) + c->rank, value);
}

// Signal array of chunk ch on rank p (fused kernels, below): csig[ch][R].
__device__ __forceinline__ u64* chunk_sig(const Ctx* c, int p, int ch) {
  return (u64*)(c->base[p] + c->off_csig) + (i64)ch * c->R;
}

// Wait (every thread of the block) until a signal array of this rank reached `target` in every slot:
//   CHUNK false: the array at offset `where` of this rank's allocation (esig, dsig), every rank's slot;
//   CHUNK true: the signal array of chunk `where` (csig), the peers' slots.
// Returns false (and skips waiting) when a fatal error is set or a wait times out (recorded, naming the
// rank that did not signal).
template <bool CHUNK>
__device__ bool wait_signals(const Ctx* c, i64 where, u64 target) {
  __shared__ int s_bad;
  if (threadIdx.x == 0) s_bad = is_fatal(c) ? 1 : 0;
  __syncthreads();
  if (s_bad) return false;
  const int me = (int)c->rank;
  const u64* sig = CHUNK ? chunk_sig(c, me, (int)where) : (const u64*)(c->base[c->rank] + where);
  for (int p = threadIdx.x; p < (int)c->R; p += blockDim.x) {
    if (CHUNK && p == me) continue;
    u64 t0 = now_ns();
    unsigned spins = 0;
    while (ld_acquire_sys(sig + p) < target) {
      if ((++spins & 255u) == 0) {
        if (is_fatal(c)) { s_bad = 1; break; }
        if ((i64)(now_ns() - t0) > c->timeout_ns) {
          set_fatal(c, ERR_TIMEOUT | (p << 8));
          s_bad = 1;
          break;
        }
      }
    }
  }
  __syncthreads();
  __threadfence();
  int bad = s_bad;
  __syncthreads();
  return bad == 0;
}

// Wait until every slot of this rank's signal array `off` reached `target` (see wait_signals).
__device__ __forceinline__ bool wait_all(const Ctx* c, i64 off, u64 target) {
  return wait_signals<false>(c, off, target);
}

// Entry barrier, fused at the start of a "send" kernel: every block stores the same epoch (idempotent)
// and waits for all peers.  Returns the epoch to commit at the end, and ok=false on fatal errors.
__device__ bool entry_barrier(const Ctx* c, u64* epoch) {
  u64 ne = ld_volatile(&c->ctr[CTR_ENTRY]) + 1;
  *epoch = ne;
  signal_all(c, c->off_esig, ne);
  return wait_all(c, c->off_esig, ne);
}

// Optional entry barrier: with barrier == 0 the caller knows that every peer already passed a barrier
// after its last read of the areas this kernel writes (see nvlink.py); the entry epoch is left as it is.
__device__ __forceinline__ bool maybe_entry_barrier(const Ctx* c, int barrier, u64* epoch) {
  if (barrier) return entry_barrier(c, epoch);
  *epoch = ld_volatile(&c->ctr[CTR_ENTRY]);
  __shared__ int s_f;
  if (threadIdx.x == 0) s_f = is_fatal(c) ? 1 : 0;
  __syncthreads();
  return s_f == 0;
}

// End of a "send" kernel: the last block to finish commits the entry epoch, bumps the data epoch (and,
// if `bump_tag`, the dispatch tag epoch) and signals data ready to every rank.
__device__ void finish_send(const Ctx* c, u64 entry_epoch, bool bump_tag) {
  __shared__ int s_last;
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) {
    u64 prev = atomicAdd(&c->ctr[CTR_DONE], 1ull);
    s_last = (prev == (u64)(gridDim.x - 1));
    if (s_last) {
      __threadfence();
      c->ctr[CTR_DONE] = 0;
      c->ctr[CTR_ENTRY] = entry_epoch;
      c->ctr[CTR_DATA] = ld_volatile(&c->ctr[CTR_DATA]) + 1;
      if (bump_tag) c->ctr[CTR_TAG] = ld_volatile(&c->ctr[CTR_TAG]) + 1;
      __threadfence();
    }
  }
  __syncthreads();
  if (s_last) signal_all(c, c->off_dsig, ld_volatile(&c->ctr[CTR_DATA]));
}

// Start of a "receive" kernel: wait until every peer's data of the current epoch is visible.
__device__ __forceinline__ bool wait_data(const Ctx* c) {
  return wait_all(c, c->off_dsig, ld_volatile(&c->ctr[CTR_DATA]));
}

// ---------------------------------------------------------------------------------------------------
// Fused kernels (moonep_dispatch_fused, moonep_combine_fused).  Blocks [0, nnv) drive NVLink and publish
// chunk c of the source tokens with a signal in csig[c][me] on every peer; blocks [nnv, grid) do the
// local HBM work and wait for chunk signals of the peers (never of their own rank's blocks, never of a
// higher-numbered block: no block waits for one that may not be scheduled yet).  The last block of the
// grid to finish commits the counters.  Every block reads the counters at its start: they change only in
// finish_fused, after every block arrived.
// ---------------------------------------------------------------------------------------------------

// Called by every thread of an NVLink block when it finished chunk ch: the last of the nnv NVLink blocks
// to get here signals chunk ch (value de) to every peer.
__device__ void chunk_done(const Ctx* c, int ch, int nnv, u64 de) {
  __shared__ int s_last_ch;
  __threadfence_system();  // this block's peer stores of chunk ch are visible system-wide
  __syncthreads();
  if (threadIdx.x == 0) {
    u64 prev = atomicAdd(&c->ctr[CTR_CHUNK + ch], 1ull);
    s_last_ch = prev == (u64)(nnv - 1);
    if (s_last_ch) {
      c->ctr[CTR_CHUNK + ch] = 0;  // the next fused kernel is stream-ordered after this one
      __threadfence_system();      // cumulativity: every NVLink block's fenced stores before the signal
    }
  }
  __syncthreads();
  if (s_last_ch) {
    __threadfence_system();
    const int me = (int)c->rank;
    for (int p = threadIdx.x; p < (int)c->R; p += blockDim.x)
      if (p != me) st_release_sys(chunk_sig(c, p, ch) + me, de);
  }
}

// The NVLink blocks' part of a fused kernel (every thread): the entry barrier (if `barrier`), then for each
// chunk ch the block's share of its work, work(ch) (skipped after a fatal error), and the chunk's signal (sent
// even then: a fatal error makes every later wait return at once).  Returns the entry epoch for finish_fused.
template <typename F>
__device__ __forceinline__ u64 nvlink_chunks(const Ctx* c, int barrier, int nnv, int nch, u64 de, F work) {
  u64 ne;
  const bool ok = maybe_entry_barrier(c, barrier, &ne);
  for (int ch = 0; ch < nch; ++ch) {
    if (ok) work(ch);
    chunk_done(c, ch, nnv, de);
  }
  return ne;
}

// Wait (every thread of the block) until every peer signalled chunk ch with an epoch >= de (see wait_signals).
__device__ __forceinline__ bool wait_chunk(const Ctx* c, int ch, u64 de) { return wait_signals<true>(c, ch, de); }

// End of a fused kernel (every block, every thread): the last block commits the entry epoch, the data
// epoch and (bump_tag) the dispatch tag epoch.  No signal: the chunk signals carried the data.
__device__ void finish_fused(const Ctx* c, u64 entry_epoch, u64 de, bool bump_tag) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    u64 prev = atomicAdd(&c->ctr[CTR_DONE], 1ull);
    if (prev == (u64)(gridDim.x - 1)) {
      __threadfence();
      c->ctr[CTR_DONE] = 0;
      c->ctr[CTR_ENTRY] = entry_epoch;
      c->ctr[CTR_DATA] = de;
      if (bump_tag) c->ctr[CTR_TAG] = ld_volatile(&c->ctr[CTR_TAG]) + 1;
      __threadfence();
    }
  }
}

// Token range [lo, hi) of chunk ch (chunk(i) = i * nch / S), clipped to s.
__device__ __forceinline__ void chunk_range(i64 S, int nch, int ch, int s, int* lo, int* hi) {
  i64 a = ((i64)ch * S + nch - 1) / nch, b = ((i64)(ch + 1) * S + nch - 1) / nch;
  *lo = (int)(a < s ? a : s);
  *hi = (int)(b < s ? b : s);
}
__device__ __forceinline__ int chunk_of(i64 i, i64 S, int nch) { return (int)((i * nch) / S); }

// ---------------------------------------------------------------------------------------------------
// L2-only loads (ld.global.cg) for memory that peers write while this kernel runs: the L1 of this SM
// may hold a line from before the peer's chunk signal (small rows share lines).
__device__ __forceinline__ int4 ld_cg_v4(const void* p) {
  int4 v;
  asm volatile("ld.global.cg.v4.s32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ u64 ld_cg_u64(const void* p) {
  u64 v;
  asm volatile("ld.global.cg.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ unsigned ld_cg_u32(const void* p) {
  unsigned v;
  asm volatile("ld.global.cg.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ unsigned short ld_cg_u16(const void* p) {
  unsigned short v;
  asm volatile("ld.global.cg.u16 %0, [%1];" : "=h"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ int ld_cg_i32(const void* p) { return (int)ld_cg_u32(p); }
__device__ __forceinline__ float ld_cg_f32(const void* p) { return __uint_as_float(ld_cg_u32(p)); }

// Loads of a source row: plain, or L2-only (CG) for a row a peer wrote during this kernel.
template <bool CG> __device__ __forceinline__ int4 ld_src(const int4* p) {
  if constexpr (CG) return ld_cg_v4(p); else return *p;
}
template <bool CG> __device__ __forceinline__ unsigned ld_src(const unsigned* p) {
  if constexpr (CG) return ld_cg_u32(p); else return *p;
}
template <bool CG> __device__ __forceinline__ unsigned short ld_src(const unsigned short* p) {
  if constexpr (CG) return ld_cg_u16(p); else return *p;
}
template <bool CG> __device__ __forceinline__ float ld_src(const float* p) {
  if constexpr (CG) return ld_cg_f32(p); else return *p;
}

// ---------------------------------------------------------------------------------------------------
// Element conversions (round to nearest even, as torch's casts do)
// ---------------------------------------------------------------------------------------------------
__device__ __forceinline__ float bf16_to_f(unsigned short b) { return __uint_as_float(((unsigned)b) << 16); }

__device__ __forceinline__ unsigned short f_to_bf16(float f) {
  unsigned u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return (unsigned short)(u >> 16);
}

__device__ __forceinline__ float f16_to_f(unsigned short h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}

__device__ __forceinline__ unsigned short f_to_f16(float f) {
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}

// Element i of a row of dtype dt, as a float (CG: L2-only load, see ld_src).
template <bool CG = false>
__device__ __forceinline__ float load_f(const void* p, i64 i, int dt) {
  if (dt == DT_F32) return ld_src<CG>((const float*)p + i);
  unsigned short v = ld_src<CG>((const unsigned short*)p + i);
  return dt == DT_BF16 ? bf16_to_f(v) : f16_to_f(v);
}

__device__ __forceinline__ void store_f(void* p, i64 i, int dt, float v) {
  if (dt == DT_F32) ((float*)p)[i] = v;
  else ((unsigned short*)p)[i] = dt == DT_BF16 ? f_to_bf16(v) : f_to_f16(v);
}

// Round a float to the precision of dtype dt and back (the result of an op computed in that dtype).
__device__ __forceinline__ float round_to(float v, int dt) {
  if (dt == DT_F32) return v;
  return dt == DT_BF16 ? bf16_to_f(f_to_bf16(v)) : f16_to_f(f_to_f16(v));
}

// ---------------------------------------------------------------------------------------------------
// Copies.  `vec` is the widest access every pointer and the byte count allow: 16, 4 or 2.  CG: the source
// is read with L2-only loads (see ld_src).
// ---------------------------------------------------------------------------------------------------
// One warp copies one source row (`nbytes`, 16-byte aligned, nbytes % 16 == 0) into `n` destination rows
// (`dsts`, any mix of local and peer memory): every 16-byte word is loaded once and stored n times, with
// four words per lane in flight.
template <bool CG = false>
__device__ __forceinline__ void warp_fanout16(char* const* dsts, int n, const void* src, i64 nbytes, int lane) {
  const int4* s = (const int4*)src;
  const i64 nw = nbytes >> 4;
  for (i64 j = lane; j < nw; j += 32 * 4) {
    int4 v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u)
      if (j + u * 32 < nw) v[u] = ld_src<CG>(s + j + u * 32);
    for (int t = 0; t < n; ++t) {
      int4* d = (int4*)dsts[t];
#pragma unroll
      for (int u = 0; u < 4; ++u)
        if (j + u * 32 < nw) d[j + u * 32] = v[u];
    }
  }
}

// One warp copies `nbytes` from src to dst (either may be a peer's memory).
template <bool CG = false>
__device__ __forceinline__ void warp_copy(void* dst, const void* src, i64 nbytes, int vec, int lane) {
  if (vec == 16) {
    char* const d = (char*)dst;
    warp_fanout16<CG>(&d, 1, src, nbytes, lane);
  } else if (vec == 4) {
    const unsigned* s = (const unsigned*)src;
    unsigned* d = (unsigned*)dst;
    for (i64 j = lane; j < (nbytes >> 2); j += 32) d[j] = ld_src<CG>(s + j);
  } else {
    const unsigned short* s = (const unsigned short*)src;
    unsigned short* d = (unsigned short*)dst;
    for (i64 j = lane; j < (nbytes >> 1); j += 32) d[j] = ld_src<CG>(s + j);
  }
}

// One warp copies one source row into the n rows dsts[0..n) (warp_fanout16 when vec == 16).
template <bool CG = false>
__device__ __forceinline__ void warp_fanout(char* const* dsts, int n, const void* src, i64 nbytes, int vec, int lane) {
  if (vec == 16) warp_fanout16<CG>(dsts, n, src, nbytes, lane);
  else for (int t = 0; t < n; ++t) warp_copy<CG>(dsts[t], src, nbytes, vec, lane);
}

__device__ __forceinline__ void warp_zero(void* dst, i64 nbytes, int vec, int lane) {
  if (vec == 16) {
    int4 z = make_int4(0, 0, 0, 0);
    for (i64 j = lane; j < (nbytes >> 4); j += 32) ((int4*)dst)[j] = z;
  } else if (vec == 4) {
    for (i64 j = lane; j < (nbytes >> 2); j += 32) ((unsigned*)dst)[j] = 0u;
  } else {
    for (i64 j = lane; j < (nbytes >> 1); j += 32) ((unsigned short*)dst)[j] = 0;
  }
}

// The whole grid copies `nbytes` (grid-stride), for large rows such as expert weights.
__device__ __forceinline__ void grid_copy(void* dst, const void* src, i64 nbytes, int vec) {
  i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x, nt = (i64)gridDim.x * blockDim.x;
  if (vec == 16) {
    for (i64 j = t; j < (nbytes >> 4); j += nt) ((int4*)dst)[j] = ((const int4*)src)[j];
  } else if (vec == 4) {
    for (i64 j = t; j < (nbytes >> 2); j += nt) ((unsigned*)dst)[j] = ((const unsigned*)src)[j];
  } else {
    for (i64 j = t; j < (nbytes >> 1); j += nt)
      ((unsigned short*)dst)[j] = ((const unsigned short*)src)[j];
  }
}

__device__ __forceinline__ void grid_zero(void* dst, i64 nbytes, int vec) {
  i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x, nt = (i64)gridDim.x * blockDim.x;
  if (vec == 16) {
    for (i64 j = t; j < (nbytes >> 4); j += nt) ((int4*)dst)[j] = make_int4(0, 0, 0, 0);
  } else if (vec == 4) {
    for (i64 j = t; j < (nbytes >> 2); j += nt) ((unsigned*)dst)[j] = 0u;
  } else {
    for (i64 j = t; j < (nbytes >> 1); j += nt) ((unsigned short*)dst)[j] = 0;
  }
}

// 16-byte word <-> floats: DT_F32 holds 4 values, DT_BF16/DT_F16 hold 8.
template <int DT>
__device__ __forceinline__ void unpack16(const int4 q, float* v) {
  if constexpr (DT == DT_F32) {
    v[0] = __int_as_float(q.x); v[1] = __int_as_float(q.y); v[2] = __int_as_float(q.z); v[3] = __int_as_float(q.w);
  } else {
    const unsigned w[4] = {(unsigned)q.x, (unsigned)q.y, (unsigned)q.z, (unsigned)q.w};
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      unsigned short lo = (unsigned short)(w[u] & 0xffffu), hi = (unsigned short)(w[u] >> 16);
      v[2 * u] = DT == DT_BF16 ? bf16_to_f(lo) : f16_to_f(lo);
      v[2 * u + 1] = DT == DT_BF16 ? bf16_to_f(hi) : f16_to_f(hi);
    }
  }
}

template <int DT>
__device__ __forceinline__ int4 pack16(const float* v) {
  if constexpr (DT == DT_F32) {
    return make_int4(__float_as_int(v[0]), __float_as_int(v[1]), __float_as_int(v[2]), __float_as_int(v[3]));
  } else {
  unsigned w[4];
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    unsigned lo = DT == DT_BF16 ? f_to_bf16(v[2 * u]) : f_to_f16(v[2 * u]);
    unsigned hi = DT == DT_BF16 ? f_to_bf16(v[2 * u + 1]) : f_to_f16(v[2 * u + 1]);
    w[u] = lo | (hi << 16);
  }
  return make_int4((int)w[0], (int)w[1], (int)w[2], (int)w[3]);
  }
}

// Store n (4 or 8) floats at element index idx of a row of dtype dt (aligned to n elements).
__device__ __forceinline__ void store_n(void* p, i64 idx, int dt, const float* v, int n) {
  for (int b = 0; b < n; b += 4) {
    if (dt == DT_F32) {
      *(float4*)((float*)p + idx + b) = make_float4(v[b], v[b + 1], v[b + 2], v[b + 3]);
    } else {
      unsigned short h[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) h[u] = dt == DT_BF16 ? f_to_bf16(v[b + u]) : f_to_f16(v[b + u]);
      *(uint2*)((unsigned short*)p + idx + b) = make_uint2((unsigned)h[0] | ((unsigned)h[1] << 16),
                                                           (unsigned)h[2] | ((unsigned)h[3] << 16));
    }
  }
}

// Choice k = lane (< K) of source token i: its destination rank r and row there (-1, -1 where masked or out
// of range) and, with w (fp32 [s, K]), its routing weight wk (0 without).  dst_rank/dst_row: int64 [s, K].
__device__ __forceinline__ void load_choice(const i64* dst_rank, const i64* dst_row, const float* w, i64 i, int K,
                                            int R, i64 cap, int lane, int& r, int& row, float& wk) {
  r = -1;
  row = -1;
  wk = 0.f;
  if (lane < K) {
    const i64 rr = dst_rank[i * K + lane], rw = dst_row[i * K + lane];
    if (rr >= 0 && rr < R && rw >= 0 && rw < cap) {
      r = (int)rr;
      row = (int)rw;
    }
    if (w != nullptr) wk = w[i * K + lane];
  }
}

// Mode 0 dispatch: the token's K-aligned row list at its first row on every destination rank whose first
// lane is set in `firsts` (lane k < K writes there the row of choice k, -1 where choice k goes elsewhere);
// every lane then calls seen(dr, frow) with that rank and row, in lane order.
template <typename F>
__device__ __forceinline__ void put_row_lists(const Ctx* c, unsigned firsts, int r, int row, int K, int lane, F seen) {
  while (firsts) {
    int fl = __ffs(firsts) - 1;
    firsts &= firsts - 1;
    int dr = __shfl_sync(FULL_MASK, r, fl);
    int frow = __shfl_sync(FULL_MASK, row, fl);
    if (lane < K) ((int*)(c->base[dr] + c->off_meta))[(i64)frow * K + lane] = (r == dr) ? row : -1;
    seen(dr, frow);
  }
}

__device__ __forceinline__ int warp_id_global() { return (blockIdx.x * blockDim.x + threadIdx.x) >> 5; }
__device__ __forceinline__ int num_warps_global() { return (gridDim.x * blockDim.x) >> 5; }

// ---------------------------------------------------------------------------------------------------
// FP8 (e4m3fn) rows: one float32 scale per token per 128 channels (the rule: csrc/quant.cu, moonep/quant.py).
// Shared by the quantiser (quant.cu) and the fp8 dispatch (dispatch.cu), so both give the same bits.
// ---------------------------------------------------------------------------------------------------
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

// sm_89+: the hardware e4m3 conversion (cvt.rn.satfinite: round to nearest even, out-of-range values give
// +-448); MOONEP_QUANT_SOFT_CVT forces the portable one, which needs |y| <= 448.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890 && !defined(MOONEP_QUANT_SOFT_CVT)
#define Q8_HW_CVT 1
#else
#define Q8_HW_CVT 0
#endif

// Two values -> 16 bits (lo in the low byte): clamped ones on either path, unclamped ones on the hardware path.
__device__ __forceinline__ unsigned q8_pack2(float lo, float hi) {
#if Q8_HW_CVT
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

// The largest |x| of a 16-byte word's values as float32 bits (x of dtype DT); inf/nan give bits >= 0x7f800000.
// Integer max on sign-cleared bits: for non-negative floats (subnormals included) it orders as the values do,
// catches NaN (which fmaxf would drop), and takes two 16-bit values per instruction (__vmaxu2).
template <int DT>
__device__ __forceinline__ unsigned q8_amax_bits(const int4 q) {
  if constexpr (DT == DT_F32) {
    const unsigned k = 0x7fffffffu;
    return max(max((unsigned)q.x & k, (unsigned)q.y & k), max((unsigned)q.z & k, (unsigned)q.w & k));
  } else {
    const unsigned k = 0x7fff7fffu;
    const unsigned m2 = __vmaxu2(__vmaxu2((unsigned)q.x & k, (unsigned)q.y & k),
                                 __vmaxu2((unsigned)q.z & k, (unsigned)q.w & k));
    const unsigned m = max(m2 & 0xffffu, m2 >> 16);
    if constexpr (DT == DT_BF16) return m << 16;
    else return m >= 0x7c00u ? 0x7f800000u : __float_as_uint(f16_to_f((unsigned short)m));
  }
}

// The N/4 words of four codes of v[N], each value mapped by q (to e4m3's range) and converted; all 0x7F in a
// bad group.
template <int N, typename Q>
__device__ __forceinline__ void q8_codes(const float* v, bool bad, unsigned* c, Q q) {
#pragma unroll
  for (int j = 0; j < N; j += 4) {
    const unsigned lo = q8_pack2(q(v[j]), q(v[j + 1]));
    const unsigned hi = q8_pack2(q(v[j + 2]), q(v[j + 3]));
    c[j / 4] = bad ? Q8_NAN_CODE * 0x01010101u : lo | (hi << 16);
  }
}

// Codes and scale of NW consecutive 16-byte words of a token row (N = NW * VEC channels, VEC = 8 bf16/fp16 or
// 4 fp32 per word), called by every lane of the warp: lanes 32*k + [0, L) with L = 128/N hold one group of 128
// channels, whose amax is an xor-shuffle reduction among them.  c: N/4 words of four codes.  Returns the group's
// scale (NaN for a group with inf/nan, whose codes are then all 0x7F) and sets *bad for it.
template <int DT, int NW>
__device__ __forceinline__ float q8_words(const int4* w, bool pow2, unsigned* c, bool* bad) {
  constexpr int VEC = DT == DT_F32 ? 4 : 8;
  constexpr int N = NW * VEC;
  constexpr int L = Q8_GROUP / N;
  static_assert(L >= 1 && L <= 32 && L * N == Q8_GROUP, "a group spans whole lanes of one warp");
  unsigned ab = 0u;
#pragma unroll
  for (int k = 0; k < NW; ++k) ab = max(ab, q8_amax_bits<DT>(w[k]));
#pragma unroll
  for (int o = L / 2; o; o >>= 1) ab = max(ab, __shfl_xor_sync(FULL_MASK, ab, o));
  const bool b = ab >= 0x7f800000u;
  float inv, scale = q8_scale(b ? __uint_as_float(0x7f800000u) : __uint_as_float(ab), pow2, &inv);
  const bool tiny = inv > 1.2676506002282294e30f;  // 2^100: subnormal inputs count (see q8_quant1)
  float v[N];
#pragma unroll
  for (int k = 0; k < NW; ++k) unpack16<DT>(w[k], v + k * VEC);
  // Warp-uniform: the common case (no group of tiny amax in the warp) multiplies without q8_quant1's
  // checks, and the hardware conversion saturates, so the clamp is not needed either (|v * inv| exceeds
  // 448 by at most rounding).  Same codes as q8_quant1 + q8_pack2 (tests/unit/test_quant.py).
  if (Q8_HW_CVT && !__any_sync(FULL_MASK, tiny))
    q8_codes<N>(v, b, c, [&](float x) { return __fmul_rn(x, inv); });
  else
    q8_codes<N>(v, b, c, [&](float x) { return q8_quant1(x, inv, tiny); });
  *bad = b;
  return b ? __uint_as_float(Q8_NAN_BITS) : scale;
}

// One 16-byte word per lane (L = 16 bf16/fp16 or 32 fp32 lanes per group).
template <int DT>
__device__ __forceinline__ float q8_word(const int4 w, bool pow2, unsigned* c, bool* bad) {
  return q8_words<DT, 1>(&w, pow2, c, bad);
}

// Bytes of an fp8 wire row (moonep/fp8.py wire_bytes): H codes, H/128 float32 scales, zeros to a multiple of 128
// (every row starts on a line: its stores fill whole lines).
__host__ __device__ __forceinline__ i64 q8_wire_bytes(i64 H) { return (H + 4 * (H / Q8_GROUP) + 127) & ~(i64)127; }

// Lane (g & 31) keeps the scale of group g (returns sreg, updated): sc is the scale each lane's group got, the
// warp-wide word holds groups [g0, g0 + 32/L), L lanes each.
template <int L>
__device__ __forceinline__ float q8_keep_scales(int G, int g0, float sc, float sreg, int lane) {
#pragma unroll
  for (int h = 0; h < 32 / L; ++h) {
    const float sh = __shfl_sync(FULL_MASK, sc, h * L);
    if (g0 + h < G && ((g0 + h) & 31) == lane) sreg = sh;
  }
  return sreg;
}

// After that word: once groups up to a multiple of 32 (or the last one) are kept, each destination gets them as
// one coalesced run, after the last one the zero padding (tail: scale + padding words of a row).  Warp-uniform.
template <int L>
__device__ __forceinline__ void q8_store_scales(char* const* dsts, int n, int H, int G, int tail, int g0, float sreg,
                                                int lane) {
  const int gl = min(g0 + 32 / L, G) - 1;  // the word's last group
  if (((gl + 1) & 31) == 0 || gl == G - 1) {  // warp-uniform: groups [gb, gl] are complete
    const int gb = gl & ~31, end = gl == G - 1 ? tail : gl + 1;
    for (int t = 0; t < n; ++t) {
      float* d = (float*)(dsts[t] + H);
      for (int k = gb + lane; k < end; k += 32) d[k] = k < G && k - gb < 32 ? sreg : 0.f;
    }
  }
}

// A lane stores the N codes of one chunk (N = 16, 8 or 4 bytes) with one store per destination.
template <int N>
__device__ __forceinline__ void q8_store_codes(char* d, const unsigned* c) {
  if constexpr (N == 16) *(uint4*)d = make_uint4(c[0], c[1], c[2], c[3]);
  else if constexpr (N == 8) *(uint2*)d = make_uint2(c[0], c[1]);
  else *(unsigned*)d = c[0];
}

// One warp quantises one token row x [H] (dtype DT, 16-byte aligned, H % 128 == 0) and stores the wire row
// (wb = q8_wire_bytes(H) bytes) into each of the n rows dsts[0..n) (16-byte aligned, local or peer memory):
// lane l quantises chunk c0 + 32u + l of NW 16-byte words (N = NW * VEC channels), U chunks per lane in flight,
// and stores its N codes coalesced; the scales are gathered in registers (lane l keeps the scale of group
// 32b + l) and stored as one coalesced run per 32 groups, after the last one with the zero padding.
// n == 0 only reads and checks.  Returns, on every lane, whether a group held inf/nan.
template <int DT, int NW, int U>
__device__ __forceinline__ bool q8_fanout(char* const* dsts, int n, const void* x, int H, i64 wb, bool pow2,
                                          int lane) {
  constexpr int VEC = DT == DT_F32 ? 4 : 8;  // channels per 16-byte word
  constexpr int N = NW * VEC;                // channels (and code bytes) per chunk
  constexpr int L = Q8_GROUP / N;            // lanes per group
  const int nc = H / N, G = H / Q8_GROUP, tail = (int)((wb - H) >> 2);  // tail: scale + padding words
  const int4* src = (const int4*)x;
  bool bad_any = false;
  float sreg = 0.f;
  for (int c0 = 0; c0 < nc; c0 += 32 * U) {  // warp-uniform
    int4 v[U][NW];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int j = c0 + u * 32 + lane;
#pragma unroll
      for (int k = 0; k < NW; ++k)  // a group's lanes are in or out together (H % 128 == 0)
        v[u][k] = j < nc ? __ldg(src + (i64)j * NW + k) : make_int4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int j0 = c0 + u * 32;
      if (j0 >= nc) break;  // warp-uniform
      const int j = j0 + lane;
      unsigned c[N / 4];
      bool bad;
      const float sc = q8_words<DT, NW>(v[u], pow2, c, &bad);
      const bool live = j < nc;
      bad_any |= live && bad;
      sreg = q8_keep_scales<L>(G, j0 / L, sc, sreg, lane);
      if (live) {
        for (int t = 0; t < n; ++t) q8_store_codes<N>(dsts[t] + (i64)j * N, c);
      }
      q8_store_scales<L>(dsts, n, H, G, tail, j0 / L, sreg, lane);
    }
  }
  return __any_sync(FULL_MASK, bad_any);
}

// The fp8 dispatch's send fanout: 16 channels per chunk and lane, stored with one 16-byte store per destination
// as the bf16 path does (4 groups of 8 lanes per warp-wide store, amax in 3 shuffles), MOONEP_FP8_WORDS 16-byte
// input words per lane in flight (default 4; a compile-time switch of the "ep" program; the variants measure
// within one another's run-to-run spread, docs/performance.md).  MOONEP_FP8_WORDS=0: the narrow fanout, one
// 16-byte input word per chunk (8 bf16/fp16 or 4 fp32 codes per lane and store), four chunks in flight.  Every
// variant writes the same bytes.
#ifndef MOONEP_FP8_WORDS
#define MOONEP_FP8_WORDS 4
#endif

template <int DT>
__device__ __forceinline__ bool warp_quant_fanout(char* const* dsts, int n, const void* x, int H, i64 wb, bool pow2,
                                                  int lane) {
#if MOONEP_FP8_WORDS > 0
  constexpr int NW = DT == DT_F32 ? 4 : 2;  // 16 channels
  return q8_fanout<DT, NW, (MOONEP_FP8_WORDS / NW > 1 ? MOONEP_FP8_WORDS / NW : 1)>(dsts, n, x, H, wb, pow2, lane);
#else
  return q8_fanout<DT, 1, 4>(dsts, n, x, H, wb, pow2, lane);
#endif
}
