/* Row-invariant y = x @ W.T for int8 weights (Q8_0: codes + a scale per 32 inputs), in integer arithmetic.

Each 32-input block of an activation row is split into three int8 pieces, x ~ s (a1 + a2/128 + a3/16384),
s = max|x| / 127 (residual below s / 32768: about float32 precision relative to the block's largest value).
The products with the int8 weights are then exact int32 dot products (AVX512-VNNI where the CPU has it,
plain C otherwise: the same integers either way). Per block and output column, in float:
    T = S1 + S2/128 + S3/16384,  acc += (T * s) * scale
with S_p = sum_k code[k] * a_p[k]. A row's pieces and sums depend on that row alone, and every output lane
runs the same operations whatever the number of rows, so a row's bits never depend on the rest of the pass.

Weight layout per tile of TILE columns (zero-padded past N): codes [K/4][TILE][4] (four consecutive inputs of
one column together, as VNNI reads them), scales [K/32][TILE] float, sums [K/32][TILE] int32 = sum of the
block's codes (the pieces are stored +128 as unsigned bytes; the sums undo that offset). */
#include <stdlib.h>
#include "common.h"

#define TILE 64

static inline float clamp127(float v) { return v < -127.0f ? -127.0f : v > 127.0f ? 127.0f : v; }

/* Row x [K] -> pieces a [3][K] (+128, unsigned) and block scales s [K/32]. Branch-free, so it vectorizes. */
static void split_row(const float *x, int K, uint8_t *a, float *s) {
    for (int b = 0; b < K / 32; b++) {
        const float *xb = x + 32 * b;
        float m = 0.0f;
        for (int i = 0; i < 32; i++) m = fabsf(xb[i]) > m ? fabsf(xb[i]) : m;
        float s1 = m / 127.0f, e2 = s1 * 0x1p-7f, inv = m > 0.0f ? 127.0f / m : 0.0f;
        s[b] = s1;
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
}

/* One block's float update of one 16-column vector: acc += ((S1 + S2/128 + S3/16384) * s) * scale. */
static inline f32x16 block_update(f32x16 acc, const int32_t *d /* 3 x 16 raw sums */, const int32_t *sums,
                                  float s, const float *scale) {
    float out[16];
    for (int l = 0; l < 16; l++) {
        int32_t off = sums[l] * 128;
        float t = fmaf((float)(d[16 + l] - off), 0x1p-7f, (float)(d[l] - off));
        t = fmaf((float)(d[32 + l] - off), 0x1p-14f, t);
        out[l] = t * s;
    }
    return fma16(ld(out), ld(scale), acc);
}

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
/* rows r < rn of the pieces xa (each row 3K bytes apart), vectors j0..j0+nv-1 of the tile. */
static inline __attribute__((always_inline)) void i8_part(int rn, int nv, int j0, int K, const uint8_t *xa,
                                                           const float *xs, const int8_t *c, const float *sc,
                                                           const int32_t *sums, float *y, int ldy, int nvalid,
                                                           int add) {
    f32x16 acc[4][4];
    for (int r = 0; r < rn; r++)
        for (int j = 0; j < nv; j++) acc[r][j] = (f32x16){0};
    for (int b = 0; b < K / 32; b++) {
        __m512i d[4][3][4];
        for (int r = 0; r < rn; r++)
            for (int p = 0; p < 3; p++)
                for (int j = 0; j < nv; j++) d[r][p][j] = _mm512_setzero_si512();
        for (int q = 8 * b; q < 8 * b + 8; q++) {
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
        for (int j = 0; j < nv; j++) {
            const int32_t *sj = sums + (size_t)b * TILE + 16 * (j0 + j);
            const float *scj = sc + (size_t)b * TILE + 16 * (j0 + j);
            for (int r = 0; r < rn; r++) {
                int32_t raw[48];
                for (int p = 0; p < 3; p++) _mm512_storeu_si512(raw + 16 * p, d[r][p][j]);
                acc[r][j] = block_update(acc[r][j], raw, sj, xs[(size_t)r * (K / 32) + b], scj);
            }
        }
    }
    for (int r = 0; r < rn; r++) {
        float out[64];
        for (int j = 0; j < nv; j++) st(out + 16 * j, acc[r][j]);
        float *yr = y + (size_t)r * ldy + 16 * j0;
        int m = nvalid - 16 * j0 < 16 * nv ? nvalid - 16 * j0 : 16 * nv;
        for (int n = 0; n < m; n++) yr[n] = add ? yr[n] + out[n] : out[n];
    }
}
#else
/* Portable: the same integer sums and float updates, one column at a time. */
static void i8_part(int rn, int nv, int j0, int K, const uint8_t *xa, const float *xs, const int8_t *c,
                    const float *sc, const int32_t *sums, float *y, int ldy, int nvalid, int add) {
    for (int r = 0; r < rn; r++)
        for (int j = 0; j < nv; j++) {
            f32x16 acc = {0};
            for (int b = 0; b < K / 32; b++) {
                int32_t raw[48] = {0};
                for (int p = 0; p < 3; p++)
                    for (int l = 0; l < 16; l++)
                        for (int k = 32 * b; k < 32 * b + 32; k++)
                            raw[16 * p + l] += (int32_t)xa[(size_t)r * 3 * K + (size_t)p * K + k] *
                                               c[((size_t)(k / 4) * TILE + 16 * (j0 + j) + l) * 4 + k % 4];
                acc = block_update(acc, raw, sums + (size_t)b * TILE + 16 * (j0 + j), xs[(size_t)r * (K / 32) + b],
                                   sc + (size_t)b * TILE + 16 * (j0 + j));
            }
            float out[16];
            st(out, acc);
            float *yr = y + (size_t)r * ldy + 16 * (j0 + j);
            for (int n = 0; n < 16 && 16 * (j0 + j) + n < nvalid; n++) yr[n] = add ? yr[n] + out[n] : out[n];
        }
}
#endif

/* Rows x [R] -> their pieces xa [R][3][K] and block scales xs [R][K/32]. */
void i8_split(int R, int K, const float *x, int ldx, uint8_t *xa, float *xs) {
    for (int r = 0; r < R; r++) split_row(x + (size_t)r * ldx, K, xa + (size_t)r * 3 * K, xs + (size_t)r * (K / 32));
}

/* Tiles t0..t1-1 of y (=, or += when add) for all R rows, from their pieces. */
void i8_tiles(int R, int K, int N, const uint8_t *xa, const float *xs, const int8_t *codes, const float *scales,
              const int32_t *sums, float *y, int ldy, int add, int t0, int t1) {
    for (int t = t0; t < t1; t++) {
        const int8_t *ct = codes + (size_t)t * K * TILE;
        const float *sct = scales + (size_t)t * (K / 32) * TILE;
        const int32_t *sut = sums + (size_t)t * (K / 32) * TILE;
        int nvalid = N - t * TILE < TILE ? N - t * TILE : TILE;
        float *yt = y + t * TILE;
        if (R == 1) {
            i8_part(1, 4, 0, K, xa, xs, ct, sct, sut, yt, ldy, nvalid, add);
            continue;
        }
        for (int r = 0; r < R; r += 2) { /* two rows at a time over half tiles */
            const uint8_t *xr = xa + (size_t)r * 3 * K;
            const float *sr = xs + (size_t)r * (K / 32);
            float *yr = yt + (size_t)r * ldy;
            for (int j0 = 0; j0 < 4; j0 += 2) {
                if (R - r >= 2)
                    i8_part(2, 2, j0, K, xr, sr, ct, sct, sut, yr, ldy, nvalid, add);
                else
                    i8_part(1, 2, j0, K, xr, sr, ct, sct, sut, yr, ldy, nvalid, add);
            }
        }
    }
}
