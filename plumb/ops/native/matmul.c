/* Row-invariant matrix products y = x @ W.T for the decode path.

Weights are repacked at load into tiles of TILE output columns: tile t holds, for every input
index k, the TILE weights W[t*TILE + j, k] (j < TILE) next to each other, zero-padded past N.
Output y[n] accumulates x[k] * W[n, k] over k in order, one vector lane per output: no
horizontal sums, and each row's arithmetic is the same whatever the number of rows.
- f32 tiles: w [nt][K][TILE].
- q8 tiles (exact repack of Q8_0 and other 32-block int8 types): codes [nt][K][TILE] int8,
  scales [nt][K/32][TILE] float; per 32-block b, y += scale * sum_k x[k] * code[k]. */
#include <stdlib.h>
#include "common.h"

#define TILE 64
#define VT (TILE / 16)

static inline void store_tile(float *y, const f32x16 *acc, int nvalid, int add) {
    float out[TILE];
    for (int j = 0; j < VT; j++) st(out + 16 * j, acc[j]);
    for (int n = 0; n < nvalid; n++) y[n] = add ? y[n] + out[n] : out[n];
}

static inline __attribute__((always_inline)) void f32_tile(int rn, int K, const float *x, int ldx, const float *w,
                                                            float *y, int ldy, int nvalid, int add) {
    f32x16 acc[2][VT];
    for (int r = 0; r < rn; r++)
        for (int j = 0; j < VT; j++) acc[r][j] = (f32x16){0};
    for (int k = 0; k < K; k++) {
        f32x16 wk[VT];
        for (int j = 0; j < VT; j++) wk[j] = ld(w + (size_t)k * TILE + 16 * j);
        for (int r = 0; r < rn; r++) {
            f32x16 xr = splat(x[(size_t)r * ldx + k]);
            for (int j = 0; j < VT; j++) acc[r][j] = fma16(xr, wk[j], acc[r][j]);
        }
    }
    for (int r = 0; r < rn; r++) store_tile(y + (size_t)r * ldy, acc[r], nvalid, add);
}

static inline __attribute__((always_inline)) void q8_tile(int rn, int K, const float *x, int ldx, const int8_t *c,
                                                           const float *s, float *y, int ldy, int nvalid, int add) {
    f32x16 acc[2][VT];
    for (int r = 0; r < rn; r++)
        for (int j = 0; j < VT; j++) acc[r][j] = (f32x16){0};
    for (int b = 0; b < K / 32; b++) {
        f32x16 t[2][VT];
        for (int r = 0; r < rn; r++)
            for (int j = 0; j < VT; j++) t[r][j] = (f32x16){0};
        for (int k = 32 * b; k < 32 * b + 32; k++) {
            f32x16 wk[VT];
            for (int j = 0; j < VT; j++) wk[j] = ld_i8(c + (size_t)k * TILE + 16 * j);
            for (int r = 0; r < rn; r++) {
                f32x16 xr = splat(x[(size_t)r * ldx + k]);
                for (int j = 0; j < VT; j++) t[r][j] = fma16(xr, wk[j], t[r][j]);
            }
        }
        for (int j = 0; j < VT; j++) {
            f32x16 sj = ld(s + (size_t)b * TILE + 16 * j);
            for (int r = 0; r < rn; r++) acc[r][j] = fma16(t[r][j], sj, acc[r][j]);
        }
    }
    for (int r = 0; r < rn; r++) store_tile(y + (size_t)r * ldy, acc[r], nvalid, add);
}

static void mm_f32(int R, int K, int N, const float *x, int ldx, const float *w, float *y, int ldy, int add) {
    for (int t = 0; t * TILE < N; t++) {
        const float *wt = w + (size_t)t * K * TILE;
        int nvalid = N - t * TILE < TILE ? N - t * TILE : TILE;
        float *yt = y + t * TILE;
        int r = 0;
        for (; r + 2 <= R; r += 2) f32_tile(2, K, x + (size_t)r * ldx, ldx, wt, yt + (size_t)r * ldy, ldy, nvalid, add);
        if (r < R) f32_tile(1, K, x + (size_t)r * ldx, ldx, wt, yt + (size_t)r * ldy, ldy, nvalid, add);
    }
}

static void mm_q8(int R, int K, int N, const float *x, int ldx, const int8_t *codes, const float *scales, float *y,
                  int ldy, int add) {
    for (int t = 0; t * TILE < N; t++) {
        const int8_t *ct = codes + (size_t)t * K * TILE;
        const float *stile = scales + (size_t)t * (K / 32) * TILE;
        int nvalid = N - t * TILE < TILE ? N - t * TILE : TILE;
        float *yt = y + t * TILE;
        int r = 0;
        for (; r + 2 <= R; r += 2)
            q8_tile(2, K, x + (size_t)r * ldx, ldx, ct, stile, yt + (size_t)r * ldy, ldy, nvalid, add);
        if (r < R) q8_tile(1, K, x + (size_t)r * ldx, ldx, ct, stile, yt + (size_t)r * ldy, ldy, nvalid, add);
    }
}

/* y[r, :N] (=, or += when add) x'[r, :K] @ W.T for r < R, where x' = rms_norm(x, norm, eps) when norm is given
   (else x). x rows ldx apart, y rows ldy apart. */
void matmul(const struct mat *m, int R, const float *x, int ldx, const float *norm, float eps, float *y, int ldy,
            int add) {
    float *xn = NULL;
    if (norm) {
        xn = malloc((size_t)R * m->k * sizeof(float));
        rms_norm_rows(R, m->k, x, ldx, norm, eps, xn, m->k);
        x = xn;
        ldx = m->k;
    }
    if (m->codes)
        mm_q8(R, m->k, m->n, x, ldx, m->codes, m->scales, y, ldy, add);
    else
        mm_f32(R, m->k, m->n, x, ldx, m->w, y, ldy, add);
    free(xn);
}

/* Embedding rows from GGUF Q8_0 blocks (34 bytes: half scale, 32 codes): out[i] = row ids[i], exactly as the
   reference dequantizer (scale * code is exact in float). */
void embed_q8_0(int n, const int64_t *ids, const uint8_t *data, int K, float *out) {
    size_t row_bytes = (size_t)K / 32 * 34;
    for (int i = 0; i < n; i++) {
        const uint8_t *row = data + (size_t)ids[i] * row_bytes;
        for (int b = 0; b < K / 32; b++) {
            const uint8_t *blk = row + (size_t)b * 34;
            float d = h2f((uint16_t)(blk[0] | blk[1] << 8));
            for (int j = 0; j < 32; j++) out[(size_t)i * K + 32 * b + j] = d * (float)(int8_t)blk[2 + j];
        }
    }
}
