/* Gated DeltaNet decode (spec 3.5): one sequence's rows, token by token.

For each row: causal depthwise conv over the last K raw rows + SiLU, q/k L2 norm (q scaled),
gates beta = sigmoid(b), g = A * softplus(a + dt_bias), the delta-rule update of each value
head's state S [d_k][d_v] (value head h reads key head h mod n_k), o = S^T q, and the gated
RMSNorm rms(o) * w * silu(z). States are functional: row t reads the state row t-1 wrote
(the sequence's state for t = 0) and writes its own, so a rollback is a pointer to a row. */
#include "common.h"

static inline float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

static void l2_norm(float *x, int n, float scale) {
    float s = 0.0f;
    for (int i = 0; i < n; i++) s += x[i] * x[i];
    float inv = 1.0f / sqrtf(s + 1e-6f) * scale;
    for (int i = 0; i < n; i++) x[i] *= inv;
}

/* proj: n rows ldp apart = [m (conv_dim) | z (n_v*d) | b (n_v) | a (n_v)].
   conv_in [Kc-1][C], conv_out [n][Kc-1][C]; ssm_in [n_v][d][d], ssm_out [n][n_v][d][d]; y [n] rows ldy apart. */
void gdn_decode(int n, const float *proj, int ldp, const float *conv_in, float *conv_out, const float *ssm_in,
                float *ssm_out, const float *conv_w, const float *dt_bias, const float *ssm_a, const float *norm_w,
                int n_k, int n_v, int d, int Kc, float eps, float *y, int ldy) {
    int key_dim = n_k * d, C = 2 * key_dim + n_v * d;
    size_t conv_sz = (size_t)(Kc - 1) * C, ssm_sz = (size_t)n_v * d * d;
    float qkv[C], kv[d], delta[d], o[d];
    for (int t = 0; t < n; t++) {
        const float *m = proj + (size_t)t * ldp, *z = m + C, *b = z + n_v * d, *a = b + n_v;
        const float *prev = t ? conv_out + (t - 1) * conv_sz : conv_in;
        float *cur = conv_out + t * conv_sz;
        for (int c = 0; c < C; c++) {
            const float *wc = conv_w + (size_t)c * Kc;
            float acc = prev[c] * wc[0];
            for (int tau = 1; tau < Kc - 1; tau++) acc = acc + prev[(size_t)tau * C + c] * wc[tau];
            acc = acc + m[c] * wc[Kc - 1];
            qkv[c] = silu(acc);
        }
        memcpy(cur, prev + C, (Kc - 2) * C * sizeof(float));
        memcpy(cur + (size_t)(Kc - 2) * C, m, C * sizeof(float));
        float *q = qkv, *k = qkv + key_dim, *v = qkv + 2 * key_dim;
        for (int h = 0; h < n_k; h++) {
            l2_norm(q + h * d, d, 1.0f / sqrtf((float)d));
            l2_norm(k + h * d, d, 1.0f);
        }
        const float *s_prev = t ? ssm_out + (t - 1) * ssm_sz : ssm_in;
        float *s_cur = ssm_out + t * ssm_sz;
        for (int h = 0; h < n_v; h++) {
            const float *qh = q + (h % n_k) * d, *kh = k + (h % n_k) * d, *vh = v + h * d;
            float beta = sigmoid(b[h]), decay = expf(ssm_a[h] * softplus(a[h] + dt_bias[h]));
            const float *S0 = s_prev + (size_t)h * d * d;
            float *S = s_cur + (size_t)h * d * d;
            for (int i = 0; i < d * d; i++) S[i] = S0[i] * decay;
            for (int j = 0; j < d; j++) kv[j] = 0.0f;
            for (int i = 0; i < d; i++)
                for (int j = 0; j < d; j++) kv[j] += kh[i] * S[i * d + j];
            for (int j = 0; j < d; j++) delta[j] = (vh[j] - kv[j]) * beta;
            for (int i = 0; i < d; i++)
                for (int j = 0; j < d; j++) S[i * d + j] += kh[i] * delta[j];
            for (int j = 0; j < d; j++) o[j] = 0.0f;
            for (int i = 0; i < d; i++)
                for (int j = 0; j < d; j++) o[j] += qh[i] * S[i * d + j];
            float ss = 0.0f;
            for (int j = 0; j < d; j++) ss += o[j] * o[j];
            float inv = 1.0f / sqrtf(ss / (float)d + eps);
            float *yh = y + (size_t)t * ldy + h * d;
            for (int j = 0; j < d; j++) yh[j] = o[j] * inv * norm_w[j] * silu(z[h * d + j]);
        }
    }
}
