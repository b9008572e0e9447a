// Balanced planner on the GPU: the same algorithm and tie-breaks as moonep/planner/cpu.py, so the results
// are bit-identical. The "plan" program (moonep/cuda_runtime.py) compiles this file with layout.cu after
// it; moonep/planner/cuda.py launches them with raw pointers into one int64 workspace per plan on torch's
// current stream (no host sync, CUDA-graph capturable).
//
// moonep_plan (one block): column sums + checks, the plan, and everything the layout needs.
//   Why one block: the plan is a short sequential loop (each rank is filled at most once, so at most
//   R steps). The loop runs on ONE warp (warp-synchronous: shuffles and __syncwarp, no block barrier
//   per step); ranks are strided over its lanes. Per rank the home experts are kept sorted by
//   (remaining desc, id asc) together with their prefix sums, so "k experts needed to cover d" is a
//   count of prefix sums below d and the largest-first fill is one parallel step
//   (take = min(v, need - prefix)). Per step (about R steps for every routing family): receiver and
//   donor are one __reduce_*_sync each where values fit 31 bits (then the loop runs in 32-bit values,
//   with balances in registers for R <= 64); a donor's k is only counted when no donor covers d with
//   its largest expert (k = 1); for epn <= 32 the fill, the donor's re-sort and its new prefix sums are
//   a fixed handful of ballots and shuffles (wfill32). The step is a chain of dependent warp
//   operations, so its cost is instruction latency. The block's other warps only help with the O(R*E) parts: the column sums
//   before the loop (8 loads in flight per thread), zeroing the [E, R] assignment DURING the loop
//   (warps not on warp 0's scheduler), and scattering its 2E possible nonzeros after it.
//   For large R*E (> 2^18) the column sums and the [E, R] assignment run as grid kernels instead.
typedef long long i64;

// MOONEP_PLAN_CLOCKS (a profiling build, tools/profile_planner.py --clocks): warp 0 accumulates clock64()
// cycles per phase of moonep_plan and per part of a fill step into CLK[0..15], written to the layout's
// hist scratch at the end (read before any layout runs). Costs a few instructions per step when on.
// MOONEP_PLAN_STAMPS (or CLOCKS; profile_planner.py --stamps): fused launches (moonep_plan_layout) stamp
// %globaltimer (ns, shared by all SMs) at phase ends, thread 0 of each block: block x owns words
// [32x, 32x + 32) after the workspace's last region (the launcher adds them in these builds); block 0, the
// plan, has CLK[0..15] at words 16..31 in the clocks build. Stamps alone barely perturb the timing.
#if defined(MOONEP_PLAN_CLOCKS) || defined(MOONEP_PLAN_STAMPS)
#define MOONEP_PLAN_TS
#define TS_MARK(k) do { if (TSp && threadIdx.x == 0) TSp[k] = gtime(); } while (0)
#else
#define TS_MARK(k) do { } while (0)
#endif
#ifdef MOONEP_PLAN_CLOCKS
#define CLK_DECL __shared__ i64 CLK[16];
#define CLK_ADD(i, t0) do { if ((threadIdx.x & 31) == 0) { const i64 t1_ = clock64(); CLK[i] += t1_ - (t0); (t0) = t1_; } } while (0)
#define CLK_BLK(i) do { if (threadIdx.x == 0) { const i64 t1_ = clock64(); CLK[i] += t1_ - tb_; tb_ = t1_; } } while (0)
#else
#define CLK_BLK(i) do { } while (0)
#define CLK_DECL
#define CLK_ADD(i, t0) do { } while (0)
#endif
__device__ __forceinline__ long long gtime() {
  long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
#define FULL 0xffffffffu
#define NONE 0x7fffffff
#define FLAG_INTS 256
#define HIST_BLOCKS 64

// plan flags (mirrored in moonep/planner/cuda.py)
#define F_C32 1
#define F_CAP 2
#define F_COLSUM 4
#define F_ASSIGN 8
#define F_DECL_SCALAR 16
#define F_DECL_PTR 32
#define F_FUSED 64  // moonep_plan_layout: leave the layout's flags alone, publish "plan done" (i64 flag 1)
#define F_AMT_SMEM 128  // the fill's per-replica amounts live in shared memory (8E more bytes), copied out at the end

// Workspace layout in int64 words; mirrored by _Geo in moonep/planner/cuda.py.
struct Ws {
  i64 *A, *rx, *rs, *rc, *L, *rem, *amt, *cst;
  int *crk, *cseg, *err, *flags;
  i64* pre;
  int* hist;
  i64* c64;
};
__device__ __forceinline__ Ws ws_layout(i64* w, i64 R, i64 E) {
  Ws s;
  i64 o = 0;
  s.A = w + o;    o += E * R;     // assignment [E, R]
  s.rx = w + o;   o += E;         // replica_experts [R, epn]
  s.rs = w + o;   o += R;         // replica_source [R]
  s.rc = w + o;   o += R;         // recv_counts [R]
  s.L = w + o;    o += E;         // expert_counts [E]
  s.rem = w + o;  o += E;         // copies of e kept home [E]
  s.amt = w + o;  o += E;         // [R, epn]: copies of donor-local expert j on receiver r
  s.cst = w + o;  o += 2 * E;     // chunk table: start (global copy index) of each chunk
  s.crk = (int*)(w + o);  o += E;             // chunk table: rank of each chunk (int32 [2E])
  s.cseg = (int*)(w + o); o += (E + 2) / 2;   // chunks of expert e: [cseg[e], cseg[e+1]) (int32 [E+1])
  s.err = (int*)(w + o);  o += 1;             // validation flags (int32)
  s.flags = (int*)(w + o); o += FLAG_INTS / 2; // layout: [0] done counter, [1 + block] published
  s.pre = w + o;  o += E;                     // layout: copies of e on source ranks < rank
  s.hist = (int*)(w + o); o += HIST_BLOCKS * E / 2;  // layout: per-block expert counts [64, E]
  s.c64 = w + o;                              // int64 copy of int32 counts [R, E] (if F_C32)
  return s;
}

__device__ __forceinline__ i64 warp_sum(i64 v) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(FULL, v, off);
  return v;
}
template <typename T>
__device__ __forceinline__ T warp_incl_scan(T v, int lane) {
  for (int off = 1; off < 32; off <<= 1) {
    T y = __shfl_up_sync(FULL, v, off);
    if (lane >= off) v += y;
  }
  return v;
}
// lexicographic min of (a, i) over the warp; i == NONE: no candidate. All lanes get the result.
__device__ __forceinline__ void warp_min2(i64& a, int& i) {
  for (int off = 16; off > 0; off >>= 1) {
    i64 oa = __shfl_xor_sync(FULL, a, off);
    int oi = __shfl_xor_sync(FULL, i, off);
    if (oi != NONE && (i == NONE || oa < a || (oa == a && oi < i))) { a = oa; i = oi; }
  }
}
// Warp argmax (MAX) or argmin of positive values, ties to the lowest index; all lanes get (value, index),
// index NONE if no lane has a candidate (v > 0, and for the argmin idx != NONE). Three single-instruction
// reductions (sm_80+) instead of five shuffle rounds: the extreme of the high words, the extreme of the low
// words among lanes holding that high word, the min index among lanes holding the extreme.
template <bool MAX>
__device__ __forceinline__ int warp_arg_pos(i64& v, int idx) {
#if __CUDA_ARCH__ >= 800
  constexpr unsigned LOSE = MAX ? 0u : 0xffffffffu;  // a key no candidate loses to
  const bool ok = v > 0 && (MAX || idx != NONE);
  const unsigned hi = ok ? (unsigned)((unsigned long long)v >> 32) : LOSE;
  const unsigned mh = MAX ? __reduce_max_sync(FULL, hi) : __reduce_min_sync(FULL, hi);
  const unsigned lo = (ok && hi == mh) ? (unsigned)(unsigned long long)v : LOSE;
  const unsigned ml = MAX ? __reduce_max_sync(FULL, lo) : __reduce_min_sync(FULL, lo);
  const i64 m = (i64)(((unsigned long long)mh << 32) | (unsigned long long)ml);
  const int bi = (int)__reduce_min_sync(FULL, (ok && v == m) ? (unsigned)idx : (unsigned)NONE);
  v = m;
  return bi;
#else  // lexicographic min of (-v, index) or (v, index)
  i64 a = MAX ? (v > 0 ? -v : 0) : v;
  int i = (v > 0 && (MAX || idx != NONE)) ? idx : NONE;
  warp_min2(a, i);
  v = MAX ? -a : a;
  return i;
#endif
}
// Warp-wide unsigned min (OR false) or bitwise or (OR true) of v; all lanes get the result.
template <bool OR>
__device__ __forceinline__ unsigned warp_reduce(unsigned v) {
#if __CUDA_ARCH__ >= 800
  return OR ? __reduce_or_sync(FULL, v) : __reduce_min_sync(FULL, v);
#else
  for (int off = 16; off > 0; off >>= 1) {
    const unsigned o = __shfl_xor_sync(FULL, v, off);
    v = OR ? v | o : (o < v ? o : v);
  }
  return v;
#endif
}
__device__ __forceinline__ unsigned warp_umin(unsigned v) { return warp_reduce<false>(v); }
__device__ __forceinline__ unsigned warp_or(unsigned v) { return warp_reduce<true>(v); }
// One-reduction forms for small values (PlanSm.ib >= 0: every value compared is below 2^(31 - ib), ib bits
// hold a rank): the value and the (inverted) index packed in one 32-bit key, one dependent reduction
// instead of three in each of the ~R steps of the fill loop (measured: -3 % plan time at (896, 64, 16),
// h200x1_planner_prof_0411968.json -> h200x1_planner_prof_ac869a9.json).
template <typename V>
__device__ __forceinline__ int warp_argmax_small(V& v, int idx, int ib) {
#if __CUDA_ARCH__ >= 800
  const unsigned mask = (1u << ib) - 1u;
  const unsigned key = v > 0 ? ((unsigned)v << ib) | (mask - (unsigned)idx) : 0u;
  const unsigned m = __reduce_max_sync(FULL, key);
  v = (V)(m >> ib);
  return m ? (int)(mask - (m & mask)) : NONE;
#else
  i64 w = v;
  const int i = warp_arg_pos<true>(w, idx);
  v = (V)w;
  return i;
#endif
}
__device__ __forceinline__ int warp_argmin_small(i64& v, int idx, int ib) {
#if __CUDA_ARCH__ >= 800
  const unsigned key = (v > 0 && idx != NONE) ? ((unsigned)v << ib) | (unsigned)idx : 0xffffffffu;
  const unsigned m = __reduce_min_sync(FULL, key);
  v = m == 0xffffffffu ? -1 : (i64)(m >> ib);
  return m == 0xffffffffu ? NONE : (int)(m & ((1u << ib) - 1u));
#else
  return warp_arg_pos<false>(v, idx);
#endif
}
// Column e of int32 counts [R, E]: the sum of its non-negative entries, each entry also widened into c64
// (the plan's int64 copy of the counts); neg |= some entry is negative.
__device__ __forceinline__ i64 colsum32(const int* c, i64* c64, int R, int E, int e, bool& neg) {
  i64 sum = 0;
  for (int r = 0; r < R; ++r) {
    i64 v = c[(i64)r * E + e];
    c64[(i64)r * E + e] = v;
    neg |= v < 0;
    sum += v < 0 ? 0 : v;
  }
  return sum;
}
// Tq, Tr: T / R and T % R, computed once (64-bit division is a long software routine)
__device__ __forceinline__ i64 tgt_of(int r, bool exact, i64 Tq, i64 Tr, i64 cap) {
  return exact ? Tq + (r < Tr ? 1 : 0) : cap;
}

struct PlanSm {
  i64* rem;    // [E] remaining home copies
  i64* psum;   // [E] per rank: prefix sums of rem in `order`
  i64* bal;    // [R] load - target
  int* order;  // [E] per rank: local expert ids by (rem desc, id asc)
  int* rsrc;   // [R] replica source
  int* tj;     // [epn] scratch: experts touched by a fill
  unsigned char* used;  // [R] cap mode
  i64* amt;    // global [R*epn]
  i64* rx;     // global [R*epn]
  int epn;
  int ib;      // >= 0: values fit the one-reduction selections with ib index bits (see warp_argmax_small)
};
// V = int: only where s.ib >= 0 (run_exact's 32-bit instantiation)
template <typename V>
__device__ __forceinline__ int argmax_pos(const PlanSm& s, V& v, int idx) {
  if constexpr (sizeof(V) == 4) return warp_argmax_small(v, idx, s.ib);
  else return s.ib >= 0 ? warp_argmax_small(v, idx, s.ib) : warp_arg_pos<true>(v, idx);
}
__device__ __forceinline__ int argmin_pos(const PlanSm& s, i64& v, int idx) {
  return s.ib >= 0 ? warp_argmin_small(v, idx, s.ib) : warp_arg_pos<false>(v, idx);
}

// warp: psum[base + a] = sum of rem over order[base .. base+a]; returns the total
__device__ __forceinline__ i64 rank_psum(const PlanSm& s, int base, int lane) {
  i64 carry = 0;
  for (int a0 = 0; a0 < s.epn; a0 += 32) {
    int a = a0 + lane;
    i64 v = a < s.epn ? s.rem[base + s.order[base + a]] : 0;
    v = warp_incl_scan(v, lane);
    if (a < s.epn) s.psum[base + a] = carry + v;
    carry += __shfl_sync(FULL, v, 31);
  }
  return carry;
}

// a shared-memory int64 value as V (int: its low word, for values below 2^31)
template <typename V>
__device__ __forceinline__ V ldv(const i64* p) {
  if constexpr (sizeof(V) == 4) return *(const int*)p;
  else return *p;
}

// warp: smallest k such that the k largest remaining experts (prefix sums ps) cover d; epn+1 if none
template <typename V>
__device__ __forceinline__ int kneed(const i64* ps, int epn, V d) {
  if (epn <= 32) {  // independent loads instead of a chain of dependent ones (ps is non-decreasing)
    // 16 loads at a time, unconditionally (the launcher pads the shared memory by 16 words, so the last
    // rank's reads past its psum stay inside the allocation): guarded loads were issued one at a time,
    // each waiting for the previous compare (~35 cycles x 16 per candidate, ncu SASS); a binary search
    // is 5 dependent loads at epn = 32.
    int k = 1;
    for (int h = 0; h < epn; h += 16) {
      V v[16];
#pragma unroll
      for (int a = 0; a < 16; ++a) v[a] = ldv<V>(ps + h + a);
      int c = 0;
#pragma unroll
      for (int a = 0; a < 16; ++a) c += (h + a < epn && v[a] < d) ? 1 : 0;
      k += c;
      if (c < 16) break;  // the first position covering d is in this half
    }
    return k;
  }
  int lo = 0, hi = epn;
  while (lo < hi) {
    int mid = (lo + hi) >> 1;
    if (ps[mid] >= d) hi = mid; else lo = mid + 1;
  }
  return lo + 1;
}

// warp, any epn: move `need` copies from donor o's largest remaining experts to receiver u (cpu.py _fill).
// The fill touches a prefix [0, t) of the donor's order and empties all of it but position t-1 (it is
// largest-first), so the new (rem desc, id asc) order merges the untouched suffix, still sorted, with the
// t touched experts: an untouched one moves up by the touched ones now before it (O(1) when its rem > 0),
// a touched one finds its place in the suffix by binary search. A full re-rank of the donor (every expert
// against every other, O(epn^2 / 32) per lane) was 19.5k of the 21.8k cycles of the fill loop at (256, 2, 8)
// (h200x1_planner_stamps_128eefa.json).
__device__ void wfill_gen(const PlanSm& s, int u, int o, i64 need, int lane, bool upd_bal) {
  const int epn = s.epn, base = o * epn;
  int ntouch = 0;
  for (int a0 = 0; a0 < epn; a0 += 32) {
    int a = a0 + lane;
    i64 take = 0;
    if (a < epn) {
      i64 prev = a ? s.psum[base + a - 1] : 0;
      i64 v = s.psum[base + a] - prev, left = need - prev;
      take = left <= 0 ? 0 : (v < left ? v : left);
      if (take > 0) {
        int j = s.order[base + a];
        s.rem[base + j] -= take;
        s.amt[(i64)u * epn + j] = take;
        s.tj[a] = j;
      }
    }
    unsigned m = __ballot_sync(FULL, take > 0);  // touched positions are a prefix
    ntouch += __popc(m);
    if (m != FULL) break;
  }
  if (lane == 0) {
    if (upd_bal) { s.bal[u] += need; s.bal[o] -= need; }
    s.rsrc[u] = o;
  }
  __syncwarp();
  const int t = ntouch;
  for (int a = lane; a < t; a += 32) {  // replica slots of u, ascending expert id
    int j = s.tj[a], pos = 0;
    for (int q = 0; q < t; ++q) pos += s.tj[q] < j;
    s.rx[(i64)u * epn + pos] = base + j;
  }
  if (t > 0) {
    const int jl = s.tj[t - 1];
    const i64 rl = s.rem[base + jl];         // the partly taken one (0 if the fill emptied it too)
    const int nz = rl > 0 ? t - 1 : t;       // touched experts now at 0: tj[0, nz)
    // zeros among the touched ones with a smaller id than j (zeros sort by id)
    auto zeros_below = [&](int j) { int c = 0; for (int q = 0; q < nz; ++q) c += s.tj[q] < j; return c; };
    i64* np = s.psum + base;                  // scratch: psum is rebuilt below
    for (int a = lane; a < epn; a += 32) {
      int j, pos;
      if (a >= t) {                           // untouched: a - t of them sort before it, plus touched ones
        j = s.order[base + a];
        const i64 v = s.rem[base + j];
        pos = a - t + (v > 0 ? ((rl > v || (rl == v && jl < j)) ? 1 : 0) : (rl > 0 ? 1 : 0) + zeros_below(j));
      } else {                                // touched: its place among the untouched, then the touched
        j = s.tj[a];
        const i64 v = (a == t - 1) ? rl : 0;
        int lo = t, hi = epn;                 // first untouched position that sorts after (v, j)
        while (lo < hi) {
          const int mid = (lo + hi) >> 1, jm = s.order[base + mid];
          const i64 vm = s.rem[base + jm];
          if (vm > v || (vm == v && jm < j)) lo = mid + 1; else hi = mid;
        }
        pos = lo - t + (v > 0 ? 0 : (rl > 0 ? 1 : 0) + zeros_below(j));
      }
      np[a] = ((i64)pos << 32) | (unsigned)j;
    }
    __syncwarp();
    for (int a = lane; a < epn; a += 32) {
      const i64 q = np[a];
      s.order[base + (int)(q >> 32)] = (int)(unsigned)q;
    }
    __syncwarp();
  }
  rank_psum(s, base, lane);
  __syncwarp();
}

// warp, epn <= 32 (lane a = position a of the donor's sorted experts): the same fill in registers, in a
// constant number of warp steps whatever the number of experts touched. Positions [0, t) are touched (a
// prefix: values are sorted descending) and every one but the last is emptied (the fill is largest-first),
// so the donor's new (rem desc, id asc) order is: the untouched nonzero experts in their old order with at
// most one expert, the partly taken last one, inserted among them; then every zero by id. Both insertions
// are a ballot (the untouched ones that sort before the partial one are a prefix of them) and a 32-bit
// id mask (ids < 32), so a fill costs the same whether it empties one expert or all (Theorem-2 routings
// empty most of a donor: the former per-touched-expert rounds cost ~1.7 us per step at (896, 64, 16)).
template <typename V>
__device__ __forceinline__ void wfill32(const PlanSm& s, int u, int o, V need, int lane, bool upd_bal) {
  const int epn = s.epn, base = o * epn;
  const bool in = lane < epn;
  const int j = in ? s.order[base + lane] : 0;
  const V P = in ? ldv<V>(s.psum + base + lane) : 0;  // old inclusive prefix sums
  V Pp = __shfl_up_sync(FULL, P, 1);
  if (lane == 0) Pp = 0;
  const V v = P - Pp, left = need - Pp;
  const V take = (in && left > 0) ? (v < left ? v : left) : 0;
  const V nv = v - take;
  const bool touched = take > 0;
  const int t = __popc(__ballot_sync(FULL, touched));
  const int lt = t ? t - 1 : 0;                        // the last touched position
  const V pv = t ? __shfl_sync(FULL, nv, lt) : 0;    // what it keeps (> 0: the partial one)
  const int pj = __shfl_sync(FULL, j, lt);
  const V Ptt = t ? __shfl_sync(FULL, P, lt) : 0;    // old sum of the touched part
  const V Pall = __shfl_sync(FULL, P, epn - 1);
  const bool part = pv > 0;
  const bool unz = in && !touched && nv > 0;           // untouched nonzero: old positions [t, t + nu)
  const bool zero = in && nv == 0;
  const bool bef = unz && part && (nv > pv || (nv == pv && j < pj));  // sorts before the partial one
  const int ub = __popc(__ballot_sync(FULL, bef));
  const int nu = __popc(__ballot_sync(FULL, unz));
  const unsigned zm = warp_or(zero ? 1u << j : 0u);
  const unsigned tm = warp_or(touched ? 1u << j : 0u);
  const V Pu = __shfl_sync(FULL, P, (lt + ub) & 31);  // old prefix through the last untouched before it
  const unsigned below = (1u << j) - 1u;
  int pos;
  V acc;
  if (unz) {
    const bool after = part && !bef;  // the partial one moved in front of this one
    pos = lane - t + (after ? 1 : 0);
    acc = P - Ptt + (after ? pv : 0);
  } else if (touched && part && lane == lt) {
    pos = ub;
    acc = (ub ? Pu - Ptt : 0) + pv;
  } else {  // zeros, by id, after the nu + part nonzero ones
    pos = nu + (part ? 1 : 0) + __popc(zm & below);
    acc = Pall - Ptt + pv;  // the new total
  }
  __syncwarp();
  if (in) {
    s.rem[base + j] = (i64)nv;
    s.order[base + pos] = j;
    s.psum[base + pos] = (i64)acc;
  }
  if (touched) {  // replica slots of u, ascending expert id
    s.amt[(i64)u * epn + j] = (i64)take;
    s.rx[(i64)u * epn + __popc(tm & below)] = base + j;
  }
  if (lane == 0) {
    if (upd_bal) { s.bal[u] += need; s.bal[o] -= need; }
    s.rsrc[u] = o;
  }
  __syncwarp();
}

// upd_bal: also move `need` in s.bal (run_exact keeps the balances in registers and writes them at the end)
template <typename V>
__device__ __forceinline__ void wfill(const PlanSm& s, int u, int o, V need, int lane, bool upd_bal = true) {
  if (s.epn <= 32) wfill32<V>(s, u, o, need, lane, upd_bal);
  else wfill_gen(s, u, o, (i64)need, lane, upd_bal);
}

// warp 0, exact mode (cpu.py _plan_core, exact branch). NR > 0 (R <= 32 NR): lane l keeps the balance and
// the largest remaining home expert of ranks l, l + 32, ... in registers (bq, tq), so the receiver and the
// fast donor choice are a reduction each with no shared-memory load in front, and a fill updates two
// registers instead of two shared-memory read-modify-writes by one lane (the balances go back to s.bal at
// the end). NR == 0 (large R): the same loop on s.bal and s.psum. V = int where every value fits
// (s.ib >= 0): half the instructions of int64 compares, selects and shuffles on this sequential path.
template <int NR, typename V>
__device__ int run_exact(const PlanSm& s, int R, int lane, i64* CLKp) {
  const int epn = s.epn;
  constexpr bool REG = NR > 0;
  const int nr = REG ? NR : (R + 31) >> 5;
  V bq[REG ? NR : 1], tq[REG ? NR : 1];
  if constexpr (REG) {
#pragma unroll
    for (int i = 0; i < NR; ++i) {
      const int r = lane + 32 * i;
      bq[i] = r < R ? ldv<V>(s.bal + r) : 0;  // ranks >= R: balance 0, never a receiver or a donor
      tq[i] = r < R ? ldv<V>(s.psum + r * epn) : 0;
    }
  }
  auto bal = [&](int i, int r) -> V {
    if constexpr (REG) return bq[i]; else return ldv<V>(s.bal + r);
  };
  auto top = [&](int i, int r) -> V {
    if constexpr (REG) return tq[i]; else return ldv<V>(s.psum + r * epn);
  };
#ifdef MOONEP_PLAN_CLOCKS
  i64* CLK = CLKp;
  i64 tc = clock64();
#endif
  while (true) {
    V d = 0; int bi = NONE;                  // receiver: largest deficit, lowest index
#pragma unroll
    for (int i = 0; i < (REG ? NR : nr); ++i) {
      const int r = lane + 32 * i;
      if (!REG && r >= R) break;
      const V dr = -bal(i, r);
      if (dr > d) { d = dr; bi = r; }
    }
    const int u = argmax_pos(s, d, bi);
    CLK_ADD(8, tc);
    if (u == NONE) break;
    // donor: min (k, excess < d, -excess, index). Fast path: if some donor covers d with its largest
    // remaining expert (k = 1), only k = 1 donors compete, by (excess < d, -excess, index).
    unsigned bc = 2; V bx = 0; int bo = NONE;
#pragma unroll
    for (int i = 0; i < (REG ? NR : nr); ++i) {
      const int c = lane + 32 * i;
      if (!REG && c >= R) break;
      const V x = bal(i, c);
      if (x <= 0 || top(i, c) < d) continue;
      const unsigned cs = x < d ? 1u : 0u;
      if (cs < bc || (cs == bc && x > bx)) { bc = cs; bx = x; bo = c; }
    }
    unsigned cmin;
    int o = NONE;
    if (sizeof(V) == 4 || s.ib >= 0) {  // one reduction: key (excess >= d, excess, -index)
#if __CUDA_ARCH__ >= 800
      const unsigned mask = (1u << s.ib) - 1u;
      const unsigned key = bo != NONE ? ((1u - bc) << 31) | ((unsigned)bx << s.ib) | (mask - (unsigned)bo) : 0u;
      const unsigned m = __reduce_max_sync(FULL, key);
      cmin = m ? 1u - (m >> 31) : 2u;
      if (m) o = (int)(mask - (m & mask));
#else
      cmin = 2;  // unreachable: ib < 0 below sm_80
#endif
    } else {
      cmin = warp_umin(bc);
      if (cmin < 2) {
        i64 xm = bc == cmin ? (i64)bx : 0;
        o = warp_arg_pos<true>(xm, bo);
      }
    }
    if (cmin >= 2) {
      int ka = 0; V kb = 0; int ki = NONE;
#pragma unroll
      for (int i = 0; i < (REG ? NR : nr); ++i) {
        const int c = lane + 32 * i;
        if (!REG && c >= R) break;
        const V x = bal(i, c);
        if (x <= 0) continue;
        const int a = 2 * kneed<V>(s.psum + c * epn, epn, d) + (x < d ? 1 : 0);
        if (ki == NONE || a < ka || (a == ka && -x < kb)) { ka = a; kb = -x; ki = c; }
      }
      // lexicographic min of (ka, -x, index): the smallest ka, then the largest excess (argmax), one
      // reduction each instead of five shuffle rounds of three values
      const unsigned amin = warp_umin(ki != NONE ? (unsigned)ka : 0xffffffffu);
      V xm = (ki != NONE && (unsigned)ka == amin) ? -kb : 0;
      o = argmax_pos(s, xm, ki);
    }
    CLK_ADD(cmin < 2 ? 9 : 10, tc);
    if (o == NONE) break;  // unreachable: total excess == total deficit
    wfill<V>(s, u, o, d, lane, !REG);
    if constexpr (REG) {
      const V ntop = ldv<V>(s.psum + o * epn);  // o's new largest remaining expert (wfill ended with __syncwarp)
#pragma unroll
      for (int i = 0; i < NR; ++i) {
        const int r = lane + 32 * i;
        if (r == u) bq[i] += d;
        if (r == o) { bq[i] -= d; tq[i] = ntop; }
      }
    }
    CLK_ADD(11, tc);
#ifdef MOONEP_PLAN_CLOCKS
    if (lane == 0) CLK[12] += 1;
#endif
  }
  if constexpr (REG) {
#pragma unroll
    for (int i = 0; i < NR; ++i)
      if (lane + 32 * i < R) s.bal[lane + 32 * i] = (i64)bq[i];
    __syncwarp();
  }
  return 0;
}

// warp 0, cap mode (cpu.py _plan_core, cap branch); returns 1 if stuck
__device__ int run_cap(const PlanSm& s, int R, int lane) {
  while (true) {
    i64 x = 0; int bi = NONE;                  // donor: largest excess over the cap, lowest index
    for (int r = lane; r < R; r += 32) {
      const i64 xr = s.bal[r];
      if (xr > x) { x = xr; bi = r; }
    }
    const int o = argmax_pos(s, x, bi);
    if (o == NONE) return 0;
    if (lane == 0) s.used[o] = 1;
    __syncwarp();
    while (x > 0) {
      i64 fa = 0; int fi = NONE;               // smallest room that takes all of x
      i64 ga = 0; int gi = NONE;               // largest room
      for (int v = lane; v < R; v += 32) {
        i64 room = -s.bal[v];
        if (s.used[v] || room <= 0) continue;
        if (room >= x && (fi == NONE || room < fa)) { fa = room; fi = v; }
        if (gi == NONE || -room < ga) { ga = -room; gi = v; }
      }
      fi = argmin_pos(s, fa, fi);
      i64 gm = gi != NONE ? -ga : 0;
      gi = argmax_pos(s, gm, gi);
      const int v = fi != NONE ? fi : gi;
      if (v == NONE) return 1;
      const i64 room = fi != NONE ? fa : gm;
      const i64 a = x < room ? x : room;
      if (lane == 0) s.used[v] = 1;
      wfill(s, v, o, a, lane);
      x -= a;
    }
  }
}

// gpu-scope acquire load and release store of a layout flag: int, or i64 (the fused launch's nonce flags)
template <typename T>
__device__ __forceinline__ T ld_acquire(const T* p) {
  T v;
  if constexpr (sizeof(T) == 8) asm volatile("ld.acquire.gpu.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  else asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
template <typename T>
__device__ __forceinline__ void st_release(T* p, T v) {
  if constexpr (sizeof(T) == 8) asm volatile("st.release.gpu.global.b64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
  else asm volatile("st.release.gpu.global.b32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Single block. Dynamic shared memory (bytes): 8*(2E + R) + 4*(E + 4R + 2 + epn) + R, plus 128 of padding
// (kneed's unconditional loads), plus 8E with F_AMT_SMEM.
__device__ __noinline__ void plan_body(
    const void* __restrict__ counts, i64* __restrict__ wsp, i64 R_, i64 E_, i64 flags, i64 slack_bits,
    const i64* __restrict__ decl, i64 decl_scalar, i64 nonce) {
  const int R = (int)R_, E = (int)E_, epn = E / R;
  const int tid = threadIdx.x, nt = blockDim.x, lane = tid & 31, warp = tid >> 5, nw = nt >> 5;
  const Ws w = ws_layout(wsp, R_, E_);
  extern __shared__ __align__(16) unsigned char sm_raw[];
  __shared__ i64 red[32];
  __shared__ int s_stuck;
  CLK_DECL
#ifdef MOONEP_PLAN_TS
  i64* TSp = (flags & F_FUSED) ? w.c64 + ((flags & F_C32) ? R_ * E_ : 0) : nullptr;
  TS_MARK(0);
#endif
#ifdef MOONEP_PLAN_CLOCKS
  i64 tb_ = clock64();
  if (threadIdx.x < 16) CLK[threadIdx.x] = 0;
  __syncthreads();
#endif
  PlanSm s;
  s.rem = (i64*)sm_raw;
  s.psum = s.rem + E;
  s.bal = s.psum + E;
  // amounts in shared memory when they fit: the chunk table reads them back per receiver, and from
  // global memory those loads were serialised behind the table's stores (11.8k cycles at (896, 64, 16) Zipf)
  const bool amt_sm = flags & F_AMT_SMEM;
  s.amt = amt_sm ? s.bal + R : w.amt;
  s.order = (int*)(s.bal + R + (amt_sm ? E : 0));
  s.rsrc = s.order + E;
  int* rpos = s.rsrc + R;      // [R]   receiver's index among its source's receivers
  int* nrecv = rpos + R;       // [R+1]
  int* rptr = nrecv + R + 1;   // [R+1] exclusive scan of nrecv
  s.tj = rptr + R + 1;         // [epn]
  s.used = (unsigned char*)(s.tj + epn);
  s.rx = w.rx;
  s.epn = epn;

  // 0. expert loads (column sums), negative check, declared row sums
  int errbits = 0;
  i64 part = 0;  // this thread's share of T
  bool neg = false;
  if (flags & F_COLSUM) {
    for (int e = tid; e < E; e += nt) {
      i64 sum = 0;
      if (flags & F_C32) {
        sum = colsum32((const int*)counts, w.c64, R, E, e, neg);
      } else {  // 8 loads in flight per thread: this single block reads all R*E counts
        const i64* c = (const i64*)counts + e;
        int r = 0;
        for (; r + 8 <= R; r += 8) {
          i64 v[8];
#pragma unroll
          for (int k = 0; k < 8; ++k) v[k] = __ldg(c + (i64)(r + k) * E);
#pragma unroll
          for (int k = 0; k < 8; ++k) { neg |= v[k] < 0; sum += v[k] < 0 ? 0 : v[k]; }
        }
        for (; r < R; ++r) {
          i64 v = __ldg(c + (i64)r * E);
          neg |= v < 0;
          sum += v < 0 ? 0 : v;
        }
      }
      w.L[e] = sum;
      s.rem[e] = sum;
      part += sum;
    }
  } else {  // moonep_colsum ran: L in the workspace, negative flags per expert in hist
    for (int e = tid; e < E; e += nt) {
      const i64 v = w.L[e];
      s.rem[e] = v;
      part += v;
      neg |= w.hist[e] != 0;
    }
  }
  // T = sum of the loads, and the negative flag, with one barrier
  part = warp_sum(part);
  if (lane == 0) red[warp] = part;
  if (__syncthreads_or(neg)) errbits |= 1;
  i64 T = 0;
  for (int q = 0; q < nw; ++q) T += red[q];
  if (flags & F_COLSUM) {
    if (flags & (F_DECL_SCALAR | F_DECL_PTR)) {
      bool bad = false;
      for (int r = warp; r < R; r += nw) {
        i64 sum = 0;
        for (int e = lane; e < E; e += 32)
          sum += (flags & F_C32) ? (i64)((const int*)counts)[(i64)r * E + e] : ((const i64*)counts)[(i64)r * E + e];
        sum = warp_sum(sum);
        bad |= sum != ((flags & F_DECL_PTR) ? decl[r] : decl_scalar);
      }
      if (__syncthreads_or(bad)) errbits |= 2;
    }
  }
  CLK_BLK(0);
  const i64 Tq = T / R, Tr = T - Tq * R;
  i64 cap = Tq + (Tr ? 1 : 0);
  {
    i64 capf = (i64)ceil((1.0 + __longlong_as_double(slack_bits)) * (double)T / (double)R);
    if (capf > cap) cap = capf;
  }

  {  // one-reduction selections when every deficit, excess and room (each <= max(T, cap)) fits
#if __CUDA_ARCH__ >= 800
    const int ib = R > 1 ? 32 - __clz(R - 1) : 1;
    const i64 lim = T > cap ? T : cap;
    s.ib = lim < (1LL << (31 - ib)) - 1 ? ib : -1;
#else
    s.ib = -1;
#endif
  }
  bool exact = true;
  CLK_BLK(1);
  TS_MARK(1);
  for (int attempt = 0; attempt < 2; ++attempt) {
    exact = !(flags & F_CAP) || attempt == 1;
    for (int e = tid; e < E; e += nt) {
      if (attempt) s.rem[e] = w.L[e];
      s.amt[e] = 0;
      w.rx[e] = -1;
    }
    for (int r = tid; r < R; r += nt) { s.rsrc[r] = -1; s.used[r] = 0; }
    __syncthreads();
    for (int idx = tid; idx < E; idx += nt) {  // per rank: local experts by (rem desc, id asc)
      int r = idx / epn, base = r * epn, j = idx - base;
      i64 v = s.rem[idx];
      int pos = 0;
#pragma unroll 8
      for (int q = 0; q < epn; ++q) { i64 x = s.rem[base + q]; pos += (x > v) || (x == v && q < j); }
      s.order[base + pos] = j;
    }
    __syncthreads();
    for (int r = warp; r < R; r += nw) {
      i64 tot = rank_psum(s, r * epn, lane);
      if (lane == 0) s.bal[r] = tot - tgt_of(r, exact, Tq, Tr, cap);
    }
    __syncthreads();
    CLK_BLK(2);
    TS_MARK(2);
    if (warp == 0) {
#ifdef MOONEP_PLAN_CLOCKS
      i64* clkp = CLK;
#else
      i64* clkp = nullptr;
#endif
      int st = !exact ? run_cap(s, R, lane)
               : (R <= 64 && s.ib >= 0) ? run_exact<2, int>(s, R, lane, clkp) : run_exact<0, i64>(s, R, lane, clkp);
      if (lane == 0) s_stuck = st;
    } else if (attempt == 0 && (flags & F_ASSIGN) && (warp & 3)) {
      // meanwhile warps on the other schedulers zero the [E, R] assignment (16-byte stores); its
      // nonzeros (home copies and replicas) are scattered after the plan
      const i64 ER = (i64)E * R, n2 = ER >> 1;
      const int nz = nw - 1 - (nw - 1) / 4, zt = ((warp - 1 - (warp >> 2)) << 5) + lane;  // warps with warp & 3
      struct __align__(16) Z2 { i64 a, b; };
      Z2* A2 = (Z2*)w.A;  // the workspace (allocator memory) and A at its start are 16-byte aligned
      Z2 z;
      z.a = 0;
      z.b = 0;
      for (i64 q = zt; q < n2; q += (i64)nz * 32) A2[q] = z;
      if ((ER & 1) && zt == 0) w.A[ER - 1] = 0;
    }
    __syncthreads();
    if (!s_stuck) break;
    __syncthreads();
  }

  CLK_BLK(3);
  TS_MARK(3);
  // 3. outputs and the layout's chunk table. The receivers of each home rank (nrecv, rptr: exclusive scan,
  // rlist: ascending) come from rsrc. R <= 32: warp 0 builds them in registers (lane = rank: a match for
  // each receiver's index among its source's, a scan for rptr) while the other warps write the outputs,
  // one block barrier instead of four (the post-loop phases cost ~3 us at (256, 8, 8), mostly barriers).
  int* rlist = s.order;  // receivers of each home rank, ascending (order is no longer needed)
  const bool small = R <= 32;
  if (small && warp == 0) {
    const int h = lane < R ? s.rsrc[lane] : -1;
    const unsigned grp = __match_any_sync(FULL, h);
    const int rp = __popc(grp & ((1u << lane) - 1u));  // index among the receivers of h
    if (lane < R) nrecv[lane] = 0;
    __syncwarp();
    if (h >= 0 && rp == 0) nrecv[h] = __popc(grp);
    __syncwarp();
    const int cnt = lane < R ? nrecv[lane] : 0;
    const int inc = warp_incl_scan(cnt, lane);
    const int tot = __shfl_sync(FULL, inc, 31);
    if (lane < R) rptr[lane] = inc - cnt;
    if (lane == 0) rptr[R] = tot;
    __syncwarp();
    if (h >= 0) rlist[rptr[h] + rp] = lane;
  } else {
    const int t0 = small ? tid - 32 : tid, n0 = small ? nt - 32 : nt;
    for (int e = t0; e < E; e += n0) {
      w.rem[e] = s.rem[e];
      if (amt_sm) w.amt[e] = s.amt[e];
    }
    for (int r = t0; r < R; r += n0) {
      w.rs[r] = s.rsrc[r];
      w.rc[r] = s.bal[r] + tgt_of(r, exact, Tq, Tr, cap);
      if (!small) nrecv[r] = 0;
    }
    if (!(flags & F_FUSED))
      for (int q = t0; q < FLAG_INTS; q += n0) w.flags[q] = 0;
    if (t0 == 0) { w.err[0] = errbits; w.err[1] = 0; }
  }
  __syncthreads();
  CLK_BLK(5);
  if (!small) {
    for (int v = tid; v < R; v += nt) {
      int h = s.rsrc[v];
      if (h >= 0) {
        int idx = 0;
        for (int q = 0; q < v; ++q) idx += s.rsrc[q] == h;
        rpos[v] = idx;
        atomicAdd(&nrecv[h], 1);
      }
    }
    __syncthreads();
    CLK_BLK(6);
    if (warp == 0) {
      int carry = 0;
      for (int r0 = 0; r0 <= R; r0 += 32) {
        int r = r0 + lane;
        int v = r < R ? nrecv[r] : 0, inc = warp_incl_scan(v, lane);
        if (r <= R) rptr[r] = carry + inc - v;
        carry += __shfl_sync(FULL, inc, 31);
      }
    }
    __syncthreads();
    CLK_BLK(7);
    for (int v = tid; v < R; v += nt) {
      int h = s.rsrc[v];
      if (h >= 0) rlist[rptr[h] + rpos[v]] = v;
    }
  }
  __syncthreads();
  CLK_BLK(13);
  // chunks of expert e (home h, local j): ranks {h} + receivers of h, ascending; chunk starts are
  // the running sum of assignment[e, r] in that order (layout.py's chunk_start)
  for (int e = tid; e < E; e += nt) {
    const int h = e / epn, j = e - h * epn, nr = nrecv[h], r0 = rptr[h];
    int c = epn * h + epn * r0 + j * (1 + nr);
    w.cseg[e] = c;
    if (e == E - 1) w.cseg[E] = E + epn * rptr[R];
    i64 run = 0;
    bool hdone = false;
    for (int q = 0; q < nr; ++q) {
      int v = rlist[r0 + q];
      if (!hdone && h < v) { w.cst[c] = run; w.crk[c] = h; run += s.rem[e]; ++c; hdone = true; }
      w.cst[c] = run; w.crk[c] = v; run += s.amt[(i64)v * epn + j]; ++c;
    }
    if (!hdone) { w.cst[c] = run; w.crk[c] = h; }
  }
#ifdef MOONEP_PLAN_CLOCKS
  __syncthreads();
  CLK_BLK(14);
#endif
  TS_MARK(4);
  if (flags & F_FUSED) {  // the layout's inputs are written (the [E, R] assignment is not one of them)
    __syncthreads();
    if (tid == 0) {
      ((i64*)w.flags)[0] = 0;  // the layout blocks' finish counter (stale memory: it is not zeroed upstream)
      __threadfence();
      st_release((i64*)w.flags + 1, nonce);
    }
    TS_MARK(5);
  }
  if (flags & F_ASSIGN) {  // zeroed during the plan (ordered before this by the barriers above)
    for (int idx = tid; idx < E; idx += nt) {
      const int r = idx / epn, j = idx - r * epn, h = s.rsrc[r];
      w.A[(i64)idx * R + r] = s.rem[idx];                                  // home copies of expert idx
      if (h >= 0) w.A[((i64)h * epn + j) * R + r] = s.amt[(i64)r * epn + j];  // r's replicas of h's expert j
    }
  }
#ifdef MOONEP_PLAN_CLOCKS
  __syncthreads();
  CLK_BLK(4);
  if (!(flags & F_FUSED) && threadIdx.x < 16) ((i64*)w.hist)[threadIdx.x] = CLK[threadIdx.x];
  if (TSp && threadIdx.x < 16) TSp[16 + threadIdx.x] = CLK[threadIdx.x];
#endif
}

extern "C" __global__ void __launch_bounds__(1024) moonep_plan(
    const void* __restrict__ counts, i64* __restrict__ wsp, i64 R_, i64 E_, i64 flags, i64 slack_bits,
    const i64* __restrict__ decl, i64 decl_scalar) {
  plan_body(counts, wsp, R_, E_, flags & ~(i64)F_FUSED, slack_bits, decl, decl_scalar, 0);
}

// Large R*E: expert loads as a grid kernel (negative flags per expert in the hist scratch).
extern "C" __global__ void moonep_colsum(const void* __restrict__ counts, i64* __restrict__ wsp, i64 R_, i64 E_,
                                         i64 c32) {
  const Ws w = ws_layout(wsp, R_, E_);
  const int R = (int)R_, E = (int)E_;
  int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= E) return;
  i64 sum = 0;
  bool neg = false;
  if (c32) {
    sum = colsum32((const int*)counts, w.c64, R, E, e, neg);
  } else {
    const i64* c = (const i64*)counts;
#pragma unroll 8
    for (int r = 0; r < R; ++r) {
      i64 v = c[(i64)r * E + e];
      neg |= v < 0;
      sum += v < 0 ? 0 : v;
    }
  }
  w.L[e] = sum;
  w.hist[e] = neg ? 1 : 0;
}

// Large R*E: assignment[e, r] as a grid kernel.
extern "C" __global__ void moonep_assign(i64* __restrict__ wsp, i64 R_, i64 E_) {
  const Ws w = ws_layout(wsp, R_, E_);
  const int R = (int)R_, E = (int)E_, epn = E / R;
  i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= (i64)E * R) return;
  int e = (int)(idx / R), r = (int)(idx - (i64)e * R), h = e / epn;
  w.A[idx] = r == h ? w.rem[e] : (w.rs[r] == h ? w.amt[(i64)r * epn + (e - h * epn)] : 0);
}
