/* The decode step and the verify pass of a small Llama-layout model in one call.
 *
 * Why this exists: a batch-1 step of the bundled model is ~12 MFLOP over 24 MB of
 * weights, which the CPU streams in about a millisecond, but eager PyTorch spends
 * most of its 3.5 ms on the ~22 dispatches per layer. Here a whole range of layers
 * runs inside one OpenMP region (the same libgomp torch uses, so one thread pool).
 *
 * Exactness contract (tests/test_native_step.py checks it): every row of a
 * multi-row pass is computed with the very instruction sequence a one-row pass
 * uses. Each output column is one fused multiply-add chain over the input in
 * index order, whatever the row blocking or the thread split; attention splits
 * the keys into fixed 256-key chunks counted from key 0, whatever the row or the
 * thread. So a verify pass over K+1 positions returns bit for bit the logits of
 * K+1 plain steps, and speculative greedy decoding cannot drift from plain.
 *
 * Layout: activations row-major [t, n]; weight matrices packed in panels of 16 output
 * columns (gemm_panels); the KV
 * cache [slots, KV, cap, hd]; rope tables [P, hd] with rotate_half's sign folded
 * into sin (see forward.py). Only x86-64 with AVX2 and FMA: elsewhere this file
 * does not compile and the engine keeps the PyTorch path.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <omp.h>

#if !defined(__AVX2__) || !defined(__FMA__)
#error "the native step needs AVX2 and FMA"
#endif

#define CD_ABI 15
/* The AMX build (avx512-amx: avx512-bf16 plus AMX-TILE, AMX-BF16, AMX-INT8) multiplies bf16 and int8 panels
 * with tiles of up to 16 activation rows; a pass of more than 16 rows goes in whole tiles, its last one
 * padded with rows of zeros in scratch. */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__) && defined(__AVX512BF16__) && defined(__AVX512VNNI__)
#define CD_AMX 1
#define AMX_M 16
/* int8 passes of at least this many rows take the tiles: their integer sums are the VNNI kernel's bits, so
 * the choice is free, and a one-row step streams its weights through vpdpbusd as before */
#define AMX_I8_ROWS 4
#define SCRATCH_ROWS(t) ((t) > AMX_M ? ((t) + AMX_M - 1) / AMX_M * AMX_M : (t))
#else
#define CD_AMX 0
#define SCRATCH_ROWS(t) (t)
#endif
/* Bytes ahead of the weights a kernel of several activation rows reads, prefetched. Such a kernel computes
 * long enough per byte that the hardware prefetcher falls behind and each weight line arrives late: one
 * 4864 x 896 bf16 matrix, one thread, streamed, five rows took 1.7-2.0x one row's time without, 1.2-1.3x
 * with 8 KB ahead (4-16 KB alike; 1 KB too little). One-row kernels are bound by the stream itself: without.
 * Measured in the AVX2 build; the AVX-512 builds' panel kernels and the AVX512_BF16 build's row-major head
 * prefetch alike, not yet measured on an AVX-512 CPU (their verify passes cost 1.6-1.8 steps at K = 4
 * there on 2026-12-04, as AVX2's did before). */
#define PF_AHEAD 8192
/* in a kernel of R rows over NP panels (both compile-time constants): each panel's weights PF_AHEAD bytes
 * past its element `off`, where R > 1 */
#define PF_PANELS(R, NP, pan, off)                                                                      \
    do {                                                                                                \
        if ((R) > 1)                                                                                    \
            _Pragma("GCC unroll 8") for (int n_ = 0; n_ < (NP); n_++)                                   \
                _mm_prefetch((const char *)((pan)[n_] + (off)) + PF_AHEAD, _MM_HINT_T0);                \
    } while (0)

/* rows in the next block when `left` rows remain and a block holds at most `most`: blocks as even as they
 * come (t = 6 in blocks of up to 5: 3 + 3) */
static inline int even_block(int left, int most) {
    const int blocks = (left + most - 1) / most;
    return (left + blocks - 1) / blocks;
}
#define CHUNK 256 /* keys per attention chunk: fixed, so a position's result never depends on t */

typedef struct {
    /* matrices packed in panels (see gemm_panels) in the format wfmt says; norms and biases plain */
    const float *ln1;
    const void *qkv;
    const float *qkv_b;
    const void *o;
    const float *o_b, *ln2;
    const void *gate;
    const float *gate_b;
    const void *up;
    const float *up_b;
    const void *down;
    const float *down_b, *q_norm, *k_norm;
    /* FMT_I8 only: each matrix's column scales, padded to whole panels (NULL otherwise) */
    const float *qkv_s, *o_s, *gate_s, *up_s, *down_s;
    int32_t wfmt; /* the five matrices' format: FMT_F32, FMT_BF16 or FMT_I8 */
} cd_layer;

typedef struct {
    int32_t d, H, KV, hd, I, n_layers;
    float eps, scale;
    const cd_layer *layers;
    int32_t vocab;    /* rows of the embedding: token ids are checked against it */
    int32_t rope_len; /* rows of the rope tables: rotary positions are checked against it */
} cd_model;

/* Error codes (negative returns), which the Python side turns into EngineError: the C code checks
 * every size, index and id it is handed before it reads or writes with it. */
#define CD_ENOMEM (-1)
#define CD_ESIZE (-2)  /* a row count, a layer range or a dimension out of range */
#define CD_EPOS (-3)   /* a slot at or past the cache's capacity, or a negative one */
#define CD_ETOKEN (-4) /* a token id outside the vocabulary */
#define CD_EROPE (-5)  /* a rotary position outside the rope tables */

int cd_abi(void) { return CD_ABI; }



/* Built with -DCD_PROFILE (never by build.py): cd_layers adds each phase's time, thread 0's CPU time from
 * barrier to barrier (with several threads it includes spinning at the barrier), into cd_prof_s[];
 * cd_profile() hands the array out. A profiling aid only: the default build compiles these to nothing. */
#define PROF_PHASES 8 /* norm+qkv, qk-norm/rope/KV write, attention, merge, o, norm+gate/up+silu, down, other */
#ifdef CD_PROFILE
static double cd_prof_s[PROF_PHASES];
double *cd_profile(void) { return cd_prof_s; }
/* thread 0's CPU time: a loaded machine's descheduled time does not count (one thread: the phase's own cost) */
static double prof_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
#define PROF_START double prof_t_ = prof_now()
#define PROF(i)                                                                                         \
    do {                                                                                                \
        if (tid == 0) {                                                                                 \
            const double now_ = prof_now();                                                             \
            cd_prof_s[i] += now_ - prof_t_;                                                             \
            prof_t_ = now_;                                                                             \
        }                                                                                               \
    } while (0)
/* finer counters (cycles) inside one kernel: PROF_T(i) adds the cycles since the previous mark to cd_prof_t[i] */
static unsigned long long cd_prof_t[8], prof_last_;
unsigned long long *cd_profile_ticks(void) { return cd_prof_t; }
#define PROF_T(i)                                                                                        \
    do {                                                                                                 \
        const unsigned long long now_ = __rdtsc();                                                       \
        if ((i) > 0) cd_prof_t[i] += now_ - prof_last_;                                                  \
        prof_last_ = now_;                                                                               \
    } while (0)
#else
#define PROF_START
#define PROF(i)
#define PROF_T(i)
#endif

/* ------------------------------------------------------------------ small maths */

/* Subnormal floats (softmax weights of far-off keys times values, mostly) take a slow microcode path on
 * x86: flush them to zero in this thread for the call, and give the caller its own mode back after.
 * Every row and every t flush alike, so the row-for-row contract holds. */
static inline unsigned int denormals_off(void) {
    unsigned int csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040); /* FTZ | DAZ */
    return csr;
}

static inline float hsum8(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
    return _mm_cvtss_f32(lo);
}

/* exp on 8 lanes (exp8), and on 16 (exp8x2, AVX-512 builds): range reduction by ln 2 and a degree-5 polynomial
 * (Cephes' constants), relative error ~2e-7; lanes are independent, so a value's result never depends on its
 * neighbours. One body for both widths: the same operations lane for lane, so the same bits. */
#define EXP_LANES(NAME, W)                                                                              \
    static inline __m##W NAME(__m##W x) {                                                               \
        x = _mm##W##_max_ps(_mm##W##_min_ps(x, _mm##W##_set1_ps(88.3762626647949f)), _mm##W##_set1_ps(-87.3365478515625f)); \
        __m##W fx = _mm##W##_fmadd_ps(x, _mm##W##_set1_ps(1.44269504088896341f), _mm##W##_set1_ps(0.5f)); \
        fx = FLOOR_##W(fx);                                                                             \
        x = _mm##W##_fnmadd_ps(fx, _mm##W##_set1_ps(0.693359375f), x);                                  \
        x = _mm##W##_fnmadd_ps(fx, _mm##W##_set1_ps(-2.12194440e-4f), x);                               \
        __m##W z = _mm##W##_mul_ps(x, x);                                                               \
        __m##W y = _mm##W##_set1_ps(1.9875691500e-4f);                                                  \
        y = _mm##W##_fmadd_ps(y, x, _mm##W##_set1_ps(1.3981999507e-3f));                                \
        y = _mm##W##_fmadd_ps(y, x, _mm##W##_set1_ps(8.3334519073e-3f));                                \
        y = _mm##W##_fmadd_ps(y, x, _mm##W##_set1_ps(4.1665795894e-2f));                                \
        y = _mm##W##_fmadd_ps(y, x, _mm##W##_set1_ps(1.6666665459e-1f));                                \
        y = _mm##W##_fmadd_ps(y, x, _mm##W##_set1_ps(5.0000001201e-1f));                                \
        y = _mm##W##_fmadd_ps(y, z, _mm##W##_add_ps(x, _mm##W##_set1_ps(1.0f)));                        \
        __m##W##i n = _mm##W##_slli_epi32(_mm##W##_add_epi32(_mm##W##_cvttps_epi32(fx), _mm##W##_set1_epi32(127)), 23); \
        return _mm##W##_mul_ps(y, _mm##W##_castsi##W##_ps(n));                                         \
    }
#define FLOOR_256(v) _mm256_floor_ps(v)
#define FLOOR_512(v) _mm512_roundscale_ps(v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)
EXP_LANES(exp8, 256)
#if defined(__AVX512F__) && defined(__AVX512DQ__)
EXP_LANES(exp8x2, 512)
#endif

/* y[i] = x[i] / sqrt(mean(x^2) + eps) * w[i] for one row of n */
static void rms_row(const float *x, int n, const float *w, float eps, float *y) {
    /* the sum of squares in 4 x 8 lanes (a one-lane chain of n fmadds was latency-bound: 768 cycles at n = 192),
     * added in a fixed order; every row alike */
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int i = 0;
    for (; i + 32 <= n; i += 32) {
        __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8), v2 = _mm256_loadu_ps(x + i + 16),
               v3 = _mm256_loadu_ps(x + i + 24);
        a0 = _mm256_fmadd_ps(v0, v0, a0);
        a1 = _mm256_fmadd_ps(v1, v1, a1);
        a2 = _mm256_fmadd_ps(v2, v2, a2);
        a3 = _mm256_fmadd_ps(v3, v3, a3);
    }
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        a0 = _mm256_fmadd_ps(v, v, a0);
    }
    float s = hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (; i < n; i++) s = fmaf(x[i], x[i], s);
    const float inv = 1.0f / sqrtf(s / (float)n + eps);
    const __m256 iv = _mm256_set1_ps(inv);
    for (i = 0; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), iv), _mm256_loadu_ps(w + i)));
    for (; i < n; i++) y[i] = (x[i] * inv) * w[i];
}

/* silu(g) * u over n values (n any size: the tail goes through the same 8-lane code) */
static void silu_mul(const float *g, const float *u, int n, float *y) {
    int i = 0;
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; i + 8 <= n; i += 8) {
        __m256 gv = _mm256_loadu_ps(g + i);
        __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
        _mm256_storeu_ps(y + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
    }
    if (i < n) {
        float gt[8] = {0}, ut[8] = {0}, yt[8];
        memcpy(gt, g + i, (size_t)(n - i) * sizeof(float));
        memcpy(ut, u + i, (size_t)(n - i) * sizeof(float));
        silu_mul(gt, ut, 8, yt);
        memcpy(y + i, yt, (size_t)(n - i) * sizeof(float));
    }
}

/* ------------------------------------------------------------------ matrix products
 * Weights are packed at load time into panels of 16 output columns, [ceil(out/16)][in][16] (zero
 * columns pad the last panel), so that every kernel streams its panels front to back.
 * y[r, j] = b[j] + s[j] * sum_k x[r, k] * W[j, k], each (r, j) one fmadd chain in k order: a kernel
 * computes R rows x NP panels at once, sharing each loaded weight vector between its rows, with
 * independent chains to hide the fmadd latency. The AVX2 and the AVX-512 kernels run the very same
 * chain per column (a 16-lane fmadd is two 8-lane ones), so both builds give the same bits.
 *
 * Three panel formats (cd_layer.wfmt):
 *   FMT_F32  16 floats per panel row.
 *   FMT_BF16 16 halves, column c at half 2c for c < 8 and 2(c-8)+1 above, so one 32-byte load widens
 *            to columns 0-7 by a shift and to 8-15 by a mask. Chosen for weights that are bf16 values
 *            (then exactly the model's float32 weights, from half the bytes) or rounded to bf16 on request.
 *   FMT_I8   16 signed bytes per panel row and one float scale per output column (symmetric, per
 *            output channel): the chain sums x * q in k order, then multiplies by the scale once. */

#define PW 16 /* panel width */
#define FMT_F32 0
#define FMT_BF16 1
#define FMT_I8 2
#define FMT_BF16_ROWS 3 /* not panels: a bf16 matrix [out, in] row-major as the model holds it (gemm_rows) */

#if defined(__AVX512F__) && defined(__AVX512DQ__)
#define CD_KERNEL "avx512"
/* one zmm holds a panel row */
#define LOAD_F32(w, k, v) v = _mm512_loadu_ps((const float *)(w) + (size_t)(k) * PW)
#define LOAD_BF16(w, k, v)                                                                              \
    do {                                                                                                \
        __m256i raw_ = _mm256_loadu_si256((const __m256i *)((const uint16_t *)(w) + (size_t)(k) * PW)); \
        __m256 lo_ = _mm256_castsi256_ps(_mm256_slli_epi32(raw_, 16));                                  \
        __m256 hi_ = _mm256_castsi256_ps(_mm256_and_si256(raw_, _mm256_set1_epi32((int)0xFFFF0000u)));  \
        v = _mm512_insertf32x8(_mm512_castps256_ps512(lo_), hi_, 1);                                    \
    } while (0)
#define LOAD_I8(w, k, v) \
    v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)(w) + (size_t)(k) * PW))))

/* columns j..j+15 of one output row (fewer at the end of the matrix): the scale is one rounded
 * multiply, the bias one rounded add, the same in every lane and in the tail */
static inline void store16(__m512 a, const float *sc, const float *b, float *yrow, int j, int out) {
    if (sc) a = _mm512_mul_ps(a, _mm512_loadu_ps(sc + j)); /* scales are padded to whole panels */
    if (j + PW <= out) {
        if (b) a = _mm512_add_ps(a, _mm512_loadu_ps(b + j));
        _mm512_storeu_ps(yrow + j, a);
        return;
    }
    float tmp[PW];
    _mm512_storeu_ps(tmp, a);
    for (int c = 0; c < PW && j + c < out; c++) yrow[j + c] = b ? tmp[c] + b[j + c] : tmp[c];
}

#define MK(NAME, ELT, LOAD, R, NP)                                                                      \
    static inline void NAME##_##R##_##NP(const float *x, int in, const void *Wp, int p0, const float *sc, \
                                         const float *b, float *y, int ldy, int out) {                  \
        __m512 acc[R][NP];                                                                              \
        const size_t ps = (size_t)in * PW;                                                              \
        const ELT *pan[NP];                                                                             \
        _Pragma("GCC unroll 8") for (int n = 0; n < NP; n++) pan[n] = (const ELT *)Wp + (size_t)(p0 + n) * ps; \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                             \
            _Pragma("GCC unroll 8") for (int n = 0; n < NP; n++) acc[r][n] = _mm512_setzero_ps();       \
        for (int k = 0; k < in; k++) {                                                                  \
            __m512 w[NP];                                                                               \
            PF_PANELS(R, NP, pan, (size_t)k * PW);                                                      \
            _Pragma("GCC unroll 8") for (int n = 0; n < NP; n++) LOAD(pan[n], k, w[n]);                 \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                       \
                __m512 xv = _mm512_set1_ps(x[(size_t)r * in + k]);                                      \
                _Pragma("GCC unroll 8") for (int n = 0; n < NP; n++) acc[r][n] = _mm512_fmadd_ps(xv, w[n], acc[r][n]); \
            }                                                                                           \
        }                                                                                               \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                             \
            _Pragma("GCC unroll 8") for (int n = 0; n < NP; n++)                                        \
                store16(acc[r][n], sc, b, y + (size_t)r * ldy, (p0 + n) * PW, out);                     \
    }

/* bf16 panels in k-pairs for AVX-512: lane c of one 64-byte load holds column c at k (low half) and at
 * k + 1 (high half), so one shift and one mask widen two panel rows (the 16-column layout takes a
 * shift, a mask and an insert for one). Each column's chain is the same fmadd sequence in k order. */
#define BF16_PAIRS 1
#define MKP(NAME, ELT, LOAD, R, NP)                                                                     \
    static inline void NAME##_##R##_##NP(const float *x, int in, const void *Wp, int p0, const float *sc, \
                                         const float *b, float *y, int ldy, int out) {                  \
        __m512 acc[R][NP];                                                                              \
        const size_t ps = (size_t)((in + 1) / 2) * 2 * PW; /* halves per panel */                       \
        const uint16_t *pan[NP];                                                                        \
        const __m512i himask = _mm512_set1_epi32((int)0xFFFF0000u);                                    \
        _Pragma("GCC unroll 8") for (int n = 0; n < NP; n++) pan[n] = (const uint16_t *)Wp + (size_t)(p0 + n) * ps; \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                             \
            _Pragma("GCC unroll 8") for (int n = 0; n < NP; n++) acc[r][n] = _mm512_setzero_ps();       \
        int k = 0;                                                                                      \
        for (; k + 1 < in; k += 2) {                                                                    \
            __m512 w0[NP], w1[NP];                                                                      \
            _Pragma("GCC unroll 8") for (int n = 0; n < NP; n++) {                                      \
                if (R > 1) /* compile-time; see PF_AHEAD */                                             \
                    _mm_prefetch((const char *)(pan[n] + (size_t)k * PW) + PF_AHEAD, _MM_HINT_T0);      \
                __m512i raw_ = _mm512_loadu_si512((const void *)(pan[n] + (size_t)k * PW));             \
                w0[n] = _mm512_castsi512_ps(_mm512_slli_epi32(raw_, 16));                               \
                w1[n] = _mm512_castsi512_ps(_mm512_and_si512(raw_, himask));                            \
            }                                                                                           \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                       \
                __m512 xv = _mm512_set1_ps(x[(size_t)r * in + k]);                                      \
                _Pragma("GCC unroll 8") for (int n = 0; n < NP; n++) acc[r][n] = _mm512_fmadd_ps(xv, w0[n], acc[r][n]); \
            }                                                                                           \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                       \
                __m512 xv = _mm512_set1_ps(x[(size_t)r * in + k + 1]);                                  \
                _Pragma("GCC unroll 8") for (int n = 0; n < NP; n++) acc[r][n] = _mm512_fmadd_ps(xv, w1[n], acc[r][n]); \
            }                                                                                           \
        }                                                                                               \
        if (k < in) { /* an odd last k: its pair's high halves are zero padding */                      \
            __m512 w0[NP];                                                                              \
            _Pragma("GCC unroll 8") for (int n = 0; n < NP; n++)                                        \
                w0[n] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512((const void *)(pan[n] + (size_t)k * PW)), 16)); \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                       \
                __m512 xv = _mm512_set1_ps(x[(size_t)r * in + k]);                                      \
                _Pragma("GCC unroll 8") for (int n = 0; n < NP; n++) acc[r][n] = _mm512_fmadd_ps(xv, w0[n], acc[r][n]); \
            }                                                                                           \
        }                                                                                               \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                             \
            _Pragma("GCC unroll 8") for (int n = 0; n < NP; n++)                                        \
                store16(acc[r][n], sc, b, y + (size_t)r * ldy, (p0 + n) * PW, out);                     \
    }

/* 32 vector registers: up to 8 rows x 2 panels (16 accumulators, 2 or 4 weights, a broadcast) */
#define KERNELS_WITH(MKX, NAME, ELT, LOAD)                                                              \
    MKX(NAME, ELT, LOAD, 1, 4) MKX(NAME, ELT, LOAD, 1, 2) MKX(NAME, ELT, LOAD, 1, 1)                    \
    MKX(NAME, ELT, LOAD, 2, 2) MKX(NAME, ELT, LOAD, 2, 1) MKX(NAME, ELT, LOAD, 3, 2) MKX(NAME, ELT, LOAD, 3, 1) \
    MKX(NAME, ELT, LOAD, 4, 2) MKX(NAME, ELT, LOAD, 4, 1) MKX(NAME, ELT, LOAD, 5, 2) MKX(NAME, ELT, LOAD, 5, 1) \
    MKX(NAME, ELT, LOAD, 6, 2) MKX(NAME, ELT, LOAD, 6, 1) MKX(NAME, ELT, LOAD, 7, 2) MKX(NAME, ELT, LOAD, 7, 1) \
    MKX(NAME, ELT, LOAD, 8, 2) MKX(NAME, ELT, LOAD, 8, 1)
#define KERNELS(NAME, ELT, LOAD) KERNELS_WITH(MK, NAME, ELT, LOAD)
#define KERNELS_BF16(NAME, ELT, LOAD) KERNELS_WITH(MKP, NAME, ELT, LOAD)
#define BLOCK 8 /* rows per full block */
#define ROWS_REST(NAME)                                                                                  \
    switch (t - r) {                                                                                     \
    case 7: ROWS(NAME, 7, 2); break;                                                                     \
    case 6: ROWS(NAME, 6, 2); break;                                                                     \
    case 5: ROWS(NAME, 5, 2); break;                                                                     \
    case 4: ROWS(NAME, 4, 2); break;                                                                     \
    case 3: ROWS(NAME, 3, 2); break;                                                                     \
    case 2: ROWS(NAME, 2, 2); break;                                                                     \
    default: break;                                                                                      \
    }
#define ROWS_FULL(NAME) ROWS(NAME, 8, 2)

#else /* AVX2 and FMA */
#define CD_KERNEL "avx2"
#define LOAD_F32(w, k, lo, hi)                                                                          \
    do {                                                                                                \
        const float *wk_ = (const float *)(w) + (size_t)(k) * PW;                                       \
        lo = _mm256_loadu_ps(wk_);                                                                      \
        hi = _mm256_loadu_ps(wk_ + 8);                                                                  \
    } while (0)
#define LOAD_BF16(w, k, lo, hi)                                                                         \
    do {                                                                                                \
        __m256i raw_ = _mm256_loadu_si256((const __m256i *)((const uint16_t *)(w) + (size_t)(k) * PW)); \
        lo = _mm256_castsi256_ps(_mm256_slli_epi32(raw_, 16));                                          \
        hi = _mm256_castsi256_ps(_mm256_and_si256(raw_, _mm256_set1_epi32((int)0xFFFF0000u)));          \
    } while (0)
/* int8 panels: w8a8 in k-quads (gemm_vnni below), never widened to float32 */

static inline void store16(__m256 a0, __m256 a1, const float *sc, const float *b, float *yrow, int j, int out) {
    if (sc) {
        a0 = _mm256_mul_ps(a0, _mm256_loadu_ps(sc + j));
        a1 = _mm256_mul_ps(a1, _mm256_loadu_ps(sc + j + 8));
    }
    if (j + PW <= out) {
        if (b) {
            a0 = _mm256_add_ps(a0, _mm256_loadu_ps(b + j));
            a1 = _mm256_add_ps(a1, _mm256_loadu_ps(b + j + 8));
        }
        _mm256_storeu_ps(yrow + j, a0);
        _mm256_storeu_ps(yrow + j + 8, a1);
        return;
    }
    float tmp[PW];
    _mm256_storeu_ps(tmp, a0);
    _mm256_storeu_ps(tmp + 8, a1);
    for (int c = 0; c < PW && j + c < out; c++) yrow[j + c] = b ? tmp[c] + b[j + c] : tmp[c];
}

#define MK(NAME, ELT, LOAD, R, NP)                                                                      \
    static inline void NAME##_##R##_##NP(const float *x, int in, const void *Wp, int p0, const float *sc, \
                                         const float *b, float *y, int ldy, int out) {                  \
        __m256 acc[R][NP][2];                                                                           \
        const size_t ps = (size_t)in * PW;                                                              \
        const ELT *pan[NP];                                                                             \
        _Pragma("GCC unroll 8") for (int n = 0; n < NP; n++) pan[n] = (const ELT *)Wp + (size_t)(p0 + n) * ps; \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                             \
            _Pragma("GCC unroll 8") for (int n = 0; n < NP; n++)                                        \
                acc[r][n][0] = acc[r][n][1] = _mm256_setzero_ps();                                      \
        for (int k = 0; k < in; k++) {                                                                  \
            __m256 w0[NP], w1[NP];                                                                      \
            PF_PANELS(R, NP, pan, (size_t)k * PW);                                                      \
            _Pragma("GCC unroll 8") for (int n = 0; n < NP; n++) LOAD(pan[n], k, w0[n], w1[n]);         \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                       \
                __m256 xv = _mm256_broadcast_ss(x + (size_t)r * in + k);                                \
                _Pragma("GCC unroll 8") for (int n = 0; n < NP; n++) {                                  \
                    acc[r][n][0] = _mm256_fmadd_ps(xv, w0[n], acc[r][n][0]);                            \
                    acc[r][n][1] = _mm256_fmadd_ps(xv, w1[n], acc[r][n][1]);                            \
                }                                                                                       \
            }                                                                                           \
        }                                                                                               \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                             \
            _Pragma("GCC unroll 8") for (int n = 0; n < NP; n++)                                        \
                store16(acc[r][n][0], acc[r][n][1], sc, b, y + (size_t)r * ldy, (p0 + n) * PW, out);    \
    }

/* Kernels R rows x NP panels. AVX2 has 16 vector registers: R * NP * 2 accumulators, NP * 2 widened
 * weights, a broadcast and the bf16 mask must fit, or accumulators spill and every k goes through a
 * store-to-load round trip (4x2 did). Measured here in whole verify passes of the bundled model (bf16
 * panels, medians in one run, pass time over a one-row step): 4x2 spilled and cost 1.08 at t = 4, 1.35 at
 * t = 6, 1.75 at t = 8; 4x1, 6x1 and 6x1 + 2x2 cost 1.03, 1.13 and 1.53; 3x1 (six chains) beats 3x2
 * (spilling) at t = 3, 0.87 against 0.97 of a one-row step's time. */
#define KERNELS(NAME, ELT, LOAD)                                                                        \
    MK(NAME, ELT, LOAD, 1, 4) MK(NAME, ELT, LOAD, 1, 2) MK(NAME, ELT, LOAD, 1, 1)                       \
    MK(NAME, ELT, LOAD, 2, 2) MK(NAME, ELT, LOAD, 2, 1) MK(NAME, ELT, LOAD, 3, 1) MK(NAME, ELT, LOAD, 4, 1) \
    MK(NAME, ELT, LOAD, 5, 1) MK(NAME, ELT, LOAD, 6, 1)
#define KERNELS_BF16(NAME, ELT, LOAD) KERNELS(NAME, ELT, LOAD)
#define BF16_PAIRS 0
#define BLOCK 6
/* t > BLOCK: full blocks, then the rest. Blocks as even as they come (t = 8: 4 + 4) measured slower than
 * 6 + 2 here (0.5B shape, bf16, K = 7: 2.13-2.34 against 1.89-2.07 of a step, interleaved runs): the 6-row
 * block's twelve chains outweigh a second pass of a 2-row block over weights still in cache. */
#define ROWS_REST(NAME)                                                                                  \
    switch (t - r) {                                                                                     \
    case 5: ROWS(NAME, 5, 1); break;                                                                     \
    case 4: ROWS(NAME, 4, 1); break;                                                                     \
    case 3: ROWS(NAME, 3, 1); break;                                                                     \
    case 2: ROWS(NAME, 2, 2); break;                                                                     \
    default: break;                                                                                      \
    }
#define ROWS_FULL(NAME) ROWS(NAME, 6, 1)
#endif

KERNELS(mkf, float, LOAD_F32)
KERNELS_BF16(mkb, uint16_t, LOAD_BF16)
#ifdef LOAD_I8 /* weight-only int8 (the avx512 build) */
KERNELS(mki, int8_t, LOAD_I8)
#endif

#define ROWS(NAME, R, NP_WIDE)                                                                           \
    do {                                                                                                 \
        int p = qa;                                                                                      \
        for (; p + NP_WIDE <= qb; p += NP_WIDE)                                                          \
            NAME##_##R##_##NP_WIDE(x + (size_t)r * in, in, Wp, p, sc, b, y + (size_t)r * ldy, ldy, out); \
        for (; p < qb; p++) NAME##_##R##_1(x + (size_t)r * in, in, Wp, p, sc, b, y + (size_t)r * ldy, ldy, out); \
    } while (0)

/* Panels per group: a group's weights are read from memory once and stay in L1/L2 while every block
 * of rows goes over them (before, each block of 4 rows streamed the whole matrix again, so 5 rows cost
 * two weight reads). */
#define PANEL_GROUP 4

#define GEMM(NAME)                                                                                       \
    for (int qa = pa; qa < pb; qa += PANEL_GROUP) {                                                      \
        const int qb = qa + PANEL_GROUP < pb ? qa + PANEL_GROUP : pb;                                    \
        int r = 0;                                                                                       \
        for (; r + BLOCK <= t; r += BLOCK) ROWS_FULL(NAME);                                              \
        if (t - r == 1) {                                                                                \
            int p = qa;                                                                                  \
            for (; p + 4 <= qb; p += 4) NAME##_1_4(x + (size_t)r * in, in, Wp, p, sc, b, y + (size_t)r * ldy, ldy, out); \
            for (; p + 2 <= qb; p += 2) NAME##_1_2(x + (size_t)r * in, in, Wp, p, sc, b, y + (size_t)r * ldy, ldy, out); \
            for (; p < qb; p++) NAME##_1_1(x + (size_t)r * in, in, Wp, p, sc, b, y + (size_t)r * ldy, ldy, out); \
        } else {                                                                                         \
            ROWS_REST(NAME)                                                                              \
        }                                                                                                \
    }

/* ------------------------------------------------------------------ int8 x int8 (AVX512_VNNI build)
 * The "avx512-vnni" build computes FMT_I8 matrices as w8a8: each activation row is quantised to int8
 * (symmetric, one scale per row: amax / 127, values rounded to nearest even), stored + 128 as u8 for
 * vpdpbusd, which sums 4 u8 x s8 products per int32 lane. The weights are packed in k-quads,
 * [panel][ceil(in/4)][16 columns][4 k] (pack_as's quads layout, zero-padded in k), and the scale tensor
 * carries, after the padded column scales, 128 * sum_k q[j, k] per column (int32 bits), which undoes the
 * offset. Integer sums are exact, so the order of the adds cannot matter; the float tail is the same
 * three rounded ops for every row: ((float)(acc - corr) * wscale[j]) * xscale[r], then + bias. A row's
 * result depends only on its own activations and the weights, whatever t, the blocking or the threads. */
/* the k-quads layout's offset corrections (128 sum_k q[j, k], int32), after the out columns' padded scales */
static inline const int32_t *i8_corrections(const float *sc, int out) {
    return (const int32_t *)(sc + (size_t)(out + PW - 1) / PW * PW);
}

#if defined(__AVX512VNNI__)
#undef CD_KERNEL
#define CD_KERNEL "avx512-vnni"
#define I8_QUADS 1
#define ACT_LEVELS 127

/* row x [in] -> xq [in4] (u8 = q + 128, padding 128), its scale *xs */
static void quantize_row(const float *x, int in, int in4, uint8_t *xq, float *xs) {
    __m512 mx = _mm512_setzero_ps();
    int i = 0;
    for (; i + 16 <= in; i += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
    float amax = _mm512_reduce_max_ps(mx);
    for (; i < in; i++) amax = fmaxf(amax, fabsf(x[i]));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    *xs = amax / 127.0f;
    const __m512 iv = _mm512_set1_ps(inv), lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
    const __m512i off = _mm512_set1_epi32(128);
    for (i = 0; i + 16 <= in; i += 16) {
        __m512 v = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(_mm512_loadu_ps(x + i), iv), lo), hi);
        __m512i q = _mm512_add_epi32(_mm512_cvtps_epi32(v), off); /* nearest even (MXCSR's default) */
        _mm_storeu_si128((__m128i *)(xq + i), _mm512_cvtepi32_epi8(q));
    }
    for (; i < in; i++) {
        float v = fminf(fmaxf(x[i] * inv, -127.0f), 127.0f);
        xq[i] = (uint8_t)((int)nearbyintf(v) + 128);
    }
    for (; i < in4; i++) xq[i] = 128;
}

#define RNE (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#ifndef CD_EMULATED
/* vpdpbusd with its accumulator in place: GCC 12 moves the accumulator into a copy and back around each
 * _mm512_dpbusd_epi32 (two moves per product), which left these kernels bound by instruction issue. The same
 * instruction, so the same bits. (The tests' emulated builds keep the intrinsic, which SIMDe provides.) */
static inline __m512i dpbusd512(__m512i acc, __m512i x, __m512i w) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(x), "v"(w));
    return acc;
}
#else
#define dpbusd512 _mm512_dpbusd_epi32
#endif
#define MKV(R, NP)                                                                                      \
    static inline void mkv_##R##_##NP(const uint8_t *xq, int in4, const float *xs, const void *Wp, int p0, \
                                      const float *sc, const int32_t *corr, const float *b, float *y, int ldy, \
                                      int out) {                                                        \
        __m512i acc[R][NP];                                                                             \
        const size_t ps = (size_t)in4 * PW;                                                             \
        const int8_t *pan[NP];                                                                          \
        _Pragma("GCC unroll 8") for (int n = 0; n < NP; n++) pan[n] = (const int8_t *)Wp + (size_t)(p0 + n) * ps; \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                             \
            _Pragma("GCC unroll 8") for (int n = 0; n < NP; n++) acc[r][n] = _mm512_setzero_si512();    \
        for (int k = 0; k < in4; k += 4) {                                                              \
            __m512i w[NP];                                                                              \
            PF_PANELS(R, NP, pan, (size_t)k * PW);                                                      \
            _Pragma("GCC unroll 8") for (int n = 0; n < NP; n++) w[n] = _mm512_loadu_si512((const void *)(pan[n] + (size_t)k * PW)); \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                       \
                int32_t quad;                                                                           \
                memcpy(&quad, xq + (size_t)r * in4 + k, 4);                                             \
                __m512i xv = _mm512_set1_epi32(quad);                                                   \
                _Pragma("GCC unroll 8") for (int n = 0; n < NP; n++) acc[r][n] = dpbusd512(acc[r][n], xv, w[n]); \
            }                                                                                           \
        }                                                                                               \
        _Pragma("GCC unroll 8") for (int n = 0; n < NP; n++) {                                          \
            const int j = (p0 + n) * PW;                                                                \
            const __m512i cv = _mm512_loadu_si512((const void *)(corr + j));                            \
            const __m512 wv = _mm512_loadu_ps(sc + j);                                                  \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                       \
                /* explicit-rounding multiplies: the compiler cannot contract them with the bias add */ \
                __m512 f = _mm512_mul_round_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][n], cv)), wv, RNE); \
                f = _mm512_mul_round_ps(f, _mm512_set1_ps(xs[r]), RNE);                                 \
                store16(f, NULL, b, y + (size_t)r * ldy, j, out);                                       \
            }                                                                                           \
        }                                                                                               \
    }
MKV(1, 4) MKV(1, 2) MKV(1, 1) MKV(2, 2) MKV(2, 1) MKV(3, 2) MKV(3, 1) MKV(4, 2) MKV(4, 1)
MKV(5, 2) MKV(5, 1) MKV(6, 2) MKV(6, 1) MKV(7, 2) MKV(7, 1) MKV(8, 2) MKV(8, 1)

#define VROWS(R, NP_WIDE)                                                                                \
    do {                                                                                                 \
        int p = qa;                                                                                      \
        for (; p + NP_WIDE <= qb; p += NP_WIDE)                                                          \
            mkv_##R##_##NP_WIDE(xq + (size_t)r * in4, in4, xs + r, Wp, p, sc, corr, b, y + (size_t)r * ldy, ldy, out); \
        for (; p < qb; p++) mkv_##R##_1(xq + (size_t)r * in4, in4, xs + r, Wp, p, sc, corr, b, y + (size_t)r * ldy, ldy, out); \
    } while (0)

/* gemm_panels for FMT_I8 in this build: the thread quantises all t rows into its scratch (a few KB per
 * row, against the panels it then streams), then goes over its panels like GEMM */
static void gemm_vnni(const float *x, int t, int in, const void *Wp, const float *sc, int out, const float *b,
                      float *y, int ldy, int pa, int pb, void *scratch) {
    const int in4 = (in + 3) / 4 * 4;
    const int32_t *corr = i8_corrections(sc, out);
    uint8_t *xq = (uint8_t *)scratch;
    float *xs = (float *)((char *)scratch + (((size_t)t * in4 + 63) & ~(size_t)63));
    for (int r = 0; r < t; r++) quantize_row(x + (size_t)r * in, in, in4, xq + (size_t)r * in4, xs + r);
    for (int qa = pa; qa < pb; qa += PANEL_GROUP) {
        const int qb = qa + PANEL_GROUP < pb ? qa + PANEL_GROUP : pb;
        int r = 0;
        for (; r + 8 <= t; r += 8) VROWS(8, 2);
        switch (t - r) {
        case 7: VROWS(7, 2); break;
        case 6: VROWS(6, 2); break;
        case 5: VROWS(5, 2); break;
        case 4: VROWS(4, 2); break;
        case 3: VROWS(3, 2); break;
        case 2: VROWS(2, 2); break;
        case 1: {
            int p = qa;
            for (; p + 4 <= qb; p += 4) mkv_1_4(xq + (size_t)r * in4, in4, xs + r, Wp, p, sc, corr, b, y + (size_t)r * ldy, ldy, out);
            for (; p + 2 <= qb; p += 2) mkv_1_2(xq + (size_t)r * in4, in4, xs + r, Wp, p, sc, corr, b, y + (size_t)r * ldy, ldy, out);
            for (; p < qb; p++) mkv_1_1(xq + (size_t)r * in4, in4, xs + r, Wp, p, sc, corr, b, y + (size_t)r * ldy, ldy, out);
            break;
        }
        default: break;
        }
    }
}
#elif !defined(__AVX512F__)
/* ------------------------------------------------------------------ int8 x int8 (AVX2 build)
 * Without VNNI, widening every int8 weight to float32 (two instructions per 8 weights) cost more than the
 * bytes int8 saves: the bundled model ran slower in int8 than in bf16, and the larger shapes 1.16-1.28x
 * their bandwidth bound. So the AVX2 build computes FMT_I8 as w8a8 too, in the VNNI build's layout (k-quads,
 * the same scale tensor and offset corrections), with vpmaddubsw (u8 x s8, adjacent pairs summed to int16)
 * and vpmaddwd against ones (the pairs of pairs to int32).
 *
 * Its activations have 7 bits (within +-63, ACT_LEVELS), not the VNNI build's 8: stored as u8 q + 64, they
 * go straight into vpmaddubsw's unsigned operand, and no pair sum can saturate (2 * 127 * 127 < 32768).
 * Eight bits needed |x| and x's sign moved onto the weights (vpabsb, vpsignb) for every row and weight
 * vector: 10 instructions per row per 64 weights, against 6 now. On a 2-core Zen 3 (AVX2 only) a 5-row
 * pass of the 0.5B shape's layers went from 19.5 to 16.0 ms and a one-row step from 12.9 to 11.7 ms
 * (old and new library in one process, interleaved); the loss cost is in docs/PERFORMANCE.md. The sums
 * are exact integers: sum_k (q_x + 64) q_w, less 64 sum_k q_w (half the VNNI build's 128 sum_k q_w), so
 * the order of the adds cannot matter and the float tail is the VNNI build's three rounded ops. */
#define I8_QUADS 1
#if defined(__AVXVNNI__)
/* AVX-VNNI (Intel since Alder Lake, whose cores have no AVX-512: vpdpbusd on ymm): the 8-bit activations
 * and the one instruction per row and 32 products of the AVX-512 VNNI build, in this build's registers and
 * layout. Not measured on such a CPU yet (none has been at hand); tested emulated (tests/emulated_kernels.py). */
#undef CD_KERNEL
#define CD_KERNEL "avx2-vnni"
#define ACT_LEVELS 127
#define OFFSET_SHIFT 0 /* the offset is 128: the stored corrections as they are */
#define DOT4(acc, xv, w) _mm256_dpbusd_avx_epi32(acc, xv, w)
#else
#define ACT_LEVELS 63
#define OFFSET_SHIFT 1 /* the offset is 64: half the stored corrections */
#define DOT4(acc, xv, w) _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(xv, w), _mm256_set1_epi16(1)))
#endif
_Static_assert((ACT_LEVELS + 1) << OFFSET_SHIFT == 128, "store_w8a8 scales the stored corrections to the offset");

/* row x [in] -> xq [in4] (u8 = q + ACT_LEVELS + 1 with |q| <= ACT_LEVELS, padding ACT_LEVELS + 1), its
 * scale *xs */
static void quantize_row(const float *x, int in, int in4, uint8_t *xq, float *xs) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 mx = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= in; i += 8) mx = _mm256_max_ps(mx, _mm256_and_ps(_mm256_loadu_ps(x + i), absmask));
    float lanes[8];
    _mm256_storeu_ps(lanes, mx);
    float amax = 0.0f;
    for (int l = 0; l < 8; l++) amax = fmaxf(amax, lanes[l]);
    for (; i < in; i++) amax = fmaxf(amax, fabsf(x[i]));
    const float inv = amax > 0.0f ? (float)ACT_LEVELS / amax : 0.0f;
    *xs = amax / (float)ACT_LEVELS;
    const __m256 iv = _mm256_set1_ps(inv), lo = _mm256_set1_ps(-(float)ACT_LEVELS);
    const __m256 hi = _mm256_set1_ps((float)ACT_LEVELS);
    const __m256i off8 = _mm256_set1_epi8((char)(uint8_t)(ACT_LEVELS + 1)); /* added mod 256 */
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7); /* undoes the packs' lane interleave */
#define Q8(o) _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i + (o)), iv), lo), hi))
    for (i = 0; i + 32 <= in; i += 32) { /* nearest even (MXCSR's default), as the VNNI build rounds */
        __m256i a = _mm256_packs_epi32(Q8(0), Q8(8)), b = _mm256_packs_epi32(Q8(16), Q8(24));
        const __m256i q = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(a, b), order);
        _mm256_storeu_si256((__m256i *)(xq + i), _mm256_add_epi8(q, off8));
    }
#undef Q8
    for (; i < in; i++) {
        const float v = fminf(fmaxf(x[i] * inv, -(float)ACT_LEVELS), (float)ACT_LEVELS);
        xq[i] = (uint8_t)((int)nearbyintf(v) + ACT_LEVELS + 1);
    }
    for (; i < in4; i++) xq[i] = ACT_LEVELS + 1;
}

/* columns j..j+15 of one row from their int32 sums less the offset's (corr: 128 sum_k q_w, so half of it
 * for an offset of 64):
 * ((float)acc * wscale) * xscale, then + bias (store16), each rounded on its own (no contraction into an
 * fma: the VNNI build's explicit-rounding multiplies) */
__attribute__((optimize("fp-contract=off"))) static void store_w8a8(__m256i a0, __m256i a1, const float *sc,
                                                                   const int32_t *corr, float xs, const float *b,
                                                                   float *yrow, int j, int out) {
    const __m256 xv = _mm256_set1_ps(xs);
    a0 = _mm256_sub_epi32(a0, _mm256_srai_epi32(_mm256_loadu_si256((const __m256i *)(corr + j)), OFFSET_SHIFT));
    a1 = _mm256_sub_epi32(a1, _mm256_srai_epi32(_mm256_loadu_si256((const __m256i *)(corr + j + 8)), OFFSET_SHIFT));
    __m256 f0 = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(a0), _mm256_loadu_ps(sc + j)), xv);
    __m256 f1 = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(a1), _mm256_loadu_ps(sc + j + 8)), xv);
    store16(f0, f1, NULL, b, yrow, j, out);
}

/* R rows x NP panels: R * NP * 2 int32 accumulators, NP * 2 weight registers, the ones (vpmaddwd's) and a
 * broadcast fit AVX2's 16 registers for (1, 2) and (1..5, 1) */
#define MKV(R, NP)                                                                                      \
    static inline void mkv_##R##_##NP(const uint8_t *xq, int in4, const float *xs, const void *Wp, int p0, \
                                      const float *sc, const int32_t *corr, const float *b, float *y, int ldy, \
                                      int out) {                                                        \
        __m256i acc[R][NP][2];                                                                          \
        const size_t ps = (size_t)in4 * PW;                                                             \
        const int8_t *pan[NP];                                                                          \
        _Pragma("GCC unroll 8") for (int n = 0; n < NP; n++) pan[n] = (const int8_t *)Wp + (size_t)(p0 + n) * ps; \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                             \
            _Pragma("GCC unroll 8") for (int n = 0; n < NP; n++) acc[r][n][0] = acc[r][n][1] = _mm256_setzero_si256(); \
        for (int k = 0; k < in4; k += 4) {                                                              \
            __m256i w0[NP], w1[NP];                                                                     \
            PF_PANELS(R, NP, pan, (size_t)k * PW);                                                      \
            _Pragma("GCC unroll 8") for (int n = 0; n < NP; n++) {                                      \
                w0[n] = _mm256_loadu_si256((const __m256i *)(pan[n] + (size_t)k * PW));                 \
                w1[n] = _mm256_loadu_si256((const __m256i *)(pan[n] + (size_t)k * PW + 32));            \
            }                                                                                           \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                       \
                int32_t quad;                                                                           \
                memcpy(&quad, xq + (size_t)r * in4 + k, 4);                                             \
                const __m256i xv = _mm256_set1_epi32(quad);                                             \
                _Pragma("GCC unroll 8") for (int n = 0; n < NP; n++) {                                  \
                    acc[r][n][0] = DOT4(acc[r][n][0], xv, w0[n]);                                       \
                    acc[r][n][1] = DOT4(acc[r][n][1], xv, w1[n]);                                       \
                }                                                                                       \
            }                                                                                           \
        }                                                                                               \
        _Pragma("GCC unroll 8") for (int n = 0; n < NP; n++)                                            \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                         \
                store_w8a8(acc[r][n][0], acc[r][n][1], sc, corr, xs[r], b, y + (size_t)r * ldy, (p0 + n) * PW, out); \
    }
MKV(1, 2) MKV(1, 1) MKV(2, 1) MKV(3, 1) MKV(4, 1) MKV(5, 1)

#define VROWS1(R)                                                                                       \
    for (int p = qa; p < qb; p++) mkv_##R##_1(xq + (size_t)r * in4, in4, xs + r, Wp, p, sc, corr, b, y + (size_t)r * ldy, ldy, out)

/* gemm_panels for FMT_I8 in this build: as the VNNI build's, rows in blocks of 4 over each panel group */
static void gemm_vnni(const float *x, int t, int in, const void *Wp, const float *sc, int out, const float *b,
                      float *y, int ldy, int pa, int pb, void *scratch) {
    const int in4 = (in + 3) / 4 * 4;
    const int32_t *corr = i8_corrections(sc, out);
    uint8_t *xq = (uint8_t *)scratch;
    float *xs = (float *)((char *)scratch + (((size_t)t * in4 + 63) & ~(size_t)63));
    for (int r = 0; r < t; r++) quantize_row(x + (size_t)r * in, in, in4, xq + (size_t)r * in4, xs + r);
    for (int qa = pa; qa < pb; qa += PANEL_GROUP) {
        const int qb = qa + PANEL_GROUP < pb ? qa + PANEL_GROUP : pb;
        int r = 0;
        /* blocks of up to 5 rows, as even as they come: K = 4's pass is one block, t = 6 is 3 + 3 (4 + 2
         * measured 1.85-2.10 of a step at K = 5 on the 0.5B shape, 3 + 3 1.79-1.96, interleaved runs) */
        while (t - r >= 2) {
            const int nr = even_block(t - r, 5);
            switch (nr) {
            case 5: VROWS1(5); break;
            case 4: VROWS1(4); break;
            case 3: VROWS1(3); break;
            default: VROWS1(2); break;
            }
            r += nr;
        }
        if (t - r == 1) {
            int p = qa;
            for (; p + 2 <= qb; p += 2) mkv_1_2(xq + (size_t)r * in4, in4, xs + r, Wp, p, sc, corr, b, y + (size_t)r * ldy, ldy, out);
            for (; p < qb; p++) mkv_1_1(xq + (size_t)r * in4, in4, xs + r, Wp, p, sc, corr, b, y + (size_t)r * ldy, ldy, out);
        }
    }
}
#else
#define I8_QUADS 0
#define ACT_LEVELS 0
#endif

#if I8_QUADS
/* bytes of scratch one thread needs to quantise t rows of up to in values (both w8a8 builds) */
static size_t vnni_scratch(int t, int in) {
    return (size_t)SCRATCH_ROWS(t) * (((size_t)in + 3) / 4 * 4 + sizeof(float)) + 128;
}
#else
static size_t vnni_scratch(int t, int in) { (void)t; (void)in; return 0; }
#endif

/* ------------------------------------------------------------------ bf16 x bf16 (AVX512_BF16 build)
 * The "avx512-bf16" build (avx512-vnni plus AVX512_BF16) computes FMT_BF16 matrices with vdpbf16ps: each
 * activation row is rounded to bf16 once per product (nearest even, as vcvtne2ps2bf16 does), and one
 * instruction adds the products of 16 columns x 2 k to 16 float32 sums, where the float32 kernels spend two
 * widenings and two fmadds. The panels keep the AVX-512 k-pairs layout (lane c: column c at k, k + 1), which
 * is the pair layout vdpbf16ps reads. The rounding of activations to bf16 costs a little accuracy (the
 * engine reports it: bench --quality); the contract is unchanged: a column's sum is one vdpbf16ps chain over
 * the k-pairs in order, the same for every row whatever t, the blocking or the threads. */
#if defined(__AVX512BF16__)
#undef CD_KERNEL
#define CD_KERNEL "avx512-bf16"
#define BF16_DOT 1

/* halves a bf16 activation row takes in scratch: whole 32-half blocks, the padding zero */
static inline size_t bf16_row_halves(int in) { return ((size_t)in + 31) / 32 * 32; }

/* row x [in] -> xb: bf16(x[k]) at half k, zeros up to bf16_row_halves(in) */
static void bf16_row(const float *x, int in, uint16_t *xb) {
    for (int i = 0; i < in; i += 32) {
        const int n = in - i;
        const __mmask16 m0 = n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1);
        const __mmask16 m1 = n >= 32 ? (__mmask16)0xFFFF : n > 16 ? (__mmask16)((1u << (n - 16)) - 1) : 0;
        const __m512 lo = _mm512_maskz_loadu_ps(m0, x + i), hi = _mm512_maskz_loadu_ps(m1, x + i + 16);
        _mm512_storeu_si512((void *)(xb + i), (__m512i)_mm512_cvtne2ps_pbh(hi, lo)); /* lo -> halves 0..15 */
    }
}

static size_t dot_scratch(int t, int in) { return (size_t)SCRATCH_ROWS(t) * bf16_row_halves(in) * sizeof(uint16_t) + 64; }

#define MKD(R, NP)                                                                                      \
    static inline void mkd_##R##_##NP(const uint16_t *xb, int ldx, int in, const void *Wp, int p0,      \
                                      const float *b, float *y, int ldy, int out) {                     \
        __m512 acc[R][NP];                                                                              \
        const int in2 = (in + 1) / 2;                                                                   \
        const size_t ps = (size_t)in2 * 2 * PW; /* halves per panel */                                  \
        const uint16_t *pan[NP];                                                                        \
        _Pragma("GCC unroll 8") for (int n = 0; n < NP; n++) pan[n] = (const uint16_t *)Wp + (size_t)(p0 + n) * ps; \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                             \
            _Pragma("GCC unroll 8") for (int n = 0; n < NP; n++) acc[r][n] = _mm512_setzero_ps();       \
        for (int k2 = 0; k2 < in2; k2++) {                                                              \
            __m512bh w[NP];                                                                             \
            PF_PANELS(R, NP, pan, (size_t)k2 * 2 * PW);                                                 \
            _Pragma("GCC unroll 8") for (int n = 0; n < NP; n++)                                        \
                w[n] = (__m512bh)_mm512_loadu_si512((const void *)(pan[n] + (size_t)k2 * 2 * PW));      \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                       \
                int32_t pair;                                                                           \
                memcpy(&pair, xb + (size_t)r * ldx + 2 * (size_t)k2, 4);                                \
                const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);                                  \
                _Pragma("GCC unroll 8") for (int n = 0; n < NP; n++) acc[r][n] = _mm512_dpbf16_ps(acc[r][n], xv, w[n]); \
            }                                                                                           \
        }                                                                                               \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                             \
            _Pragma("GCC unroll 8") for (int n = 0; n < NP; n++)                                        \
                store16(acc[r][n], NULL, b, y + (size_t)r * ldy, (p0 + n) * PW, out);                   \
    }
MKD(1, 4) MKD(1, 2) MKD(1, 1) MKD(2, 2) MKD(2, 1) MKD(3, 2) MKD(3, 1) MKD(4, 2) MKD(4, 1)
MKD(5, 2) MKD(5, 1) MKD(6, 2) MKD(6, 1) MKD(7, 2) MKD(7, 1) MKD(8, 2) MKD(8, 1)

#define DROWS(R, NP_WIDE)                                                                                \
    do {                                                                                                 \
        int p = qa;                                                                                      \
        for (; p + NP_WIDE <= qb; p += NP_WIDE)                                                          \
            mkd_##R##_##NP_WIDE(xb + (size_t)r * ldx, ldx, in, Wp, p, b, y + (size_t)r * ldy, ldy, out);  \
        for (; p < qb; p++) mkd_##R##_1(xb + (size_t)r * ldx, ldx, in, Wp, p, b, y + (size_t)r * ldy, ldy, out); \
    } while (0)

/* gemm_panels for FMT_BF16 in this build: the thread rounds all t rows into its scratch, then goes over
 * its panels like GEMM */
static void gemm_dot(const float *x, int t, int in, const void *Wp, int out, const float *b, float *y, int ldy,
                     int pa, int pb, void *scratch) {
    const int ldx = (int)bf16_row_halves(in);
    uint16_t *xb = (uint16_t *)scratch;
    for (int r = 0; r < t; r++) bf16_row(x + (size_t)r * in, in, xb + (size_t)r * ldx);
    for (int qa = pa; qa < pb; qa += PANEL_GROUP) {
        const int qb = qa + PANEL_GROUP < pb ? qa + PANEL_GROUP : pb;
        int r = 0;
        for (; r + 8 <= t; r += 8) DROWS(8, 2);
        switch (t - r) {
        case 7: DROWS(7, 2); break;
        case 6: DROWS(6, 2); break;
        case 5: DROWS(5, 2); break;
        case 4: DROWS(4, 2); break;
        case 3: DROWS(3, 2); break;
        case 2: DROWS(2, 2); break;
        case 1: {
            int p = qa;
            for (; p + 4 <= qb; p += 4) mkd_1_4(xb + (size_t)r * ldx, ldx, in, Wp, p, b, y + (size_t)r * ldy, ldy, out);
            for (; p + 2 <= qb; p += 2) mkd_1_2(xb + (size_t)r * ldx, ldx, in, Wp, p, b, y + (size_t)r * ldy, ldy, out);
            for (; p < qb; p++) mkd_1_1(xb + (size_t)r * ldx, ldx, in, Wp, p, b, y + (size_t)r * ldy, ldy, out);
            break;
        }
        default: break;
        }
    }
}

/* The float32 products of the same bf16 panels (the avx512 builds' kernel), here only for the probe below */
static void gemm_widen(const float *x, int t, int in, const void *Wp, int out, const float *b, float *y, int ldy,
                       int pa, int pb) {
    const float *sc = NULL;
    GEMM(mkb)
}

/* How fast this build's bf16 products (vdpbf16ps) run against the float32 ones of the same panels on this
 * CPU: the float32 kernel's time over this one's, for 16 rows (a verify pass, a prefill's rows) by a 512 x 256
 * matrix in cache, the fastest of five timings each (thread CPU time: a descheduled moment does not count).
 * Some CPUs run vdpbf16ps at a fraction of their fmadd rate, and there the avx512-vnni build is the faster
 * one for bf16 models: build.py's kernel choice asks this. 0 where scratch memory was refused. */
double cd_bf16_dot_speed(void) {
    enum { T = 16, IN = 512, OUT = 256 };
    const int panels = OUT / PW;
    float *x = aligned_alloc(64, sizeof(float) * (T * IN + T * OUT));
    uint16_t *w = aligned_alloc(64, sizeof(uint16_t) * IN * OUT);
    void *scr = aligned_alloc(64, (dot_scratch(T, IN) + 63) & ~(size_t)63);
    double best[2] = {1e30, 1e30};
    if (x && w && scr) {
        float *y = x + T * IN;
        uint32_t v = 12345u; /* weights of bf16 magnitude about 0.01, activations about 1, neither denormal */
        for (int i = 0; i < IN * OUT; i++) { v = v * 1664525u + 1013904223u; w[i] = (uint16_t)(0x3C00u + (v >> 25)); }
        for (int i = 0; i < T * IN; i++) { v = v * 1664525u + 1013904223u; x[i] = (float)(v >> 8) * (1.0f / 16777216.0f) - 0.5f; }
        const unsigned int csr = denormals_off();
        for (int r = 0; r < 6; r++)
            for (int k = 0; k < 2; k++) {
                struct timespec t0, t1;
                clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t0);
                for (int rep = 0; rep < 20; rep++) {
                    if (k) gemm_widen(x, T, IN, w, OUT, NULL, y, OUT, 0, panels);
                    else gemm_dot(x, T, IN, w, OUT, NULL, y, OUT, 0, panels, scr);
                }
                clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t1);
                const double s = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
                if (r && s < best[k]) best[k] = s; /* the first round wakes the wide units up */
            }
        _mm_setcsr(csr);
    }
    free(x);
    free(w);
    free(scr);
    return best[0] < 1e30 && best[0] > 0.0 ? best[1] / best[0] : 0.0;
}

#else
#define BF16_DOT 0
static size_t dot_scratch(int t, int in) { (void)t; (void)in; return 0; }
#endif


/* ------------------------------------------------------------------ AMX tiles (avx512-amx build)
 * FMT_BF16 and FMT_I8 panels are already in the layouts AMX multiplies: a bf16 panel's k-pairs rows
 * [in2][16 columns][2] and an int8 panel's k-quads rows [in4/4][16][4] are each 64 bytes, so 16 of them are
 * one B tile as they lie. The activation rows (rounded to bf16 or quantised to u8 + 128, as the AVX512_BF16
 * and VNNI kernels do) are the A tiles. A group of up to four panels accumulates in four C tiles over the
 * whole tiles of k; k-groups past the last whole tile (a width that is not a multiple of 32 bf16 or 64 int8)
 * are added to each row's sums with vdpbf16ps / vpdpbusd. Every row, whatever t, runs the same tile
 * sequence and the same tail (a tile's rows are independent of each other), so a row's bits never depend
 * on the pass: a prefill chunk, a verify pass and a one-row step agree. int8 sums are integers, so they
 * are the VNNI kernel's bits too; bf16 sums are AMX's own (its adds differ from vdpbf16ps's chain in the
 * last bit), which is why every FMT_BF16 product of this build takes the tiles, one-row steps included. */
#if CD_AMX
#include <sys/syscall.h>
#include <unistd.h>
#undef CD_KERNEL
#define CD_KERNEL "avx512-amx"

/* whether this process may use the tile registers (Linux asks for the request first: ARCH_REQ_XCOMP_PERM
 * for XFEATURE_XTILEDATA); asked once, at load (build.py refuses the build where it is not granted) */
int cd_amx_ready(void) {
    static int ready = -1;
    if (ready < 0) ready = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return ready;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

/* tiles 0..3: C (mr rows of 16 float32 / int32); 4, 5: A (mr rows of 64 bytes); 6, 7: B (16 rows of 64 bytes) */
static void amx_configure(int mr) {
    amx_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 6; i++) c.rows[i] = (uint8_t)mr, c.colsb[i] = 64;
    for (int i = 6; i < 8; i++) c.rows[i] = AMX_M, c.colsb[i] = 64;
    _tile_loadconfig(&c);
}

#define AMX_DP(I8, C, A, B)                                                                             \
    do {                                                                                                \
        if (I8) _tile_dpbusd(C, A, B);                                                                  \
        else _tile_dpbf16ps(C, A, B);                                                                   \
    } while (0)

/* C tiles of one block of rows times NP panels from p0 over the kb whole k tiles: xa the activation rows (lda
 * bytes apart), Wp the panels (ps bytes each); the sums into cbuf [NP][16][16] */
#define AMX_TILES(NP)                                                                                   \
    static void amx_tiles_##NP(const char *xa, size_t lda, const char *Wp, size_t ps, int p0, int kb, int i8, \
                               void *cbuf) {                                                            \
        const char *w = Wp + (size_t)p0 * ps;                                                           \
        _tile_zero(0);                                                                                  \
        if (NP > 1) _tile_zero(1);                                                                      \
        if (NP > 2) _tile_zero(2);                                                                      \
        if (NP > 3) _tile_zero(3);                                                                      \
        for (int k = 0; k < kb; k++) {                                                                  \
            const size_t off = (size_t)k * 1024;                                                        \
            _tile_loadd(4, xa + (size_t)k * 64, lda);                                                   \
            _tile_loadd(6, w + off, 64);                                                                \
            AMX_DP(i8, 0, 4, 6);                                                                        \
            if (NP > 1) { _tile_loadd(7, w + ps + off, 64); AMX_DP(i8, 1, 4, 7); }                      \
            if (NP > 2) { _tile_loadd(6, w + 2 * ps + off, 64); AMX_DP(i8, 2, 4, 6); }                  \
            if (NP > 3) { _tile_loadd(7, w + 3 * ps + off, 64); AMX_DP(i8, 3, 4, 7); }                  \
        }                                                                                               \
        _tile_stored(0, (char *)cbuf, 64);                                                              \
        if (NP > 1) _tile_stored(1, (char *)cbuf + 1024, 64);                                           \
        if (NP > 2) _tile_stored(2, (char *)cbuf + 2048, 64);                                           \
        if (NP > 3) _tile_stored(3, (char *)cbuf + 3072, 64);                                           \
    }
AMX_TILES(1) AMX_TILES(2) AMX_TILES(3) AMX_TILES(4)

/* two blocks of 16 rows (xa, xa + 16 lda) times two panels (p0, p0 + 1): two A and two B tile loads per four
 * products, where one block times four panels takes five. cbuf [4][16][16]: (block 0, p0), (0, p0 + 1),
 * (1, p0), (1, p0 + 1). The same products in the same k order as amx_tiles_*: the same bits. */
static void amx_tiles_2x2(const char *xa, size_t lda, const char *Wp, size_t ps, int p0, int kb, int i8, void *cbuf) {
    const char *w = Wp + (size_t)p0 * ps, *xb = xa + AMX_M * lda;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int k = 0; k < kb; k++) {
        const size_t off = (size_t)k * 1024;
        _tile_loadd(4, xa + (size_t)k * 64, lda);
        _tile_loadd(6, w + off, 64);
        AMX_DP(i8, 0, 4, 6);
        _tile_loadd(7, w + ps + off, 64);
        AMX_DP(i8, 1, 4, 7);
        _tile_loadd(5, xb + (size_t)k * 64, lda);
        AMX_DP(i8, 2, 5, 6);
        AMX_DP(i8, 3, 5, 7);
    }
    _tile_stored(0, (char *)cbuf, 64);
    _tile_stored(1, (char *)cbuf + 1024, 64);
    _tile_stored(2, (char *)cbuf + 2048, 64);
    _tile_stored(3, (char *)cbuf + 3072, 64);
}

static void amx_tiles(int np, const char *xa, size_t lda, const char *Wp, size_t ps, int p0, int kb, int i8,
                      void *cbuf) {
    switch (np) {
    case 4: amx_tiles_4(xa, lda, Wp, ps, p0, kb, i8, cbuf); break;
    case 3: amx_tiles_3(xa, lda, Wp, ps, p0, kb, i8, cbuf); break;
    case 2: amx_tiles_2(xa, lda, Wp, ps, p0, kb, i8, cbuf); break;
    default: amx_tiles_1(xa, lda, Wp, ps, p0, kb, i8, cbuf); break;
    }
}

/* what a format does with one C tile: the k tail, scales, bias and the store of rows r0..r0+rows-1 of
 * panel p (tile: [16][16] float32 or int32 sums) */
typedef struct {
    const char *xa; /* activation rows: bf16 halves or u8 */
    size_t lda;     /* bytes between them */
    int kb, in_k;   /* whole k tiles; k-groups (pairs or quads) in all */
    const char *Wp;
    size_t ps;
    const float *sc, *xs; /* int8: column scales, row scales */
    const int32_t *corr;
    const float *b;
    float *y;
    int ldy, out;
} amx_job;

static void amx_store_bf16(const amx_job *J, const void *tile, int r0, int rows, int p) {
    const uint16_t *pan = (const uint16_t *)(J->Wp + (size_t)p * J->ps);
    for (int r = 0; r < rows; r++) {
        __m512 acc = _mm512_load_ps((const float *)tile + r * PW);
        const uint16_t *xr = (const uint16_t *)(J->xa + (size_t)(r0 + r) * J->lda);
        for (int k2 = J->kb * 16; k2 < J->in_k; k2++) { /* the k-pairs past the whole tiles */
            int32_t pair;
            memcpy(&pair, xr + 2 * (size_t)k2, 4);
            acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(pair),
                                   (__m512bh)_mm512_loadu_si512((const void *)(pan + (size_t)k2 * 2 * PW)));
        }
        store16(acc, NULL, J->b, J->y + (size_t)(r0 + r) * J->ldy, p * PW, J->out);
    }
}

static void amx_store_i8(const amx_job *J, const void *tile, int r0, int rows, int p) {
    const int j = p * PW;
    const int8_t *pan = (const int8_t *)(J->Wp + (size_t)p * J->ps);
    const __m512i cv = _mm512_loadu_si512((const void *)(J->corr + j));
    const __m512 wv = _mm512_loadu_ps(J->sc + j);
    for (int r = 0; r < rows; r++) {
        __m512i acc = _mm512_load_si512((const void *)((const int32_t *)tile + r * PW));
        const uint8_t *xr = (const uint8_t *)(J->xa + (size_t)(r0 + r) * J->lda);
        for (int k = J->kb * 64; k < 4 * J->in_k; k += 4) { /* the k-quads past the whole tiles */
            int32_t quad;
            memcpy(&quad, xr + k, 4);
            acc = dpbusd512(acc, _mm512_set1_epi32(quad), _mm512_loadu_si512((const void *)(pan + (size_t)k * PW)));
        }
        __m512 f = _mm512_mul_round_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc, cv)), wv, RNE);
        f = _mm512_mul_round_ps(f, _mm512_set1_ps(J->xs[r0 + r]), RNE);
        store16(f, NULL, J->b, J->y + (size_t)(r0 + r) * J->ldy, j, J->out);
    }
}

/* t rows (tp in scratch: whole tiles past 16) times panels [pa, pb): groups of PANEL_GROUP panels, read from
 * memory once while every block of rows goes over them, two blocks by two panels at a time where they come */
static void amx_gemm(const amx_job *J, int t, int tp, int pa, int pb, int i8) {
    char cbuf[4][AMX_M * PW * 4] __attribute__((aligned(64)));
    void (*store)(const amx_job *, const void *, int, int, int) = i8 ? amx_store_i8 : amx_store_bf16;
    amx_configure(t < AMX_M ? t : AMX_M);
    for (int qa = pa; qa < pb; qa += PANEL_GROUP) {
        const int np = qa + PANEL_GROUP < pb ? PANEL_GROUP : pb - qa;
        int r0 = 0;
        for (; r0 + 2 * AMX_M <= tp; r0 += 2 * AMX_M) {
            const int rows0 = AMX_M, rows1 = t - r0 - AMX_M < AMX_M ? t - r0 - AMX_M : AMX_M;
            const char *xa = J->xa + (size_t)r0 * J->lda;
            int n = 0;
            for (; n + 2 <= np; n += 2) {
                amx_tiles_2x2(xa, J->lda, J->Wp, J->ps, qa + n, J->kb, i8, cbuf);
                store(J, cbuf[0], r0, rows0, qa + n);
                store(J, cbuf[1], r0, rows0, qa + n + 1);
                store(J, cbuf[2], r0 + AMX_M, rows1, qa + n);
                store(J, cbuf[3], r0 + AMX_M, rows1, qa + n + 1);
            }
            for (; n < np; n++) {
                amx_tiles_1(xa, J->lda, J->Wp, J->ps, qa + n, J->kb, i8, cbuf);
                store(J, cbuf[0], r0, rows0, qa + n);
                amx_tiles_1(xa + AMX_M * J->lda, J->lda, J->Wp, J->ps, qa + n, J->kb, i8, cbuf);
                store(J, cbuf[0], r0 + AMX_M, rows1, qa + n);
            }
        }
        for (; r0 < t; r0 += AMX_M) {
            amx_tiles(np, J->xa + (size_t)r0 * J->lda, J->lda, J->Wp, J->ps, qa, J->kb, i8, cbuf);
            const int rows = t - r0 < AMX_M ? t - r0 : AMX_M;
            for (int n = 0; n < np; n++) store(J, cbuf[n], r0, rows, qa + n);
        }
    }
    _tile_release();
}

/* gemm_panels for FMT_BF16 in this build: rows rounded to bf16 as gemm_dot rounds them, then tiles */
static void gemm_amx_bf16(const float *x, int t, int in, const void *Wp, int out, const float *b, float *y, int ldy,
                          int pa, int pb, void *scratch) {
    const int ldx = (int)bf16_row_halves(in), in2 = (in + 1) / 2, tp = SCRATCH_ROWS(t);
    uint16_t *xb = (uint16_t *)scratch;
    for (int r = 0; r < t; r++) bf16_row(x + (size_t)r * in, in, xb + (size_t)r * ldx);
    if (tp > t) memset(xb + (size_t)t * ldx, 0, (size_t)(tp - t) * ldx * sizeof(uint16_t));
    const amx_job J = {(const char *)xb, (size_t)ldx * sizeof(uint16_t), in2 / 16, in2, (const char *)Wp,
                       (size_t)in2 * 2 * PW * sizeof(uint16_t), NULL, NULL, NULL, b, y, ldy, out};
    amx_gemm(&J, t, tp, pa, pb, 0);
}

/* gemm_panels for FMT_I8 in this build: rows quantised as gemm_vnni quantises them, then tiles; the float
 * tail is gemm_vnni's */
static void gemm_amx_i8(const float *x, int t, int in, const void *Wp, const float *sc, int out, const float *b,
                        float *y, int ldy, int pa, int pb, void *scratch) {
    const int in4 = (in + 3) / 4 * 4, tp = SCRATCH_ROWS(t);
    uint8_t *xq = (uint8_t *)scratch;
    float *xs = (float *)((char *)scratch + (((size_t)tp * in4 + 63) & ~(size_t)63));
    for (int r = 0; r < t; r++) quantize_row(x + (size_t)r * in, in, in4, xq + (size_t)r * in4, xs + r);
    if (tp > t) memset(xq + (size_t)t * in4, 128, (size_t)(tp - t) * in4);
    const amx_job J = {(const char *)xq, (size_t)in4, in4 / 64, in4 / 4, (const char *)Wp, (size_t)in4 * PW, sc, xs,
                       i8_corrections(sc, out), b, y, ldy, out};
    amx_gemm(&J, t, tp, pa, pb, 1);
}
#else
int cd_amx_ready(void) { return 0; }
#endif

/* bytes of scratch one thread needs for t activation rows of up to in values (rounded or quantised) */
static size_t panel_scratch(int t, int in) {
    size_t a = vnni_scratch(t, in), b = dot_scratch(t, in);
    return a > b ? a : b;
}

/* the same where the matrix may also be a row-major bf16 head (the float32 builds split its activation rows) */
static size_t split_scratch(int t, int in);
static size_t row_scratch(int t, int in) {
    size_t a = panel_scratch(t, in), c = split_scratch(t, in);
    return a > c ? a : c;
}

/* t rows of x [t, in] times the panels [pa, pb) of Wp: y [t, ldy] at the panels' columns. Rows go in
 * blocks of BLOCK, then the rest; which kernel computes a row never changes its bits. sc: the int8
 * format's column scales (NULL otherwise). */
static void gemm_rows(const float *x, int t, int in, const uint16_t *W, int out, const float *b, float *y, int ldy,
                      int j0, int j1, void *scratch);

static void gemm_panels(const float *x, int t, int in, const void *Wp, int fmt, const float *sc, int out, const float *b,
                        float *y, int ldy, int pa, int pb, void *scratch) {
    if (fmt == FMT_BF16) {
        sc = NULL;
#if CD_AMX
        gemm_amx_bf16(x, t, in, Wp, out, b, y, ldy, pa, pb, scratch);
#elif BF16_DOT
        gemm_dot(x, t, in, Wp, out, b, y, ldy, pa, pb, scratch);
#else
        GEMM(mkb)
#endif
    } else if (fmt == FMT_BF16_ROWS) {
        const int j1 = pb * PW < out ? pb * PW : out;
        if (pa * PW < j1) gemm_rows(x, t, in, (const uint16_t *)Wp, out, b, y, ldy, pa * PW, j1, scratch);
    } else if (fmt == FMT_I8) {
#if CD_AMX
        if (t >= AMX_I8_ROWS) gemm_amx_i8(x, t, in, Wp, sc, out, b, y, ldy, pa, pb, scratch);
        else gemm_vnni(x, t, in, Wp, sc, out, b, y, ldy, pa, pb, scratch);
#elif I8_QUADS
        gemm_vnni(x, t, in, Wp, sc, out, b, y, ldy, pa, pb, scratch);
#else
        (void)scratch;
        GEMM(mki)
#endif
    } else {
        sc = NULL;
        GEMM(mkf)
    }
}

/* ------------------------------------------------------------------ row-major bf16 (FMT_BF16_ROWS)
 * A large model's tied embedding is its LM head too: packing the head into panels would keep a second copy
 * of the largest matrix (272 MB in the 0.5B shape). FMT_BF16_ROWS reads the model's own bf16 [out, in]
 * rows instead, as dot products: y[r, j] = b[j] + fold(acc), where acc holds 16 lane sums, each one
 * chain in k order, and fold adds lanes l and l + 8, then hsum8. In the float32 builds (AVX2 and AVX-512,
 * one code) lane l of each 16 k holds k = 2l and lane l + 8 holds k = 2l + 1: one 32-byte load of 16 bf16
 * weights widens into both 8-lane halves with a shift and a mask (no shuffle-port vpmovzxwd per 8
 * weights), and the activation rows are split into even and odd k once per call, in scratch. The BF16
 * build multiplies bf16-rounded activation rows with vdpbf16ps (lane l: k = 2l, 2l + 1 of each 32).
 * Groups of RJ output rows by blocks of activation rows: each weight row is read once from memory for all t. */
#define RJ 4
#define RR 4 /* the BF16 build's block of activation rows */

static inline void store_dot(float sum, const float *b, float *dst, int j) { *dst = b ? sum + b[j] : sum; }

#if BF16_DOT
static size_t split_scratch(int t, int in) { (void)t; (void)in; return 0; } /* rounds rows into dot_scratch */

static void gemm_rows(const float *x, int t, int in, const uint16_t *W, int out, const float *b, float *y, int ldy,
                      int j0, int j1, void *scratch) {
    (void)out;
    const int ldx = (int)bf16_row_halves(in);
    uint16_t *xb = (uint16_t *)scratch;
    for (int r = 0; r < t; r++) bf16_row(x + (size_t)r * in, in, xb + (size_t)r * ldx);
    for (int j = j0; j < j1; j += RJ) {
        const int nj = j1 - j < RJ ? j1 - j : RJ;
        for (int r0 = 0; r0 < t; r0 += RR) {
            const int nr = t - r0 < RR ? t - r0 : RR;
            __m512 acc[RR][RJ];
            _Pragma("GCC unroll 8") for (int rr = 0; rr < RR; rr++)
                _Pragma("GCC unroll 8") for (int jj = 0; jj < RJ; jj++) acc[rr][jj] = _mm512_setzero_ps();
            for (int k = 0; k < in; k += 32) {
                const __mmask32 m = in - k >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << (in - k)) - 1);
                __m512bh w[RJ];
                if (t > 1 && r0 == 0) /* see PF_AHEAD; the later blocks of rows find the weights in cache */
                    _Pragma("GCC unroll 8") for (int jj = 0; jj < nj; jj++)
                        _mm_prefetch((const char *)(W + (size_t)(j + jj) * in + k) + PF_AHEAD, _MM_HINT_T0);
                _Pragma("GCC unroll 8") for (int jj = 0; jj < RJ; jj++)
                    w[jj] = (__m512bh)(jj < nj ? _mm512_maskz_loadu_epi16(m, W + (size_t)(j + jj) * in + k) : _mm512_setzero_si512());
                _Pragma("GCC unroll 8") for (int rr = 0; rr < RR; rr++) {
                    if (rr >= nr) break;
                    const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(xb + (size_t)(r0 + rr) * ldx + k));
                    _Pragma("GCC unroll 8") for (int jj = 0; jj < RJ; jj++) acc[rr][jj] = _mm512_dpbf16_ps(acc[rr][jj], xv, w[jj]);
                }
            }
            for (int rr = 0; rr < nr; rr++)
                for (int jj = 0; jj < nj; jj++) {
                    __m256 f = _mm256_add_ps(_mm512_castps512_ps256(acc[rr][jj]), _mm512_extractf32x8_ps(acc[rr][jj], 1));
                    store_dot(hsum8(f), b, y + (size_t)(r0 + rr) * ldy + j + jj, j + jj);
                }
        }
    }
}
#else
/* The float32 chain. A block of NR activation rows by one weight row keeps its 2 * NR chains and the
 * widened weights in AVX2's 16 registers (the former block of 4 x 4 needed 32 chains and spilled them to
 * the stack every k). A chain's ops do not depend on the block it is in, so every row gets the bits of a
 * one-row pass. */
static inline size_t split_floats(int in) { return ((size_t)in + 15) / 16 * 16; }

/* x [t, in] -> xs [t, split_floats(in)]: per 16 k, the 8 even k, then the 8 odd k; zeros past in */
static void split_rows(const float *x, int t, int in, float *xs) {
    const size_t ld = split_floats(in);
    for (int r = 0; r < t; r++)
        for (size_t k = 0; k < ld; k += 16)
            for (int l = 0; l < 16; l++) {
                const size_t src = k + 2 * (size_t)(l & 7) + (size_t)(l >> 3);
                xs[(size_t)r * ld + k + l] = src < (size_t)in ? x[(size_t)r * in + src] : 0.0f;
            }
}

static size_t split_scratch(int t, int in) { return (size_t)t * split_floats(in) * sizeof(float) + 64; }

/* 16 k of one weight row (RAW: its 16 bf16 bits) into every row's two chains (lo, hi, xs, ld, k and odd
 * are rowk's) */
#define ROWK_CHUNK(NR, RAW)                                                                              \
    do {                                                                                                 \
        const __m256 we_ = _mm256_castsi256_ps(_mm256_slli_epi32(RAW, 16));                              \
        const __m256 wo_ = _mm256_castsi256_ps(_mm256_and_si256(RAW, odd));                              \
        _Pragma("GCC unroll 8") for (int rr = 0; rr < NR; rr++) {                                        \
            lo[rr] = _mm256_fmadd_ps(_mm256_loadu_ps(xs + rr * ld + k), we_, lo[rr]);                    \
            hi[rr] = _mm256_fmadd_ps(_mm256_loadu_ps(xs + rr * ld + k + 8), wo_, hi[rr]);                \
        }                                                                                                \
    } while (0)

/* NR activation rows (split) against weight row j */
#define ROWK(NR)                                                                                         \
    static inline void rowk_##NR(const float *xs, size_t ld, int in, const uint16_t *W, const float *b,  \
                                 float *y, int ldy, int j) {                                            \
        const __m256i odd = _mm256_set1_epi32((int)0xFFFF0000u);                                         \
        const uint16_t *w = W + (size_t)j * in;                                                          \
        __m256 lo[NR], hi[NR];                                                                           \
        _Pragma("GCC unroll 8") for (int rr = 0; rr < NR; rr++) lo[rr] = hi[rr] = _mm256_setzero_ps();   \
        const int in16 = in / 16 * 16;                                                                   \
        int k = 0;                                                                                       \
        for (; k < in16; k += 16) {                                                                      \
            if (NR > 1) /* compile-time; see PF_AHEAD */                                                 \
                _mm_prefetch((const char *)(w + k) + PF_AHEAD, _MM_HINT_T0);                             \
            ROWK_CHUNK(NR, _mm256_loadu_si256((const __m256i *)(w + k)));                                \
        }                                                                                                \
        if (k < in) { /* the last k < 16 through a zero-padded copy: x * 0 adds nothing to a chain */    \
            uint16_t wt[16] = {0};                                                                       \
            memcpy(wt, w + k, sizeof(uint16_t) * (size_t)(in - k));                                      \
            ROWK_CHUNK(NR, _mm256_loadu_si256((const __m256i *)wt));                                     \
        }                                                                                                \
        _Pragma("GCC unroll 8") for (int rr = 0; rr < NR; rr++)                                          \
            store_dot(hsum8(_mm256_add_ps(lo[rr], hi[rr])), b, y + (size_t)rr * ldy + j, j);             \
    }
ROWK(1) ROWK(2) ROWK(3) ROWK(4) ROWK(5) ROWK(6)

#define ROWS_EACH(NR) for (int jj = j; jj < j + jn; jj++) rowk_##NR(xr, ld, in, W, b, yr, ldy, jj)

static void gemm_rows(const float *x, int t, int in, const uint16_t *W, int out, const float *b, float *y, int ldy,
                      int j0, int j1, void *scratch) {
    (void)out;
    const size_t ld = split_floats(in);
    float *xs = (float *)scratch;
    split_rows(x, t, in, xs);
    /* RJ weight rows (a few KB) stay in L1 while every block of activation rows goes over them */
    for (int j = j0; j < j1; j += RJ) {
        const int jn = j1 - j < RJ ? j1 - j : RJ;
        for (int r0 = 0; r0 < t;) {
            const int nr = even_block(t - r0, 6);
            const float *xr = xs + (size_t)r0 * ld;
            float *yr = y + (size_t)r0 * ldy;
            switch (nr) {
            case 6: ROWS_EACH(6); break;
            case 5: ROWS_EACH(5); break;
            case 4: ROWS_EACH(4); break;
            case 3: ROWS_EACH(3); break;
            case 2: ROWS_EACH(2); break;
            default: ROWS_EACH(1);
            }
            r0 += nr;
        }
    }
}
#endif

/* which kernels this build runs: "avx2" or "avx512" (native/__init__.py picks the build) */
const char *cd_kernel(void) { return CD_KERNEL; }

/* 1: this build reads bf16 panels in k-pairs (pack_as's pairs layout), 0: in 16-column rows */
int cd_bf16_pairs(void) { return BF16_PAIRS; }

/* 1: this build multiplies bf16 panels by bf16-rounded activations (vdpbf16ps), 0: widens them to float32 */
int cd_bf16_dot(void) { return BF16_DOT; }

/* 1: this build reads int8 panels in k-quads with the offset corrections after the scales (w8a8, VNNI) */
int cd_i8_quads(void) { return I8_QUADS; }

/* the w8a8 builds' activation levels: each row is quantised to integers within +-ACT_LEVELS (0: weight-only) */
int cd_act_levels(void) { return ACT_LEVELS; }

/* this thread's panels of an out-column matrix */
static void share_panels(int out, int tid, int nt, int *pa, int *pb) {
    int panels = (out + PW - 1) / PW;
    *pa = (int)((int64_t)panels * tid / nt);
    *pb = (int)((int64_t)panels * (tid + 1) / nt);
}

/* h[r, j] += y[r, j] over the columns of panels [pa, pb) */
static void add_cols(float *h, const float *y, int t, int d, int pa, int pb) {
    int j0 = pa * PW, j1 = pb * PW < d ? pb * PW : d;
    for (int r = 0; r < t; r++)
        for (int j = j0; j < j1; j++) h[(size_t)r * d + j] += y[(size_t)r * d + j];
}

static void share_items(int n, int tid, int nt, int *a, int *b) {
    *a = (int)((int64_t)n * tid / nt);
    *b = (int)((int64_t)n * (tid + 1) / nt);
}

/* ------------------------------------------------------------------ attention
 * One chunk of keys of one head, for every row of the pass that sees into it (row r sees n_r keys:
 * pos + r + 1, or under a tree mask the slots its mask row allows): each key block is read once and scored
 * against all those rows from L1. Per row, the chunk's max m, sum l of exp(s - m) and o = sum
 * exp(s - m) * v (merged over chunks in key order by merge()). A row's arithmetic is the same whichever
 * other rows share the chunk: each score is one fmadd chain over the dims in order (keys in the lanes, read
 * from K transposed in blocks of KB keys), its exp and sums run in groups of 8 from the chunk start, its o is
 * one fmadd chain per lane over its keys in order.
 * Keys are counted in the row's logical sequence, not by slot: a tree node's visible keys (the prefix, its
 * ancestors at scattered slots, itself) are gathered in order into kidx, so chunks, 8-key groups and
 * chains fall exactly where a plain step at the node's position puts them, and its bits are that step's. */

#define ROW_GROUP 16 /* query vectors scored together (the stack holds their scores) */
/* the cache slot of the row's i-th key in logical order: kidx (a tree node's visible slots, one row per
 * call) or the identity (a causal row) */
#define KEY(i) (kidx ? kidx[i] : (i))
#define VSUB 32      /* keys per pass over v: one block of v rows stays in L1 for all rows */
#define KB 64        /* keys per transposed K block: kt[e * KB + j] is dim e of the block's key j */

/* 8 rows of 8 floats transposed in place */
static inline void transpose8(__m256 r[8]) {
    __m256 t[8], u[8];
    _Pragma("GCC unroll 4") for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    _Pragma("GCC unroll 2") for (int i = 0; i < 2; i++) {
        u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
        u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    _Pragma("GCC unroll 4") for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
}

/* The block of KB keys from logical key `first` (n of them live; the rest zeros) transposed into kt [hd][KB]. */
static void k_block_t(const float *kb, const int *kidx, int first, int n, int hd, float *kt) {
    for (int j0 = 0; j0 < KB; j0 += 8) {
        const float *kr[8];
        _Pragma("GCC unroll 8") for (int j = 0; j < 8; j++) kr[j] = j0 + j < n ? kb + (size_t)KEY(first + j0 + j) * hd : NULL;
        for (int e = 0; e < hd; e += 8) {
            __m256 r[8];
            _Pragma("GCC unroll 8") for (int j = 0; j < 8; j++) r[j] = kr[j] ? _mm256_loadu_ps(kr[j] + e) : _mm256_setzero_ps();
            transpose8(r);
            _Pragma("GCC unroll 8") for (int j = 0; j < 8; j++) _mm256_storeu_ps(kt + (size_t)(e + j) * KB + j0, r[j]);
        }
    }
}

#if defined(__AVX512F__)
/* R rows' scores of one block (R a constant once inlined): R rows share each load of K */
static inline __attribute__((always_inline)) void score_rows(const float *const *q, const int *rows, int R,
                                                             const float *kt, int hd, __m512 sc,
                                                             float (*s)[CHUNK + 16], int i0) {
    __m512 a[4][4];
    _Pragma("GCC unroll 4") for (int r = 0; r < R; r++)
        _Pragma("GCC unroll 4") for (int v = 0; v < 4; v++) a[r][v] = _mm512_setzero_ps();
    for (int e = 0; e < hd; e++) {
        const float *kr = kt + (size_t)e * KB;
        const __m512 k0 = _mm512_load_ps(kr), k1 = _mm512_load_ps(kr + 16), k2 = _mm512_load_ps(kr + 32),
                     k3 = _mm512_load_ps(kr + 48);
        _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {
            const __m512 x = _mm512_set1_ps(q[rows[r]][e]);
            a[r][0] = _mm512_fmadd_ps(x, k0, a[r][0]);
            a[r][1] = _mm512_fmadd_ps(x, k1, a[r][1]);
            a[r][2] = _mm512_fmadd_ps(x, k2, a[r][2]);
            a[r][3] = _mm512_fmadd_ps(x, k3, a[r][3]);
        }
    }
    _Pragma("GCC unroll 4") for (int r = 0; r < R; r++)
        _Pragma("GCC unroll 4") for (int v = 0; v < 4; v++) _mm512_store_ps(s[rows[r]] + i0 + 16 * v, _mm512_mul_ps(a[r][v], sc));
}
#endif

/* s[r] + i0: the scores of the block's KB keys (kt: 64-byte aligned) for each row in rows[0..nl), each an
 * fmadd chain over the dims in order from zero, times the scale */
static __attribute__((noinline)) void score_block(const float *const *q, const int *rows, int nl, const float *kt, int hd, float scale,
                        float (*s)[CHUNK + 16], int i0) {
    int l = 0;
#if defined(__AVX512F__)
    const __m512 sc = _mm512_set1_ps(scale);
    for (; l + 4 <= nl; l += 4) score_rows(q, rows + l, 4, kt, hd, sc, s, i0);
    switch (nl - l) {
    case 3: score_rows(q, rows + l, 3, kt, hd, sc, s, i0); break;
    case 2: score_rows(q, rows + l, 2, kt, hd, sc, s, i0); break;
    case 1: score_rows(q, rows + l, 1, kt, hd, sc, s, i0); break;
    default: break;
    }
#else
    const __m256 sc = _mm256_set1_ps(scale);
    for (; l < nl; l++) {
        const float *qa = q[rows[l]];
        __m256 a[8];
        _Pragma("GCC unroll 8") for (int v = 0; v < 8; v++) a[v] = _mm256_setzero_ps();
        for (int e = 0; e < hd; e++) {
            const __m256 x = _mm256_set1_ps(qa[e]);
            _Pragma("GCC unroll 8") for (int v = 0; v < 8; v++)
                a[v] = _mm256_fmadd_ps(x, _mm256_load_ps(kt + (size_t)e * KB + 8 * v), a[v]);
        }
        _Pragma("GCC unroll 8") for (int v = 0; v < 8; v++) _mm256_store_ps(s[rows[l]] + i0 + 8 * v, _mm256_mul_ps(a[v], sc));
    }
#endif
}

/* o[0..hd) += sum over keys i in [i0, i1) of p[i] * v_i, one fmadd chain per dim in key order */
static inline void pv_row(float *o, const float *p, const float *vb, const int *kidx, int k0, int i0, int i1, int hd) {
    int e = 0;
#if defined(__AVX512F__)
    /* each o[e] is one fmadd chain over the keys in order, whatever the vector width: the bits of the 8-lane
     * code below */
    for (; e + 64 <= hd; e += 64) {
        __m512 acc[4];
        _Pragma("GCC unroll 4") for (int v = 0; v < 4; v++) acc[v] = _mm512_loadu_ps(o + e + 16 * v);
        for (int i = i0; i < i1; i++) {
            const __m512 pi = _mm512_set1_ps(p[i]);
            const float *vr = vb + (size_t)KEY(k0 + i) * hd + e;
            _Pragma("GCC unroll 4") for (int v = 0; v < 4; v++) acc[v] = _mm512_fmadd_ps(pi, _mm512_loadu_ps(vr + 16 * v), acc[v]);
        }
        _Pragma("GCC unroll 4") for (int v = 0; v < 4; v++) _mm512_storeu_ps(o + e + 16 * v, acc[v]);
    }
#endif
    for (; e + 64 <= hd; e += 64) {
        __m256 acc[8];
        _Pragma("GCC unroll 8") for (int v = 0; v < 8; v++) acc[v] = _mm256_loadu_ps(o + e + 8 * v);
        for (int i = i0; i < i1; i++) {
            const __m256 pi = _mm256_set1_ps(p[i]);
            const float *vr = vb + (size_t)KEY(k0 + i) * hd + e;
            _Pragma("GCC unroll 8") for (int v = 0; v < 8; v++) acc[v] = _mm256_fmadd_ps(pi, _mm256_loadu_ps(vr + 8 * v), acc[v]);
        }
        _Pragma("GCC unroll 8") for (int v = 0; v < 8; v++) _mm256_storeu_ps(o + e + 8 * v, acc[v]);
    }
    for (; e < hd; e += 8) {
        __m256 acc = _mm256_loadu_ps(o + e);
        for (int i = i0; i < i1; i++)
            acc = _mm256_fmadd_ps(_mm256_set1_ps(p[i]), _mm256_loadu_ps(vb + (size_t)KEY(k0 + i) * hd + e), acc);
        _mm256_storeu_ps(o + e, acc);
    }
}

#if defined(__AVX512F__)
/* pv_row for R rows (R a constant once inlined) over the VSUB block from b0: R rows share each load of v over
 * the keys all of them see, and each goes on alone to its own end; hd is whole 64s */
static inline __attribute__((always_inline)) void pv_rows(float *const *part, float (*s)[CHUNK + 16], const int *rows,
                                                          int R, const int *n, const float *vb, const int *kidx, int k0,
                                                          int b0, int hd) {
    int end[4], all = b0 + VSUB;
    for (int r = 0; r < R; r++) {
        end[r] = b0 + VSUB < n[rows[r]] ? b0 + VSUB : n[rows[r]];
        if (end[r] < all) all = end[r];
    }
    for (int e = 0; e < hd; e += 64) {
        __m512 a[4][4];
        _Pragma("GCC unroll 4") for (int r = 0; r < R; r++)
            _Pragma("GCC unroll 4") for (int v = 0; v < 4; v++) a[r][v] = _mm512_loadu_ps(part[rows[r]] + 2 + e + 16 * v);
        for (int i = b0; i < all; i++) {
            const float *vr = vb + (size_t)KEY(k0 + i) * hd + e;
            __m512 w[4];
            _Pragma("GCC unroll 4") for (int v = 0; v < 4; v++) w[v] = _mm512_loadu_ps(vr + 16 * v);
            _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {
                const __m512 p = _mm512_set1_ps(s[rows[r]][i]);
                _Pragma("GCC unroll 4") for (int v = 0; v < 4; v++) a[r][v] = _mm512_fmadd_ps(p, w[v], a[r][v]);
            }
        }
        _Pragma("GCC unroll 4") for (int r = 0; r < R; r++)
            _Pragma("GCC unroll 4") for (int v = 0; v < 4; v++) _mm512_storeu_ps(part[rows[r]] + 2 + e + 16 * v, a[r][v]);
    }
    for (int r = 0; r < R; r++) pv_row(part[rows[r]] + 2, s[rows[r]], vb, kidx, k0, all, end[r], hd);
}
#endif

/* ktc: this chunk's K transposed (blocks of KB keys, hd * KB floats each), shared by every batch that reads the
 * chunk; NULL: each block is transposed here */
static void attend_rows(const float *const *q, const int *nkeys, const int *kidx, int nr, const float *kb,
                        const float *vb, const float *ktc, int hd, float scale, int k0, float *const *part) {
    float s[ROW_GROUP][CHUNK + 16] __attribute__((aligned(64)));
    int n[ROW_GROUP], kmax = 0;
    for (int r = 0; r < nr; r++) {
        int k1 = k0 + CHUNK < nkeys[r] ? k0 + CHUNK : nkeys[r];
        n[r] = k1 - k0;
        if (k1 > kmax) kmax = k1;
    }
    const int nmax = kmax - k0;
    float ktl[ktc ? 16 : (size_t)KB * hd] __attribute__((aligned(64)));
    for (int i0 = 0; i0 < nmax; i0 += KB) {
        int live[ROW_GROUP], nl = 0; /* the rows that see key i0 */
        for (int r = 0; r < nr; r++)
            if (i0 < n[r]) live[nl++] = r;
        const float *kt = ktl;
        if (ktc)
            kt = ktc + (size_t)(i0 / KB) * hd * KB;
        else
            k_block_t(kb, kidx, k0 + i0, nmax - i0 < KB ? nmax - i0 : KB, hd, ktl);
        score_block(q, live, nl, kt, hd, scale, s, i0);
    }

    float mx[ROW_GROUP];
    for (int r = 0; r < nr; r++) {
        float *o = part[r] + 2;
        memset(o, 0, (size_t)hd * sizeof(float));
        /* The max over 8 lanes, then across them: the value of a scan in key order (a maximum does not
         * depend on the order, and of +0 and -0 either gives every exp(s - m) and merge weight the same bits). */
        int n8 = (n[r] + 7) & ~7;
        for (int i = n[r]; i < n8; i++) s[r][i] = -INFINITY;
        __m256 mv = _mm256_set1_ps(-INFINITY);
        int i = 0;
#if defined(__AVX512F__) && defined(__AVX512DQ__)
        __m512 mw = _mm512_set1_ps(-INFINITY);
        for (; i + 16 <= n8; i += 16) mw = _mm512_max_ps(mw, _mm512_load_ps(s[r] + i));
        mv = _mm256_max_ps(_mm512_castps512_ps256(mw), _mm512_extractf32x8_ps(mw, 1));
#endif
        for (; i < n8; i += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s[r] + i));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
        mx[r] = _mm_cvtss_f32(m4);
        part[r][0] = mx[r];
        part[r][1] = 0.0f;
        if (mx[r] == -INFINITY) continue;
        __m256 lsum = _mm256_setzero_ps(), m8 = _mm256_set1_ps(mx[r]);
        i = 0;
#if defined(__AVX512F__) && defined(__AVX512DQ__)
        /* 16 keys a step, the sum still taken 8 lanes at a time in key order */
        for (const __m512 m16 = _mm512_set1_ps(mx[r]); i + 16 <= n8; i += 16) {
            const __m512 sv = _mm512_load_ps(s[r] + i);
            const __mmask16 live = _mm512_cmp_ps_mask(sv, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
            const __m512 p = _mm512_maskz_mov_ps(live, exp8x2(_mm512_sub_ps(sv, m16)));
            _mm512_store_ps(s[r] + i, p);
            lsum = _mm256_add_ps(lsum, _mm512_castps512_ps256(p));
            lsum = _mm256_add_ps(lsum, _mm512_extractf32x8_ps(p, 1));
        }
#endif
        for (; i < n8; i += 8) {
            __m256 sv = _mm256_loadu_ps(s[r] + i);
            __m256 live = _mm256_cmp_ps(sv, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ);
            __m256 p = _mm256_and_ps(exp8(_mm256_sub_ps(sv, m8)), live); /* masked keys weigh exactly 0 */
            _mm256_storeu_ps(s[r] + i, p);
            lsum = _mm256_add_ps(lsum, p);
        }
        part[r][1] = hsum8(lsum);
    }
    /* o += p * v, one block of VSUB v rows at a time for every row, each row's chains kept in its o */
    for (int b0 = 0; b0 < nmax; b0 += VSUB) {
        int live[ROW_GROUP], nl = 0;
        for (int r = 0; r < nr; r++)
            if (mx[r] != -INFINITY && b0 < n[r]) live[nl++] = r;
        int l = 0;
#if defined(__AVX512F__)
        if (hd % 64 == 0) {
            for (; l + 4 <= nl; l += 4) pv_rows(part, s, live + l, 4, n, vb, kidx, k0, b0, hd);
            switch (nl - l) { /* one row left: pv_row below */
            case 3: pv_rows(part, s, live + l, 3, n, vb, kidx, k0, b0, hd); l = nl; break;
            case 2: pv_rows(part, s, live + l, 2, n, vb, kidx, k0, b0, hd); l = nl; break;
            default: break;
            }
        }
#endif
        for (; l < nl; l++) {
            const int r = live[l];
            pv_row(part[r] + 2, s[r], vb, kidx, k0, b0, b0 + VSUB < n[r] ? b0 + VSUB : n[r], hd);
        }
    }
}

static void merge(const float *parts, int nch, int hd, float *out) {
    float M = -INFINITY;
    for (int c = 0; c < nch; c++) if (parts[(size_t)c * (hd + 2)] > M) M = parts[(size_t)c * (hd + 2)];
    for (int e = 0; e < hd; e++) out[e] = 0.0f;
    if (M == -INFINITY) return; /* a row that sees no key (cannot happen for a causal row) */
    float L = 0.0f;
    for (int c = 0; c < nch; c++) {
        const float *p = parts + (size_t)c * (hd + 2);
        if (p[0] == -INFINITY) continue;
        float w = expf(p[0] - M);
        L = fmaf(p[1], w, L);
        for (int e = 0; e < hd; e++) out[e] = fmaf(p[2 + e], w, out[e]);
    }
    float inv = 1.0f / L;
    for (int e = 0; e < hd; e++) out[e] *= inv;
}

#if CD_AMX
/* ------------------------------------------------------------------ attention on AMX tiles (avx512-amx build)
 * Where a model's query heads share each K/V head in groups of ATT_TILE_GROUP or more, hd is whole tiles of 32
 * dims and a layer's matrices are bf16 or int8 panels (its products round activations already; float32 layers
 * keep float32 attention), its attention runs on tiles with bf16 operands: q rounded to bf16; K and V rounded to bf16 as each call
 * repacks the chunks it reads (K in dim pairs, transposed: the B tiles of S = Q K^T; V in key pairs: the B tiles
 * of O = P V); the probabilities rounded to bf16 (their sum taken before). Chunks, masking
 * and merge() are the float32 path's. A tile row's sums depend only on that row and the B tiles, and the
 * softmax runs per row, so a row's scores, maximum, sum and o never depend on the rows it shares tiles with:
 * every row of any pass has the bits of a one-row step. A row that sees fewer keys than its batch's longest
 * gets P = 0 for the rest, over V rows that are the chunk's own or zeros, which adds nothing to its sums.
 * A one-row step repacks what it reads, at about the cost of a few heads' float32 dot products: hence the
 * group threshold (a model of one query head per K/V head would pay it on every decode step for nothing). */
#ifndef ATT_TILE_GROUP /* a profiling build may move it */
#define ATT_TILE_GROUP 4
#endif
#define KEYS_S 16 /* keys per S tile (B: 16 dim pairs x 16 keys) */
#define KEYS_P 32 /* keys per P tile (A: rows x 32 keys) and per V tile (B: 16 key pairs x 16 dims) */

static inline int att_tiles(int hd, int group) { return hd % 32 == 0 && hd <= 256 && group >= ATT_TILE_GROUP; }

/* dwords one repacked chunk takes: K^T pairs [CHUNK/16][hd/32][16][16], then V pairs [CHUNK/32][hd/16][16][16] */
static inline size_t att_chunk_dwords(int hd) { return (size_t)CHUNK * hd; }

/* bytes of one thread's scratch: q rows in bf16, scores, probabilities in bf16, o rows (and a chunk repacked
 * for a tree row, whose keys are its own) */
static inline size_t att_scratch(int hd) {
    return (size_t)AMX_M * hd * 2 + (size_t)AMX_M * CHUNK * 4 + (size_t)AMX_M * CHUNK * 2 + (size_t)AMX_M * hd * 4
           + att_chunk_dwords(hd) * 4 + 256;
}

/* 16 x 16 dwords transposed in registers */
static inline void transpose16(__m512i *r) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 16; i += 8)
        for (int j = 0; j < 4; j++) {
            t[i + j] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0x88);
            t[i + j + 4] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0xdd);
        }
    for (int j = 0; j < 8; j++) {
        r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
        r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
    }
}

/* 16 floats rounded to bf16 (nearest even), each in the low half of a dword */
static inline __m512i bf16_lanes(__m512 v) { return _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)); }

/* the chunk's first n keys (logical k0..k0+n-1, slots KEY()) from the float32 cache rows kb, vb into kv: K^T and
 * V pairs in bf16, keys past n zero up to the chunk's last whole tile */
static void att_repack(const float *kb, const float *vb, const int *kidx, int k0, int n, int hd, uint32_t *kv) {
    const int nd = hd / 32, ne = hd / 16;
    uint32_t *kt = kv, *vp = kv + (size_t)CHUNK * hd / 2;
    for (int b = 0; b * KEYS_S < n; b++)
        for (int db = 0; db < nd; db++) {
            __m512i r[16];
            for (int j = 0; j < 16; j++) {
                const int i = b * KEYS_S + j;
                if (i < n) {
                    const float *kr = kb + (size_t)KEY(k0 + i) * hd + 32 * db;
                    r[j] = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(kr + 16), _mm512_loadu_ps(kr));
                } else {
                    r[j] = _mm512_setzero_si512();
                }
            }
            transpose16(r); /* row p: dims 2p, 2p + 1 of the 16 keys */
            uint32_t *dst = kt + ((size_t)b * nd + db) * 256;
            for (int j = 0; j < 16; j++) _mm512_storeu_si512((void *)(dst + 16 * j), r[j]);
        }
    for (int b = 0; b * KEYS_P < n; b++)
        for (int kp = 0; kp < 16; kp++) {
            const int i0 = b * KEYS_P + 2 * kp, i1 = i0 + 1;
            const float *v0 = i0 < n ? vb + (size_t)KEY(k0 + i0) * hd : NULL;
            const float *v1 = i1 < n ? vb + (size_t)KEY(k0 + i1) * hd : NULL;
            for (int e = 0; e < ne; e++) {
                const __m512i lo = v0 ? bf16_lanes(_mm512_loadu_ps(v0 + 16 * e)) : _mm512_setzero_si512();
                const __m512i hi = v1 ? bf16_lanes(_mm512_loadu_ps(v1 + 16 * e)) : _mm512_setzero_si512();
                _mm512_storeu_si512((void *)(vp + (((size_t)b * ne + e) * 16 + kp) * 16), _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
            }
        }
}

/* exp(x) for x <= 0 on 16 lanes, to about 2e-7 relative (the probabilities are rounded to bf16 after, 4e-3):
 * 2^(x log2 e) as 2^n times a degree-5 polynomial of the fraction in [-0.5, 0.5], scalef for 2^n (0 far below) */
static inline __m512 exp16(__m512 x) {
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 y = _mm512_set1_ps(1.3333558146e-3f);
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(9.6181291076e-3f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(5.5504108665e-2f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.4022650696e-1f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.9314718056e-1f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(y, n);
}

/* the lanes of 16 keys from key i on that a row of n keys sees */
static inline __mmask16 keys_live(int i, int n) {
    const int k = n - i;
    return k >= 16 ? (__mmask16)0xFFFF : k <= 0 ? (__mmask16)0 : (__mmask16)((1u << k) - 1);
}

/* attend_rows on tiles: nr <= 16 query vectors against one repacked chunk kv (keys k0.., row r sees nkeys[r] in
 * all), each row's (max, sum, o) into part[r] */
static void attend_tiles(const float *const *q, const int *nkeys, int nr, const uint32_t *kv, int hd, float scale,
                         int k0, float *const *part, char *scr) {
    const int nd = hd / 32, ne = hd / 16;
    const uint32_t *kt = kv, *vp = kv + (size_t)CHUNK * hd / 2;
    uint16_t *qa = (uint16_t *)scr;                      /* [16][hd] */
    float *s = (float *)(qa + (size_t)AMX_M * hd);         /* [16][CHUNK] */
    uint16_t *pb = (uint16_t *)(s + (size_t)AMX_M * CHUNK); /* [16][CHUNK] */
    float *ot = (float *)(pb + (size_t)AMX_M * CHUNK);      /* [16][hd] */
    int n[AMX_M], nmax = 0;
    for (int r = 0; r < nr; r++) {
        n[r] = nkeys[r] - k0 < CHUNK ? nkeys[r] - k0 : CHUNK;
        if (n[r] > nmax) nmax = n[r];
        for (int e = 0; e < hd; e += 32)
            _mm512_storeu_si512((void *)(qa + (size_t)r * hd + e),
                                (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(q[r] + e + 16), _mm512_loadu_ps(q[r] + e)));
    }
    const int nv = (nmax + KEYS_P - 1) / KEYS_P * KEYS_P;
    PROF_T(0);
    amx_configure(nr);
    for (int b = 0; b * KEYS_S < nmax; b++) {
        _tile_zero(0);
        for (int db = 0; db < nd; db++) {
            _tile_loadd(4, qa + 32 * db, hd * 2);
            _tile_loadd(6, kt + ((size_t)b * nd + db) * 256, 64);
            _tile_dpbf16ps(0, 4, 6);
        }
        _tile_stored(0, s + KEYS_S * b, CHUNK * 4);
    }
    PROF_T(1);
    float mx[AMX_M], ls[AMX_M];
    for (int r = 0; r < nr; r++) {
        const float *sr = s + (size_t)r * CHUNK;
        __m512 mv = _mm512_set1_ps(-INFINITY);
        for (int i = 0; i < n[r]; i += 16) mv = _mm512_mask_max_ps(mv, keys_live(i, n[r]), mv, _mm512_loadu_ps(sr + i));
        /* the largest scaled score: scaling by scale > 0 and rounding keep the order */
        const float m = _mm512_reduce_max_ps(mv) * scale;
        const __m512 m16 = _mm512_set1_ps(m), sc = _mm512_set1_ps(scale);
        __m512 lsum = _mm512_setzero_ps();
        for (int i = 0; i < nv; i += 32) {
            const __mmask16 l0 = keys_live(i, n[r]), l1 = keys_live(i + 16, n[r]);
            const __m512 p0 = _mm512_maskz_mov_ps(l0, exp16(_mm512_maskz_fmsub_ps(l0, _mm512_loadu_ps(sr + i), sc, m16)));
            const __m512 p1 = _mm512_maskz_mov_ps(l1, exp16(_mm512_maskz_fmsub_ps(l1, _mm512_loadu_ps(sr + i + 16), sc, m16)));
            _mm512_storeu_si512((void *)(pb + (size_t)r * CHUNK + i), (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
            lsum = _mm512_add_ps(_mm512_add_ps(lsum, p0), p1);
        }
        mx[r] = m;
        ls[r] = _mm512_reduce_add_ps(lsum);
    }
    PROF_T(2);
    for (int e0 = 0; e0 < ne; e0 += 4) { /* up to four C tiles of 16 dims at a time */
        const int four = ne - e0 >= 4;
        _tile_zero(0);
        _tile_zero(1);
        if (four) {
            _tile_zero(2);
            _tile_zero(3);
        }
        for (int b = 0; b * KEYS_P < nv; b++) {
            const uint32_t *vt = vp + ((size_t)b * ne + e0) * 256;
            _tile_loadd(4, pb + KEYS_P * b, CHUNK * 2);
            _tile_loadd(6, vt, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(7, vt + 256, 64);
            _tile_dpbf16ps(1, 4, 7);
            if (four) {
                _tile_loadd(6, vt + 512, 64);
                _tile_dpbf16ps(2, 4, 6);
                _tile_loadd(7, vt + 768, 64);
                _tile_dpbf16ps(3, 4, 7);
            }
        }
        _tile_stored(0, ot + 16 * e0, hd * 4);
        _tile_stored(1, ot + 16 * e0 + 16, hd * 4);
        if (four) {
            _tile_stored(2, ot + 16 * e0 + 32, hd * 4);
            _tile_stored(3, ot + 16 * e0 + 48, hd * 4);
        }
    }
    PROF_T(3);
    for (int r = 0; r < nr; r++) {
        part[r][0] = mx[r];
        part[r][1] = ls[r];
        memcpy(part[r] + 2, ot + (size_t)r * hd, (size_t)hd * sizeof(float));
    }
    PROF_T(4);
}
#else
static inline int att_tiles(int hd, int group) { (void)hd; (void)group; return 0; }
static inline size_t att_chunk_dwords(int hd) { (void)hd; return 0; }
static inline size_t att_scratch(int hd) { (void)hd; return 0; }
#endif

/* rotate_half's rope of one vector in place: v[e] * cos[e] + v[e -+ half] * sin[e] (the sign folded into sin),
 * the second product fused */
static inline void rope_vec(float *v, int hd, const float *c, const float *s) {
    const int half = hd / 2;
    int e = 0;
    for (; half % 8 == 0 && e < half; e += 8) {
        const __m256 lo = _mm256_loadu_ps(v + e), hi = _mm256_loadu_ps(v + half + e);
        _mm256_storeu_ps(v + e, _mm256_fmadd_ps(hi, _mm256_loadu_ps(s + e), _mm256_mul_ps(lo, _mm256_loadu_ps(c + e))));
        _mm256_storeu_ps(v + half + e,
                         _mm256_fmadd_ps(lo, _mm256_loadu_ps(s + half + e), _mm256_mul_ps(hi, _mm256_loadu_ps(c + half + e))));
    }
    for (; e < half; e++) {
        const float lo = v[e], hi = v[half + e];
        v[e] = fmaf(hi, s[e], lo * c[e]);
        v[half + e] = fmaf(lo, s[half + e], hi * c[half + e]);
    }
}

/* ------------------------------------------------------------------ the layers
 * h [t, d] in place: layers [first, last) at slots pos..pos+t-1. rope_pos: each row's rotary
 * position (NULL: its slot). mask [t, pos+t] (NULL: causal, row r sees keys 0..pos+r).
 * write = 0: the slots' K/V are already in the cache and stay untouched. Returns 0, or -1 when
 * scratch memory cannot be had (nothing was written then). */
int cd_layers(const cd_model *m, float *h, int t, int first, int last, int pos, const int64_t *rope_pos,
              const uint8_t *mask, int write, float *kc, float *vc, int cap, const float *cos_t,
              const float *sin_t, int nthreads) {
    const int d = m->d, H = m->H, KV = m->KV, hd = m->hd, I = m->I, nq = H + 2 * KV, qw = nq * hd;
    if (t < 1 || first < 0 || last > m->n_layers || first > last || d < 1 || hd < 1 || KV < 1 || H % KV) return CD_ESIZE;
    for (int i = first; i < last; i++) /* layers are panels: a row-major format would want scratch they do not get */
        if (m->layers[i].wfmt < FMT_F32 || m->layers[i].wfmt > FMT_I8) return CD_ESIZE;
    if (pos < 0 || cap < 1 || pos > cap - t) return CD_EPOS; /* the slots pos..pos+t-1 must exist */
    if (rope_pos) {
        for (int r = 0; r < t; r++)
            if (rope_pos[r] < 0 || rope_pos[r] >= m->rope_len) return CD_EROPE;
    } else if (pos + t > m->rope_len) {
        return CD_EROPE;
    }
    const int group = H / KV, width = pos + t;
    if (nthreads < 1) nthreads = 1;
    /* Under a tree mask each row's visible slots in logical (increasing slot) order: kidx [t, width],
     * nvis [t]; such rows attend one per work item, each over its own keys. */
    int *kidx = NULL, *nvis = NULL;
    if (mask) {
        kidx = malloc(sizeof(int) * ((size_t)t * width + t));
        if (!kidx) return CD_ENOMEM;
        nvis = kidx + (size_t)t * width;
        for (int r = 0; r < t; r++) {
            int nv = 0;
            for (int j = 0; j < width; j++)
                if (mask[(size_t)r * width + j]) kidx[(size_t)r * width + nv++] = j;
            nvis[r] = nv;
        }
    }
    /* attention work items (row, head, chunk), with each row's first item */
    int *row_items = malloc(sizeof(int) * (size_t)(t + 1));
    if (!row_items) { free(kidx); return CD_ENOMEM; }
    row_items[0] = 0;
    int maxkeys = 0;
    for (int r = 0; r < t; r++) {
        int keys = mask ? nvis[r] : pos + r + 1;
        if (keys > maxkeys) maxkeys = keys;
        row_items[r + 1] = row_items[r] + H * ((keys + CHUNK - 1) / CHUNK);
    }
    const int items = row_items[t];
    /* Attention work items (KV head, chunk, unit, batch). The query vectors that read one KV head are
     * the pairs (row, q head of its group): every row's (causal: one unit of t * group pairs) or one row's
     * (tree: a unit per row, since its keys are its own), cut into nb even batches of at most ROW_GROUP.
     * A batch reads its chunk of K and V once for all its pairs, rather than once per q head: the group's
     * heads share it from L1. More batches than the size asks for only where the threads would idle. */
    const int nch = (maxkeys + CHUNK - 1) / CHUNK, units = mask ? t : 1, pairs = mask ? group : t * group;
    int nb = (pairs + ROW_GROUP - 1) / ROW_GROUP;
    const int busy = (2 * nthreads + KV * nch * units - 1) / (KV * nch * units);
    if (busy > nb) nb = busy < pairs ? busy : pairs;
    /* attention on tiles (the AMX build, grouped heads): each chunk of K/V is repacked once per layer for every
     * row (kvt: [KV][nch] chunks); under a tree mask only the chunks of the prefix (slots below pos), which a
     * row that sees them all reads as they are, and a tree row repacks the rest of its keys in its scratch */
    const int tiles = att_tiles(hd, group), shared = mask ? pos / CHUNK : nch; /* chunks repacked for all */
    const size_t kvt_dwords = tiles ? (size_t)KV * nch * att_chunk_dwords(hd) : 0;
    /* K transposed once per layer for every batch (kts: [KV][nch] chunks of CHUNK * hd floats), where several
     * batches read each chunk of a causal pass; else each batch transposes the blocks it reads */
    const size_t kts_floats = !mask && nb > 2 ? (size_t)KV * nch * CHUNK * hd : 0;
    size_t nx = (size_t)t * d, floats = (size_t)nthreads * nx + (size_t)t * qw + (size_t)t * H * hd
                                         + (size_t)t * 2 * I + (size_t)t * I + nx + (size_t)items * (hd + 2)
                                         + kts_floats + kvt_dwords + 16;
    float *buf = malloc(floats * sizeof(float));
    if (!buf) { free(row_items); free(kidx); return CD_ENOMEM; }
    uint32_t *kvt = (uint32_t *)(buf + floats - kvt_dwords);
    (void)kvt, (void)shared; /* read by the AMX build only */
    float *xs = buf, *qkv = xs + (size_t)nthreads * nx, *att = qkv + (size_t)t * qw, *gu = att + (size_t)t * H * hd;
    float *act = gu + (size_t)t * 2 * I, *y = act + (size_t)t * I, *parts = y + nx;
    /* 64-byte aligned (the 16 spare floats): its rows are read in whole cache lines */
    float *kts = kts_floats ? (float *)(((uintptr_t)(parts + (size_t)items * (hd + 2)) + 63) & ~(uintptr_t)63) : NULL;
    /* per-thread scratch for activation rows quantised (VNNI build) or rounded to bf16 (BF16 build); 0 bytes elsewhere */
    int maxin = d > H * hd ? d : H * hd;
    if (I > maxin) maxin = I;
    size_t qper = panel_scratch(t, maxin); /* layers are panels only */
    if (tiles && att_scratch(hd) > qper) qper = att_scratch(hd);
    qper = (qper + 63) & ~(size_t)63;
    char *qscr = qper ? aligned_alloc(64, qper * (size_t)nthreads) : NULL;
    if (qper && !qscr) { free(buf); free(row_items); free(kidx); return CD_ENOMEM; }

#pragma omp parallel num_threads(nthreads)
    {
        const unsigned int csr = denormals_off();
        const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
        float *x = xs + (size_t)tid * nx; /* each thread normalises h itself: no barrier for it */
        void *qs8 = qscr ? qscr + (size_t)tid * qper : NULL;
        int a, b;
        PROF_START;
        for (int li = first; li < last; li++) {
            const cd_layer *L = m->layers + li;
            for (int r = 0; r < t; r++) rms_row(h + (size_t)r * d, d, L->ln1, m->eps, x + (size_t)r * d);
            share_panels(qw, tid, nt, &a, &b);
            gemm_panels(x, t, d, L->qkv, L->wfmt, L->qkv_s, qw, L->qkv_b, qkv, qw, a, b, qs8);
#pragma omp barrier
            PROF(0);
            /* per (row, head of q, k, v): qk-norm, rope, and the new K/V into the cache */
            share_items(t * nq, tid, nt, &a, &b);
            for (int it = a; it < b; it++) {
                int r = it / nq, hh = it % nq;
                float *vec = qkv + (size_t)r * qw + (size_t)hh * hd;
                if (hh < H + KV) {
                    const float *nw = hh < H ? L->q_norm : L->k_norm;
                    if (nw) rms_row(vec, hd, nw, m->eps, vec);
                    int64_t rp = rope_pos ? rope_pos[r] : (int64_t)pos + r;
                    const float *c = cos_t + (size_t)rp * hd, *s = sin_t + (size_t)rp * hd;
                    rope_vec(vec, hd, c, s);
                }
                if (write && hh >= H) {
                    int g = hh < H + KV ? hh - H : hh - H - KV;
                    float *dst = (hh < H + KV ? kc : vc) + (((size_t)li * KV + g) * cap + pos + r) * hd;
                    memcpy(dst, vec, (size_t)hd * sizeof(float));
                }
            }
#pragma omp barrier
            PROF(1);
            /* tiles for layers whose products already round activations (bf16 or int8 panels); a float32
             * layer keeps float32 attention */
            const int tl = tiles && L->wfmt != FMT_F32;
#if CD_AMX
            if (kvt_dwords && tl && shared) {
                share_items(KV * shared, tid, nt, &a, &b);
                for (int it = a; it < b; it++) {
                    const int g = it / shared, c = it % shared, n = width - c * CHUNK < CHUNK ? width - c * CHUNK : CHUNK;
                    const size_t base = ((size_t)li * KV + g) * cap * hd;
                    att_repack(kc + base, vc + base, NULL, c * CHUNK, n, hd,
                               kvt + ((size_t)g * nch + c) * att_chunk_dwords(hd));
                }
#pragma omp barrier
            }
#endif
            if (kts && !tl) {
                share_items(KV * nch, tid, nt, &a, &b);
                for (int it = a; it < b; it++) {
                    const int g = it / nch, c = it % nch, n = width - c * CHUNK < CHUNK ? width - c * CHUNK : CHUNK;
                    const float *kb = kc + ((size_t)li * KV + g) * cap * hd;
                    for (int i0 = 0; i0 < n; i0 += KB)
                        k_block_t(kb, NULL, c * CHUNK + i0, n - i0 < KB ? n - i0 : KB, hd,
                                  kts + ((size_t)it * CHUNK + i0) * hd);
                }
#pragma omp barrier
            }
            share_items(KV * nch * units * nb, tid, nt, &a, &b);
            for (int it = a; it < b; it++) {
                const int g = it / (nch * units * nb), c = (it / (units * nb)) % nch, u = (it / nb) % units,
                          bt = it % nb;
                const float *qs[ROW_GROUP];
                const int *ki = mask ? kidx + (size_t)u * width : NULL;
                float *ps[ROW_GROUP];
                int nk[ROW_GROUP], nr = 0, p0, p1;
                share_items(pairs, bt, nb, &p0, &p1); /* batch bt's pairs: the even cut threads get */
                for (int p = p0; p < p1; p++) {
                    const int r = mask ? u : p / group, head = g * group + p % group;
                    const int keys = mask ? nvis[r] : pos + r + 1;
                    if (keys <= c * CHUNK) continue;
                    const int per_head = (row_items[r + 1] - row_items[r]) / H;
                    qs[nr] = qkv + (size_t)r * qw + (size_t)head * hd;
                    ps[nr] = parts + (size_t)(row_items[r] + head * per_head + c) * (hd + 2);
                    nk[nr++] = keys;
                }
                if (nr == 0) continue;
                const float *kb = kc + ((size_t)li * KV + g) * cap * hd, *vb = vc + ((size_t)li * KV + g) * cap * hd;
#if CD_AMX
                if (tl) {
                    const uint32_t *kv = kvt + ((size_t)g * nch + c) * att_chunk_dwords(hd);
                    const int end = (c + 1) * CHUNK; /* a tree row that sees every slot of a prefix chunk reads it shared */
                    if (mask && !(c < shared && end <= nvis[u] && ki[end - 1] == end - 1)) {
                        /* this row's own keys, repacked behind the kernel's scratch */
                        uint32_t *own = (uint32_t *)((char *)qs8 + att_scratch(hd) - att_chunk_dwords(hd) * 4 - 64);
                        own = (uint32_t *)(((uintptr_t)own) & ~(uintptr_t)63);
                        const int n = nvis[u] - c * CHUNK < CHUNK ? nvis[u] - c * CHUNK : CHUNK;
                        att_repack(kb, vb, ki, c * CHUNK, n, hd, own);
                        kv = own;
                    }
                    attend_tiles(qs, nk, nr, kv, hd, m->scale, c * CHUNK, ps, (char *)qs8);
                    continue;
                }
#endif
                attend_rows(qs, nk, ki, nr, kb, vb, kts && !tl ? kts + ((size_t)g * nch + c) * CHUNK * hd : NULL, hd,
                            m->scale, c * CHUNK, ps);
            }
#if CD_AMX
            if (tl) _tile_release();
#else
            (void)tl;
#endif
#pragma omp barrier
            PROF(2);
            share_items(t * H, tid, nt, &a, &b);
            for (int it = a; it < b; it++) {
                int r = it / H, head = it % H, per_head = (row_items[r + 1] - row_items[r]) / H;
                merge(parts + (size_t)(row_items[r] + head * per_head) * (hd + 2), per_head, hd,
                      att + (size_t)r * H * hd + (size_t)head * hd);
            }
#pragma omp barrier
            PROF(3);
            share_panels(d, tid, nt, &a, &b);
            gemm_panels(att, t, H * hd, L->o, L->wfmt, L->o_s, d, L->o_b, y, d, a, b, qs8);
            add_cols(h, y, t, d, a, b);
#pragma omp barrier
            PROF(4);
            for (int r = 0; r < t; r++) rms_row(h + (size_t)r * d, d, L->ln2, m->eps, x + (size_t)r * d);
            /* the same gate and up columns in one thread, so their product needs no barrier */
            share_panels(I, tid, nt, &a, &b);
            gemm_panels(x, t, d, L->gate, L->wfmt, L->gate_s, I, L->gate_b, gu, 2 * I, a, b, qs8);
            gemm_panels(x, t, d, L->up, L->wfmt, L->up_s, I, L->up_b, gu + I, 2 * I, a, b, qs8);
            {
                int j0 = a * PW, j1 = b * PW < I ? b * PW : I;
                for (int r = 0; r < t; r++)
                    silu_mul(gu + (size_t)r * 2 * I + j0, gu + (size_t)r * 2 * I + I + j0, j1 - j0, act + (size_t)r * I + j0);
            }
#pragma omp barrier
            PROF(5);
            share_panels(d, tid, nt, &a, &b);
            gemm_panels(act, t, I, L->down, L->wfmt, L->down_s, d, L->down_b, y, d, a, b, qs8);
            add_cols(h, y, t, d, a, b);
#pragma omp barrier
            PROF(6);
        }
        _mm_setcsr(csr);
    }
    free(buf);
    free(qscr);
    free(row_items);
    free(kidx);
    return 0;
}

/* the sizes every matrix entry point checks (wscale: the int8 format's scales, which it cannot go without) */
static inline int matrix_args_bad(int t, int in, int out, int wfmt, const float *wscale) {
    return t < 1 || in < 1 || out < 1 || wfmt < FMT_F32 || wfmt > FMT_BF16_ROWS || (wfmt == FMT_I8 && !wscale);
}

/* `reps` products y [t, out] = x [t, in] times W (packed from [out, in] in format wfmt) + bias, the panels
 * shared out over nthreads threads in one parallel region: each thread computes its share `reps` times with
 * no fork or join between (cd_head once, cd_arith over and over). 0, or CD_ENOMEM. */
static int gemm_threads(const float *x, int t, int in, const void *W, int wfmt, const float *wscale, int out,
                        const float *bias, float *y, int reps, int nthreads) {
    if (nthreads < 1) nthreads = 1;
    const size_t qper = (row_scratch(t, in) + 63) & ~(size_t)63;
    char *qscr = qper ? aligned_alloc(64, qper * (size_t)nthreads) : NULL;
    if (qper && !qscr) return CD_ENOMEM;
#pragma omp parallel num_threads(nthreads)
    {
        const unsigned int csr = denormals_off();
        int a, b;
        share_panels(out, omp_get_thread_num(), omp_get_num_threads(), &a, &b);
        char *scr = qscr ? qscr + (size_t)omp_get_thread_num() * qper : NULL;
        for (int r = 0; r < reps; r++) gemm_panels(x, t, in, W, wfmt, wscale, out, bias, y, out, a, b, scr);
        _mm_setcsr(csr);
    }
    free(qscr);
    return 0;
}

/* Final norm + an LM head (or a subset of its rows): x [t, d] -> logits [t, V], W packed from [V, d]. */
int cd_head(const float *h, int t, int d, const float *norm_w, float eps, const void *W, int wfmt, const float *wscale,
            int V, const float *bias, float *out, int nthreads) {
    if (matrix_args_bad(t, d, V, wfmt, wscale)) return CD_ESIZE;
    float *x = malloc(sizeof(float) * (size_t)t * d);
    if (!x) return CD_ENOMEM;
    for (int r = 0; r < t; r++) rms_row(h + (size_t)r * d, d, norm_w, eps, x + (size_t)r * d);
    const int rc = gemm_threads(x, t, d, W, wfmt, wscale, V, bias, out, 1, nthreads);
    free(x);
    return rc;
}

/* One matrix product, y [t, out] = x [t, in] times W (packed from [out, in] in format wfmt) + bias, in one
 * thread and with no norm: the tests compare each build's arithmetic with a reference through it. */
int cd_gemm(const float *x, int t, int in, const void *W, int wfmt, const float *wscale, int out, const float *bias,
            float *y) {
    if (matrix_args_bad(t, in, out, wfmt, wscale)) return CD_ESIZE;
    void *scr = NULL;
    const size_t q = row_scratch(t, in);
    if (q && !(scr = malloc(q))) return CD_ENOMEM;
    const unsigned int csr = denormals_off();
    gemm_panels(x, t, in, W, wfmt, wscale, out, bias, y, out, 0, (out + PW - 1) / PW, scr);
    _mm_setcsr(csr);
    free(scr);
    return 0;
}

/* The matrix arithmetic alone: `reps` products of x [t, in] with W, as cd_head computes its product but
 * with no norm and no bias, over and over. With W small enough to stay in cache, the time says how fast
 * this build's kernels consume weights at t rows when no memory stream holds them back (bench-device sets
 * that against a streamed step). y [t, out]: the product, as cd_gemm's. */
int cd_arith(const float *x, int t, int in, const void *W, int wfmt, const float *wscale, int out, float *y, int reps,
             int nthreads) {
    if (matrix_args_bad(t, in, out, wfmt, wscale) || reps < 1) return CD_ESIZE;
    return gemm_threads(x, t, in, W, wfmt, wscale, out, NULL, y, reps, nthreads);
}

/* index of the largest of n logits: the first of equal maxima, as torch.argmax */
static inline int argmax_row(const float *row, int n) {
    int j = 0;
    for (int v = 1; v < n; v++)
        if (row[v] > row[j]) j = v;
    return j;
}

/* one embedding row into dst [d]: embed is [vocab, d], float32 or (ebf16) bf16 bits widened exactly */
static void embed_row(const void *embed, int ebf16, int64_t tok, int d, float *dst) {
    if (!ebf16) {
        memcpy(dst, (const float *)embed + (size_t)tok * d, sizeof(float) * (size_t)d);
        return;
    }
    const uint16_t *src = (const uint16_t *)embed + (size_t)tok * d;
    for (int i = 0; i < d; i++) {
        uint32_t bits = (uint32_t)src[i] << 16;
        memcpy(dst + i, &bits, sizeof(float));
    }
}

/* Greedy early-exit drafting in one call: up to k_max tokens after `token`, each fed through layers
 * [0, E) at slots pos, pos+1, ... (their K/V written: the verifier keeps them, as it would have written
 * the same) and scored by the final norm and the head rows Wp (the draft vocabulary; ids maps a row to
 * its token id, NULL: row j is id j). Stops when the top probability falls below threshold (the state
 * fed last is kept, with no token for it) and after an eos id. states [k_max, d]: the layer-E state of
 * each fed token. Returns the number of tokens drafted (and *n_fed), or a negative CD_E* code (bad
 * arguments are refused before anything is written). */
int cd_draft_greedy(const cd_model *m, const void *embed, int ebf16, int64_t token, int E, int pos, int k_max,
                    float threshold, const float *norm_w, float norm_eps, const void *Wp, int wfmt, const float *wscale,
                    int Vd, const float *bias, const int64_t *ids, const int64_t *eos, int n_eos, float *kc, float *vc,
                    int cap, const float *cos_t, const float *sin_t, int nthreads, int64_t *tokens, float *states,
                    int *n_fed) {
    const int d = m->d;
    *n_fed = 0;
    if (k_max < 1 || E < 0 || E > m->n_layers || Vd < 1 || n_eos < 0) return CD_ESIZE;
    if (pos < 0 || pos > cap - k_max) return CD_EPOS;
    if (pos + k_max > m->rope_len) return CD_EROPE;
    if (token < 0 || token >= m->vocab) return CD_ETOKEN;
    if (ids) /* every row's id, checked once: a drafted token is fed back as the next input */
        for (int j = 0; j < Vd; j++)
            if (ids[j] < 0 || ids[j] >= m->vocab) return CD_ETOKEN;
    if (!ids && Vd > m->vocab) return CD_ESIZE;
    float *logits = malloc(sizeof(float) * (size_t)(Vd + 8));
    if (!logits) return CD_ENOMEM;
    int k = 0, fed = 0, rc = 0;
    int64_t x = token;
    for (int i = 0; i < k_max; i++) {
        float *h = states + (size_t)i * d;
        embed_row(embed, ebf16, x, d, h);
        rc = cd_layers(m, h, 1, 0, E, pos + i, NULL, NULL, 1, kc, vc, cap, cos_t, sin_t, nthreads);
        if (rc == 0) rc = cd_head(h, 1, d, norm_w, norm_eps, Wp, wfmt, wscale, Vd, bias, logits, nthreads);
        if (rc != 0) break;
        fed++;
        int j = argmax_row(logits, Vd);
        if (threshold > 0.0f) {
            /* top probability = 1 / sum_v exp(l_v - l_j) */
            const float top_logit = logits[j];
            int n8 = (Vd + 7) & ~7;
            for (int v = Vd; v < n8; v++) logits[v] = -INFINITY;
            __m256 acc = _mm256_setzero_ps(), mx = _mm256_set1_ps(top_logit);
            for (int v = 0; v < n8; v += 8) {
                __m256 lv = _mm256_loadu_ps(logits + v);
                __m256 live = _mm256_cmp_ps(lv, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ);
                acc = _mm256_add_ps(acc, _mm256_and_ps(exp8(_mm256_sub_ps(lv, mx)), live));
            }
            if (1.0f / hsum8(acc) < threshold) break; /* unsure: the verifier takes over from this state */
        }
        int64_t tok = ids ? ids[j] : (int64_t)j;
        tokens[k++] = tok;
        int stop = 0;
        for (int e = 0; e < n_eos; e++) stop |= tok == eos[e];
        if (stop) break;
        x = tok;
    }
    free(logits);
    *n_fed = fed;
    return rc ? rc : k;
}

/* A greedy verify pass in one call: tokens [t] (the pending token, then the drafted ones) embedded, fed
 * through layers [0, last) at slots pos.. (their K/V written), the final norm and the head, and each row's
 * argmax into out [t] (argmax_row). The same cd_layers and cd_head a plain step runs, so row r's argmax is
 * what a plain step at slot pos + r would pick. Returns 0, or a negative CD_E* code: bad arguments are
 * refused before anything is written; without memory the K/V of the slots may be partly written (they
 * are past the sequence's valid length, so nothing reads them). */
int cd_verify_greedy(const cd_model *m, const void *embed, int ebf16, const int64_t *tokens, int t, int last, int pos,
                     const float *norm_w, float norm_eps, const void *W, int wfmt, const float *wscale, int V,
                     const float *bias, float *kc, float *vc, int cap, const float *cos_t, const float *sin_t,
                     int nthreads, int64_t *out) {
    const int d = m->d;
    if (t < 1 || last < 0 || last > m->n_layers || V < 1) return CD_ESIZE;
    if (pos < 0 || pos > cap - t) return CD_EPOS;
    for (int r = 0; r < t; r++)
        if (tokens[r] < 0 || tokens[r] >= m->vocab) return CD_ETOKEN;
    float *h = malloc(sizeof(float) * (size_t)t * d);
    float *logits = malloc(sizeof(float) * (size_t)t * V);
    int rc = CD_ENOMEM;
    if (h && logits) {
        for (int r = 0; r < t; r++) embed_row(embed, ebf16, tokens[r], d, h + (size_t)r * d);
        rc = cd_layers(m, h, t, 0, last, pos, NULL, NULL, 1, kc, vc, cap, cos_t, sin_t, nthreads);
        if (rc == 0) rc = cd_head(h, t, d, norm_w, norm_eps, W, wfmt, wscale, V, bias, logits, nthreads);
        if (rc == 0)
            for (int r = 0; r < t; r++) out[r] = argmax_row(logits + (size_t)r * V, V);
    }
    free(h);
    free(logits);
    return rc;
}
