// Quantile Balancing on CUDA (moonep/balance.py): fused histogram recording and the bias step.
//
// Compiled at run time by CuPy (NVRTC) as the "balance" program of moonep/cuda_runtime.py; launched on
// torch's current stream.
// Every floating operation mirrors the torch CPU path of moonep/balance.py one for one, with explicit
// round-to-nearest intrinsics (__fsub_rn, __fdiv_rn, __dmul_rn, ...) so nothing is contracted into an FMA
// or turned into a reciprocal multiply. Hence the counts, the range and the uncentred quantiles are
// bit-identical to the CPU path; only the mean used for centring sums in a different (fixed) order.
//
//   qb_record_<dtype>  r = alpha_i - s_ij, its bin, +1 in counts[E*B] (shared-memory histograms per
//                      expert tile, flushed with one global atomic per non-empty bin); the first
//                      micro-batch of a step also fixes the range [min b - 1, max b + 1] from the bias;
//                      optional deferred validation (+1 in counts[E*B] per launch with a score outside
//                      [0, 1] or NaN, via a last-block-done counter).
//   qb_quantiles       one block per expert: row cumsum (int64), first bin reaching ceil(q), float64 in-bin
//                      interpolation; zeroes its row (row 0 is read by every block: zeroed by qb_finalize).
//   qb_finalize        one block: mean-centring (+ EMA, re-centring), bias update unless the histogram is
//                      empty or bad scores were seen, num_steps += 1, bad total, counts[0:B] and the bad
//                      slot reset.

typedef unsigned short u16;

// ---------------------------------------------------------------- score loads (exact widening)
__device__ __forceinline__ float ld_score(const float* p) { return __ldg(p); }
__device__ __forceinline__ double ld_score(const double* p) { return __ldg(p); }
struct bf16_t { u16 x; };
struct f16_t { u16 x; };
__device__ __forceinline__ float ld_score(const bf16_t* p) {
    return __uint_as_float(((unsigned)__ldg(&p->x)) << 16);
}
__device__ __forceinline__ float ld_score(const f16_t* p) {
    u16 h = __ldg(&p->x);
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// ---------------------------------------------------------------- arithmetic, no contraction
__device__ __forceinline__ float sub_rn(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ double sub_rn(double a, double b) { return __dsub_rn(a, b); }
__device__ __forceinline__ float div_rn(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ double div_rn(double a, double b) { return __ddiv_rn(a, b); }

// torch: x.nan_to_num_(nan=0).clamp_(0, B - 1).to(int32)  (NaN -> 0, +inf -> B-1, -inf -> 0, truncation)
template <typename C>
__device__ __forceinline__ int to_bin(C x, C bmax) {
    C y = x >= C(0) ? x : C(0);  // NaN fails the test -> 0
    y = y < bmax ? y : bmax;
    return (int)y;
}

// ---------------------------------------------------------------- block reductions
// NaN-propagating min/max, like torch.min()/max() of the bias.
__device__ __forceinline__ float nmin(float a, float b) { return (a != a || b != b) ? __int_as_float(0x7fc00000) : (b < a ? b : a); }
__device__ __forceinline__ float nmax(float a, float b) { return (a != a || b != b) ? __int_as_float(0x7fc00000) : (b > a ? b : a); }

// Range of this step from the bias (torch, float32): lo = min(b) - 1; width = (max(b) + 1 - lo) / bins.
// Min/max are exact, so any reduction order gives the CPU's values. Needs blockDim.x a multiple of 32, <= 1024.
__device__ void range_from_bias(const float* __restrict__ bias, int E, int bins, float* lo, float* width) {
    __shared__ float smn[32], smx[32];
    float mn = __int_as_float(0x7f800000), mx = __int_as_float(0xff800000);
    for (int i = threadIdx.x; i < E; i += blockDim.x) {
        float v = bias[i];
        mn = nmin(mn, v);
        mx = nmax(mx, v);
    }
    for (int o = 16; o; o >>= 1) {
        mn = nmin(mn, __shfl_xor_sync(0xffffffffu, mn, o));
        mx = nmax(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    }
    const int w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    __syncthreads();  // smn/smx may be reused by a previous call
    if ((threadIdx.x & 31) == 0) { smn[w] = mn; smx[w] = mx; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int i = 1; i < nw; ++i) { mn = nmin(mn, smn[i]); mx = nmax(mx, smx[i]); }
        const float l = __fsub_rn(mn, 1.0f);
        smn[0] = l;
        smx[0] = __fdiv_rn(__fsub_rn(__fadd_rn(mx, 1.0f), l), (float)bins);
    }
    __syncthreads();
    *lo = smn[0];
    *width = smx[0];
    __syncthreads();
}

// int64 block sum (exact, order-free). blockDim.x a multiple of 32, <= 1024.
__device__ long long block_sum_i64(long long v) {
    __shared__ long long sh[32];
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    __syncthreads();
    if ((threadIdx.x & 31) == 0) sh[w] = v;
    __syncthreads();
    long long t = 0;
    for (int i = 0; i < nw; ++i) t += sh[i];
    __syncthreads();
    return t;
}

// float64 block sum in a fixed order (deterministic for a fixed blockDim): every rank gets the same bits.
__device__ double block_sum_f64(double v) {
    __shared__ double sh[32];
    for (int o = 16; o; o >>= 1) v = __dadd_rn(v, __shfl_xor_sync(0xffffffffu, v, o));
    const int w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    __syncthreads();
    if ((threadIdx.x & 31) == 0) sh[w] = v;
    __syncthreads();
    double t = sh[0];
    for (int i = 1; i < nw; ++i) t = __dadd_rn(t, sh[i]);
    __syncthreads();
    return t;
}

// ---------------------------------------------------------------- recording
// Grid: (tiles of `et` experts, token chunks of `tpb` tokens). Block b covers experts [e0, e0+ne) of tokens
// [t0, t1). smem = et * B int32 when `privatise` (else atomics go straight to global memory).
// alpha: the (K+1)-th biased score of each token, in the compute type C, stride `astride` elements.
// lohi: float32 [2] device buffers (lo, width) of the step: written by block (0,0) when `first`, read otherwise.
// flags: int32 [2] scratch (bad seen in this launch, blocks done), zero between launches.
template <typename T, typename C, bool privatise>
__device__ void record_impl(const T* __restrict__ scores, long long sstride, const C* __restrict__ alpha,
                            long long astride, int n, int E, int B, int et, int tpb,
                            const float* __restrict__ bias, float* lo_buf, float* width_buf, int first,
                            int* __restrict__ counts, int check, int* flags) {
    extern __shared__ int hist[];
    const int e0 = blockIdx.x * et;
    const int ne = min(et, E - e0);
    const int t0 = blockIdx.y * tpb;
    const int t1 = min(n, t0 + tpb);
    float lo, width;
    if (first) {
        range_from_bias(bias, E, B, &lo, &width);
        if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) { *lo_buf = lo; *width_buf = width; }
    } else {
        lo = *lo_buf;
        width = *width_buf;
    }
    if (privatise) {
        for (int i = threadIdx.x; i < ne * B; i += blockDim.x) hist[i] = 0;
        __syncthreads();
    }
    const C clo = (C)lo, cw = (C)width, bmax = (C)(B - 1);
    int* gcounts = counts + (long long)e0 * B;
    int bad = 0;
    if (ne > 0 && t1 > t0) {
        // k = tt * ne + e walks the block's (token, expert) pairs; (tt, e) advance without a division
        const int dt = blockDim.x / ne, de = blockDim.x - dt * ne;
        int tt = threadIdx.x / ne, e = threadIdx.x - tt * ne;
        for (; t0 + tt < t1; tt += dt, e += de) {
            if (e >= ne) { e -= ne; ++tt; if (t0 + tt >= t1) break; }
            const int t = t0 + tt;
            const C s = ld_score(scores + (long long)t * sstride + e0 + e);
            if (check) bad |= !(s >= C(0) && s <= C(1));
            const C a = alpha[(long long)t * astride];
            // torch: x = alpha[:, None] - s; x.sub_(lo).div_(width)
            const C x = div_rn(sub_rn(sub_rn(a, s), clo), cw);
            const int bin = to_bin(x, bmax);
            if (privatise) atomicAdd(&hist[e * B + bin], 1);
            else atomicAdd(&gcounts[(long long)e * B + bin], 1);
        }
    }
    if (privatise) {
        __syncthreads();
        for (int i = threadIdx.x; i < ne * B; i += blockDim.x) {
            const int v = hist[i];
            if (v) atomicAdd(&gcounts[i], v);
        }
    }
    if (check) {
        const int any = __syncthreads_or(bad);
        if (threadIdx.x == 0) {
            if (any) atomicOr(&flags[0], 1);
            __threadfence();
            const unsigned nblk = gridDim.x * gridDim.y;
            if ((unsigned)atomicAdd(&flags[1], 1) == nblk - 1) {  // last block: one count per micro-batch
                __threadfence();
                if (atomicExch(&flags[0], 0)) atomicAdd(&counts[(long long)E * B], 1);
                atomicExch(&flags[1], 0);
            }
        }
    }
}

#define QB_RECORD(NAME, T, C)                                                                                  \
    extern "C" __global__ void __launch_bounds__(1024) NAME(                                                  \
        const T* scores, long long sstride, const C* alpha, long long astride, int n, int E, int B, int et,   \
        int tpb, const float* bias, float* lo_buf, float* width_buf, int first, int* counts, int check,       \
        int* flags, int privatise) {                                                                          \
        if (privatise)                                                                                        \
            record_impl<T, C, true>(scores, sstride, alpha, astride, n, E, B, et, tpb, bias, lo_buf,          \
                                    width_buf, first, counts, check, flags);                                  \
        else                                                                                                  \
            record_impl<T, C, false>(scores, sstride, alpha, astride, n, E, B, et, tpb, bias, lo_buf,         \
                                     width_buf, first, counts, check, flags);                                 \
    }

QB_RECORD(qb_record_f32, float, float)
QB_RECORD(qb_record_bf16, bf16_t, float)
QB_RECORD(qb_record_f16, f16_t, float)
QB_RECORD(qb_record_f64, double, double)

// ---------------------------------------------------------------- the step
// Grid E, block a multiple of 32. counts int32 [E*B (+1)]; work int64 [E + 1]: the uncentred quantiles
// (float64 bits) then m. Mirrors histogram_quantiles(): cum = cumsum(int64); m = cum[0, -1];
// need = (m*K + E-1) // E; l = min(searchsorted(cum_j, need), B-1); h = counts[j, l]; c = cum[j, l] - h;
// q = (double)m * K / E; frac = clamp((q - c) / max(h, 1), 0, 1); b = lo + (l + frac) * width.
extern "C" __global__ void __launch_bounds__(1024) qb_quantiles(
    int* counts, int E, int B, int K, const float* bias, float* lo_buf, float* width_buf, int from_bias,
    long long* work) {
    __shared__ int s_l;
    const int j = blockIdx.x;
    long long part = 0;
    for (int i = threadIdx.x; i < B; i += blockDim.x) part += counts[i];
    const long long m = block_sum_i64(part);
    float lo, width;
    if (from_bias) {  // nothing recorded on this rank this step: the same range as the peers, from the bias
        range_from_bias(bias, E, B, &lo, &width);
        if (j == 0 && threadIdx.x == 0) { *lo_buf = lo; *width_buf = width; }
    } else {
        lo = *lo_buf;
        width = *width_buf;
    }
    int* row = counts + (long long)j * B;
    const int per = (B + blockDim.x - 1) / blockDim.x;
    const int b0 = min(B, (int)threadIdx.x * per), b1 = min(B, b0 + per);
    long long mine = 0;
    for (int b = b0; b < b1; ++b) mine += row[b];
    // exclusive block scan of the per-thread sums (warp shuffles + one smem pass; exact in int64)
    __shared__ long long wsum[32];
    long long incl = mine;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int o = 1; o < 32; o <<= 1) {
        const long long v = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += v;
    }
    if (lane == 31) wsum[w] = incl;
    if (threadIdx.x == 0) s_l = B;
    __syncthreads();
    long long pre = incl - mine;
    for (int i = 0; i < w; ++i) pre += wsum[i];
    (void)nw;
    const long long need = (m * K + (E - 1)) / E;  // ceil(q), m >= 0
    {
        long long cum = pre;
        for (int b = b0; b < b1; ++b) {
            cum += row[b];
            if (cum >= need) { atomicMin(&s_l, b); break; }
        }
    }
    __syncthreads();
    const int l = min(s_l, B - 1);
    if (l >= b0 && l < b1) {
        long long c = pre;
        for (int b = b0; b < l; ++b) c += row[b];
        const long long h = row[l];
        const double q = __ddiv_rn(__dmul_rn((double)m, (double)K), (double)E);
        double frac = __ddiv_rn(__dsub_rn(q, (double)c), (double)(h > 1 ? h : 1));
        frac = frac < 0.0 ? 0.0 : (frac > 1.0 ? 1.0 : frac);
        const double b = __dadd_rn((double)lo, __dmul_rn(__dadd_rn((double)l, frac), (double)width));
        work[j] = __double_as_longlong(b);
        if (j == 0) work[E] = m;
    }
    __syncthreads();
    if (j != 0)  // row 0 feeds every block's m: qb_finalize zeroes it
        for (int b = threadIdx.x; b < B; b += blockDim.x) row[b] = 0;
}

// One block. torch: b = b - b.mean(); [ema: b = ema*old + (1-ema)*b; b = b - b.mean()];
// bias = where(m > 0 & bad == 0, float32(b), bias); num_steps += 1; bad_total += bad; reset counts.
extern "C" __global__ void __launch_bounds__(1024) qb_finalize(
    const long long* work, int* counts, int E, int B, float* bias, double ema, double one_minus_ema,
    long long* num_steps, long long* bad_total) {
    const double* braw = reinterpret_cast<const double*>(work);
    const long long m = work[E];
    const int bad = counts[(long long)E * B];
    double part = 0.0;
    for (int i = threadIdx.x; i < E; i += blockDim.x) part = __dadd_rn(part, braw[i]);
    const double mean = __ddiv_rn(block_sum_f64(part), (double)E);
    double mean2 = 0.0;
    if (ema > 0.0) {
        part = 0.0;
        for (int i = threadIdx.x; i < E; i += blockDim.x) {
            const double bi = __dsub_rn(braw[i], mean);
            part = __dadd_rn(part, __dadd_rn(__dmul_rn(ema, (double)bias[i]), __dmul_rn(one_minus_ema, bi)));
        }
        mean2 = __ddiv_rn(block_sum_f64(part), (double)E);
    }
    const bool ok = m > 0 && bad == 0;
    __syncthreads();
    if (ok) {
        for (int i = threadIdx.x; i < E; i += blockDim.x) {  // same thread reads and writes bias[i]
            double bi = __dsub_rn(braw[i], mean);
            if (ema > 0.0)
                bi = __dsub_rn(__dadd_rn(__dmul_rn(ema, (double)bias[i]), __dmul_rn(one_minus_ema, bi)), mean2);
            bias[i] = __double2float_rn(bi);
        }
    }
    for (int b = threadIdx.x; b < B; b += blockDim.x) counts[b] = 0;
    if (threadIdx.x == 0) {
        *num_steps += 1;
        *bad_total += bad;
        counts[(long long)E * B] = 0;
    }
}
