// moonep NVLink transport: combine (local reduce + push of one row per (token, rank), then a local
// rank-ordered sum), two-kernel and fused.
//
// Arithmetic matches moonep.combine.combine_rows bit for bit:
//   destination:  acc = 0; for k in 0..K-1 with row_k valid: acc = acc + out[row_k] * w[row_k]
//                 (skipping invalid rows equals adding +0: acc is never -0), then rounded to the wire
//                 dtype (bf16/fp16 for bf16/fp16 rows, fp32 for fp32 rows)
//   source:       y = 0;   for r in ranks the token was sent to, ascending: y = y + float(acc_r)
// with every multiply and add rounded separately (__fmul_rn/__fadd_rn: no FMA contraction).
#include "common.cuh"

// Per-token helpers of both paths.

// fp32 sums, in k order, of words j0 and j0+32 (if has2) of the n (weighted) rows, 4 rows at a time: up to
// 8 16-byte loads per lane in flight (a warp that waited on one word per row per step was latency-bound;
// 4 words per lane spilled registers under __launch_bounds__(512)).  Every multiply and add is rounded
// separately (no FMA), every element summed in k order.
template <int DT>
__device__ __forceinline__ void partial2(const char* out, i64 row_bytes, const int* rows, const float* ws, int n,
                                         bool weighted, i64 j0, bool has2, float (&a)[2][8]) {
  constexpr int G = DT == DT_F32 ? 4 : 8;
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int u = 0; u < 8; ++u) a[h][u] = 0.f;
  for (int k0 = 0; k0 < n; k0 += 4) {
    int4 v[4][2];
#pragma unroll
    for (int t = 0; t < 4; ++t) {
      if (k0 + t < n) {
        const int4* rp = (const int4*)(out + (i64)rows[k0 + t] * row_bytes);
        v[t][0] = rp[j0];
        if (has2) v[t][1] = rp[j0 + 32];
      }
    }
#pragma unroll
    for (int t = 0; t < 4; ++t) {
      if (k0 + t < n) {
        const float wk = weighted ? ws[k0 + t] : 1.f;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          if (h == 0 || has2) {
            float o[8];
            unpack16<DT>(v[t][h], o);
#pragma unroll
            for (int u = 0; u < G; ++u) a[h][u] = __fadd_rn(a[h][u], weighted ? __fmul_rn(o[u], wk) : o[u]);
          }
        }
      }
    }
  }
}

// The warp's list of this rank's rows of a token (k order) and their weights, in shared memory.
__device__ __forceinline__ int stage_rows(int row, bool valid, const float* weights, int* s_rows, float* s_w,
                                          int lane) {
  const unsigned vm = __ballot_sync(FULL_MASK, valid);
  if (valid) {
    const int q = __popc(vm & ((1u << lane) - 1u));
    s_rows[q] = row;
    s_w[q] = weights != nullptr ? weights[row] : 1.f;
  }
  __syncwarp();
  return __popc(vm);
}

// NVLink side, one token received from rank p (first row f here): reduce its rows here and push the
// partial (wire dtype = row dtype) to back[p][me*S + i], with 16-byte stores.
template <int DT>
__device__ __forceinline__ void push_token16(char* dst, const char* out, i64 row_bytes, const int* rows,
                                             const float* ws, int n, bool weighted, int lane) {
  const i64 nw = row_bytes >> 4;
  for (i64 j0 = lane; j0 < nw; j0 += 64) {
    const bool has2 = j0 + 32 < nw;
    float a[2][8];
    partial2<DT>(out, row_bytes, rows, ws, n, weighted, j0, has2, a);
    ((int4*)dst)[j0] = pack16<DT>(a[0]);
    if (has2) ((int4*)dst)[j0 + 32] = pack16<DT>(a[1]);
  }
}

// Element h of the k-ordered fp32 sum of the n (weighted) rows rows[0..n) of out ([cap, H] of dtype dt):
// the element-wise path of partial2, with the same separately rounded multiplies and adds.
__device__ __forceinline__ float sum_rows(const void* out, i64 H, i64 h, int dt, const int* rows, const float* ws,
                                          int n, bool weighted) {
  float a = 0.f;
  for (int t = 0; t < n; ++t) {
    float o = load_f(out, (i64)rows[t] * H + h, dt);
    if (weighted) o = __fmul_rn(o, ws[t]);
    a = __fadd_rn(a, o);
  }
  return a;
}

// NVLink side of combine, one token received from rank p (first row f here, back-area slot `slot` =
// me*S + its source index there): stage its rows here (rec: K-aligned, k order) and their weights in the
// warp's s_rows/s_w, push its per-choice weight gradients (gw_in: fp32 [cap] or null) K-aligned to
// base[p] + gw_off, then its partial to base[p] + acc_off: the k-ordered fp32 sum of the (weighted) rows
// rounded to out_dt, the wire dtype (push_token16 with vec, else element by element).
__device__ __forceinline__ void push_partial(const Ctx* c, int K, i64 cap, i64 f, int p, i64 slot,
                                             const void* out, int out_dt, i64 H, i64 row_bytes, const float* weights,
                                             const float* gw_in, const int* rec, int vec, i64 acc_off, i64 gw_off,
                                             int* s_rows, float* s_w, int lane) {
  int row = -1;
  if (lane < K) {
    row = rec[f * K + lane];
    if (row >= cap) row = -1;
  }
  const int n = stage_rows(row, row >= 0, weights, s_rows, s_w, lane);
  if (gw_in != nullptr && lane < K)
    ((float*)(c->base[p] + gw_off))[slot * K + lane] = row >= 0 ? gw_in[row] : 0.f;
  char* dst = c->base[p] + acc_off + slot * row_bytes;
  const bool weighted = weights != nullptr;
  if (vec) {
    if (out_dt == DT_F32) push_token16<DT_F32>(dst, (const char*)out, row_bytes, s_rows, s_w, n, weighted, lane);
    else if (out_dt == DT_BF16) push_token16<DT_BF16>(dst, (const char*)out, row_bytes, s_rows, s_w, n, weighted, lane);
    else push_token16<DT_F16>(dst, (const char*)out, row_bytes, s_rows, s_w, n, weighted, lane);
  } else {
    for (i64 h = lane; h < H; h += 32) store_f(dst, h, out_dt, sum_rows(out, H, h, out_dt, s_rows, s_w, n, weighted));
  }
  __syncwarp();
}

// Bit p set for every rank p that some lane's r names (r = -1: none; R <= 64).
__device__ __forceinline__ u64 warp_rank_mask(int r) {
  const unsigned lo = __reduce_or_sync(FULL_MASK, (r >= 0 && r < 32) ? (1u << r) : 0u);
  const unsigned hi = __reduce_or_sync(FULL_MASK, (r >= 32) ? (1u << (r - 32)) : 0u);
  return ((u64)hi << 32) | lo;
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
extern "C" __global__ void __launch_bounds__(512) moonep_combine_reduce(const Ctx* c, const void* out, int out_dt, const float* weights,
                                                 const float* gw_in, const int* row_first, const int* rec,
                                                 const int* src, int vec, int barrier, i64 acc_off, i64 gw_off,
                                                 const int* tokfirst) {
  __shared__ int s_rows[MAX_WARPS][32];
  __shared__ float s_w[MAX_WARPS][32];
  u64 ne;
  bool ok = maybe_entry_barrier(c, barrier, &ne);
  if (ok) {
    const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5, K = (int)c->K, me = (int)c->rank;
    const i64 cap = c->cap, H = c->H, S = c->S, nsrc = c->R * c->S;
    const int esz = out_dt == DT_F32 ? 4 : 2;
    const i64 row_bytes = H * esz;
    // With tokfirst (the fused dispatch's [R, S] first rows) one warp takes one source token: a warp per
    // row of the expert-grouped layout got a varying share of the clustered first rows, and the block
    // barrier at the end waited for the busiest warp (45% of the stalls, ncu).
    const i64 n_items = tokfirst != nullptr ? nsrc : cap;
    for (i64 q = warp_id_global(); q < n_items; q += num_warps_global()) {
      i64 f, sr;
      if (tokfirst != nullptr) {
        f = tokfirst[q];
        if (f < 0 || f >= cap) continue;
        sr = q;
      } else {
        f = q;
        if (row_first[f] != f) continue;
        sr = src[f];
      }
      if (sr < 0 || sr >= nsrc) continue;
      const int p = (int)(sr / S);
      const i64 slot = (i64)me * S + (sr - (i64)p * S);
      push_partial(c, K, cap, f, p, slot, out, out_dt, H, row_bytes, weights, gw_in, rec, vec, acc_off, gw_off,
                   s_rows[wib], s_w[wib], lane);
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
    const u64 mask = warp_rank_mask(r);
    if (vec) {  // U = 4 16-byte words per lane and rank in flight (latency-bound with one)
      const int G = wire_dt == DT_F32 ? 4 : 8;
      constexpr int U = 4;
      const i64 nw = row_bytes >> 4;
      for (i64 j0 = lane; j0 < nw; j0 += 32 * U) {
        float a[U][8];
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
          for (int g = 0; g < 8; ++g) a[u][g] = 0.f;
        for (u64 m = mask; m; m &= m - 1) {
          const int p = __ffsll((long long)m) - 1;
          const int4* rp = (const int4*)(back + ((i64)p * S + i) * row_bytes);
          int4 q[U];
#pragma unroll
          for (int u = 0; u < U; ++u)
            if (j0 + u * 32 < nw) q[u] = rp[j0 + u * 32];
#pragma unroll
          for (int u = 0; u < U; ++u) {
            if (j0 + u * 32 < nw) {
              float o[8];
              if (wire_dt == DT_F32) unpack16<DT_F32>(q[u], o);
              else if (wire_dt == DT_BF16) unpack16<DT_BF16>(q[u], o);
              else unpack16<DT_F16>(q[u], o);
#pragma unroll
              for (int g = 0; g < 8; ++g)
                if (g < G) a[u][g] = __fadd_rn(a[u][g], o[g]);
            }
          }
        }
#pragma unroll
        for (int u = 0; u < U; ++u)
          if (j0 + u * 32 < nw) store_n(y, (i64)i * H + (j0 + u * 32) * G, y_dt, a[u], G);
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

// ===================================================================================================
// Fused path (default; Tuning(fused=()) selects the kernels above).
// ===================================================================================================

// Local side, words [jlo, jhi) of this rank's token i: y = sum over its destination ranks p (ascending) of
// partial_p, where this rank's own partial is computed here from its rows (rounded to the wire dtype,
// exactly what the unfused path stores and reloads) and the peers' come from back[p*S + i] (L2 loads).
template <int DT>
__device__ __forceinline__ void sum_token16(const Ctx* c, i64 i, u64 mask, const char* out, i64 row_bytes,
                                            const int* rows, const float* ws, int n, bool weighted,
                                            const char* back, void* y, int y_dt, i64 jlo, i64 jhi, int lane) {
  constexpr int G = DT == DT_F32 ? 4 : 8;
  const int me = (int)c->rank;
  const i64 S = c->S, H = c->H;
  // The first peer's words are loaded before this rank's rows (loads in any order, adds in rank order).
  const u64 peers = mask & ~(1ull << me);
  const int pp = peers ? __ffsll((long long)peers) - 1 : -1;
  const char* ppr = pp >= 0 ? back + ((i64)pp * S + i) * row_bytes : nullptr;
  for (i64 j0 = jlo + lane; j0 < jhi; j0 += 64) {
    const bool has2 = j0 + 32 < jhi;
    int4 pq0 = make_int4(0, 0, 0, 0), pq1 = make_int4(0, 0, 0, 0);
    if (pp >= 0) {
      pq0 = ld_cg_v4((const int4*)ppr + j0);
      if (has2) pq1 = ld_cg_v4((const int4*)ppr + j0 + 32);
    }
    float a[2][8];
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int u = 0; u < 8; ++u) a[h][u] = 0.f;
    for (u64 m = mask; m; m &= m - 1) {
      const int p = __ffsll((long long)m) - 1;
      float o[2][8];
      if (p == pp) {
        unpack16<DT>(pq0, o[0]);
        unpack16<DT>(pq1, o[1]);
      } else if (p == me) {
        partial2<DT>(out, row_bytes, rows, ws, n, weighted, j0, has2, o);
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int u = 0; u < G; ++u) o[h][u] = round_to(o[h][u], DT);
      } else {
        const char* pr = back + ((i64)p * S + i) * row_bytes;
        int4 q0 = ld_cg_v4((const int4*)pr + j0), q1 = make_int4(0, 0, 0, 0);
        if (has2) q1 = ld_cg_v4((const int4*)pr + j0 + 32);
        unpack16<DT>(q0, o[0]);
        unpack16<DT>(q1, o[1]);
      }
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int u = 0; u < G; ++u) a[h][u] = __fadd_rn(a[h][u], o[h][u]);
    }
    store_n(y, i * H + j0 * G, y_dt, a[0], G);
    if (has2) store_n(y, i * H + (j0 + 32) * G, y_dt, a[1], G);
  }
}

// Fused combine.  Double-buffered receive-back area as in moonep_combine_reduce (barrier: see nvlink.py).
//   Blocks [0, nnv) (NVLink): for each chunk, every first row here of a token from a PEER whose source index
//     falls in the chunk: k-ordered fp32 reduce of its rows, rounded to the wire dtype, pushed to the
//     source rank (plus the per-choice weight gradients, K-aligned); then the chunk signal.
//   Blocks [nnv, grid) (local): for each chunk, after every peer's signal, y[i] for this rank's tokens of
//     the chunk, the own partial computed on the spot (so it never goes through memory).  A token's
//     columns are split into `parts` pieces (one warp each) so that the last chunk's tail is short.
//   out: [cap, H] of out_dt (= wire dtype); weights: fp32 [cap] or null; gw_in: fp32 [cap] or null;
//   dst_rank/dst_row: int64 [s, K] (this rank's routing); y: [s, H] of y_dt; gw_out: fp32 [s, K] or null.
extern "C" __global__ void __launch_bounds__(512, 1) moonep_combine_fused(
    const Ctx* c, const void* out, int out_dt, const float* weights, const float* gw_in, const int* row_first,
    const int* rec, const int* src, int vec, int barrier, i64 acc_off, i64 gw_off, int s, const i64* dst_rank,
    const i64* dst_row, void* y, int y_dt, float* gw_out, int nnv, int nch) {
  __shared__ int s_rows[MAX_WARPS][32];
  __shared__ float s_w[MAX_WARPS][32];
  const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5, wpb = blockDim.x >> 5;
  const int K = (int)c->K, R = (int)c->R, me = (int)c->rank;
  const i64 cap = c->cap, H = c->H, S = c->S, nsrc = (i64)R * S;
  const int esz = out_dt == DT_F32 ? 4 : 2;
  const i64 row_bytes = H * esz;
  const bool weighted = weights != nullptr;
  const u64 de = ld_volatile(&c->ctr[CTR_DATA]) + 1;
  u64 ne;
  if ((int)blockIdx.x < nnv) {
    // ------------------------------------------------------------------ NVLink blocks
    const int w0 = blockIdx.x * wpb + wib, nw = nnv * wpb;
    ne = nvlink_chunks(c, barrier, nnv, nch, de, [&](int ch) {
      for (i64 b0 = (i64)w0 * 32; b0 < cap; b0 += (i64)nw * 32) {
        const i64 f = b0 + lane;
        int sr = -1;
        bool cand = false;
        if (f < cap && row_first[f] == f) {
          sr = src[f];
          if (sr >= 0 && (i64)sr < nsrc) {
            const int p = (int)(sr / S);
            cand = p != me && chunk_of(sr - (i64)p * S, S, nch) == ch;
          }
        }
        unsigned cm = __ballot_sync(FULL_MASK, cand);
        while (cm) {
          const int l = __ffs(cm) - 1;
          cm &= cm - 1;
          const i64 ff = b0 + l;
          const int srr = __shfl_sync(FULL_MASK, sr, l);
          const int p = srr / (int)S;
          const i64 slot = (i64)me * S + (srr - (i64)p * S);
          push_partial(c, K, cap, ff, p, slot, out, out_dt, H, row_bytes, weights, gw_in, rec, vec, acc_off,
                       gw_off, s_rows[wib], s_w[wib], lane);
        }
      }
    });
  } else {
    // ------------------------------------------------------------------ local blocks
    ne = ld_volatile(&c->ctr[CTR_ENTRY]) + (barrier ? 1 : 0);
    const int lw0 = ((int)blockIdx.x - nnv) * wpb + wib, nlw = ((int)gridDim.x - nnv) * wpb;
    const char* back = c->base[me] + acc_off;
    const float* gwb = (const float*)(c->base[me] + gw_off);
    const i64 nwords = vec ? (row_bytes >> 4) : H;  // 16-byte words, or elements on the scalar path
    const int parts = (vec && nwords >= 256) ? 4 : 1;
    const i64 pw = parts == 1 ? nwords : (((nwords + parts - 1) / parts + 63) / 64) * 64;
    for (int ch = 0; ch < nch; ++ch) {
      if (!wait_chunk(c, ch, de)) break;
      int lo, hi;
      chunk_range(S, nch, ch, s, &lo, &hi);
      const i64 units = (i64)(hi - lo) * parts;
      for (i64 u = lw0; u < units; u += nlw) {
        const i64 i = lo + u / parts;
        const int part = (int)(u % parts);
        const i64 jlo = part * pw, jhi = jlo + pw < nwords ? jlo + pw : nwords;
        int r, row;
        float wk;  // unused: no weights here
        load_choice(dst_rank, dst_row, nullptr, i, K, R, cap, lane, r, row, wk);
        const u64 mask = warp_rank_mask(r);
        const int n = stage_rows(row, r == me, weights, s_rows[wib], s_w[wib], lane);
        if (jlo < jhi) {
          if (vec) {
            if (out_dt == DT_F32) sum_token16<DT_F32>(c, i, mask, (const char*)out, row_bytes, s_rows[wib], s_w[wib], n, weighted, back, y, y_dt, jlo, jhi, lane);
            else if (out_dt == DT_BF16) sum_token16<DT_BF16>(c, i, mask, (const char*)out, row_bytes, s_rows[wib], s_w[wib], n, weighted, back, y, y_dt, jlo, jhi, lane);
            else sum_token16<DT_F16>(c, i, mask, (const char*)out, row_bytes, s_rows[wib], s_w[wib], n, weighted, back, y, y_dt, jlo, jhi, lane);
          } else {
            for (i64 h = jlo + lane; h < jhi; h += 32) {
              float a = 0.f;
              for (u64 m = mask; m; m &= m - 1) {
                const int p = __ffsll((long long)m) - 1;
                float v;
                if (p == me) {
                  v = round_to(sum_rows(out, H, h, out_dt, s_rows[wib], s_w[wib], n, weighted), out_dt);
                } else {
                  v = load_f<true>(back + ((i64)p * S + i) * row_bytes, h, out_dt);
                }
                a = __fadd_rn(a, v);
              }
              store_f(y, i * H + h, y_dt, a);
            }
          }
        }
        if (gw_out != nullptr && part == 0 && lane < K) {
          float g = 0.f;
          for (u64 m = mask; m; m &= m - 1) {
            const int p = __ffsll((long long)m) - 1;
            float v = 0.f;
            if (r == p) v = p == me ? gw_in[row] : ld_cg_f32(gwb + ((i64)p * S + i) * K + lane);
            g = __fadd_rn(g, v);
          }
          gw_out[i * K + lane] = g;
        }
        __syncwarp();
      }
    }
  }
  finish_fused(c, ne, de, false);
}
