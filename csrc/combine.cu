// moonep NVLink transport: combine (local reduce, then one row per (token, rank) read back) and the
// replica gradient reduction.
//
// Arithmetic matches moonep.combine.combine_rows bit for bit in fp32:
//   destination:  acc = 0; for k in 0..K-1: acc = acc + (row_k valid ? out[row_k] * w[row_k] : 0)
//   source:       y = 0;   for r in ranks the token was sent to, ascending: y = y + acc_r
// with every multiply and add rounded separately (__fmul_rn/__fadd_rn: no FMA contraction).
#include "common.cuh"

__device__ __forceinline__ void load4(const void* p, i64 idx, int dt, float v[4]) {
  if (dt == DT_F32) {
    float4 q = *(const float4*)((const float*)p + idx);
    v[0] = q.x; v[1] = q.y; v[2] = q.z; v[3] = q.w;
  } else {
    uint2 q = *(const uint2*)((const unsigned short*)p + idx);
    unsigned short h[4] = {(unsigned short)(q.x & 0xffffu), (unsigned short)(q.x >> 16),
                           (unsigned short)(q.y & 0xffffu), (unsigned short)(q.y >> 16)};
#pragma unroll
    for (int u = 0; u < 4; ++u) v[u] = dt == DT_BF16 ? bf16_to_f(h[u]) : f16_to_f(h[u]);
  }
}

__device__ __forceinline__ void store4(void* p, i64 idx, int dt, const float v[4]) {
  if (dt == DT_F32) {
    *(float4*)((float*)p + idx) = make_float4(v[0], v[1], v[2], v[3]);
  } else {
    unsigned short h[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) h[u] = dt == DT_BF16 ? f_to_bf16(v[u]) : f_to_f16(v[u]);
    *(uint2*)((unsigned short*)p + idx) = make_uint2((unsigned)h[0] | ((unsigned)h[1] << 16),
                                                     (unsigned)h[2] | ((unsigned)h[3] << 16));
  }
}

#define MAX_WARPS 32

// Phase 1 (every rank, on the rows it received): for each token's first row f, reduce the token's rows
// on this rank in k order into acc[src_rank*S + src_token] (fp32, this rank's symmetric area).
//   out: [cap, H] of dtype out_dt; weights: fp32 [cap] or null (unweighted sum);
//   gw_in: fp32 [cap] or null: per-row weight gradients exported K-aligned to gwacc (backward of dispatch).
//   row_first/rec/src: the step-local lists written by moonep_dispatch_expand.
extern "C" __global__ void moonep_combine_reduce(const Ctx* c, const void* out, int out_dt, const float* weights,
                                                 const float* gw_in, const int* row_first, const int* rec,
                                                 const int* src, int vec4) {
  __shared__ int s_rows[MAX_WARPS][32];
  __shared__ float s_w[MAX_WARPS][32];
  u64 ne;
  bool ok = entry_barrier(c, &ne);
  if (ok) {
    const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5, K = (int)c->K;
    const i64 cap = c->cap, H = c->H, nsrc = c->R * c->S;
    float* acc_base = (float*)(c->base[c->rank] + c->off_acc);
    float* gwacc = (float*)(c->base[c->rank] + c->off_gwacc);
    for (i64 f = warp_id_global(); f < cap; f += num_warps_global()) {
      if (row_first[f] != f) continue;
      i64 sr = src[f];
      if (sr < 0 || sr >= nsrc) continue;
      int row = -1;
      if (lane < K) {
        row = rec[f * K + lane];
        if (row >= cap) row = -1;
      }
      __syncwarp();
      s_rows[wib][lane] = row;
      s_w[wib][lane] = (weights != nullptr && row >= 0) ? weights[row] : 0.f;
      if (gw_in != nullptr && lane < K) gwacc[sr * K + lane] = row >= 0 ? gw_in[row] : 0.f;
      __syncwarp();
      float* acc = acc_base + sr * H;
      if (vec4) {
        for (i64 h = (i64)lane * 4; h < H; h += 128) {
          float a[4] = {0.f, 0.f, 0.f, 0.f};
          for (int k = 0; k < K; ++k) {
            int rk = s_rows[wib][k];
            float o[4] = {0.f, 0.f, 0.f, 0.f};
            if (rk >= 0) {
              load4(out, (i64)rk * H + h, out_dt, o);
              if (weights != nullptr) {
                float wk = s_w[wib][k];
#pragma unroll
                for (int u = 0; u < 4; ++u) o[u] = __fmul_rn(o[u], wk);
              }
            }
#pragma unroll
            for (int u = 0; u < 4; ++u) a[u] = __fadd_rn(a[u], o[u]);
          }
          *(float4*)(acc + h) = make_float4(a[0], a[1], a[2], a[3]);
        }
      } else {
        for (i64 h = lane; h < H; h += 32) {
          float a = 0.f;
          for (int k = 0; k < K; ++k) {
            int rk = s_rows[wib][k];
            float o = 0.f;
            if (rk >= 0) {
              o = load_f(out, (i64)rk * H + h, out_dt);
              if (weights != nullptr) o = __fmul_rn(o, s_w[wib][k]);
            }
            a = __fadd_rn(a, o);
          }
          acc[h] = a;
        }
      }
      __syncwarp();
    }
  }
  finish_send(c, ne, false);
}

// Phase 2 (every rank, for its own tokens): y[i] = sum over the ranks token i was sent to, in rank order,
// of acc_r[me*S + i], read from peer memory.  One warp per token.
//   dst_rank: int64 [s, K]; y: [s, H] of dtype y_dt; gw_out: fp32 [s, K] or null.
extern "C" __global__ void moonep_combine_gather(const Ctx* c, int s, const i64* dst_rank, void* y, int y_dt,
                                                 float* gw_out, int vec4) {
  if (!wait_data(c)) return;
  const int lane = threadIdx.x & 31, K = (int)c->K, R = (int)c->R, me = (int)c->rank;
  const i64 H = c->H, S = c->S;
  for (int i = warp_id_global(); i < s; i += num_warps_global()) {
    int r = -1;
    if (lane < K) {
      i64 rr = dst_rank[(i64)i * K + lane];
      if (rr >= 0 && rr < R) r = (int)rr;
    }
    unsigned lo = __reduce_or_sync(FULL_MASK, (r >= 0 && r < 32) ? (1u << r) : 0u);
    unsigned hi = __reduce_or_sync(FULL_MASK, (r >= 32) ? (1u << (r - 32)) : 0u);
    const u64 mask = ((u64)hi << 32) | lo;
    const i64 slot = (i64)me * S + i;
    if (vec4) {
      for (i64 h = (i64)lane * 4; h < H; h += 128) {
        float a[4] = {0.f, 0.f, 0.f, 0.f};
        for (u64 m = mask; m; m &= m - 1) {
          int p = __ffsll((long long)m) - 1;
          float4 q = *(const float4*)((const float*)(c->base[p] + c->off_acc) + slot * H + h);
          a[0] = __fadd_rn(a[0], q.x); a[1] = __fadd_rn(a[1], q.y);
          a[2] = __fadd_rn(a[2], q.z); a[3] = __fadd_rn(a[3], q.w);
        }
        store4(y, (i64)i * H + h, y_dt, a);
      }
    } else {
      for (i64 h = lane; h < H; h += 32) {
        float a = 0.f;
        for (u64 m = mask; m; m &= m - 1) {
          int p = __ffsll((long long)m) - 1;
          a = __fadd_rn(a, ((const float*)(c->base[p] + c->off_acc))[slot * H + h]);
        }
        store_f(y, (i64)i * H + h, y_dt, a);
      }
    }
    if (gw_out != nullptr && lane < K) {
      float g = 0.f;
      for (u64 m = mask; m; m &= m - 1) {
        int p = __ffsll((long long)m) - 1;
        float v = (r == p) ? ((const float*)(c->base[p] + c->off_gwacc))[slot * K + lane] : 0.f;
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
