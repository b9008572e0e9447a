// moonep NVLink transport: combine (local reduce + push of one row per (token, rank), then a local
// rank-ordered sum) and the replica gradient reduction.
//
// Arithmetic matches moonep.combine.combine_rows bit for bit:
//   destination:  acc = 0; for k in 0..K-1 with row_k valid: acc = acc + out[row_k] * w[row_k]
//                 (skipping invalid rows equals adding +0: acc is never -0), then rounded to the wire
//                 dtype (bf16/fp16 for bf16/fp16 rows, fp32 for fp32 rows)
//   source:       y = 0;   for r in ranks the token was sent to, ascending: y = y + float(acc_r)
// with every multiply and add rounded separately (__fmul_rn/__fadd_rn: no FMA contraction).
#include "common.cuh"

#define MAX_WARPS 32

// Sum, in k order, the (weighted) valid rows of one token: 16 bytes of each row per lane per step, up to 8
// rows' loads in flight, fp32 accumulation with separately rounded multiplies and adds (no FMA).  The
// result (same element count, dtype DT: the wire dtype equals the row dtype) goes to `dst` with one
// 16-byte store per step; dst may be a peer's memory.
template <int DT>
__device__ __forceinline__ void reduce_rows16(char* dst, const char* out, i64 row_bytes, const int* rows,
                                              const float* ws, int n, bool weighted, int lane) {
  constexpr int G = DT == DT_F32 ? 4 : 8;
  const i64 nw = row_bytes >> 4;
  for (i64 j = lane; j < nw; j += 32) {
    float a[G];
#pragma unroll
    for (int u = 0; u < G; ++u) a[u] = 0.f;
    for (int k0 = 0; k0 < n; k0 += 8) {
      int4 v[8];
#pragma unroll
      for (int t = 0; t < 8; ++t)
        if (k0 + t < n) v[t] = *((const int4*)(out + (i64)rows[k0 + t] * row_bytes) + j);
#pragma unroll
      for (int t = 0; t < 8; ++t) {
        if (k0 + t < n) {
          float o[G];
          unpack16<DT>(v[t], o);
          if (weighted) {
            const float wk = ws[k0 + t];
#pragma unroll
            for (int u = 0; u < G; ++u) o[u] = __fmul_rn(o[u], wk);
          }
#pragma unroll
          for (int u = 0; u < G; ++u) a[u] = __fadd_rn(a[u], o[u]);
        }
      }
    }
    ((int4*)dst)[j] = pack16<DT>(a);
  }
}

// Phase 1 (every rank, on the rows it received): for each token's first row f, reduce the token's rows on
// this rank in k order (fp32) and PUSH the result, rounded to the wire dtype (the row dtype for bf16/fp16,
// fp32 for fp32; see moonep/combine.py), into the source rank's receive-back area:
//   back[p][me*S + i]  at  base[p] + acc_off,  p = src_rank, i = src_token  (p == me: a local store).
//   out: [cap, H] of dtype out_dt; weights: fp32 [cap] or null (unweighted sum);
//   gw_in: fp32 [cap] or null: per-row weight gradients, pushed K-aligned to base[p] + gw_off;
//   row_first/rec/src: the step-local lists written by moonep_dispatch_expand;
//   vec: rows are 16-byte aligned multiples of 16 bytes (else a scalar path);
//   barrier: 1 when the receive-back area is not double-buffered (see nvlink.py).
extern "C" __global__ void moonep_combine_reduce(const Ctx* c, const void* out, int out_dt, const float* weights,
                                                 const float* gw_in, const int* row_first, const int* rec,
                                                 const int* src, int vec, int barrier, i64 acc_off, i64 gw_off) {
  __shared__ int s_rows[MAX_WARPS][32];
  __shared__ float s_w[MAX_WARPS][32];
  u64 ne;
  bool ok = maybe_entry_barrier(c, barrier, &ne);
  if (ok) {
    const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5, K = (int)c->K, me = (int)c->rank;
    const i64 cap = c->cap, H = c->H, S = c->S, nsrc = c->R * c->S;
    const int esz = out_dt == DT_F32 ? 4 : 2;
    const i64 row_bytes = H * esz;
    for (i64 f = warp_id_global(); f < cap; f += num_warps_global()) {
      if (row_first[f] != f) continue;
      const i64 sr = src[f];
      if (sr < 0 || sr >= nsrc) continue;
      const int p = (int)(sr / S);
      const i64 slot = (i64)me * S + (sr - (i64)p * S);
      int row = -1;
      if (lane < K) {
        row = rec[f * K + lane];
        if (row >= cap) row = -1;
      }
      unsigned vm = __ballot_sync(FULL_MASK, row >= 0);
      const int n = __popc(vm);
      if (row >= 0) {
        int q = __popc(vm & ((1u << lane) - 1u));
        s_rows[wib][q] = row;
        s_w[wib][q] = weights != nullptr ? weights[row] : 1.f;
      }
      if (gw_in != nullptr && lane < K)
        ((float*)(c->base[p] + gw_off))[slot * K + lane] = row >= 0 ? gw_in[row] : 0.f;
      __syncwarp();
      char* dst = c->base[p] + acc_off + slot * row_bytes;
      const bool weighted = weights != nullptr;
      if (vec) {
        if (out_dt == DT_F32) reduce_rows16<DT_F32>(dst, (const char*)out, row_bytes, s_rows[wib], s_w[wib], n, weighted, lane);
        else if (out_dt == DT_BF16) reduce_rows16<DT_BF16>(dst, (const char*)out, row_bytes, s_rows[wib], s_w[wib], n, weighted, lane);
        else reduce_rows16<DT_F16>(dst, (const char*)out, row_bytes, s_rows[wib], s_w[wib], n, weighted, lane);
      } else {
        for (i64 h = lane; h < H; h += 32) {
          float a = 0.f;
          for (int t = 0; t < n; ++t) {
            float o = load_f(out, (i64)s_rows[wib][t] * H + h, out_dt);
            if (weighted) o = __fmul_rn(o, s_w[wib][t]);
            a = __fadd_rn(a, o);
          }
          store_f(dst, h, out_dt, a);
        }
      }
      __syncwarp();
    }
  }
  finish_send(c, ne, false);
}

// Phase 2 (every rank, for its own tokens, local memory only): y[i] = sum over the ranks token i was sent
// to, in rank order, of back[p][i] (wire dtype wire_dt, at base[me] + acc_off + (p*S + i) * row), fp32
// adds, rounded once to y_dt.  One warp per token.
//   dst_rank: int64 [s, K]; y: [s, H] of dtype y_dt; gw_out: fp32 [s, K] or null.
extern "C" __global__ void moonep_combine_sum(const Ctx* c, int s, const i64* dst_rank, void* y, int y_dt,
                                              float* gw_out, int vec, i64 acc_off, i64 gw_off, int wire_dt) {
  if (!wait_data(c)) return;
  const int lane = threadIdx.x & 31, K = (int)c->K, R = (int)c->R, me = (int)c->rank;
  const i64 H = c->H, S = c->S;
  const int wes = wire_dt == DT_F32 ? 4 : 2;
  const i64 row_bytes = H * wes;
  const char* back = c->base[me] + acc_off;
  const float* gwb = (const float*)(c->base[me] + gw_off);
  for (int i = warp_id_global(); i < s; i += num_warps_global()) {
    int r = -1;
    if (lane < K) {
      i64 rr = dst_rank[(i64)i * K + lane];
      if (rr >= 0 && rr < R) r = (int)rr;
    }
    unsigned lo = __reduce_or_sync(FULL_MASK, (r >= 0 && r < 32) ? (1u << r) : 0u);
    unsigned hi = __reduce_or_sync(FULL_MASK, (r >= 32) ? (1u << (r - 32)) : 0u);
    const u64 mask = ((u64)hi << 32) | lo;
    if (vec) {
      const int G = wire_dt == DT_F32 ? 4 : 8;
      for (i64 j = lane; j < (row_bytes >> 4); j += 32) {
        float a[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) a[u] = 0.f;
        for (u64 m = mask; m; m &= m - 1) {
          int p = __ffsll((long long)m) - 1;
          int4 q = *((const int4*)(back + ((i64)p * S + i) * row_bytes) + j);
          float o[8];
          if (wire_dt == DT_F32) unpack16<DT_F32>(q, o);
          else if (wire_dt == DT_BF16) unpack16<DT_BF16>(q, o);
          else unpack16<DT_F16>(q, o);
#pragma unroll
          for (int u = 0; u < 8; ++u)
            if (u < G) a[u] = __fadd_rn(a[u], o[u]);
        }
        store_n(y, (i64)i * H + j * G, y_dt, a, G);
      }
    } else {
      for (i64 h = lane; h < H; h += 32) {
        float a = 0.f;
        for (u64 m = mask; m; m &= m - 1) {
          int p = __ffsll((long long)m) - 1;
          a = __fadd_rn(a, load_f(back + ((i64)p * S + i) * row_bytes, h, wire_dt));
        }
        store_f(y, (i64)i * H + h, y_dt, a);
      }
    }
    if (gw_out != nullptr && lane < K) {
      float g = 0.f;
      for (u64 m = mask; m; m &= m - 1) {
        int p = __ffsll((long long)m) - 1;
        float v = (r == p) ? gwb[((i64)p * S + i) * K + lane] : 0.f;
        g = __fadd_rn(g, v);
      }
      gw_out[(i64)i * K + lane] = g;
    }
  }
}

// Replica gradient reduce, stage: copy this rank's replica slot gradients into its own pool (slot j at
// j*row_bytes), then signal.  grad: [2*epn, row_bytes].
extern "C" __global__ void moonep_reduce_stage(const Ctx* c, const char* grad, i64 row_bytes, int vec, int epn,
                                               const i64* rep) {
  u64 ne;
  bool ok = entry_barrier(c, &ne);
  if (ok) {
    const int me = (int)c->rank;
    for (int j = 0; j < epn; ++j)
      if (rep[(i64)me * epn + j] >= 0)
        grid_copy(c->pbase[me] + (i64)j * row_bytes, grad + (i64)(epn + j) * row_bytes, row_bytes, vec);
  }
  finish_send(c, ne, false);
}

// Replica gradient reduce, finish: home[e] = grad[e] + sum over ranks u (ascending) whose replicas come
// from here, of u's slot holding expert me*epn+e; each add rounded to the gradient dtype (as torch's
// in-place add is).  out/grad rows have n elements of dtype dt.
extern "C" __global__ void moonep_reduce_finish(const Ctx* c, void* out, const void* grad, i64 n, int dt, int epn,
                                                const i64* rep, const i64* rsrc) {
  bool ok = wait_data(c);
  const int R = (int)c->R, me = (int)c->rank;
  const int esize = dt == DT_F32 ? 4 : 2;
  i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x, nt = (i64)gridDim.x * blockDim.x;
  for (i64 q = t; q < (i64)epn * n; q += nt) {
    int e = (int)(q / n);
    i64 x = q % n;
    float a = load_f(grad, q, dt);
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
