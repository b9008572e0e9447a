// Balanced planner on the GPU: the same algorithm and tie-breaks as moonep/planner/cpu.py, so the
// results are bit-identical. Compiled at run time by CuPy (NVRTC) from moonep/planner/cuda.py.
//
// Why one block: the plan is a short sequential loop (at most R fills), each step a few block-wide
// reductions over ranks; one block keeps all state in shared memory and needs no grid sync, so it
// runs without any host involvement and is CUDA-graph capturable. Parallel work (column sums and the
// [E, R] assignment) runs in separate grid kernels.
typedef long long i64;

extern "C" __global__ void colsum_i64(const i64* __restrict__ counts, int R, int E, i64* L, int* err) {
  int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= E) return;
  i64 s = 0; bool neg = false;
  for (int r = 0; r < R; ++r) { i64 v = counts[(i64)r * E + e]; neg |= v < 0; s += v < 0 ? 0 : v; }
  L[e] = s;
  if (neg) atomicOr(err, 1);
}

extern "C" __global__ void colsum_i32(const int* __restrict__ counts, int R, int E, i64* L, int* err) {
  int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= E) return;
  i64 s = 0; bool neg = false;
  for (int r = 0; r < R; ++r) { int v = counts[(i64)r * E + e]; neg |= v < 0; s += v < 0 ? 0 : v; }
  L[e] = s;
  if (neg) atomicOr(err, 1);
}

// assignment[e, r]: copies kept home, or received as a replica from home(e).
extern "C" __global__ void assign_kernel(const i64* rem, const i64* amt, const i64* rep_src, int R,
                                         int epn, i64* assignment) {
  i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  i64 E = (i64)R * epn;
  if (idx >= E * R) return;
  int e = (int)(idx / R), r = (int)(idx % R), h = e / epn;
  assignment[idx] = r == h ? rem[e] : (rep_src[r] == h ? amt[(i64)r * epn + (e - h * epn)] : 0);
}

// lexicographic min over (a, b, i); i == INT_MAX marks "no candidate"
struct Cand { i64 a, b; int i; };
__device__ __forceinline__ bool better(const Cand& x, const Cand& y) {
  if (x.i == 0x7fffffff) return false;
  if (y.i == 0x7fffffff) return true;
  if (x.a != y.a) return x.a < y.a;
  if (x.b != y.b) return x.b < y.b;
  return x.i < y.i;
}
__device__ Cand block_min(Cand c, Cand* sh) {
  for (int off = 16; off > 0; off >>= 1) {
    Cand o;
    o.a = __shfl_down_sync(0xffffffffu, c.a, off);
    o.b = __shfl_down_sync(0xffffffffu, c.b, off);
    o.i = __shfl_down_sync(0xffffffffu, c.i, off);
    if (better(o, c)) c = o;
  }
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  if (lane == 0) sh[warp] = c;
  __syncthreads();
  if (warp == 0) {
    Cand d = {0, 0, 0x7fffffff};
    c = lane < nw ? sh[lane] : d;
    for (int off = 16; off > 0; off >>= 1) {
      Cand o;
      o.a = __shfl_down_sync(0xffffffffu, c.a, off);
      o.b = __shfl_down_sync(0xffffffffu, c.b, off);
      o.i = __shfl_down_sync(0xffffffffu, c.i, off);
      if (better(o, c)) c = o;
    }
    if (lane == 0) sh[32] = c;
  }
  __syncthreads();
  Cand r = sh[32];
  __syncthreads();
  return r;
}

// order[base .. base+epn) := local experts of rank o sorted by (rem desc, id asc); all threads
__device__ void sort_rank(const i64* rem, int* order, int o, int epn) {
  int base = o * epn;
  for (int j = threadIdx.x; j < epn; j += blockDim.x) {
    i64 v = rem[base + j]; int pos = 0;
    for (int q = 0; q < epn; ++q) { i64 w = rem[base + q]; pos += (w > v) || (w == v && q < j); }
    order[base + pos] = j;
  }
}

// Fill receiver u with `need` copies of donor o's largest remaining experts (all threads call it).
__device__ void fill(i64* rem, int* order, i64* load, i64* amt, i64* rep_exp, i64* rep_src, int u, int o,
                     int epn, i64 need) {
  int base = o * epn;
  if (threadIdx.x == 0) {
    load[u] += need; load[o] -= need; rep_src[u] = o;
    for (int a = 0; need > 0; ++a) {
      int j = order[base + a];
      i64 take = rem[base + j] < need ? rem[base + j] : need;
      rem[base + j] -= take; amt[(i64)u * epn + j] += take; need -= take;
    }
  }
  __syncthreads();
  for (int j = threadIdx.x; j < epn; j += blockDim.x) {   // replica slots, ascending expert id
    if (amt[(i64)u * epn + j] > 0) {
      int pos = 0;
      for (int q = 0; q < j; ++q) pos += amt[(i64)u * epn + q] > 0;
      rep_exp[(i64)u * epn + pos] = base + j;
    }
  }
  sort_rank(rem, order, o, epn);
  __syncthreads();
}

// Single block. Shared: rem i64[E], load i64[R], tgt i64[R], order int[E], used char[R].
// Outputs: rem_out i64[E], amt i64[R*epn], rep_exp i64[R*epn], rep_src i64[R], recv i64[R].
extern "C" __global__ void plan_kernel(const i64* L, int R, int epn, double slack, int cap_mode,
                                       i64* rem_out, i64* amt, i64* rep_exp, i64* rep_src, i64* recv) {
  extern __shared__ i64 smem[];
  __shared__ Cand red[33];
  int E = R * epn, tid = threadIdx.x, nt = blockDim.x;
  i64* rem = smem;
  i64* load = rem + E;
  i64* tgt = load + R;
  int* order = (int*)(tgt + R);
  unsigned char* used = (unsigned char*)(order + E);
  // T = sum L
  i64 part = 0;
  for (int e = tid; e < E; e += nt) part += L[e];
  for (int off = 16; off > 0; off >>= 1) part += __shfl_down_sync(0xffffffffu, part, off);
  if ((tid & 31) == 0) red[tid >> 5].a = part;
  __syncthreads();
  i64 T = 0;
  for (int w = 0; w < (nt >> 5); ++w) T += red[w].a;
  __syncthreads();
  i64 cap = (T + R - 1) / R;
  i64 capf = (i64)ceil((1.0 + slack) * (double)T / (double)R);
  if (capf > cap) cap = capf;

  for (int attempt = 0; attempt < 2; ++attempt) {
    bool exact = !cap_mode || attempt == 1;
    for (int e = tid; e < E; e += nt) { rem[e] = L[e]; amt[e] = 0; rep_exp[e] = -1; }
    for (int r = tid; r < R; r += nt) {
      i64 s = 0;
      for (int j = 0; j < epn; ++j) s += L[(i64)r * epn + j];
      load[r] = s; rep_src[r] = -1; used[r] = 0;
      tgt[r] = exact ? T / R + (r < T % R ? 1 : 0) : cap;
    }
    __syncthreads();
    for (int idx = tid; idx < E; idx += nt) {          // initial per-rank sort
      int r = idx / epn, j = idx - r * epn, base = r * epn;
      i64 v = rem[idx]; int pos = 0;
      for (int q = 0; q < epn; ++q) { i64 w = rem[base + q]; pos += (w > v) || (w == v && q < j); }
      order[base + pos] = j;
    }
    __syncthreads();
    bool stuck = false;
    if (exact) {
      while (true) {
        Cand best = {0, 0, 0x7fffffff};
        for (int r = tid; r < R; r += nt) {
          i64 d = tgt[r] - load[r];
          Cand x = {-d, 0, r};
          if (d > 0 && better(x, best)) best = x;
        }
        best = block_min(best, red);
        if (best.i == 0x7fffffff) break;
        int u = best.i; i64 d = -best.a;
        Cand bo = {0, 0, 0x7fffffff};
        for (int o = tid; o < R; o += nt) {
          i64 x = load[o] - tgt[o];
          if (x <= 0) continue;
          int base = o * epn, k = epn + 1; i64 acc = 0;
          for (int a = 0; a < epn; ++a) { acc += rem[base + order[base + a]]; if (acc >= d) { k = a + 1; break; } }
          Cand cc = {(i64)k * 2 + (x < d ? 1 : 0), -x, o};
          if (better(cc, bo)) bo = cc;
        }
        bo = block_min(bo, red);
        fill(rem, order, load, amt, rep_exp, rep_src, u, bo.i, epn, d);
      }
    } else {
      while (!stuck) {
        Cand best = {0, 0, 0x7fffffff};
        for (int r = tid; r < R; r += nt) {
          i64 x = load[r] - tgt[r];
          Cand cc = {-x, 0, r};
          if (x > 0 && better(cc, best)) best = cc;
        }
        best = block_min(best, red);
        if (best.i == 0x7fffffff) break;
        int o = best.i; i64 x = -best.a;
        if (tid == 0) used[o] = 1;
        __syncthreads();
        while (x > 0) {
          Cand fit = {0, 0, 0x7fffffff}, big = {0, 0, 0x7fffffff};
          for (int v = tid; v < R; v += nt) {
            i64 room = tgt[v] - load[v];
            if (used[v] || room <= 0) continue;
            Cand cf = {room, 0, v}, cb = {-room, 0, v};
            if (room >= x && better(cf, fit)) fit = cf;
            if (better(cb, big)) big = cb;
          }
          fit = block_min(fit, red);
          big = block_min(big, red);
          int v = fit.i != 0x7fffffff ? fit.i : big.i;
          if (v == 0x7fffffff) { stuck = true; break; }
          i64 room = fit.i != 0x7fffffff ? fit.a : -big.a;
          i64 a = x < room ? x : room;
          if (tid == 0) used[v] = 1;
          fill(rem, order, load, amt, rep_exp, rep_src, v, o, epn, a);
          x -= a;
        }
      }
    }
    if (!stuck) break;
    __syncthreads();
  }
  for (int e = tid; e < E; e += nt) rem_out[e] = rem[e];
  for (int r = tid; r < R; r += nt) recv[r] = load[r];
}
