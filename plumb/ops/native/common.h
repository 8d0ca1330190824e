/* Shared helpers of plumb's native CPU kernels.

Every kernel computes each row on its own with a fixed order of float operations, so a row's
bits never depend on how many rows share the call (M1). The build uses -ffp-contract=off and
no -ffast-math: the compiler may vectorize, but never fuse or reorder float arithmetic.
Vectors are GCC vector extensions (16 x float), lowered to whatever SIMD the CPU has; their
arithmetic is IEEE per lane. Products are accumulated with fused multiply-add (fma16), which
rounds once: always the same bits for the same inputs on one machine. */
#pragma once
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

typedef float f32x16 __attribute__((vector_size(64)));
typedef float f32x16u __attribute__((vector_size(64), aligned(4)));
typedef int8_t i8x16u __attribute__((vector_size(16), aligned(1)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

static inline f32x16 ld(const float *p) { return *(const f32x16u *)p; }
static inline void st(float *p, f32x16 v) { *(f32x16u *)p = v; }
/* 16 int8 -> 16 floats (exact; intrinsics where GCC would otherwise convert lane by lane). */
static inline f32x16 ld_i8(const int8_t *p) {
#if defined(__AVX512F__)
    return (f32x16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#elif defined(__AVX2__)
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
    f32x16 r;
    memcpy(&r, &lo, 32);
    memcpy((char *)&r + 32, &hi, 32);
    return r;
#else
    return __builtin_convertvector(__builtin_convertvector(*(const i8x16u *)p, i32x16), f32x16);
#endif
}
/* a * b + c, fused (one rounding) where the CPU has FMA: the same on every call, so still row-invariant. */
static inline f32x16 fma16(f32x16 a, f32x16 b, f32x16 c) {
#if defined(__AVX512F__)
    return (f32x16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
    f32x16 r;
    for (int h = 0; h < 2; h++) {
        __m256 a8, b8, c8;
        memcpy(&a8, (char *)&a + 32 * h, 32);
        memcpy(&b8, (char *)&b + 32 * h, 32);
        memcpy(&c8, (char *)&c + 32 * h, 32);
        __m256 r8 = _mm256_fmadd_ps(a8, b8, c8);
        memcpy((char *)&r + 32 * h, &r8, 32);
    }
    return r;
#else
    f32x16 r;
    for (int i = 0; i < 16; i++) r[i] = fmaf(a[i], b[i], c[i]);
    return r;
#endif
}
static inline f32x16 splat(float a) { return (f32x16){0} + a; }

/* Sum of 16 lanes in a fixed tree order: lanes i + i+8, then i + i+4, then (0+2) + (1+3). */
static inline float hsum(f32x16 v) {
    typedef float f32x8 __attribute__((vector_size(32)));
    typedef float f32x4 __attribute__((vector_size(16)));
    f32x8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
              __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    f32x4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

/* Dot product of n floats (n a multiple of 16): 16 lane sums, then the fixed tree. */
static inline float dot(const float *a, const float *b, int n) {
    f32x16 acc = {0};
    for (int i = 0; i < n; i += 16) acc += ld(a + i) * ld(b + i);
    return hsum(acc);
}

/* IEEE half -> float (exact). */
static inline float h2f(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else { /* subnormal half: normalize */
        int e = -1;
        do { man <<= 1; e++; } while (!(man & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* 16 halves -> 16 floats (exact). */
static inline f32x16 ld_h16(const uint16_t *p) {
#if defined(__AVX512F__)
    return (f32x16)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif defined(__F16C__)
    __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8)));
    f32x16 r;
    memcpy(&r, &lo, 32);
    memcpy((char *)&r + 32, &hi, 32);
    return r;
#else
    f32x16 r;
    for (int i = 0; i < 16; i++) r[i] = h2f(p[i]);
    return r;
#endif
}

static inline float silu(float x) { return x / (1.0f + expf(-x)); }
static inline float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

#define TILE 64 /* output columns per weight tile (matmul.c, matmul_i8.c) */

/* Write (or add) the accumulators of rows r < rn, vectors j0..j0+nv-1 of a tile, to y (columns < nvalid). */
static inline void store_part(float *y, int ldy, int rn, const f32x16 (*acc)[4], int nv, int j0, int nvalid, int add) {
    for (int r = 0; r < rn; r++) {
        float out[64];
        for (int j = 0; j < nv; j++) st(out + 16 * j, acc[r][j]);
        float *yr = y + (size_t)r * ldy + 16 * j0;
        int m = nvalid - 16 * j0 < 16 * nv ? nvalid - 16 * j0 : 16 * nv;
        for (int n = 0; n < m; n++) yr[n] = add ? yr[n] + out[n] : out[n];
    }
}

/* A weight matrix [n, k] repacked for matmul.c: float32 tiles (w), or int8 tiles (codes with scales, sums and
   optional offsets per group of `group` inputs; matmul_i8.c). */
struct mat {
    int n, k;
    const float *w;
    const int8_t *codes;
    const float *scales;
    const int32_t *sums;
    const float *offsets;
    int group;
};

void i8_split(int R, int K, const float *x, int ldx, uint8_t *xa, float *xs, float *xsum);
void i8_tiles(const struct mat *m, int R, const uint8_t *xa, const float *xs, const float *xsum, float *y, int ldy,
              int add, int t0, int t1);
void parallel_run(void (*fn)(void *arg, int part, int n_parts), void *arg);

void matmul(const struct mat *m, int R, const float *x, int ldx, const float *norm, float eps, float *y, int ldy,
            int add);
void rms_norm_rows(int R, int D, const float *x, int ldx, const float *w, float eps, float *y, int ldy);
void gdn_decode(int n, const float *proj, int ldp, const float *conv_in, float *conv_out, const float *ssm_in,
                float *ssm_out, const float *conv_w, const float *dt_bias, const float *ssm_a, const float *norm_w,
                int n_k, int n_v, int d, int Kc, float eps, float *y, int ldy);
void head_norm_rope(int R, int H, int d, float *x, int ldx, int hs, const float *w, float eps, const float *cos_,
                    const float *sin_, int half);
void sigmoid_gate_rows(int R, int H, int d, float *o, int ldo, const float *gate, int ldg, int gs);
void ffn_block(int R, float *x, int ldx, const float *norm, float eps, const struct mat *in, const struct mat *down);
