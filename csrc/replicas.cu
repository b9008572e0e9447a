// moonep NVLink transport: replica weights.  Before the expert GEMM, each home rank pushes the weights of
// its experts that other ranks replicate this step into their replica pools (prefetch); in the backward
// pass, the replicas' weight gradients are staged in each rank's own pool and the home rank adds them to
// its experts' gradients (reduce), in rank order.
#include "common.cuh"

// Replica weight prefetch, push side: the home rank writes local_weight[e - me*epn] into slot j of the
// pool of every rank u whose replicas come from here (replica_source[u] == me).
// rep: int64 [R, epn]; rsrc: int64 [R]; local: [epn, row_bytes].
extern "C" __global__ void moonep_prefetch_push(const Ctx* c, const char* local, i64 row_bytes, int vec, int epn,
                                                const i64* rep, const i64* rsrc) {
  u64 ne;
  bool ok = entry_barrier(c, &ne);
  if (ok) {
    const int R = (int)c->R, me = (int)c->rank;
    for (int u = 0; u < R; ++u) {
      if (rsrc[u] != me) continue;
      for (int j = 0; j < epn; ++j) {
        i64 e = rep[(i64)u * epn + j] - (i64)me * epn;
        if (e < 0 || e >= epn) continue;
        grid_copy(c->pbase[u] + (i64)j * row_bytes, local + e * row_bytes, row_bytes, vec);
      }
    }
  }
  finish_send(c, ne, false);
}

// Replica weight prefetch, receive side: the replica slots rep_out[epn, row_bytes] (zero where the slot is
// empty) and, when home_out is not null, the home rows home_out[epn, row_bytes] = local (a caller whose home
// weights stay where they are passes null).  prev (int64 [epn] or null): the replica table of this rank at
// the previous call into the same persistent rep_out; a slot that was empty then is still zero, so it is not
// written again (a pool of large weights is mostly such slots).
extern "C" __global__ void moonep_prefetch_finish(const Ctx* c, char* home_out, char* rep_out, const char* local,
                                                  i64 row_bytes, int vec, int epn, const i64* rep,
                                                  const i64* prev) {
  bool ok = wait_data(c);
  const int me = (int)c->rank;
  if (home_out != nullptr) grid_copy(home_out, local, row_bytes * epn, vec);
  for (int j = 0; j < epn; ++j) {
    char* d = rep_out + (i64)j * row_bytes;
    if (ok && rep[(i64)me * epn + j] >= 0) grid_copy(d, c->pbase[me] + (i64)j * row_bytes, row_bytes, vec);
    else if (!ok || prev == nullptr || prev[j] >= 0) grid_zero(d, row_bytes, vec);
  }
}

// Replica gradient reduce, stage: copy this rank's replica slot gradients into its own pool (slot j at
// j*row_bytes), then signal.  rep_grad: [epn, row_bytes], the replica slots' gradients.
extern "C" __global__ void moonep_reduce_stage(const Ctx* c, const char* rep_grad, i64 row_bytes, int vec, int epn,
                                               const i64* rep) {
  u64 ne;
  bool ok = entry_barrier(c, &ne);
  if (ok) {
    const int me = (int)c->rank;
    for (int j = 0; j < epn; ++j)
      if (rep[(i64)me * epn + j] >= 0)
        grid_copy(c->pbase[me] + (i64)j * row_bytes, rep_grad + (i64)j * row_bytes, row_bytes, vec);
  }
  finish_send(c, ne, false);
}

// Replica gradient reduce, finish: home[e] = home_grad[e] + sum over ranks u (ascending) whose replicas come
// from here, of u's slot holding expert me*epn+e; each add rounded to the gradient dtype (as torch's
// in-place add is).  out/home_grad: [epn, n] elements of dtype dt; out == home_grad sums in place, and an
// expert that no rank replicated is then not touched (a one-rank group, or a step with few replicas).
// Work items are (expert, part of its row), parts = grid / epn (at least 1) so that a few experts still fill
// the grid.  Each item's block lists once, in shared memory and in the order of the sum (u, then j,
// ascending), the slots holding its expert; its threads then add those slots for their elements (the table
// is not searched per element), 16-byte words at a time when vec == 16 (rows of a multiple of 16 bytes,
// out and home_grad 16-byte aligned), else one element at a time.  More than REDUCE_LIST such slots: the
// search per element.
#define REDUCE_LIST 128

// Words [x0, x1) of one expert's row: out = home plus the listed slots' words, in list order (out, home: the
// row's first word; slot q = u * epn + j is row j of rank u's pool, row_words words per row).
template <int DT>
__device__ __forceinline__ void reduce_words(const Ctx* c, int4* out, const int4* home, i64 row_words, i64 x0,
                                             i64 x1, const int* slot, int cnt, int epn) {
  constexpr int V = DT == DT_F32 ? 4 : 8;
  for (i64 x = x0 + threadIdx.x; x < x1; x += blockDim.x) {
    float a[V], b[V];
    unpack16<DT>(home[x], a);
    for (int k = 0; k < cnt; ++k) {
      const int q = slot[k], u = q / epn, j = q - u * epn;
      unpack16<DT>(((const int4*)c->pbase[u])[(i64)j * row_words + x], b);
#pragma unroll
      for (int i = 0; i < V; ++i) a[i] = round_to(__fadd_rn(a[i], b[i]), DT);
    }
    out[x] = pack16<DT>(a);
  }
}

extern "C" __global__ void moonep_reduce_finish(const Ctx* c, void* out, const void* home_grad, i64 n, int dt, int epn,
                                                const i64* rep, const i64* rsrc, int vec) {
  __shared__ int s_slot[REDUCE_LIST];  // u * epn + j
  __shared__ int s_cnt;
  const bool ok = wait_data(c);
  if (epn <= 0) return;
  const int R = (int)c->R, me = (int)c->rank, nq = R * epn;
  const i64 esize = dt == DT_F32 ? 4 : 2;
  const int parts = max(1, (int)gridDim.x / epn);
  for (i64 item = blockIdx.x; item < (i64)epn * parts; item += gridDim.x) {
    const int e = (int)(item / parts), p = (int)(item % parts);
    const i64 want = (i64)me * epn + e;
    __syncthreads();  // every thread is done with the previous item's list
    if (threadIdx.x < 32) {
      const int lane = threadIdx.x;
      int cnt = 0;
      for (int b = 0; ok && b < nq; b += 32) {  // warp-uniform
        const int q = b + lane;
        const bool hit = q < nq && rsrc[q / epn] == me && rep[q] == want;
        const unsigned m = __ballot_sync(FULL_MASK, hit);
        const int at = cnt + __popc(m & ((1u << lane) - 1u));
        if (hit && at < REDUCE_LIST) s_slot[at] = q;
        cnt += __popc(m);
      }
      if (lane == 0) s_cnt = cnt;
    }
    __syncthreads();
    const int cnt = s_cnt;
    if (cnt == 0 && out == home_grad) continue;  // in place, nothing to add (block-uniform)
    if (vec == 16 && cnt <= REDUCE_LIST) {  // block-uniform
      const i64 rw = n * esize / 16, x0 = rw * p / parts, x1 = rw * (p + 1) / parts;
      int4* o = (int4*)out + (i64)e * rw;
      const int4* h = (const int4*)home_grad + (i64)e * rw;
      if (dt == DT_F32) reduce_words<DT_F32>(c, o, h, rw, x0, x1, s_slot, cnt, epn);
      else if (dt == DT_BF16) reduce_words<DT_BF16>(c, o, h, rw, x0, x1, s_slot, cnt, epn);
      else reduce_words<DT_F16>(c, o, h, rw, x0, x1, s_slot, cnt, epn);
      continue;
    }
    const i64 x0 = n * p / parts, x1 = n * (p + 1) / parts;
    for (i64 x = x0 + threadIdx.x; x < x1; x += blockDim.x) {
      float a = load_f(home_grad, (i64)e * n + x, dt);
      if (cnt <= REDUCE_LIST) {
        for (int k = 0; k < cnt; ++k) {
          const int q = s_slot[k], u = q / epn, j = q - u * epn;
          a = round_to(__fadd_rn(a, load_f(c->pbase[u] + (i64)j * n * esize, x, dt)), dt);
        }
      } else {
        for (int q = 0; q < nq; ++q) {
          const int u = q / epn, j = q - u * epn;
          if (rsrc[u] == me && rep[q] == want)
            a = round_to(__fadd_rn(a, load_f(c->pbase[u] + (i64)j * n * esize, x, dt)), dt);
        }
      }
      store_f(out, (i64)e * n + x, dt, a);
    }
  }
}
