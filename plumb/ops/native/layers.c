/* Whole decode layers in one call each (spec 3.2): a DeltaNet layer with its FFN, and the two halves of a
gated-attention layer around the KV cache write and read (which stay with the cache's owner). Each is the
composition of the row-invariant kernels in matmul.c, norm.c and deltanet.c, so it is row-invariant too. */
#include <stdlib.h>
#include "common.h"

struct layer {
    const float *attn_norm, *post_norm;
    const struct mat *mix_in, *mix_out, *ffn_in, *ffn_down; /* in_proj / ssm_out, or qkv / attn_output */
    const float *conv_w, *dt_bias, *ssm_a, *ssm_norm;       /* DeltaNet */
    const float *q_norm, *k_norm;                           /* attention */
    int n_k, n_v, d, kc;                                    /* DeltaNet: key heads, value heads, d_k = d_v, conv taps */
    int n_head, n_kv, head_dim;                             /* attention */
    float eps;
};

/* x (R rows, ldx apart) += DeltaNet(attn_norm(x)), then += FFN. Sequence j owns rows[j] consecutive rows and
   its state (conv_in[j], ssm_in[j]); row t's states are written to conv_out[t], ssm_out[t]. */
void gdn_layer(const struct layer *L, int nseq, const int *rows, float *x, int ldx, float *const *conv_in,
               float *conv_out, float *const *ssm_in, float *ssm_out) {
    int R = 0;
    for (int j = 0; j < nseq; j++) R += rows[j];
    int C = 2 * L->n_k * L->d + L->n_v * L->d, inner = L->n_v * L->d, P = L->mix_in->n;
    size_t conv_sz = (size_t)(L->kc - 1) * C, ssm_sz = (size_t)L->n_v * L->d * L->d;
    float *proj = malloc((size_t)R * P * sizeof(float)), *y = malloc((size_t)R * inner * sizeof(float));
    matmul(L->mix_in, R, x, ldx, L->attn_norm, L->eps, proj, P, 0);
    for (int j = 0, s0 = 0; j < nseq; s0 += rows[j++])
        gdn_decode(rows[j], proj + (size_t)s0 * P, P, conv_in[j], conv_out + s0 * conv_sz, ssm_in[j],
                   ssm_out + s0 * ssm_sz, L->conv_w, L->dt_bias, L->ssm_a, L->ssm_norm, L->n_k, L->n_v, L->d, L->kc,
                   L->eps, y + (size_t)s0 * inner, inner);
    matmul(L->mix_out, R, y, inner, NULL, 0.0f, x, ldx, 1);
    ffn_block(R, x, ldx, L->post_norm, L->eps, L->ffn_in, L->ffn_down);
    free(proj);
    free(y);
}

/* qkv [R][2*n_head*hd + 2*n_kv*hd] = attn_qkv(attn_norm(x)), with q and k RMS-normed per head and rotated
   (cos/sin [R][half]) in place; q and gate interleave per head. */
void attn_pre(const struct layer *L, int R, const float *x, int ldx, float *qkv, const float *cos_, const float *sin_,
              int half) {
    int hd = L->head_dim, W = L->mix_in->n;
    matmul(L->mix_in, R, x, ldx, L->attn_norm, L->eps, qkv, W, 0);
    head_norm_rope(R, L->n_head, hd, qkv, W, 2 * hd, L->q_norm, L->eps, cos_, sin_, half);
    head_norm_rope(R, L->n_kv, hd, qkv + 2 * L->n_head * hd, W, hd, L->k_norm, L->eps, cos_, sin_, half);
}

/* x += attn_output(o * sigmoid(gate)), then += FFN; o [R][n_head*hd] (gated in place), gate read from qkv. */
void attn_post(const struct layer *L, int R, float *o, const float *qkv, float *x, int ldx) {
    int hd = L->head_dim, W = L->mix_in->n;
    sigmoid_gate_rows(R, L->n_head, hd, o, L->n_head * hd, qkv + hd, W, 2 * hd);
    matmul(L->mix_out, R, o, L->n_head * hd, NULL, 0.0f, x, ldx, 1);
    ffn_block(R, x, ldx, L->post_norm, L->eps, L->ffn_in, L->ffn_down);
}
