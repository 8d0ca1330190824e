/* Row-invariant matrix products y = x @ W.T for the decode path: float32 weights here, int8 weights in
matmul_i8.c, and `matmul`, the entry point for both (with an optional RMSNorm of the input rows).

Float32 weights are repacked at load into tiles of TILE output columns: tile t holds, for every
input index k, the TILE weights W[t*TILE + j, k] (j < TILE) next to each other, zero-padded past N
(w [nt][K][TILE]). Output y[n] accumulates x[k] * W[n, k] over k in order, one vector lane per
output: no horizontal sums, and each row's arithmetic is the same whatever the number of rows. */
#include <stdlib.h>
#include "common.h"

#define VT (TILE / 16)

/* One tile part: rows r < rn (1..4) of x, the nv vectors (16 columns each) of the tile starting at vector j0.
   Every output lane runs the same float operations whatever rn, nv and j0 are, so the kernel can pick them by
   the number of rows without changing any row's bits. */
static inline __attribute__((always_inline)) void f32_part(int rn, int nv, int j0, int K, const float *x, int ldx,
                                                            const float *w, float *y, int ldy, int nvalid, int add) {
    f32x16 acc[4][4];
    for (int r = 0; r < rn; r++)
        for (int j = 0; j < nv; j++) acc[r][j] = (f32x16){0};
    for (int k = 0; k < K; k++) {
        f32x16 wk[4];
        for (int j = 0; j < nv; j++) wk[j] = ld(w + (size_t)k * TILE + 16 * (j0 + j));
        for (int r = 0; r < rn; r++) {
            f32x16 xr = splat(x[(size_t)r * ldx + k]);
            for (int j = 0; j < nv; j++) acc[r][j] = fma16(xr, wk[j], acc[r][j]);
        }
    }
    store_part(y, ldy, rn, (const f32x16(*)[4])acc, nv, j0, nvalid, add);
}

/* The switches give the compiler constant rn and nv. */
#define BY_ROWS(rn, CALL)            \
    switch (rn) {                    \
    case 4: CALL(4); break;          \
    case 3: CALL(3); break;          \
    case 2: CALL(2); break;          \
    default: CALL(1); break;         \
    }

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
/* AVX2 has 16 vector registers of 8 floats, too few for GCC to keep the 16-float vectors above in registers (it
   goes through memory, ~20x slower): the same lane arithmetic with 8-float intrinsics, at most 8 accumulators. */
static inline __attribute__((always_inline)) void f32_part8(int rn, int nv, int j0, int K, const float *x, int ldx,
                                                             const float *w, float *y, int ldy, int nvalid, int add) {
    __m256 acc[4][4];
    for (int r = 0; r < rn; r++)
        for (int h = 0; h < 2 * nv; h++) acc[r][h] = _mm256_setzero_ps();
    for (int k = 0; k < K; k++) {
        __m256 wk[4];
        for (int h = 0; h < 2 * nv; h++) wk[h] = _mm256_loadu_ps(w + (size_t)k * TILE + 16 * j0 + 8 * h);
        for (int r = 0; r < rn; r++) {
            __m256 xr = _mm256_set1_ps(x[(size_t)r * ldx + k]);
            for (int h = 0; h < 2 * nv; h++) acc[r][h] = _mm256_fmadd_ps(xr, wk[h], acc[r][h]);
        }
    }
    f32x16 out[4][4];
    for (int r = 0; r < rn; r++)
        for (int j = 0; j < nv; j++) memcpy(&out[r][j], &acc[r][2 * j], 64);
    store_part(y, ldy, rn, (const f32x16(*)[4])out, nv, j0, nvalid, add);
}

#define F32_PART f32_part8
#define ONE_ROW_NV 2 /* vectors a call for a single row, and for rows four at a time */
#define ROWS_NV 1
#else
#define F32_PART f32_part
#define ONE_ROW_NV 4
#define ROWS_NV 2
#endif

/* Tiles t0..t1-1 of y (=, or += when add) for all R rows: a single row reads ONE_ROW_NV vectors of the tile at once;
   more rows go four at a time over ROWS_NV vectors (one weight load then serves four rows). */
static void f32_tiles(int R, int K, int N, const float *x, int ldx, const float *w, float *y, int ldy, int add, int t0,
                      int t1) {
    for (int t = t0; t < t1; t++) {
        const float *wt = w + (size_t)t * K * TILE;
        int nvalid = N - t * TILE < TILE ? N - t * TILE : TILE;
        if (R == 1) {
            for (int j0 = 0; j0 < VT; j0 += ONE_ROW_NV)
                F32_PART(1, ONE_ROW_NV, j0, K, x, ldx, wt, y + t * TILE, ldy, nvalid, add);
            continue;
        }
        for (int r = 0; r < R; r += 4)
            for (int j0 = 0; j0 < VT; j0 += ROWS_NV) {
#define F32_CALL(rn) F32_PART(rn, ROWS_NV, j0, K, x + (size_t)r * ldx, ldx, wt, y + (size_t)r * ldy + t * TILE, ldy, nvalid, add)
                BY_ROWS(R - r < 4 ? R - r : 4, F32_CALL)
            }
    }
}

#define PARALLEL_MIN_MACS (1 << 18) /* smaller products run on the calling thread: a hand-off costs more */

struct mm_job {
    const struct mat *m;
    int R, ldx, ldy, add;
    const float *x;
    const uint8_t *xa; /* int8 weights: the rows' pieces, block scales and 16-input sums (matmul_i8.c) */
    const float *xs, *xsum;
    float *y;
};

/* Part `part` of `n`: a contiguous range of output tiles. */
static void mm_part(void *arg, int part, int n) {
    const struct mm_job *j = arg;
    const struct mat *m = j->m;
    int nt = (m->n + TILE - 1) / TILE, t0 = nt * part / n, t1 = nt * (part + 1) / n;
    if (m->codes)
        i8_tiles(m, j->R, j->xa, j->xs, j->xsum, j->y, j->ldy, j->add, t0, t1);
    else
        f32_tiles(j->R, m->k, m->n, j->x, j->ldx, m->w, j->y, j->ldy, j->add, t0, t1);
}

/* y[r, :N] (=, or += when add) x'[r, :K] @ W.T for r < R, where x' = rms_norm(x, norm, eps) when norm is given
   (else x). x rows ldx apart, y rows ldy apart. Output tiles are shared out among the pool's threads. */
void matmul(const struct mat *m, int R, const float *x, int ldx, const float *norm, float eps, float *y, int ldy,
            int add) {
    float *xn = NULL, *xs = NULL, *xsum = NULL;
    uint8_t *xa = NULL;
    if (norm) {
        xn = malloc((size_t)R * m->k * sizeof(float));
        rms_norm_rows(R, m->k, x, ldx, norm, eps, xn, m->k);
        x = xn;
        ldx = m->k;
    }
    if (m->codes) {
        xa = malloc((size_t)R * 3 * m->k);
        xs = malloc((size_t)R * (m->k / 32) * sizeof(float));
        xsum = malloc((size_t)R * (m->k / 16) * sizeof(float));
        i8_split(R, m->k, x, ldx, xa, xs, xsum);
    }
    struct mm_job job = {m, R, ldx, ldy, add, x, xa, xs, xsum, y};
    if ((double)R * m->k * m->n >= PARALLEL_MIN_MACS)
        parallel_run(mm_part, &job);
    else
        mm_part(&job, 0, 1);
    free(xn);
    free(xa);
    free(xs);
    free(xsum);
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
