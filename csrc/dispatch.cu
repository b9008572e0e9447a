// moonep NVLink transport: dispatch (send + local expand), two-kernel and fused.
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
//
// FP8 dispatch (qdt = the dtype code of x, mode 0 only): the sender reads each token's [H] row once and
// quantises it in registers (warp_quant_fanout, common.cuh), storing the fp8 wire row (moonep/fp8.py: codes,
// scales, padding; row_bytes = q8_wire_bytes(H)) wherever the bytes path stores the token's row; the receivers
// move wire rows as bytes.  qdt = -1: rows are moved as bytes (token dtype rows, pre-packed wire rows, mode 1).
// A non-finite x: the sender records ERR_NONFINITE_X for itself and writes the data epoch into its slot of
// every peer's xbad words (u64 [R] at off_xbad, before the signal that publishes its rows), and each peer
// records it after that signal, so every rank raises it (xrep: the last epoch recorded, so once per kernel).
#include "common.cuh"

// fp8: record a non-finite x of rank `rank` as this rank's input error, once per data epoch de.
__device__ __forceinline__ void xbad_record(const Ctx* c, u64* xrep, u64 de, int rank) {
  if (atomicMax(xrep, de) < de) set_input_error(c, ERR_NONFINITE_X | (rank << 8));
}

// fp8: this rank's x holds inf/nan (every lane of the warp); `peers`: tell every peer (before the signal).
__device__ __forceinline__ void xbad_mark(const Ctx* c, i64 off_xbad, u64* xrep, u64 de, bool peers, int lane) {
  const int R = (int)c->R, me = (int)c->rank;
  if (peers)
    for (int p = lane; p < R; p += 32)
      if (p != me) ((u64*)(c->base[p] + off_xbad))[me] = de;
  if (lane == 0) xbad_record(c, xrep, de, me);
}

// fp8, one thread, after every peer's signal of data epoch de: record the first peer that marked its x.
__device__ __forceinline__ void xbad_check(const Ctx* c, i64 off_xbad, u64* xrep, u64 de) {
  const u64* xb = (const u64*)(c->base[c->rank] + off_xbad);
  for (int p = 0; p < (int)c->R; ++p)
    if (p != (int)c->rank && ld_cg_u64(xb + p) == de) {
      xbad_record(c, xrep, de, p);
      return;
    }
}

// Source token i into the n rows dsts[0..n): QDT < 0 copies its row of row_bytes bytes; QDT = DT_* quantises
// its [H] row of that dtype into wire rows of row_bytes bytes (n == 0: only checks it).  Returns (every
// lane) whether the token held inf/nan (fp8 only).
template <int QDT>
__device__ __forceinline__ bool put_token(char* const* dsts, int n, const char* x, int i, i64 row_bytes, int vec,
                                          int H, bool pow2, int lane) {
  if constexpr (QDT < 0) {
    warp_fanout(dsts, n, x + (i64)i * row_bytes, row_bytes, vec, lane);
    return false;
  } else {
    return warp_quant_fanout<QDT>(dsts, n, x + (i64)i * H * (QDT == DT_F32 ? 4 : 2), H, row_bytes, pow2, lane);
  }
}

// The kernels below take (qdt, pow2, off_xbad, xrep) last and run the body instantiated for qdt: the bytes
// path (qdt -1) is the same code as without fp8.
#define QDT_SWITCH(qdt, CALL) \
  switch (qdt) {               \
    case DT_BF16: CALL(DT_BF16); break; \
    case DT_F16: CALL(DT_F16); break;   \
    case DT_F32: CALL(DT_F32); break;   \
    default: CALL(-1);                  \
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
// fp8 (qdt >= 0): x is [s, H] of dtype qdt, quantised into wire rows of row_bytes bytes; a token without any
//   destination is read and checked too.
template <int QDT>
__device__ __forceinline__ void dispatch_send_impl(const Ctx* c, int mode, const char* x, i64 row_bytes, int vec,
                                                   int s, const i64* dst_rank, const i64* dst_row, const float* w,
                                                   int barrier, int local_expand, bool pow2, i64 off_xbad, u64* xrep,
                                                   char* (*s_dst)[32]) {
  const u64 de = QDT >= 0 ? ld_volatile(&c->ctr[CTR_DATA]) + 1 : 0;  // the data epoch finish_send signals
  u64 ne;
  bool ok = maybe_entry_barrier(c, barrier, &ne);
  if (ok) {
    const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5, K = (int)c->K, R = (int)c->R, me = (int)c->rank;
    const i64 cap = c->cap, S = c->S;
    const u64 tag_epoch = (ld_volatile(&c->ctr[CTR_TAG]) + 1) & 0xffffffffull;
    for (int i = warp_id_global(); i < s; i += num_warps_global()) {
      int r, row;
      float wk;
      load_choice(dst_rank, dst_row, mode == 0 ? w : nullptr, i, K, R, cap, lane, r, row, wk);
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
      if (mode == 0)  // K-aligned row lists at the first row of every destination rank
        put_row_lists(c, __ballot_sync(FULL_MASK, is_first), r, row, K, lane, [](int, int) {});
      __syncwarp();
      if (put_token<QDT>(s_dst[wib], n, x, i, row_bytes, vec, (int)c->H, pow2, lane))
        xbad_mark(c, off_xbad, xrep, de, true, lane);
      __syncwarp();
    }
  }
  finish_send(c, ne, mode == 0);
}

extern "C" __global__ void moonep_dispatch_send(const Ctx* c, int mode, const char* x, i64 row_bytes, int vec,
                                                int s, const i64* dst_rank, const i64* dst_row, const float* w,
                                                int barrier, int local_expand, int qdt, int pow2, i64 off_xbad,
                                                u64* xrep) {
  __shared__ char* s_dst[MAX_WARPS][32];
#define SEND_CALL(Q) \
  dispatch_send_impl<Q>(c, mode, x, row_bytes, vec, s, dst_rank, dst_row, w, barrier, local_expand, pow2 != 0, \
                        off_xbad, xrep, s_dst)
  QDT_SWITCH(mode == 0 ? qdt : -1, SEND_CALL)
#undef SEND_CALL
}

// Receiver side of dispatch: wait for every peer, then expand first rows into the other rows.
//   mode 0: source buffer = main receive buffer; reads tags, writes row_first/rec/src (step-local) and
//           the weights w_out (zero in unwritten rows).
//   mode 1: source buffer = gradient receive buffer; row_first/rec/src are inputs (from the forward).
// dst: [cap, row_bytes]; may be the source buffer itself (zero-copy) or a fresh tensor (copy mode).
// local_expand: the send kernel already wrote every row of tokens from this rank (only when dst is the
//   source buffer).  One warp per row: unwritten rows are zeroed; the warp of a token's first row reads
//   it once and stores it into the token's other rows (and into the row itself when copying).
// xrep (fp8 dispatch, else null): record a peer's non-finite x marked in xbad (off_xbad) by its send kernel.
extern "C" __global__ void moonep_dispatch_expand(const Ctx* c, int mode, char* dst, float* w_out, int* row_first,
                                                  int* rec, int* src, i64 row_bytes, int vec, int local_expand,
                                                  i64 off_xbad, u64* xrep) {
  __shared__ char* s_dst[MAX_WARPS][32];
  if (!wait_data(c)) return;
  if (xrep != nullptr && blockIdx.x == 0 && threadIdx.x == 0)
    xbad_check(c, off_xbad, xrep, ld_volatile(&c->ctr[CTR_DATA]));
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
    warp_fanout(s_dst[wib], n, sbuf + row * row_bytes, row_bytes, vec, lane);
    __syncwarp();
  }
}

// ===================================================================================================
// Fused path (default; Tuning(fused=()) selects the kernels above).
// ===================================================================================================

// Fused dispatch: send + local expansion in one launch.
//   Blocks [0, nnv) (NVLink): every token once per REMOTE destination rank, into its first row there (with
//     meta/w/tag in mode 0), chunk by chunk (chunk(i) = i*nch/S); in mode 0 also, for every source token
//     i < S and every peer p, flist[me][i] on p = the token's first row on p, or -1 (so the receiver
//     finds the tokens of a chunk without scanning rows).  After each chunk the last of them signals the
//     chunk to every peer.
//   Blocks [nnv, grid) (local HBM work):
//     A. this rank's own tokens: x read once, stored into every local row of the token; in mode 0 they
//        also write the step-local lists (row_first, rec, src, w_out) and an own-row tag; in mode 1 they
//        zero the rows without a token (row_first < 0).
//     B. for each chunk: wait for every peer's chunk signal, then one warp per (peer, source token) of the
//        chunk: copy the token's first row into its other rows (and into dst itself when copying); mode 0
//        exports the row lists from the symmetric flist/meta/w and keeps the first rows in the step-local
//        tokfirst [R, S] for mode 1.  One warp per token, not per group of rows: the expert-grouped layout
//        clusters a peer's first rows, and a warp per 32 rows serialised up to 32 tokens (~300 us).
//        tokfirst [R, S] (step-local) gets every source token's first row here (own tokens from A), -1
//        without one: combine and the backward pass walk tokens through it.
//        Peer-written memory is read with L2-only loads.
//   Mode 0 rows nobody wrote (padding, unused capacity) are zeroed by moonep_dispatch_zero afterwards, or,
//   with zero_from (align 1: this rank's rows are dense, [0, *zero_from) all written), rows [*zero_from, cap)
//   are zeroed here by the local blocks after A (no other kernel, no tag pass over every row).
//   mode 0: forward (main receive buffer; dst = it (zero-copy) or a fresh tensor; w: fp32 [s, K]).
//   mode 1: backward of combine (gradient receive buffer; row_first/rec/src/tokfirst are the forward's).
//   fp8 (qdt >= 0, mode 0): x is [s, H] of dtype qdt; the NVLink blocks and A quantise each token into the rows
//   they write (row_bytes: wire rows).  With R > 1 the NVLink blocks also read and check the tokens without a
//   remote row, so that a non-finite x reaches the peers before the chunk signals; block nnv checks the
//   peers' marks after the last chunk.  With R == 1, A checks the tokens without any row.
template <int QDT>
__device__ __forceinline__ void dispatch_fused_impl(
    const Ctx* c, int mode, const char* x, i64 row_bytes, int vec, int s, const i64* dst_rank, const i64* dst_row,
    const float* w, int barrier, int nnv, int nch, char* dst, float* w_out, int* row_first, int* rec, int* src,
    int* tokfirst, const int* zero_from, bool pow2, i64 off_xbad, u64* xrep, char* (*s_dst)[32], int& s_fat) {
  const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5, wpb = blockDim.x >> 5;
  const int K = (int)c->K, R = (int)c->R, me = (int)c->rank;
  const i64 cap = c->cap, S = c->S;
  const u64 de = ld_volatile(&c->ctr[CTR_DATA]) + 1;
  const u64 tag_epoch = (ld_volatile(&c->ctr[CTR_TAG]) + 1) & 0xffffffffull;
  const char* sbuf = mode == 0 ? c->base[me] + c->off_recv : c->gbase[me];
  u64 ne;
  if ((int)blockIdx.x < nnv) {
    // ------------------------------------------------------------------ NVLink blocks
    const int w0 = blockIdx.x * wpb + wib, nw = nnv * wpb;
    ne = nvlink_chunks(c, barrier, nnv, nch, de, [&](int ch) {
      int lo, hi;
      chunk_range(S, nch, ch, s, &lo, &hi);
      for (int i = lo + w0; i < hi; i += nw) {
        int r, row;
        float wk;
        load_choice(dst_rank, dst_row, mode == 0 ? w : nullptr, i, K, R, cap, lane, r, row, wk);
        unsigned same = __match_any_sync(FULL_MASK, r);
        int first_lane = __ffs(same) - 1;
        const bool remote = r >= 0 && r != me;
        const bool is_first = remote && first_lane == lane;
        int my_first = __shfl_sync(FULL_MASK, row, first_lane);
        if (mode == 0 && remote) {
          char* b = c->base[r];
          ((float*)(b + c->off_w))[row] = wk;
          ((u64*)(b + c->off_tag))[row] = (tag_epoch << 32) | (u64)(unsigned)my_first;
        }
        unsigned dmask = __ballot_sync(FULL_MASK, is_first);
        int n = __popc(dmask);
        if (is_first) {
          char* dbase = mode == 0 ? c->base[r] + c->off_recv : c->gbase[r];
          s_dst[wib][__popc(dmask & ((1u << lane) - 1u))] = dbase + (i64)row * row_bytes;
        }
        if (mode == 0) {  // K-aligned row lists at the first row of every remote destination rank
          int f_lo = -1, f_hi = -1;  // the first row on rank `lane` / `lane + 32`
          put_row_lists(c, dmask, r, row, K, lane, [&](int dr, int frow) {
            if (dr == lane) f_lo = frow;
            if (dr == lane + 32) f_hi = frow;
          });
          if (lane < R && lane != me) ((int*)(c->base[lane] + c->off_flist))[(i64)me * S + i] = f_lo;
          if (lane + 32 < R && lane + 32 != me)
            ((int*)(c->base[lane + 32] + c->off_flist))[(i64)me * S + i] = f_hi;
        }
        __syncwarp();
        if constexpr (QDT < 0) {
          if (n > 0) {
            warp_fanout(s_dst[wib], n, x + (i64)i * row_bytes, row_bytes, vec, lane);
          }
        } else if (n > 0 || R > 1) {
          if (put_token<QDT>(s_dst[wib], n, x, i, row_bytes, vec, (int)c->H, pow2, lane))
            xbad_mark(c, off_xbad, xrep, de, true, lane);
        }
        __syncwarp();
      }
      if (mode == 0) {  // source token slots this rank does not fill (s <= i < S): no token
        int a, b;
        chunk_range(S, nch, ch, (int)S, &a, &b);
        const int from = a > s ? a : s;
        for (i64 q = (i64)w0 * 32 + lane; q < (i64)(b - from) * R; q += (i64)nw * 32) {
          const int p = (int)(q % R), i = from + (int)(q / R);
          if (p != me) ((int*)(c->base[p] + c->off_flist))[(i64)me * S + i] = -1;
        }
      }
    });
  } else {
    // ------------------------------------------------------------------ local blocks
    ne = ld_volatile(&c->ctr[CTR_ENTRY]) + (barrier ? 1 : 0);
    if (threadIdx.x == 0) s_fat = is_fatal(c) ? 1 : 0;
    __syncthreads();
    const int lw0 = ((int)blockIdx.x - nnv) * wpb + wib, nlw = ((int)gridDim.x - nnv) * wpb;
    const bool inplace = (const char*)dst == sbuf;
    u64* tag = (u64*)(c->base[me] + c->off_tag);
    const float* wbuf = (const float*)(c->base[me] + c->off_w);
    const int* meta = (const int*)(c->base[me] + c->off_meta);
    const int* flist = (const int*)(c->base[me] + c->off_flist);
    if (!s_fat) {
      // A. own tokens
      for (int i = lw0; i < s; i += nlw) {
        int r, row;
        float wk;
        load_choice(dst_rank, dst_row, mode == 0 ? w : nullptr, i, K, R, cap, lane, r, row, wk);
        const bool local = r == me;
        const unsigned lm = __ballot_sync(FULL_MASK, local);
        if (lm == 0u) {
          if (mode == 0 && lane == 0) tokfirst[(i64)me * S + i] = -1;
          if (QDT >= 0 && R == 1 && put_token<QDT>(s_dst[wib], 0, x, i, row_bytes, vec, (int)c->H, pow2, lane))
            xbad_mark(c, off_xbad, xrep, de, false, lane);
          continue;
        }
        const int f = __shfl_sync(FULL_MASK, row, __ffs(lm) - 1);
        if (mode == 0) {
          if (lane == 0) tokfirst[(i64)me * S + i] = f;
          if (local) {
            w_out[row] = wk;
            row_first[row] = f;
            tag[row] = (tag_epoch << 32) | (u64)(unsigned)f;
          }
          if (lane == 0) src[f] = (int)(me * S + i);
          if (lane < K) rec[(i64)f * K + lane] = local ? row : -1;
        }
        if (local) s_dst[wib][__popc(lm & ((1u << lane) - 1u))] = dst + (i64)row * row_bytes;
        __syncwarp();
        const int n = __popc(lm);
        if (put_token<QDT>(s_dst[wib], n, x, i, row_bytes, vec, (int)c->H, pow2, lane))
          xbad_mark(c, off_xbad, xrep, de, false, lane);
        __syncwarp();
      }
      if (mode == 0)  // own source slots without a token
        for (i64 q = (i64)lw0 * 32 + lane; q < S - s; q += (i64)nlw * 32) tokfirst[(i64)me * S + s + q] = -1;
      if (mode == 0 && zero_from != nullptr) {  // unused capacity: nobody writes these rows this step
        i64 z = *zero_from;
        z = z < 0 ? 0 : (z > cap ? cap : z);
        for (i64 row = z + lw0; row < cap; row += nlw) {
          if (lane == 0) {
            w_out[row] = 0.f;
            row_first[row] = -1;
          }
          warp_zero(dst + row * row_bytes, row_bytes, vec, lane);
        }
      }
      if (mode == 1) {  // rows without a token (known from the forward)
        for (i64 b0 = (i64)lw0 * 32; b0 < cap; b0 += (i64)nlw * 32) {
          const i64 row = b0 + lane;
          unsigned zm = __ballot_sync(FULL_MASK, row < cap && row_first[row] < 0);
          while (zm) {
            int l = __ffs(zm) - 1;
            zm &= zm - 1;
            warp_zero(dst + (b0 + l) * row_bytes, row_bytes, vec, lane);
          }
        }
      }
    }
    // B. tokens from peers, chunk by chunk: warp q takes (peer, source token) pairs q, q + nlw, ...
    bool waited = true;
    for (int ch = 0; ch < nch; ++ch) {
      if (!wait_chunk(c, ch, de)) {
        waited = false;
        break;
      }
      int lo, hi;
      chunk_range(S, nch, ch, (int)S, &lo, &hi);
      const int nt = hi - lo;
      for (i64 q = lw0; q < (i64)(R - 1) * nt; q += nlw) {
        int p = (int)(q / nt);
        const int i = lo + (int)(q - (i64)p * nt);
        p += p >= me ? 1 : 0;  // the peers, skipping this rank
        const i64 slot = (i64)p * S + i;
        int f;
        if (mode == 0) {
          f = ld_cg_i32(flist + slot);
          if (f >= cap) f = -1;
          if (lane == 0) tokfirst[slot] = f;
        } else {
          f = tokfirst[slot];
        }
        if (f < 0) continue;
        int rk = -1;
        if (lane < K) {
          if (mode == 0) {
            rk = ld_cg_i32(meta + (i64)f * K + lane);
            if (rk >= cap) rk = -1;
            rec[(i64)f * K + lane] = rk;
            if (rk >= 0) {
              row_first[rk] = f;
              w_out[rk] = ld_cg_f32(wbuf + rk);
            }
          } else {
            rk = rec[(i64)f * K + lane];
          }
        }
        if (mode == 0 && lane == 0) src[f] = (int)slot;
        const bool want = rk >= 0 && rk < cap && (!inplace || rk != f);
        const unsigned dm = __ballot_sync(FULL_MASK, want);
        if (want) s_dst[wib][__popc(dm & ((1u << lane) - 1u))] = dst + (i64)rk * row_bytes;
        __syncwarp();
        const int n = __popc(dm);
        warp_fanout<true>(s_dst[wib], n, sbuf + (i64)f * row_bytes, row_bytes, vec, lane);
        __syncwarp();
      }
    }
    if (QDT >= 0 && R > 1 && waited && (int)blockIdx.x == nnv && threadIdx.x == 0) xbad_check(c, off_xbad, xrep, de);
  }
  finish_fused(c, ne, de, mode == 0);
}

// Threads per block: moonep/cuda_runtime.py dispatch_threads() (MOONEP_DISPATCH_THREADS), one block per SM.
#ifndef MOONEP_DISPATCH_THREADS
#define MOONEP_DISPATCH_THREADS 512
#endif
extern "C" __global__ void __launch_bounds__(MOONEP_DISPATCH_THREADS, 1) moonep_dispatch_fused(
    const Ctx* c, int mode, const char* x, i64 row_bytes, int vec, int s, const i64* dst_rank, const i64* dst_row,
    const float* w, int barrier, int nnv, int nch, char* dst, float* w_out, int* row_first, int* rec, int* src,
    int* tokfirst, const int* zero_from, int qdt, int pow2, i64 off_xbad, u64* xrep) {
  __shared__ char* s_dst[MAX_WARPS][32];
  __shared__ int s_fat;
#define FUSED_CALL(Q)                                                                                           \
  dispatch_fused_impl<Q>(c, mode, x, row_bytes, vec, s, dst_rank, dst_row, w, barrier, nnv, nch, dst, w_out,   \
                         row_first, rec, src, tokfirst, zero_from, pow2 != 0, off_xbad, xrep, s_dst, s_fat)
  QDT_SWITCH(mode == 0 ? qdt : -1, FUSED_CALL)
#undef FUSED_CALL
}

// Mode 0 epilogue of the fused dispatch: rows whose tag is not of this dispatch (nobody wrote them) get
// zeros, weight 0 and row_first -1.  Local memory only, after the fused kernel in stream order.
extern "C" __global__ void moonep_dispatch_zero(const Ctx* c, char* dst, float* w_out, int* row_first, i64 row_bytes,
                                                int vec) {
  if (is_fatal(c)) return;
  const int lane = threadIdx.x & 31;
  const i64 cap = c->cap;
  const u64 epoch = ld_volatile(&c->ctr[CTR_TAG]) & 0xffffffffull;
  const u64* tag = (const u64*)(c->base[c->rank] + c->off_tag);
  for (i64 b0 = (i64)warp_id_global() * 32; b0 < cap; b0 += (i64)num_warps_global() * 32) {
    const i64 row = b0 + lane;
    bool stale = false;
    if (row < cap) {
      const u64 t = tag[row];
      stale = !((t >> 32) == epoch && (i64)(t & 0xffffffffull) < cap);
      if (stale) {
        w_out[row] = 0.f;
        row_first[row] = -1;
      }
    }
    unsigned zm = __ballot_sync(FULL_MASK, stale);
    while (zm) {
      const int l = __ffs(zm) - 1;
      zm &= zm - 1;
      warp_zero(dst + (b0 + l) * row_bytes, row_bytes, vec, lane);
    }
  }
}
