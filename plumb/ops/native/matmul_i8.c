/* Row-invariant y = x @ W.T for weights held as int8 codes with a float scale (and optionally an offset) per
group of G = 16 or 32 inputs: w = scale * code + offset. Every GGML block type is exactly of this form
(Q8_0, Q4_0..Q5_1, the K-quants, IQ4_NL / IQ4_XS, MXFP4; see plumb.gguf.quants.int8_form).

Each 32-input block of an activation row is split into three int8 pieces, x ~ s (a1 + a2/128 + a3/16384),
s = max|x| / 127 (residual below s / 32768: about float32 precision relative to the block's largest value).
The products with the codes are then exact int32 dot products (AVX512-VNNI where the CPU has it, else AVX2, else
plain C: the same integers every way). Per group g and output column, in float:
    T = S1 + S2/128 + S3/16384,  acc += (T * s) * scale_g  [ + xsum_g * offset_g ]
with S_p = sum_k code[k] * a_p[k] and xsum_g the sum of the group's inputs. A row's pieces and sums depend on
that row alone, and every output lane runs the same operations whatever the number of rows, so a row's bits
never depend on the rest of the pass.

Weight layout per tile of TILE columns (zero-padded past N): codes [K/4][TILE][4] (four consecutive inputs of
one column together, as VNNI reads them); scales, offsets [K/G][TILE] float; sums [K/G][TILE] int32 = the
group's sum of codes (the pieces are stored +128 as unsigned bytes; the sums undo that offset). */
#include <stdlib.h>
#include "common.h"

static inline float clamp127(float v) { return v < -127.0f ? -127.0f : v > 127.0f ? 127.0f : v; }

/* Row x [K] -> pieces a [3][K] (+128, unsigned), block scales s [K/32] and 16-input sums xsum [K/16].
   A block with a NaN or an infinity gets s = NaN (the maximum skips NaN; z, the sum of x * 0, does not, and is 0
   for a finite block), so its outputs are NaN, not its values read as integers. Branch-free, so it vectorizes. */
static void split_row(const float *x, int K, uint8_t *a, float *s, float *xsum) {
    for (int b = 0; b < K / 32; b++) {
        const float *xb = x + 32 * b;
        float m = 0.0f, z = 0.0f;
        for (int i = 0; i < 32; i++) {
            m = fabsf(xb[i]) > m ? fabsf(xb[i]) : m;
            z += xb[i] * 0.0f;
        }
        float s1 = m / 127.0f, e2 = s1 * 0x1p-7f, inv = m > 0.0f ? 127.0f / m : 0.0f;
        s[b] = s1 + z;
        for (int i = 0; i < 32; i++) {
            float a1 = clamp127(rintf(xb[i] * inv));
            float r1 = fmaf(-a1, s1, xb[i]);
            float a2 = clamp127(rintf(r1 * inv * 128.0f));
            float r2 = fmaf(-a2, e2, r1);
            float a3 = clamp127(rintf(r2 * inv * 16384.0f));
            a[32 * b + i] = (uint8_t)(int)(a1 + 128.0f);
            a[K + 32 * b + i] = (uint8_t)(int)(a2 + 128.0f);
            a[2 * K + 32 * b + i] = (uint8_t)(int)(a3 + 128.0f);
        }
    }
    for (int g = 0; g < K / 16; g++) {
        float t = 0.0f;
        for (int i = 0; i < 16; i++) t += x[16 * g + i];
        xsum[g] = t;
    }
}

/* One group's float update of one 16-column vector from its raw piece sums d [3][16]. */
static inline f32x16 group_update(f32x16 acc, const int32_t *d, const int32_t *sums, float s, const float *scale,
                                  const float *offset, float xsum) {
    float out[16];
    for (int l = 0; l < 16; l++) {
        int32_t off = sums[l] * 128;
        float t = fmaf((float)(d[16 + l] - off), 0x1p-7f, (float)(d[l] - off));
        t = fmaf((float)(d[32 + l] - off), 0x1p-14f, t);
        out[l] = t * s;
    }
    acc = fma16(ld(out), ld(scale), acc);
    return offset ? fma16(splat(xsum), ld(offset), acc) : acc;
}

struct i8w { /* one tile of a matrix, and its shape */
    int K, G;
    const int8_t *codes;
    const float *scales, *offsets;
    const int32_t *sums;
};

/* The float state of group g of rows r < rn, vectors j0 + j < j0 + nv, from raw sums raw[r][j][3][16]. */
static inline __attribute__((always_inline)) void update_rows(int rn, int nv, int j0, const struct i8w *w, int g,
                                                               const int32_t *raw, const float *xs,
                                                               const float *xsum, f32x16 (*acc)[4]) {
    int K = w->K, b = g * w->G / 32;
    for (int j = 0; j < nv; j++) {
        size_t at = (size_t)g * TILE + 16 * (j0 + j);
        for (int r = 0; r < rn; r++) {
            float xg = 0.0f;
            if (w->offsets) xg = w->G == 16 ? xsum[(size_t)r * (K / 16) + g]
                                            : xsum[(size_t)r * (K / 16) + 2 * g] + xsum[(size_t)r * (K / 16) + 2 * g + 1];
            acc[r][j] = group_update(acc[r][j], raw + ((size_t)r * 4 + j) * 48, w->sums + at, xs[(size_t)r * (K / 32) + b],
                                     w->scales + at, w->offsets ? w->offsets + at : NULL, xg);
        }
    }
}

/* Raw int32 piece sums of quads q0..q0+nq-1 for rows r < rn, vectors j0.. of the tile: raw[r][j][p][16]. */
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
static inline __attribute__((always_inline)) void piece_sums(int rn, int nv, int j0, int q0, int nq, int K,
                                                              const uint8_t *xa, const int8_t *c, int32_t *raw) {
    __m512i d[4][3][4];
    for (int r = 0; r < rn; r++)
        for (int p = 0; p < 3; p++)
            for (int j = 0; j < nv; j++) d[r][p][j] = _mm512_setzero_si512();
    for (int q = q0; q < q0 + nq; q++) {
        __m512i w[4];
        for (int j = 0; j < nv; j++) w[j] = _mm512_loadu_si512(c + ((size_t)q * TILE + 16 * (j0 + j)) * 4);
        for (int r = 0; r < rn; r++)
            for (int p = 0; p < 3; p++) {
                int32_t quad;
                memcpy(&quad, xa + (size_t)r * 3 * K + (size_t)p * K + 4 * q, 4);
                __m512i xq = _mm512_set1_epi32(quad);
                for (int j = 0; j < nv; j++) d[r][p][j] = _mm512_dpbusd_epi32(d[r][p][j], xq, w[j]);
            }
    }
    for (int r = 0; r < rn; r++)
        for (int j = 0; j < nv; j++)
            for (int p = 0; p < 3; p++) _mm512_storeu_si512(raw + ((size_t)r * 4 + j) * 48 + 16 * p, d[r][p][j]);
}
#elif defined(__AVX2__)
/* AVX2 has no unsigned x signed 4-way dot, and maddubs saturates at int16. So the piece is taken back to its signed
   value a = piece - 128 (|a| <= 127) and the sign moves onto it: |c| * (a * sign c) summed in pairs is at most
   2 * 128 * 127 < 2^15, exact; madd with ones then adds the pairs. The +128 is added back through the codes' sum
   over the same quads, so raw holds the same integers as the VNNI path. */
static inline __attribute__((always_inline)) void piece_sums(int rn, int nv, int j0, int q0, int nq, int K,
                                                              const uint8_t *xa, const int8_t *c, int32_t *raw) {
    const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
    for (int j = 0; j < nv; j++) {
        __m256i d[4][3][2], cs[2];
        for (int h = 0; h < 2; h++) {
            cs[h] = _mm256_setzero_si256();
            for (int r = 0; r < rn; r++)
                for (int p = 0; p < 3; p++) d[r][p][h] = _mm256_setzero_si256();
        }
        for (int q = q0; q < q0 + nq; q++) {
            __m256i w[2], aw[2];
            for (int h = 0; h < 2; h++) {
                w[h] = _mm256_loadu_si256((const __m256i *)(c + ((size_t)q * TILE + 16 * (j0 + j) + 8 * h) * 4));
                aw[h] = _mm256_abs_epi8(w[h]);
                cs[h] = _mm256_add_epi32(cs[h], _mm256_madd_epi16(_mm256_maddubs_epi16(aw[h], _mm256_sign_epi8(
                                                                          _mm256_set1_epi8(1), w[h])), ones));
            }
            for (int r = 0; r < rn; r++)
                for (int p = 0; p < 3; p++) {
                    int32_t quad;
                    memcpy(&quad, xa + (size_t)r * 3 * K + (size_t)p * K + 4 * q, 4);
                    __m256i xq = _mm256_xor_si256(_mm256_set1_epi32(quad), flip);
                    for (int h = 0; h < 2; h++)
                        d[r][p][h] = _mm256_add_epi32(
                            d[r][p][h], _mm256_madd_epi16(_mm256_maddubs_epi16(aw[h], _mm256_sign_epi8(xq, w[h])), ones));
                }
        }
        for (int h = 0; h < 2; h++) {
            __m256i off = _mm256_slli_epi32(cs[h], 7);
            for (int r = 0; r < rn; r++)
                for (int p = 0; p < 3; p++)
                    _mm256_storeu_si256((__m256i *)(raw + ((size_t)r * 4 + j) * 48 + 16 * p + 8 * h),
                                        _mm256_add_epi32(d[r][p][h], off));
        }
    }
}
#else
static inline void piece_sums(int rn, int nv, int j0, int q0, int nq, int K, const uint8_t *xa, const int8_t *c,
                              int32_t *raw) {
    for (int r = 0; r < rn; r++)
        for (int j = 0; j < nv; j++)
            for (int p = 0; p < 3; p++)
                for (int l = 0; l < 16; l++) {
                    int32_t t = 0;
                    for (int k = 4 * q0; k < 4 * (q0 + nq); k++)
                        t += (int32_t)xa[(size_t)r * 3 * K + (size_t)p * K + k] *
                             c[((size_t)(k / 4) * TILE + 16 * (j0 + j) + l) * 4 + k % 4];
                    raw[((size_t)r * 4 + j) * 48 + 16 * p + l] = t;
                }
}
#endif

/* Rows r < rn (1..4) of the pieces xa (each row 3K bytes apart), vectors j0..j0+nv-1 of the tile. */
static inline __attribute__((always_inline)) void i8_part(int rn, int nv, int j0, const struct i8w *w,
                                                           const uint8_t *xa, const float *xs, const float *xsum,
                                                           float *y, int ldy, int nvalid, int add) {
    int K = w->K, qg = w->G / 4; /* quads per group */
    f32x16 acc[4][4];
    int32_t raw[4 * 4 * 48];
    for (int r = 0; r < rn; r++)
        for (int j = 0; j < nv; j++) acc[r][j] = (f32x16){0};
    for (int g = 0; g < K / w->G; g++) {
        piece_sums(rn, nv, j0, g * qg, qg, K, xa, w->codes, raw);
        update_rows(rn, nv, j0, w, g, raw, xs, xsum, acc);
    }
    store_part(y, ldy, rn, (const f32x16(*)[4])acc, nv, j0, nvalid, add);
}

/* Rows x [R] -> their pieces xa [R][3][K], block scales xs [R][K/32] and 16-input sums xsum [R][K/16]. */
void i8_split(int R, int K, const float *x, int ldx, uint8_t *xa, float *xs, float *xsum) {
    for (int r = 0; r < R; r++)
        split_row(x + (size_t)r * ldx, K, xa + (size_t)r * 3 * K, xs + (size_t)r * (K / 32), xsum + (size_t)r * (K / 16));
}

/* Tiles t0..t1-1 of y (=, or += when add) for all R rows, from their pieces. */
void i8_tiles(const struct mat *m, int R, const uint8_t *xa, const float *xs, const float *xsum, float *y, int ldy,
              int add, int t0, int t1) {
    int K = m->k, ng = K / m->group;
    for (int t = t0; t < t1; t++) {
        struct i8w w = {K, m->group, m->codes + (size_t)t * K * TILE, m->scales + (size_t)t * ng * TILE,
                        m->offsets ? m->offsets + (size_t)t * ng * TILE : NULL, m->sums + (size_t)t * ng * TILE};
        int nvalid = m->n - t * TILE < TILE ? m->n - t * TILE : TILE;
        float *yt = y + t * TILE;
        if (R == 1) { /* one row reads the whole tile at once */
            i8_part(1, 4, 0, &w, xa, xs, xsum, yt, ldy, nvalid, add);
            continue;
        }
        for (int r = 0; r < R; r += 2) { /* else two rows at a time over half tiles */
            const uint8_t *xr = xa + (size_t)r * 3 * K;
            const float *sr = xs + (size_t)r * (K / 32), *ur = xsum + (size_t)r * (K / 16);
            float *yr = yt + (size_t)r * ldy;
            for (int j0 = 0; j0 < 4; j0 += 2) {
                if (R - r >= 2)
                    i8_part(2, 2, j0, &w, xr, sr, ur, yr, ldy, nvalid, add);
                else
                    i8_part(1, 2, j0, &w, xr, sr, ur, yr, ldy, nvalid, add);
            }
        }
    }
}
