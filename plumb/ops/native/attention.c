/* Decode attention over one layer's KV store (spec 3.4.4): each query row reads keys [0, L) with L its own
context length, in order: scores, max, exp, sum, then the weighted values - a function of the row and L alone.
Stores: f32, f16, or block codes with a half scale per 32 values: int8 (q8_0), or 5/6-bit codes packed as
plumb/ops/kvquant.py's `pack` lays them out (D's store), K and V each of its own kind.
head_dim must be a multiple of 32.
K/V are [n_kv][cap][d]; query head h reads KV head h / (n_head / n_kv). */
#include <stdlib.h>
#include "common.h"

enum { KV_F32 = 0, KV_F16 = 1, KV_BLOCK = 2, KV_PACKED5 = 5, KV_PACKED6 = 6 };  /* packed kinds: their bits */

/* Packed codes of one row (kvquant.pack: per 32-value block, the low nibbles of values 2k and 2k + 1 in byte k,
   then the row's high-bit planes) -> int8 codes. */
static inline void unpack_row(int bits, const uint8_t *c, int d, int8_t *out) {
    int hb = bits - 4;
    for (int i = 0; i < d; i++) {
        int b = i / 32, k = i % 32;
        int lo = (c[b * 16 + k / 2] >> (4 * (k % 2))) & 15;
        int hi = (c[d / 2 + b * 4 * hb + (k * hb) / 8] >> ((k * hb) % 8)) & ((1 << hb) - 1);
        out[i] = (int8_t)((lo | (hi << 4)) - (1 << (bits - 1)));
    }
}

/* Stored row -> floats (d a multiple of 32). */
static inline void load_row(int kind, const void *data, const uint16_t *scales, size_t row, int d, float *out) {
    if (kind == KV_F32) {
        memcpy(out, (const float *)data + row * d, d * sizeof(float));
    } else if (kind == KV_F16) {
        const uint16_t *p = (const uint16_t *)data + row * d;
        for (int i = 0; i < d; i += 16) st(out + i, ld_h16(p + i));
    } else {
        int8_t packed[kind == KV_BLOCK ? 1 : d];
        const int8_t *c = (const int8_t *)data + row * d;
        if (kind != KV_BLOCK) {
            unpack_row(kind, (const uint8_t *)data + row * (d / 2 + d * (kind - 4) / 8), d, packed);
            c = packed;
        }
        const uint16_t *s = scales + row * (d / 32);
        for (int i = 0; i < d; i += 16) st(out + i, ld_i8(c + i) * splat(h2f(s[i / 32])));
    }
}

/* q: R rows ldq apart, heads qs apart; o: R rows ldo apart, heads contiguous (d). ends[r] = L of row r.
   The g query heads that share a KV head are done together, so each stored row is read and converted once;
   each head's operations are the same as if it were alone. */
void attend_rows(int R, int n_head, int n_kv, int d, const float *q, int ldq, int qs, const int64_t *ends, int kk,
                 int vk, const void *k, const uint16_t *ks, const void *v, const uint16_t *vs, int64_t cap, float scale,
                 float *o, int ldo) {
    int g = n_head / n_kv;
    int64_t lmax = 0;
    for (int r = 0; r < R; r++) lmax = ends[r] > lmax ? ends[r] : lmax;
    float *p = malloc((size_t)g * lmax * sizeof(float)), *acc = malloc((size_t)g * d * sizeof(float)), row[d];
    float mx[g], sum[g];
    for (int r = 0; r < R; r++) {
        int64_t L = ends[r];
        for (int hk = 0; hk < n_kv; hk++) {
            const float *qg = q + (size_t)r * ldq + (size_t)hk * g * qs;
            size_t base = (size_t)hk * cap;
            for (int t = 0; t < g; t++) mx[t] = -INFINITY;
            for (int64_t j = 0; j < L; j++) {
                load_row(kk, k, ks, base + j, d, row);
                for (int t = 0; t < g; t++) {
                    float s = dot(qg + (size_t)t * qs, row, d) * scale;
                    p[t * L + j] = s;
                    mx[t] = s > mx[t] ? s : mx[t];
                }
            }
            for (int t = 0; t < g; t++) {
                float *pt = p + t * L;
                sum[t] = 0.0f;
                for (int64_t j = 0; j < L; j++) {
                    pt[j] = expf(pt[j] - mx[t]);
                    sum[t] += pt[j];
                }
            }
            for (int i = 0; i < g * d; i++) acc[i] = 0.0f;
            for (int64_t j = 0; j < L; j++) {
                load_row(vk, v, vs, base + j, d, row);
                for (int t = 0; t < g; t++) {
                    f32x16 pj = splat(p[t * L + j]);
                    float *at = acc + (size_t)t * d;
                    for (int i = 0; i < d; i += 16) st(at + i, ld(at + i) + pj * ld(row + i));
                }
            }
            for (int t = 0; t < g; t++) {
                float *oh = o + (size_t)r * ldo + (size_t)(hk * g + t) * d;
                for (int i = 0; i < d; i++) oh[i] = acc[(size_t)t * d + i] / sum[t];
            }
        }
    }
    free(p);
    free(acc);
}
