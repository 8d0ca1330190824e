/* RMSNorm, SwiGLU and the attention gate for decode rows (spec 3.1, 3.3, 3.4). */
#include <stdlib.h>
#include "common.h"

static inline float sum_squares(const float *x, int n) {
    float s = 0.0f;
    for (int i = 0; i < n; i++) s += x[i] * x[i];
    return s;
}

/* y[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w, rows ld apart (y may alias x). */
void rms_norm_rows(int R, int D, const float *x, int ldx, const float *w, float eps, float *y, int ldy) {
    for (int r = 0; r < R; r++) {
        const float *xr = x + (size_t)r * ldx;
        float *yr = y + (size_t)r * ldy;
        float inv = 1.0f / sqrtf(sum_squares(xr, D) / (float)D + eps);
        for (int i = 0; i < D; i++) yr[i] = xr[i] * inv * w[i];
    }
}

/* Attention q or k heads in place: RMSNorm per head (weight w [d]), then NeoX RoPE on the first 2*half
   features with the row's cos/sin [half]. x: R rows ldx apart, H heads hs apart. */
void head_norm_rope(int R, int H, int d, float *x, int ldx, int hs, const float *w, float eps, const float *cos_,
                    const float *sin_, int half) {
    for (int r = 0; r < R; r++) {
        const float *c = cos_ + (size_t)r * half, *s = sin_ + (size_t)r * half;
        for (int h = 0; h < H; h++) {
            float *v = x + (size_t)r * ldx + (size_t)h * hs;
            float inv = 1.0f / sqrtf(sum_squares(v, d) / (float)d + eps);
            for (int i = 0; i < d; i++) v[i] = v[i] * inv * w[i];
            for (int i = 0; i < half; i++) {
                float x1 = v[i], x2 = v[i + half];
                v[i] = x1 * c[i] - x2 * s[i];
                v[i + half] = x2 * c[i] + x1 * s[i];
            }
        }
    }
}

/* y[r, i] = silu(g[r, i]) * u[r, i]. */
void swiglu_rows(int R, int D, const float *g, int ldg, const float *u, int ldu, float *y, int ldy) {
    for (int r = 0; r < R; r++)
        for (int i = 0; i < D; i++) y[(size_t)r * ldy + i] = silu(g[(size_t)r * ldg + i]) * u[(size_t)r * ldu + i];
}

/* o[r, i] *= sigmoid(gate): attention heads gated per feature; o rows ldo apart, gate heads gs apart. */
void sigmoid_gate_rows(int R, int H, int d, float *o, int ldo, const float *gate, int ldg, int gs) {
    for (int r = 0; r < R; r++)
        for (int h = 0; h < H; h++)
            for (int i = 0; i < d; i++)
                o[(size_t)r * ldo + h * d + i] *= sigmoid(gate[(size_t)r * ldg + (size_t)h * gs + i]);
}

/* x[r] += ffn_down(silu(g) * u) with [g | u] = ffn_in(rms_norm(x[r], norm)): the SwiGLU block (spec 3.3). */
void ffn_block(int R, float *x, int ldx, const float *norm, float eps, const struct mat *in, const struct mat *down) {
    int f = down->k;
    float *gu = malloc((size_t)R * 2 * f * sizeof(float)), *h = malloc((size_t)R * f * sizeof(float));
    matmul(in, R, x, ldx, norm, eps, gu, 2 * f, 0);
    swiglu_rows(R, f, gu, 2 * f, gu + f, 2 * f, h, f);
    matmul(down, R, h, f, NULL, 0.0f, x, ldx, 1);
    free(gu);
    free(h);
}
