// moonep NVLink transport, first stage of a step: the routing counts all-gather that the planner reads.
//
//   moonep_gather        two-kernel path: one int64 vector per rank ([counts, s, flags]) to every rank,
//                        behind an entry barrier
//   moonep_route_gather  fused path (default): routing validation, this rank's histogram and the same
//                        all-gather in one launch, double-buffered so that it needs no entry barrier
// Both report bad routing found on any rank (and a wrong num_global_tokens) as an input error.
#include "common.cuh"

// After a counts all-gather (thread 0): the first rank's input-error flags, else ERR_TOTAL when the s of all
// ranks do not add up to expected_total (-1: not checked), recorded as the input error.  g: the gathered
// [R, E2] rows (counts[E], s, flags); a volatile pointer where peers wrote them during this kernel.
template <typename P>
__device__ __forceinline__ void report_inputs(const Ctx* c, P g, int R, int E2, int me, i64 expected_total) {
  i64 total = 0;
  int code = 0;
  for (int r = 0; r < R; ++r) {
    total += g[r * E2 + E2 - 2];
    i64 f = g[r * E2 + E2 - 1];
    if (f != 0 && code == 0) code = (int)f | (r << 8);
  }
  if (code == 0 && expected_total >= 0 && total != expected_total) code = ERR_TOTAL | (me << 8);
  if (code) set_input_error(c, code);
}

// All-gather of one int64 vector per rank (routing counts, s, input-error flags), one block.
// mine: [E2] = counts[E], s, flags.  out: [R, E2].  expected_total: -1 or num_global_tokens.
extern "C" __global__ void moonep_gather(const Ctx* c, const i64* mine, i64* out, i64 expected_total) {
  u64 ne;
  bool ok = entry_barrier(c, &ne);
  const int R = (int)c->R, E2 = (int)c->E2, me = (int)c->rank;
  if (ok) {
    for (int j = threadIdx.x; j < R * E2; j += blockDim.x) {
      int p = j / E2, q = j % E2;
      ((i64*)(c->base[p] + c->off_gather))[me * E2 + q] = mine[q];
    }
  }
  u64 nd = ld_volatile(&c->ctr[CTR_DATA]) + 1;
  signal_all(c, c->off_dsig, nd);  // begins with __syncthreads + system fence: the stores above are published
  ok = wait_all(c, c->off_dsig, nd) && ok;
  const i64* g = (const i64*)(c->base[me] + c->off_gather);
  for (int j = threadIdx.x; j < R * E2; j += blockDim.x) out[j] = ok ? g[j] : 0;
  __syncthreads();
  if (threadIdx.x == 0) {
    c->ctr[CTR_ENTRY] = ne;
    c->ctr[CTR_DATA] = nd;
    if (ok) report_inputs(c, g, R, E2, me, expected_total);
    __threadfence();
  }
}

#define MAXE_SMEM 4096

// Routing validation + this rank's expert histogram + counts all-gather, one launch.  Every block checks a
// grid-stride share of the s*K choices:
//   expert ids outside [-1, E) -> ERR_BAD_IDX, masked to -1 in idx_out; a repeated expert in one token
//   -> ERR_DUP_IDX (kept, counted twice, as the host path does); a non-finite weight -> ERR_NONFINITE;
//   idx_out: int64 [s, K] masked ids; w_out: fp32 [s, K] weights (exact widening of bf16/fp16).
// The histogram goes to shared memory, then to scratch (int32 [E + 2]: counts, flags, block counter; zero
// between calls: the last block resets it).  The last block to finish gathers [counts, s, flags] from
// every rank through peer stores into one half of the gather area (halves alternate between calls, so
// no entry barrier is needed: a peer writes half h again only after it saw this rank's signal of the
// gather in between, which this rank sent after reading h), signals, waits for every rank's data and
// copies its counts, int64 [R, E], to `out` (the planner's input as is).  The data wait also stands for the entry barrier of the dispatch
// that follows: every peer has finished its earlier kernels (which read the receive buffers).
extern "C" __global__ void __launch_bounds__(512) moonep_route_gather(
    const Ctx* c, const void* idx, int idx64, const void* w, int w_dt, int s, i64* idx_out, float* w_out,
    int* scratch, i64* out, i64 expected_total) {
  __shared__ int s_hist[MAXE_SMEM];
  __shared__ int s_flag, s_last, s_fatal;
  const int K = (int)c->K, E2 = (int)c->E2, E = E2 - 2, R = (int)c->R, me = (int)c->rank;
  int* g_hist = scratch;
  int* g_flag = scratch + E;
  int* g_cnt = scratch + E + 1;
  const bool use_smem = E <= MAXE_SMEM;
  if (use_smem)
    for (int e = threadIdx.x; e < E; e += blockDim.x) s_hist[e] = 0;
  if (threadIdx.x == 0) s_flag = 0;
  __syncthreads();
  int* hist = use_smem ? s_hist : g_hist;
  int flag = 0;
  const i64 n = (i64)s * K;
  // Whole warps step together (j0 = the warp's first choice), so when K divides 32 a token's K choices sit
  // in K adjacent lanes and its duplicate check is one __match_any_sync instead of up to K-1 reloads.
  const int lane = threadIdx.x & 31;
  const bool kwarp = (32 % K) == 0;
  const unsigned tok = K == 32 ? FULL_MASK : ((1u << K) - 1u) << (lane - lane % K);
  const i64 stride = (i64)gridDim.x * blockDim.x;
  for (i64 j0 = (i64)blockIdx.x * blockDim.x + (threadIdx.x & ~31); j0 < n; j0 += stride) {
    const i64 j = j0 + lane;
    const bool live = j < n;
    i64 v = !live ? -1 : idx64 ? ((const i64*)idx)[j] : (i64)((const int*)idx)[j];
    if (v < -1 || v >= E) {
      flag |= ERR_BAD_IDX;
      v = -1;
    }
    if (kwarp) {
      const unsigned same = __match_any_sync(FULL_MASK, v) & tok;
      if (v >= 0 && __popc(same) > 1) flag |= ERR_DUP_IDX;
    }
    if (!live) continue;
    idx_out[j] = v;
    if (v >= 0) {
      atomicAdd(&hist[v], 1);
      if (!kwarp) {
        const int k = (int)(j % K);
        const i64 b = j - k;
        for (int q = 0; q < k; ++q) {
          i64 u = idx64 ? ((const i64*)idx)[b + q] : (i64)((const int*)idx)[b + q];
          if (u == v) flag |= ERR_DUP_IDX;
        }
      }
    }
    float wf;
    bool fin;
    if (w_dt == DT_F32) {
      unsigned u = ((const unsigned*)w)[j];
      wf = __uint_as_float(u);
      fin = (u & 0x7f800000u) != 0x7f800000u;
    } else {
      unsigned short h = ((const unsigned short*)w)[j];
      if (w_dt == DT_BF16) {
        wf = bf16_to_f(h);
        fin = (h & 0x7f80u) != 0x7f80u;
      } else {
        wf = f16_to_f(h);
        fin = (h & 0x7c00u) != 0x7c00u;
      }
    }
    if (!fin) flag |= ERR_NONFINITE;
    w_out[j] = wf;
  }
  if (flag) atomicOr(&s_flag, flag);
  __syncthreads();
  if (use_smem)
    for (int e = threadIdx.x; e < E; e += blockDim.x)
      if (s_hist[e]) atomicAdd(&g_hist[e], s_hist[e]);
  if (threadIdx.x == 0 && s_flag) atomicOr(g_flag, s_flag);
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    s_last = atomicAdd(g_cnt, 1) == (int)gridDim.x - 1;
    s_fatal = is_fatal(c) ? 1 : 0;
  }
  __syncthreads();
  if (!s_last) return;
  // ---- last block: gather ----
  __threadfence();
  const u64 gen = ld_volatile(&c->ctr[CTR_GATHER]) + 1;
  const i64 half = (i64)(gen & 1ull) * R * E2;
  const u64 nd = ld_volatile(&c->ctr[CTR_DATA]) + 1;
  for (int q = threadIdx.x; q < E2; q += blockDim.x) {
    i64 v;
    if (q < E) v = (i64)atomicExch(&g_hist[q], 0);  // read and reset for the next call
    else if (q == E) v = s;
    else v = (i64)atomicExch(g_flag, 0);
    if (!s_fatal)
      for (int p = 0; p < R; ++p) ((i64*)(c->base[p] + c->off_gather))[half + (i64)me * E2 + q] = v;
  }
  if (threadIdx.x == 0) atomicExch(g_cnt, 0);
  signal_all(c, c->off_dsig, nd);  // begins with a system fence + __syncthreads: the stores above first
  bool ok = wait_all(c, c->off_dsig, nd);
  const volatile i64* g = (const volatile i64*)(c->base[me] + c->off_gather) + half;
  for (int j = threadIdx.x; j < R * E; j += blockDim.x) out[j] = ok ? g[(j / E) * E2 + j % E] : 0;  // counts only
  __syncthreads();
  if (threadIdx.x == 0) {
    c->ctr[CTR_DATA] = nd;
    c->ctr[CTR_GATHER] = gen;
    if (ok) report_inputs(c, g, R, E2, me, expected_total);
    __threadfence();
  }
}
