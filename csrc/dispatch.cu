// moonep NVLink transport: counts all-gather, dispatch (send + local expand), replica weight prefetch.
//
// Dispatch writes each token ONCE per destination rank, straight into its first row there (the row of
// its lowest-k choice on that rank), with 16-byte stores when alignment allows.  With the token it
// writes, into the peer's symmetric area:
//   meta[first, K]  the K-aligned rows of the token on that rank (-1 where choice k goes elsewhere),
//   msrc[first]     src_rank * S + src_token,
//   w[row]          the routing weight of every row it owns there,
//   tag[row]        (dispatch epoch << 32) | first  for every row it owns there.
// The receiver's expand kernel then copies each first row into the token's other rows (local HBM), zeroes
// rows nobody wrote this epoch (alignment padding, unused capacity) and exports step-local copies of the
// row lists, so later combines and backward passes never read symmetric metadata again.
#include "common.cuh"

#define MAX_WARPS_BLOCK 32

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
    if (ok) {
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
    __threadfence();
  }
}

// Source side of dispatch.  One warp per token.
//   mode 0: forward; rows go to the main receive buffers, with meta/msrc/w/tag.
//   mode 1: backward of combine (dispatch of dy); rows go to the gradient receive buffers, rows only.
// x: [s, row_bytes] contiguous; dst_rank/dst_row: int64 [s, K]; w: fp32 [s, K] (mode 0).
// barrier: 0 skips the entry barrier (the counts gather of this step just passed one; nvlink.py decides).
// local_expand: 1 writes a token's rows on THIS rank all at once (x read once, stored to every local row),
//   so the receiver's expand kernel only has to expand rows that came from peers; remote destinations
//   always get the token once, in its first row there.  Used when the receive buffer is the output
//   (zero-copy and mode 1).
extern "C" __global__ void moonep_dispatch_send(const Ctx* c, int mode, const char* x, i64 row_bytes, int vec,
                                                int s, const i64* dst_rank, const i64* dst_row, const float* w,
                                                int barrier, int local_expand) {
  __shared__ char* s_dst[MAX_WARPS_BLOCK][32];
  u64 ne;
  bool ok = maybe_entry_barrier(c, barrier, &ne);
  if (ok) {
    const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5, K = (int)c->K, R = (int)c->R, me = (int)c->rank;
    const i64 cap = c->cap, S = c->S;
    const u64 tag_epoch = (ld_volatile(&c->ctr[CTR_TAG]) + 1) & 0xffffffffull;
    for (int i = warp_id_global(); i < s; i += num_warps_global()) {
      int r = -1, row = -1;
      float wk = 0.f;
      if (lane < K) {
        i64 rr = dst_rank[(i64)i * K + lane], rw = dst_row[(i64)i * K + lane];
        if (rr >= 0 && rr < R && rw >= 0 && rw < cap) {
          r = (int)rr;
          row = (int)rw;
        }
        if (mode == 0 && w != nullptr) wk = w[(i64)i * K + lane];
      }
      unsigned same = __match_any_sync(FULL_MASK, r);
      int first_lane = __ffs(same) - 1;
      bool is_first = r >= 0 && first_lane == lane;
      int my_first = __shfl_sync(FULL_MASK, row, first_lane);
      if (mode == 0 && r >= 0) {
        char* b = c->base[r];
        ((float*)(b + c->off_w))[row] = wk;
        ((u64*)(b + c->off_tag))[row] = (tag_epoch << 32) | (u64)(unsigned)my_first;
        if (is_first) {
          ((int*)(b + c->off_msrc))[row] = (int)(me * S + i);
        }
      }
      // Destination rows of the data: the first row on every rank, plus (local_expand) every local row.
      bool dst = is_first || (local_expand && r == me && r >= 0);
      unsigned dmask = __ballot_sync(FULL_MASK, dst);
      int n = __popc(dmask);
      if (dst) {
        int slot = __popc(dmask & ((1u << lane) - 1u));
        char* dbase = mode == 0 ? c->base[r] + c->off_recv : c->gbase[r];
        s_dst[wib][slot] = dbase + (i64)row * row_bytes;
      }
      if (mode == 0) {  // K-aligned row lists at the first row of every destination rank
        unsigned firsts = __ballot_sync(FULL_MASK, is_first);
        while (firsts) {
          int fl = __ffs(firsts) - 1;
          firsts &= firsts - 1;
          int dr = __shfl_sync(FULL_MASK, r, fl);
          int frow = __shfl_sync(FULL_MASK, row, fl);
          if (lane < K) ((int*)(c->base[dr] + c->off_meta))[(i64)frow * K + lane] = (r == dr) ? row : -1;
        }
      }
      __syncwarp();
      if (vec == 16) {
        warp_fanout16(s_dst[wib], n, x + (i64)i * row_bytes, row_bytes, lane);
      } else {
        for (int t = 0; t < n; ++t) warp_copy(s_dst[wib][t], x + (i64)i * row_bytes, row_bytes, vec, lane);
      }
      __syncwarp();
    }
  }
  finish_send(c, ne, mode == 0);
}

// Receiver side of dispatch: wait for every peer, then expand first rows into the other rows.
//   mode 0: source buffer = main receive buffer; reads tags, writes row_first/rec/src (step-local) and
//           the weights w_out (zero in unwritten rows).
//   mode 1: source buffer = gradient receive buffer; row_first/rec/src are inputs (from the forward).
// dst: [cap, row_bytes]; may be the source buffer itself (zero-copy) or a fresh tensor (copy mode).
// local_expand: the send kernel already wrote every row of tokens from this rank (only when dst is the
//   source buffer).  One warp per row: unwritten rows are zeroed; the warp of a token's first row reads
//   it once and stores it into the token's other rows (and into the row itself when copying).
extern "C" __global__ void moonep_dispatch_expand(const Ctx* c, int mode, char* dst, float* w_out, int* row_first,
                                                  int* rec, int* src, i64 row_bytes, int vec, int local_expand) {
  __shared__ char* s_dst[MAX_WARPS_BLOCK][32];
  if (!wait_data(c)) return;
  const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5, K = (int)c->K, me = (int)c->rank;
  const i64 cap = c->cap, S = c->S;
  const char* sbuf = mode == 0 ? c->base[me] + c->off_recv : c->gbase[me];
  const bool inplace = (const char*)dst == sbuf;
  const u64 epoch = ld_volatile(&c->ctr[CTR_TAG]) & 0xffffffffull;
  const u64* tag = (const u64*)(c->base[me] + c->off_tag);
  const float* wbuf = (const float*)(c->base[me] + c->off_w);
  const int* meta = (const int*)(c->base[me] + c->off_meta);
  const int* msrc = (const int*)(c->base[me] + c->off_msrc);
  for (i64 row = warp_id_global(); row < cap; row += num_warps_global()) {
    int f, sr = -1, rk = -1;
    if (mode == 0) {
      u64 t = tag[row];
      f = ((t >> 32) == epoch) ? (int)(unsigned)(t & 0xffffffffull) : -1;
      if (f >= cap) f = -1;
      float wv = f >= 0 ? wbuf[row] : 0.f;
      if (f == row) sr = msrc[row];
      if (lane < K && f == row) rk = meta[row * K + lane];
      __syncwarp();
      if (lane == 0) {
        row_first[row] = f;
        w_out[row] = wv;
        src[row] = sr;
      }
      if (lane < K) rec[row * K + lane] = rk;
    } else {
      f = row_first[row];
      if (f == row) {
        sr = src[row];
        if (lane < K) rk = rec[row * K + lane];
      }
    }
    char* d = dst + row * row_bytes;
    if (f < 0) {
      warp_zero(d, row_bytes, vec, lane);
      continue;
    }
    if (f != row) continue;  // written by the warp of its first row
    if (inplace && local_expand && sr >= 0 && sr / S == me) continue;  // the sender wrote every row
    bool want = rk >= 0 && rk < cap && (!inplace || rk != row);
    unsigned dmask = __ballot_sync(FULL_MASK, want);
    int n = __popc(dmask);
    if (want) s_dst[wib][__popc(dmask & ((1u << lane) - 1u))] = dst + (i64)rk * row_bytes;
    __syncwarp();
    if (vec == 16) warp_fanout16(s_dst[wib], n, sbuf + row * row_bytes, row_bytes, lane);
    else for (int t = 0; t < n; ++t) warp_copy(s_dst[wib][t], sbuf + row * row_bytes, row_bytes, vec, lane);
    __syncwarp();
  }
}

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

// Replica weight prefetch, receive side: out[2*epn, row_bytes] = home experts, then replica slots
// (zero where the slot is empty).
extern "C" __global__ void moonep_prefetch_finish(const Ctx* c, char* out, const char* local, i64 row_bytes,
                                                  int vec, int epn, const i64* rep) {
  bool ok = wait_data(c);
  const int me = (int)c->rank;
  grid_copy(out, local, row_bytes * epn, vec);
  for (int j = 0; j < epn; ++j) {
    char* d = out + (i64)(epn + j) * row_bytes;
    if (ok && rep[(i64)me * epn + j] >= 0) grid_copy(d, c->pbase[me] + (i64)j * row_bytes, row_bytes, vec);
    else grid_zero(d, row_bytes, vec);
  }
}
