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
// in-place add is).  out/home_grad: [epn, n] elements of dtype dt.
extern "C" __global__ void moonep_reduce_finish(const Ctx* c, void* out, const void* home_grad, i64 n, int dt, int epn,
                                                const i64* rep, const i64* rsrc) {
  bool ok = wait_data(c);
  const int R = (int)c->R, me = (int)c->rank;
  const int esize = dt == DT_F32 ? 4 : 2;
  i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x, nt = (i64)gridDim.x * blockDim.x;
  for (i64 q = t; q < (i64)epn * n; q += nt) {
    int e = (int)(q / n);
    i64 x = q % n;
    float a = load_f(home_grad, q, dt);
    if (ok) {
      for (int u = 0; u < R; ++u) {
        if (rsrc[u] != me) continue;
        for (int j = 0; j < epn; ++j) {
          if (rep[(i64)u * epn + j] != (i64)me * epn + e) continue;
          const void* pool = c->pbase[u] + (i64)j * n * esize;
          a = round_to(__fadd_rn(a, load_f(pool, x, dt)), dt);
        }
      }
    }
    store_f(out, q, dt, a);
  }
}
