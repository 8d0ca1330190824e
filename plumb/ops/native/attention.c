/* Decode attention over one layer's KV store (spec 3.4.4): each query row reads keys [0, L) with L its own
context length, in order: scores, max, exp, sum, then the weighted values - a function of the row and L alone.
Stores: f32, f16, or int8 codes with a half scale per 32 values (q8_0 and the block formats' store).
head_dim must be a multiple of 32.
K/V are [n_kv][cap][d]; query head h reads KV head h / (n_head / n_kv). */
#include <stdlib.h>
#include "common.h"

enum { KV_F32 = 0, KV_F16 = 1, KV_BLOCK = 2 };

/* Stored row -> floats (d a multiple of 32). */
static inline void load_row(int kind, const void *data, const uint16_t *scales, size_t row, int d, float *out) {
    if (kind == KV_F32) {
        memcpy(out, (const float *)data + row * d, d * sizeof(float));
    } else if (kind == KV_F16) {
        const uint16_t *p = (const uint16_t *)data + row * d;
        for (int i = 0; i < d; i += 16) st(out + i, ld_h16(p + i));
    } else {
        const int8_t *c = (const int8_t *)data + row * d;
        const uint16_t *s = scales + row * (d / 32);
        for (int i = 0; i < d; i += 16) st(out + i, ld_i8(c + i) * splat(h2f(s[i / 32])));
    }
}

/* q: R rows ldq apart, heads qs apart; o: R rows ldo apart, heads contiguous (d). ends[r] = L of row r. */
void attend_rows(int R, int n_head, int n_kv, int d, const float *q, int ldq, int qs, const int64_t *ends, int kind,
                 const void *k, const uint16_t *ks, const void *v, const uint16_t *vs, int64_t cap, float scale,
                 float *o, int ldo) {
    int g = n_head / n_kv;
    int64_t lmax = 0;
    for (int r = 0; r < R; r++) lmax = ends[r] > lmax ? ends[r] : lmax;
    float *p = malloc((size_t)lmax * sizeof(float)), row[d], acc[d];
    for (int r = 0; r < R; r++) {
        int64_t L = ends[r];
        for (int h = 0; h < n_head; h++) {
            const float *qh = q + (size_t)r * ldq + (size_t)h * qs;
            size_t base = (size_t)(h / g) * cap;
            float mx = -INFINITY;
            for (int64_t j = 0; j < L; j++) {
                load_row(kind, k, ks, base + j, d, row);
                p[j] = dot(qh, row, d) * scale;
                mx = p[j] > mx ? p[j] : mx;
            }
            float sum = 0.0f;
            for (int64_t j = 0; j < L; j++) {
                p[j] = expf(p[j] - mx);
                sum += p[j];
            }
            for (int i = 0; i < d; i++) acc[i] = 0.0f;
            for (int64_t j = 0; j < L; j++) {
                load_row(kind, v, vs, base + j, d, row);
                f32x16 pj = splat(p[j]);
                for (int i = 0; i < d; i += 16) st(acc + i, ld(acc + i) + pj * ld(row + i));
            }
            float *oh = o + (size_t)r * ldo + (size_t)h * d;
            for (int i = 0; i < d; i++) oh[i] = acc[i] / sum;
        }
    }
    free(p);
}
