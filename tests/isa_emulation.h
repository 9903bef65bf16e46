/* Test-only (tests/emulated_kernels.py): step.c's AVX-512 and AVX-VNNI builds compiled for a CPU with
 * AVX2/FMA only. Force-included before step.c: its AVX-512 and VNNI intrinsics become SIMDe's (simde-py),
 * which compute them over 256-bit halves; those SIMDe lacks, and those whose SIMDe form differs from the
 * hardware in a way the tests could see, are written out below from the instruction set reference. */
#include <immintrin.h>
#include <string.h>
#include <math.h>
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>

static inline simde__m512i emu_cvtepi8_epi32(simde__m128i a) {
    int8_t s[16]; int32_t d[16];
    memcpy(s, &a, 16);
    for (int i = 0; i < 16; i++) d[i] = s[i];
    simde__m512i r; memcpy(&r, d, 64); return r;
}
#undef _mm512_cvtepi8_epi32
#define _mm512_cvtepi8_epi32(a) emu_cvtepi8_epi32(a)

static inline simde__m128i emu_cvtepi32_epi8(simde__m512i a) { /* truncates, as vpmovdb */
    int32_t s[16]; int8_t d[16];
    memcpy(s, &a, 64);
    for (int i = 0; i < 16; i++) d[i] = (int8_t)(uint8_t)(uint32_t)s[i];
    simde__m128i r; memcpy(&r, d, 16); return r;
}
#undef _mm512_cvtepi32_epi8
#define _mm512_cvtepi32_epi8(a) emu_cvtepi32_epi8(a)

/* the rounding argument is always round-to-nearest-even here, MXCSR's default mode */
#undef _mm512_mul_round_ps
#define _mm512_mul_round_ps(a, b, rounding) simde_mm512_mul_ps(a, b)

static inline uint16_t emu_bf16(float f) { /* round to nearest even, as vcvtne2ps2bf16 (NaN stays NaN) */
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
static inline simde__m512bh emu_cvtne2ps_pbh(simde__m512 a, simde__m512 b) {
    float fa[16], fb[16]; uint16_t d[32];
    memcpy(fa, &a, 64); memcpy(fb, &b, 64);
    for (int i = 0; i < 16; i++) { d[i] = emu_bf16(fb[i]); d[16 + i] = emu_bf16(fa[i]); }
    simde__m512bh r; memcpy(&r, d, 64); return r;
}
#undef _mm512_cvtne2ps_pbh
#define _mm512_cvtne2ps_pbh(a, b) emu_cvtne2ps_pbh(a, b)

/* vdpbf16ps as the SDM writes it: per lane, the odd pair's product added first, then the even pair's,
 * each add rounded (the products of two bf16 values are exact in float32) */
static inline simde__m512 emu_dpbf16_ps(simde__m512 src, simde__m512bh a, simde__m512bh b) {
    float s[16]; uint16_t x[32], y[32];
    memcpy(s, &src, 64); memcpy(x, &a, 64); memcpy(y, &b, 64);
    for (int j = 0; j < 16; j++)
        for (int h = 1; h >= 0; h--) {
            uint32_t ux = (uint32_t)x[2 * j + h] << 16, uy = (uint32_t)y[2 * j + h] << 16;
            float fx, fy; memcpy(&fx, &ux, 4); memcpy(&fy, &uy, 4);
            volatile float p = fx * fy;
            s[j] = s[j] + p;
        }
    simde__m512 r; memcpy(&r, s, 64); return r;
}
#undef _mm512_dpbf16_ps
#define _mm512_dpbf16_ps(src, a, b) emu_dpbf16_ps(src, a, b)

/* Masked loads read only the lanes their mask keeps, as the hardware does (it suppresses faults on the
 * others): SIMDe's load the whole 64 bytes, past the end of a row that ends at a page boundary. */
static inline void emu_maskz_copy(void *dst, const void *p, uint32_t k, int lane_bytes) {
    memset(dst, 0, 64);
    for (int i = 0; i < 64 / lane_bytes; i++)
        if (k >> i & 1) memcpy((char *)dst + lane_bytes * i, (const char *)p + lane_bytes * i, (size_t)lane_bytes);
}
static inline simde__m512 emu_maskz_loadu_ps(simde__mmask16 k, const void *p) {
    simde__m512 r; emu_maskz_copy(&r, p, k, 4); return r;
}
static inline simde__m512i emu_maskz_loadu_epi16(simde__mmask32 k, const void *p) {
    simde__m512i r; emu_maskz_copy(&r, p, k, 2); return r;
}
#undef _mm512_maskz_loadu_ps
#define _mm512_maskz_loadu_ps(k, p) emu_maskz_loadu_ps(k, p)
#undef _mm512_maskz_loadu_epi16
#define _mm512_maskz_loadu_epi16(k, p) emu_maskz_loadu_epi16(k, p)

/* AVX-VNNI's ymm vpdpbusd (the avx2-vnni build) is AVX512VL+VNNI's, VEX-encoded: the same sums */
#undef _mm256_dpbusd_avx_epi32
#define _mm256_dpbusd_avx_epi32(src, a, b) simde_mm256_dpbusd_epi32(src, a, b)

#define CD_EMULATED 1 /* step.c keeps intrinsics where it would use inline assembly */
/* which build: step.c reads the compiler's ISA macros, defined here after every header has been read */
#ifdef EMULATE_AVXVNNI
#define __AVXVNNI__ 1
#else
#define __AVX512F__ 1
#define __AVX512DQ__ 1
#define __AVX512BW__ 1
#define __AVX512VL__ 1
#endif
#ifdef EMULATE_VNNI
#define __AVX512VNNI__ 1
#endif
#ifdef EMULATE_BF16
#define __AVX512BF16__ 1
#endif
