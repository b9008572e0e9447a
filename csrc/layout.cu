// Token layout on the GPU: every local copy's (dst rank, dst row) from a plan, as the torch layout in
// moonep/layout.py computes it (bit-identical), and the slot offsets (cu_seqlens).  Compiled after
// planner.cu in the "plan" program (moonep/cuda_runtime.py): it uses planner.cu's workspace layout, warp
// helpers and flags, and moonep_plan_layout runs planner.cu's plan_body in its block 0.
//
// moonep_layout (grid): every local copy's (dst rank, dst row) in one launch. Block b owns a tile
//   of copies in (token, k) order; its warps own contiguous sub-tiles. Pass 1 counts copies per
//   expert per warp; each block publishes its per-expert counts and waits only for LOWER blocks
//   (flags in the plan workspace, reset by the last block to finish; lower-indexed blocks are
//   always resident first, the assumption CUB's decoupled look-back makes too). Pass 2 ranks each
//   copy among its expert's copies with __match_any_sync in (token, k) order, adds the copies of
//   earlier blocks/warps and of earlier source ranks (prefix blocks), and finds its chunk (rank)
//   in the plan's per-expert chunk table.
#include "planner.cu"

// cu_seqlens (int32) of one rank (rank >= 0: warp 0) or of every rank (warp r: rank r; [R, 2*epn + 1]).
// One warp per rank, 32 slots per step with a warp scan: a single thread walking 2*epn slots one dependent
// load and store at a time took ~70 us at epn = 256 (torch profiler, h200x1_dispatch_profile_f8f6224.json).
extern "C" __global__ void moonep_cu(i64* __restrict__ wsp, int* __restrict__ out, i64 R_, i64 E_, i64 align,
                                     i64 rank) {
  if (R_ <= 0) return;  // no-op launch (the launcher's probe)
  const Ws w = ws_layout(wsp, R_, E_);
  const int R = (int)R_, E = (int)E_, epn = E / R, lane = threadIdx.x & 31;
  const int gw = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5);
  const int r = rank >= 0 ? (gw == 0 ? (int)rank : -1) : gw;
  if (r < 0 || r >= R) return;  // warp-uniform
  int* o = out + (rank >= 0 ? 0 : (i64)r * (2 * epn + 1));
  if (lane == 0) o[0] = 0;
  i64 acc = 0;
  for (int j0 = 0; j0 < epn; j0 += 32) {  // home slots
    const int j = j0 + lane;
    const i64 v = j < epn ? (w.rem[(i64)r * epn + j] + align - 1) / align * align : 0;
    const i64 inc = warp_incl_scan(v, lane);
    if (j < epn) o[1 + j] = (int)(acc + inc);
    acc += __shfl_sync(FULL, inc, 31);
  }
  int p = 0;
  for (int j0 = 0; j0 < epn; j0 += 32) {  // replica slots: the non-empty ones, packed in order
    const int j = j0 + lane;
    const i64 a = j < epn ? w.amt[(i64)r * epn + j] : 0;
    const i64 inc = warp_incl_scan(a > 0 ? (a + align - 1) / align * align : 0, lane);
    const unsigned m = __ballot_sync(FULL, a > 0);
    if (a > 0) o[1 + epn + p + __popc(m & ((1u << lane) - 1u))] = (int)(acc + inc);
    acc += __shfl_sync(FULL, inc, 31);
    p += __popc(m);
  }
  for (int q = p + lane; q < epn; q += 32) o[1 + epn + q] = (int)acc;
}

__device__ __forceinline__ void ld_acq_wait64(const i64* p, i64 want) {
  while (ld_acquire(p) != want) __nanosleep(64);
}
__device__ __forceinline__ int load_e(const void* topk, i64 idx, bool t32, i64 n, int E) {
  if (idx >= n) return -1;
  i64 e = t32 ? (i64)__ldg((const int*)topk + idx) : __ldg((const i64*)topk + idx);
  return (e >= 0 && e < E) ? (int)e : -1;
}
// Plan outputs: through the read-only cache when an earlier kernel wrote them, through L2 when the plan
// block of the same launch did (moonep_plan_layout: the non-coherent path could hold stale lines).
template <bool FUSED, typename T>
__device__ __forceinline__ T ld_plan(const T* p) {
  return FUSED ? __ldcg(p) : __ldg(p);
}

// Fields of the layout kernels' cfg word, by bit (mirrored in moonep/planner/cuda.py as LAY_*).
#define CFG_B 8        // bits 8-15: tile blocks B (bits 0-7: prefix blocks P)
#define CFG_SUB 16     // bits 16-31: copies per warp
#define CFG_T32 32     // topk is int32
#define CFG_C32 33     // counts are int32 (moonep_plan_layout; moonep_layout reads the plan's int64 counts)
#define CFG_STAGE 34   // the plan's chunk tables staged in shared memory
#define CFG_PRE 35     // fused only: the rank's slot experts and cu_seqlens after dst row
#define CFG_NW 40      // bits 40-47: warps that own copies (0: all of the block's)

// Token layout of source rank `rank`: out[0:n] = dst rank, out[n:2n] = dst row (int64, -1 masked).
// cfg: bits 0-7 P (prefix blocks), 8-15 B (tile blocks), 16-31 SUB (copies per warp), bit 32: int32 topk,
// bit 33: int32 counts, bit 34: chunk tables staged in shared memory, bit 35 (fused only): also write this
// rank's slot experts (int64 [2*epn]) and cu_seqlens (int32 [2*epn + 1]) at out + 2n, bits 40-47: warps that own copies
// (0: all of the block's). Blocks [0, P): copies of each expert on source ranks < rank. Blocks [P, P+B):
// tiles of nw*SUB copies. Dynamic shared memory (bytes): max((16 + 2*nw) * E, 256 * warps of the block),
// (44 + 2*nw) * E + 16 with bit 34.
//
// FUSED (moonep_plan_layout, layout block blk = blockIdx.x - 1 beside the plan in block 0): nothing in the
// workspace is zeroed beforehand, so the flags are i64 words holding this launch's 56-bit `nonce` (a 2^-56
// chance that stale memory matches), "plan done" is flag 1, block blk's is flag 2 + blk, and flag 0 counts
// finished layout blocks (zeroed by the plan block before "plan done"); the last one zeroes every flag, so
// a CUDA graph that replays the same nonce starts clean. Pass 1, the prefix blocks and each tile's
// prefixes need no plan: they overlap it.
template <bool FUSED>
__device__ __noinline__ void layout_body(
    const void* __restrict__ topk, i64* __restrict__ out, i64* __restrict__ wsp, const void* __restrict__ counts,
    i64 n, i64 R_, i64 E_, i64 rank, i64 align, i64 cfg, int blk, i64 nonce) {
  const int R = (int)R_, E = (int)E_, epn = E / R;
  const int P = (int)(cfg & 0xff), B = (int)((cfg >> CFG_B) & 0xff), SUB = (int)((cfg >> CFG_SUB) & 0xffff);
  const bool t32 = (cfg >> CFG_T32) & 1, c32 = (cfg >> CFG_C32) & 1;
  const int tid = threadIdx.x, nt = blockDim.x, lane = tid & 31, warp = tid >> 5, ntw = nt >> 5;
  const int nw = ((cfg >> CFG_NW) & 0xff) ? (int)((cfg >> CFG_NW) & 0xff) : ntw;
  const bool owns = warp < nw;
  const int G = P + B;
  const Ws w = ws_layout(wsp, R_, E_);
  i64* f64 = (i64*)w.flags;
  extern __shared__ __align__(16) unsigned char sm_raw[];
  i64* off = (i64*)sm_raw;                                 // [E] copies of e before this block
  int* Tt = (int*)(off + E);                               // [R, 2*epn] row offsets (home j | replica j)
  // cfg bit 34: the plan's chunk tables are staged in shared memory (pass 2's binary searches then wait on
  // shared memory, not on chains of L2 loads; measured 20 us of 24 after the plan at (896, 64, 16))
  const bool stage = (cfg >> CFG_STAGE) & 1;
  i64* cst_s = (i64*)(Tt + 2 * E);                         // [2E] staged w.cst
  int* crk_s = (int*)(cst_s + 2 * E);                      // [2E] staged w.crk
  int* cseg_s = crk_s + 2 * E;                             // [E+1] staged w.cseg
  unsigned short* cnt = (unsigned short*)(stage ? (void*)(cseg_s + E + 1) : (void*)(Tt + 2 * E));  // [nw, E]
  const i64 w0 = ((i64)(blk - P) * nw + warp) * SUB;       // this warp's first copy (tile blocks)
#ifdef MOONEP_PLAN_TS
  i64* TSp = FUSED ? w.c64 + (c32 ? R_ * E_ : 0) + 32 * (i64)(blk + 1) : nullptr;
  TS_MARK(0);
#endif
  // The first NC rounds of a warp's copies stay in registers from pass 1 to pass 2, and their loads are
  // all issued before the first use (one memory latency instead of one per round).
  constexpr int NC = 8;
  int ec[NC];

  if (blk < P) {
    i64* red = off;  // [ntw * 32]
    for (int e0 = blk * 32; e0 < E; e0 += P * 32) {
      int e = e0 + lane;
      i64 sum = 0;
      if (e < E)
        for (i64 src = warp; src < rank; src += ntw)
          sum += c32 ? (i64)((const int*)counts)[src * E + e] : ((const i64*)counts)[src * E + e];
      red[warp * 32 + lane] = sum;
      __syncthreads();
      if (warp == 0 && e < E) {
        i64 t = 0;
        for (int q = 0; q < ntw; ++q) t += red[q * 32 + lane];
        w.pre[e] = t;
      }
      __syncthreads();
    }
  } else {
    const int b = blk - P;
    for (int q = tid; q < nw * E; q += nt) cnt[q] = 0;
#pragma unroll
    for (int it = 0; it < NC; ++it) ec[it] = (owns && it * 32 < SUB) ? load_e(topk, w0 + it * 32 + lane, t32, n, E) : -1;
    __syncthreads();
    auto pass1 = [&](int e) {  // per-warp counts: one add per distinct expert of the round
      const unsigned peers = __match_any_sync(FULL, e);
      if (e >= 0 && lane == __ffs(peers) - 1) cnt[warp * E + e] += (unsigned short)__popc(peers);
      __syncwarp();
    };
    if (owns) {
#pragma unroll
      for (int it = 0; it < NC; ++it) {
        if (it * 32 >= SUB) break;
        pass1(ec[it]);
      }
      for (int c = NC * 32; c < SUB; c += 32) pass1(load_e(topk, w0 + c + lane, t32, n, E));
    }
    __syncthreads();
    for (int e = tid; e < E; e += nt) {
      int run = 0;
      for (int q = 0; q < nw; ++q) { int c = cnt[q * E + e]; cnt[q * E + e] = (unsigned short)run; run += c; }
      w.hist[(i64)b * E + e] = run;
    }
  }
  __threadfence();
  __syncthreads();
  if (tid == 0) {
    if (FUSED) st_release(f64 + 2 + blk, nonce);
    else st_release(&w.flags[1 + blk], 1);
  }
  TS_MARK(1);

  if (blk >= P) {
    const int b = blk - P;
    // copies of each expert before this block: needs only the lower blocks (not the plan), so in a fused
    // launch it is done while the plan block still runs
    for (int q = tid; q < blk; q += nt) {
      if (FUSED) ld_acq_wait64(f64 + 2 + q, nonce);
      else while (ld_acquire(&w.flags[1 + q]) == 0) __nanosleep(64);
    }
    __syncthreads();
    TS_MARK(2);
    for (int e = tid; e < E; e += nt) {
      i64 sum = P ? __ldcg(&w.pre[e]) : 0;
#pragma unroll 8
      for (int bb = 0; bb < b; ++bb) sum += __ldcg(&w.hist[(i64)bb * E + e]);  // 8 loads in flight
      off[e] = sum;
    }
    if (FUSED) {
      if (tid == 0) ld_acq_wait64(f64 + 1, nonce);  // the plan block's outputs
      __syncthreads();
    }
    TS_MARK(3);
    if (stage) {  // two rounds per thread unrolled: every load issued before the first store waits
      for (int q0 = tid; q0 < 2 * E; q0 += 2 * nt) {
        const int q1 = q0 + nt;
        const bool h1 = q1 < 2 * E;
        const i64 a0 = ld_plan<FUSED>(w.cst + q0), a1 = h1 ? ld_plan<FUSED>(w.cst + q1) : 0;
        const int b0 = ld_plan<FUSED>(w.crk + q0), b1 = h1 ? ld_plan<FUSED>(w.crk + q1) : 0;
        const int c0 = q0 <= E ? ld_plan<FUSED>(w.cseg + q0) : 0, c1 = q1 <= E ? ld_plan<FUSED>(w.cseg + q1) : 0;
        cst_s[q0] = a0; crk_s[q0] = b0;
        if (q0 <= E) cseg_s[q0] = c0;
        if (h1) { cst_s[q1] = a1; crk_s[q1] = b1; }
        if (q1 <= E) cseg_s[q1] = c1;
      }
    }
    // Row offsets of every (rank, slot) for this align: the aligned slot sizes first, by the whole block
    // (independent loads), then a warp per rank scans them in shared memory. A warp per rank loading as it
    // scanned waited one L2 latency per 32 slots: ~4 us at epn 128, ~7 at epn 256 (h200x1_planner_stamps_128eefa.json).
    for (int q = tid; q < 2 * E; q += nt) {
      const int r = q / (2 * epn), k = q - r * 2 * epn;
      const i64 x = k < epn ? ld_plan<FUSED>(w.rem + r * epn + k) : ld_plan<FUSED>(w.amt + r * epn + k - epn);
      Tt[q] = (int)((x + align - 1) / align * align);
    }
    __syncthreads();
    // cfg bit 35 (PRE): tile block 0's warp of rank `rank` also writes that rank's slot experts and
    // cu_seqlens after dst row (moonep_cu's output, without its launch and two torch ops per step)
    const bool pre = FUSED && ((cfg >> CFG_PRE) & 1) && blk == P;
    for (int r = warp; r < R; r += ntw) {
      const int base = r * epn;
      const bool mine = pre && r == (int)rank;
      int* cuo = (int*)(out + 2 * n + 2 * epn);
      i64 carry = 0;
      int packed = 0;
      for (int k0 = 0; k0 < 2 * epn; k0 += 32) {
        const int k = k0 + lane;
        const int v = k < 2 * epn ? Tt[2 * base + k] : 0;
        const i64 inc = warp_incl_scan((i64)v, lane);
        if (k < 2 * epn) Tt[2 * base + k] = (int)(carry + inc - v);
        if (mine) {  // cu_seqlens: home slots, then the non-empty replica slots packed (as moonep_cu)
          const bool rep = k >= epn && k < 2 * epn && v > 0;
          const unsigned m = __ballot_sync(FULL, rep);
          if (k < epn) cuo[1 + k] = (int)(carry + inc);
          if (rep) cuo[1 + epn + packed + __popc(m & ((1u << lane) - 1u))] = (int)(carry + inc);
          packed += __popc(m);
        }
        carry += __shfl_sync(FULL, inc, 31);
      }
      if (mine) {
        if (lane == 0) cuo[0] = 0;
        for (int q = packed + lane; q < epn; q += 32) cuo[1 + epn + q] = (int)carry;
        for (int k = lane; k < 2 * epn; k += 32)  // slot experts: home ids, then the replicas (-1 empty)
          out[2 * n + k] = k < epn ? (i64)(base + k) : ld_plan<FUSED>(w.rx + base + k - epn);
      }
    }
    __syncthreads();
    TS_MARK(4);
    const unsigned lt = (1u << lane) - 1u;
    // (dst rank, dst row) of the copy with global index g among expert e's copies
    auto place = [&](int e, i64 g, i64& dr, i64& rw) {
      const int h = e / epn, j = e - h * epn;
      int lo, hi;
      if (stage) { lo = cseg_s[e]; hi = cseg_s[e + 1] - 1; }
      else { lo = ld_plan<FUSED>(w.cseg + e); hi = ld_plan<FUSED>(w.cseg + e + 1) - 1; }
      while (lo < hi) {  // last chunk starting at or before g
        const int mid = (lo + hi + 1) >> 1;
        const i64 cm = stage ? cst_s[mid] : ld_plan<FUSED>(w.cst + mid);
        if (cm <= g) lo = mid; else hi = mid - 1;
      }
      const int r = stage ? crk_s[lo] : ld_plan<FUSED>(w.crk + lo);
      const i64 c0 = stage ? cst_s[lo] : ld_plan<FUSED>(w.cst + lo);
      dr = r;
      rw = (i64)Tt[2 * r * epn + (r == h ? j : epn + j)] + (g - c0);
    };
    auto pass2 = [&](int e, i64 idx) {  // global copy index -> (rank, row)
      const unsigned peers = __match_any_sync(FULL, e);
      i64 g = 0;
      if (e >= 0) g = off[e] + cnt[warp * E + e] + __popc(peers & lt);
      __syncwarp();
      if (e >= 0 && lane == __ffs(peers) - 1) cnt[warp * E + e] += (unsigned short)__popc(peers);
      __syncwarp();
      if (idx < n) {
        i64 dr = -1, rw = -1;
        if (e >= 0) place(e, g, dr, rw);
        out[idx] = dr;
        out[n + idx] = rw;
      }
    };
    if (owns) {
#pragma unroll
      for (int it = 0; it < NC; ++it) {
        if (it * 32 >= SUB) break;
        pass2(ec[it], w0 + it * 32 + lane);
      }
      for (int c = NC * 32; c < SUB; c += 32) pass2(load_e(topk, w0 + c + lane, t32, n, E), w0 + c + lane);
    }
  }
  __syncthreads();
  TS_MARK(6);
  if (tid == 0) {  // the last block to finish re-arms the flags for the next call
    __threadfence();
    if (FUSED) {
      // The plan block zeroed the counter before publishing "plan done", so one atomicAdd per block
      // counts (a CAS loop that recognised stale counts by a tag cost ~16 us of contention at 72 blocks).
      // Prefix blocks never waited for the plan: they do now, to count after the zeroing.
      if (blk < P) ld_acq_wait64(f64 + 1, nonce);
      if (atomicAdd((unsigned long long*)f64, 1ull) == (unsigned long long)(G - 1)) {
        // every flag word, not only this launch's: a plan from this launch may later be given to
        // moonep_layout (token_destinations), whose int flags must start zeroed, as moonep_plan leaves them
        for (int q = 1; q < FLAG_INTS / 2; ++q) f64[q] = 0;
        __threadfence();
        f64[0] = 0;
      }
    } else if (atomicAdd(&w.flags[0], 1) == G - 1) {
      for (int q = 1; q <= G; ++q) w.flags[q] = 0;
      __threadfence();
      w.flags[0] = 0;
    }
  }
}

extern "C" __global__ void __launch_bounds__(1024) moonep_layout(
    const void* __restrict__ topk, i64* __restrict__ out, i64* __restrict__ wsp, const i64* __restrict__ counts,
    i64 n, i64 R_, i64 E_, i64 rank, i64 align, i64 cfg) {
  layout_body<false>(topk, out, wsp, counts, n, R_, E_, rank, align, cfg & ~(1ll << CFG_C32), blockIdx.x, 0);
}

// Plan and this rank's layout in one launch: block 0 plans (moonep_plan with F_FUSED), blocks 1.. are
// moonep_layout's blocks. The layout's counting and its prefix blocks run while the plan's one-warp loop
// does; only the row offsets and pass 2 wait for the plan. Lower-indexed blocks are resident first
// (moonep_layout's assumption), so block 0 never waits behind blocks that spin on it.
extern "C" __global__ void __launch_bounds__(1024) moonep_plan_layout(
    const void* __restrict__ counts, i64* __restrict__ wsp, i64 R_, i64 E_, i64 flags, i64 slack_bits,
    const void* __restrict__ topk, i64* __restrict__ out, i64 n, i64 rank, i64 align, i64 cfg, i64 nonce) {
  if (blockIdx.x == 0) plan_body(counts, wsp, R_, E_, flags | F_FUSED, slack_bits, nullptr, 0, nonce);
  else layout_body<true>(topk, out, wsp, counts, n, R_, E_, rank, align, cfg, (int)blockIdx.x - 1, nonce);
}
