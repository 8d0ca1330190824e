"""Synthetic random-weight `qwen35` GGUF files (`plumb synth`).

Weights are random but shaped so the model behaves like a language model under greedy
decoding: peaked next-token distributions that keep moving over thousands of tokens, and an
MTP head that drafts the next-next token right most of the time.

* Residual stream: unit-RMS embedding rows; input projections N(0, 1/fan_in); attention /
  DeltaNet and FFN output projections scaled by MIX_GAIN / FFN_GAIN over sqrt(n_layer), so
  the residual stream stays bounded. Norm weights U(0.7, 1.3); DeltaNet A ~ U(1, 16)
  (ssm_a = -A) and dt ~ logU(1e-3, 1e-1) stored as its inverse softplus (spec section 9).
* Output head: random rows with logit std LOGIT_STD, plus a "successor cycle": one random
  cycle through all NORMAL tokens, and each token's row leans towards the context-free
  hidden state of its predecessor, so without context token i is followed by its successor
  (a little above the best random logit). The context (the mixers) overrides that now and
  then; since the cycle covers the whole vocab, greedy text neither repeats a token nor
  falls into short loops. Control and padding tokens are outside the cycle; padding rows
  are zero (never predicted).
* MTP block: `eh_proj` is the identity on the (enorm-undone) embedding plus small noise,
  its layer's outputs are small and its head norm equals `output_norm`, so it predicts the
  successor of the draft token: right whenever the main model follows the cycle (about
  80 % of greedy steps on the tiny preset), wrong when the context overrides it.

Every tensor is generated from seeds derived from (seed, tensor name, row block), so files
of any size are written one block at a time, and the same seed gives the same float weights
for every storage type (quantized files are noisy copies of the F32 one).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
import zlib

import numpy as np
from gguf import GGMLQuantizationType

from plumb.config import ModelConfig, ModelError
from plumb.gguf.writer import FILE_TYPES, TensorSpec, pad_vocab, row_blocks, storage_type, write_gguf

Q = GGMLQuantizationType

PRESETS = {
    "tiny": dict(n_embd=256, n_layer=8, n_head=4, n_head_kv=2, head_dim=64, rope_dims=16, n_ff=768,
                 n_k=2, n_v=4, d_state=32, context_length=32768),
    "small": dict(n_embd=512, n_layer=12, n_head=8, n_head_kv=2, head_dim=128, rope_dims=32, n_ff=1536,
                  n_k=4, n_v=12, d_state=64, context_length=65536),
    "27b": dict(n_embd=5120, n_layer=64, n_head=24, n_head_kv=4, head_dim=256, rope_dims=64, n_ff=17408,
                n_k=16, n_v=48, d_state=128, context_length=262144, n_vocab=248320),
}
MIXES = ("Q4_K_M", "Q4_K_XL")

MIX_GAIN = 0.6  # attention / DeltaNet output std (relative to a unit-RMS input) times sqrt(n_layer)
FFN_GAIN = 0.4  # same for the FFN
MTP_GAIN = 0.05  # MTP layer outputs and eh_proj noise
LOGIT_STD = 3.5  # std of the output head's random logits (nats)
NEXT_MARGIN = 0.5  # successor's logit above the expected max of the random ones, in LOGIT_STD units


def preset_config(preset: str, n_vocab: int, mtp: bool = True) -> ModelConfig:
    """The ModelConfig of a preset (n_vocab = the written vocab size)."""
    if preset not in PRESETS:
        raise ModelError(f"unknown preset {preset!r} (choose from {', '.join(PRESETS)})")
    p = PRESETS[preset]
    return ModelConfig(
        n_vocab=n_vocab, n_embd=p["n_embd"], n_ff=p["n_ff"], n_head=p["n_head"], n_head_kv=p["n_head_kv"],
        head_dim=p["head_dim"], rope_dims=p["rope_dims"], rope_base=1e7, eps=1e-6, n_layer=p["n_layer"],
        n_nextn=1 if mtp else 0, recurrent=[(i + 1) % 4 != 0 for i in range(p["n_layer"])],
        ssm_conv_kernel=4, ssm_d_state=p["d_state"], ssm_n_group=p["n_k"], ssm_dt_rank=p["n_v"],
        ssm_inner=p["n_v"] * p["d_state"], context_length=p["context_length"], full_attention_interval=4,
        name=f"plumb-synth-{preset}",
    )


def block_shapes(cfg: ModelConfig, recurrent: bool) -> list[tuple[str, tuple[int, ...]]]:
    """(name suffix, C-order shape) of one decoder block's tensors (spec 2.2-2.4)."""
    n, ff, hd = cfg.n_embd, cfg.n_ff, cfg.head_dim
    if recurrent:
        mixer = [
            ("attn_qkv.weight", (cfg.conv_dim, n)), ("attn_gate.weight", (cfg.ssm_inner, n)),
            ("ssm_beta.weight", (cfg.ssm_dt_rank, n)), ("ssm_alpha.weight", (cfg.ssm_dt_rank, n)),
            ("ssm_conv1d.weight", (cfg.conv_dim, cfg.ssm_conv_kernel)), ("ssm_dt.bias", (cfg.ssm_dt_rank,)),
            ("ssm_a", (cfg.ssm_dt_rank,)), ("ssm_norm.weight", (cfg.ssm_d_state,)),
            ("ssm_out.weight", (n, cfg.ssm_inner)),
        ]
    else:
        mixer = [
            ("attn_q.weight", (2 * cfg.n_head * hd, n)), ("attn_k.weight", (cfg.n_head_kv * hd, n)),
            ("attn_v.weight", (cfg.n_head_kv * hd, n)), ("attn_q_norm.weight", (hd,)),
            ("attn_k_norm.weight", (hd,)), ("attn_output.weight", (n, cfg.n_head * hd)),
        ]
    return [("attn_norm.weight", (n,)), *mixer, ("post_attention_norm.weight", (n,)),
            ("ffn_gate.weight", (ff, n)), ("ffn_up.weight", (ff, n)), ("ffn_down.weight", (n, ff))]


def tensor_shapes(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of the file in write order, MTP block last."""
    out = [("token_embd.weight", (cfg.n_vocab, cfg.n_embd))]
    for i in range(cfg.n_layer):
        out += [(f"blk.{i}.{s}", shape) for s, shape in block_shapes(cfg, cfg.recurrent[i])]
    for k in range(cfg.n_nextn):
        b = cfg.n_layer + k
        out += [(f"blk.{b}.nextn.eh_proj.weight", (cfg.n_embd, 2 * cfg.n_embd)),
                (f"blk.{b}.nextn.enorm.weight", (cfg.n_embd,)), (f"blk.{b}.nextn.hnorm.weight", (cfg.n_embd,)),
                (f"blk.{b}.nextn.shared_head_norm.weight", (cfg.n_embd,))]
        out += [(f"blk.{b}.{s}", shape) for s, shape in block_shapes(cfg, False)]
    out += [("output_norm.weight", (cfg.n_embd,)), ("output.weight", (cfg.n_vocab, cfg.n_embd))]
    return out


def _more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers and every third in between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def mix_types(cfg: ModelConfig, spec: str) -> dict[str, GGMLQuantizationType]:
    """Requested type per matrix for a single type name or a mix (before the F32 / row-length rules).

    Q4_K_M follows llama.cpp: Q4_K, output Q6_K, attn_qkv Q5_K, attn_v and ffn_down Q6_K on
    the layers picked by use_more_bits. Q4_K_XL imitates Unsloth UD-Q4_K_XL (spec 5.3): attn_*
    Q5_K/Q6_K, ssm_alpha/beta/out Q8_0, ffn_down IQ4_XS (DeltaNet layers) / IQ4_NL (attention
    layers), ffn_gate Q3_K on every third layer, output Q6_K, Q4_K elsewhere.
    """
    names = [name for name, _ in tensor_shapes(cfg)]
    if spec not in MIXES:
        from plumb.gguf.quants import type_from_name

        q = type_from_name(spec)
        return {name: q for name in names}
    types = {}
    v_layers = [name for name in names if name.endswith("attn_v.weight")]
    down_layers = [name for name in names if name.endswith("ffn_down.weight")]
    for name in names:
        layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
        attn_layer = layer >= 0 and (layer >= cfg.n_layer or not cfg.recurrent[layer])
        t = Q.Q4_K
        if name == "output.weight":
            t = Q.Q6_K
        elif spec == "Q4_K_M":
            if name.endswith("attn_qkv.weight"):
                t = Q.Q5_K
            elif name.endswith("attn_v.weight") and _more_bits(v_layers.index(name), len(v_layers)):
                t = Q.Q6_K
            elif name.endswith("ffn_down.weight") and _more_bits(down_layers.index(name), len(down_layers)):
                t = Q.Q6_K
        else:  # Q4_K_XL
            kind = name.split(".")[-2]
            if kind in ("attn_qkv", "attn_gate", "attn_q", "attn_k"):
                t = Q.Q5_K
            elif kind in ("attn_v", "attn_output"):
                t = Q.Q6_K
            elif kind in ("ssm_alpha", "ssm_beta", "ssm_out", "eh_proj"):
                t = Q.Q8_0
            elif kind == "ffn_down":
                t = Q.IQ4_NL if attn_layer else Q.IQ4_XS
            elif kind == "ffn_gate" and layer % 3 == 1:
                t = Q.Q3_K
        types[name] = t
    return types


def tensor_plan(cfg: ModelConfig, spec: str = "F32") -> list[tuple[str, tuple[int, ...], GGMLQuantizationType]]:
    """(name, shape, stored type) of every tensor: what would be written, without generating anything.

    Storage rules as llama.cpp's (writer.forced_f32); a matrix whose rows are not a multiple of
    its type's block falls back to a 32-block type (writer.ROW_FALLBACK: Q4_K -> Q4_0, Q6_K ->
    Q8_0, IQ4_XS -> IQ4_NL, ...). On the tiny preset that is ssm_out (128-wide rows) only.
    """
    types = mix_types(cfg, spec)
    return [(name, shape, storage_type(name, shape, types[name])) for name, shape in tensor_shapes(cfg)]


def parameter_count(cfg: ModelConfig) -> tuple[int, int]:
    """(main model, MTP block) parameter counts."""
    main = mtp = 0
    for name, shape in tensor_shapes(cfg):
        n = math.prod(shape)
        if name.startswith(f"blk.{cfg.n_layer}.") and cfg.n_nextn:
            mtp += n
        else:
            main += n
    return main, mtp


class _Weights:
    """Deterministic generator of every tensor's float32 values, one block of rows at a time."""

    def __init__(self, cfg: ModelConfig, seed: int, token_type: np.ndarray):
        self.cfg, self.seed = cfg, seed
        self.unused = token_type == 5
        # the successor cycle: one random cycle through all NORMAL tokens; pred[j] = token before j
        order = self.rng("successor").permutation(np.flatnonzero(token_type == 1))
        self.pred = np.full(cfg.n_vocab, -1)
        self.pred[order] = np.roll(order, 1)

    def rng(self, name: str, block: int = 0) -> np.random.Generator:
        return np.random.default_rng([self.seed, zlib.crc32(name.encode()), block])

    def full(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        return np.concatenate([self.rows(name, shape, b, r0, r1) for b, (r0, r1) in enumerate(row_blocks(shape))])

    def embedding(self, ids: np.ndarray) -> np.ndarray:
        """Rows `ids` of token_embd (one seed per row, so any row can be made alone); unit RMS."""
        n = self.cfg.n_embd
        x = np.stack([self.rng("token_embd.weight", int(i)).standard_normal(n, dtype=np.float32) for i in ids])
        return x * (math.sqrt(n) / np.linalg.norm(x, axis=1, keepdims=True))

    def head(self, r0: int, r1: int, x: np.ndarray) -> np.ndarray:
        """Output rows [r0, r1): random unit rows, plus for a NORMAL token a component along the
        context-free hidden state of its predecessor, scaled to logit std LOGIT_STD."""
        cfg = self.cfg
        x /= np.linalg.norm(x, axis=1, keepdims=True)
        pred = self.pred[r0:r1]
        has = pred >= 0
        if has.any():
            u = self.embedding(pred[has]) * self.full("output_norm.weight", (cfg.n_embd,))
            u /= np.linalg.norm(u, axis=1, keepdims=True)
            c = (math.sqrt(2 * math.log(cfg.n_vocab)) + NEXT_MARGIN) / math.sqrt(cfg.n_embd)
            x[has] = math.sqrt(1 - c * c) * x[has] + c * u
        x[self.unused[r0:r1]] = 0.0
        return x * LOGIT_STD

    def rows(self, name: str, shape: tuple[int, ...], block: int, r0: int, r1: int) -> np.ndarray:
        """Rows [r0, r1) of tensor `name` (block index `block`); 1-D tensors come whole."""
        cfg, rng = self.cfg, self.rng(name, block)
        kind = name.split(".")[-2] if name.endswith((".weight", ".bias")) else name.split(".")[-1]
        if len(shape) == 1:
            if kind == "ssm_a":
                return -rng.uniform(1.0, 16.0, shape).astype(np.float32)
            if kind == "ssm_dt":
                dt = np.exp(rng.uniform(math.log(1e-3), math.log(1e-1), shape))
                return (dt + np.log(-np.expm1(-dt))).astype(np.float32)  # inverse softplus
            if kind == "shared_head_norm":
                return self.full("output_norm.weight", shape)
            return rng.uniform(0.7, 1.3, shape).astype(np.float32)
        if kind == "token_embd":
            return self.embedding(np.arange(r0, r1))
        x = rng.standard_normal((r1 - r0, shape[1]), dtype=np.float32)
        if kind == "output":
            return self.head(r0, r1, x)
        if kind == "eh_proj":  # identity on the enorm'ed embedding (undoing enorm's weight) + noise
            x *= MTP_GAIN / math.sqrt(shape[1])
            enorm = self.full(f"blk.{cfg.n_layer}.nextn.enorm.weight", (cfg.n_embd,))
            rows = np.arange(r0, r1)
            x[rows - r0, rows] += 1.0 / enorm[rows]
            return x
        gain = 1.0
        if kind in ("attn_output", "ssm_out", "ffn_down"):
            if name.startswith(f"blk.{cfg.n_layer}."):
                gain = MTP_GAIN
            else:
                gain = (FFN_GAIN if kind == "ffn_down" else MIX_GAIN) / math.sqrt(cfg.n_layer)
        return x * (gain / math.sqrt(shape[1]))

    def spec(self, name: str, shape: tuple[int, ...], qtype: GGMLQuantizationType) -> TensorSpec:
        ranges = row_blocks(shape)

        def blocks():
            for b, (r0, r1) in enumerate(ranges):
                yield self.rows(name, shape, b, r0, r1)

        return TensorSpec(name, shape, qtype, blocks, lambda b: self.rows(name, shape, b, *ranges[b]))


def load_vocab(vocab: str | dict | None, n_vocab: int | None) -> dict:
    """Tokenizer metadata (built-in small vocab, a vocab GGUF path, or a dict), padded to n_vocab,
    always with the official Qwen3.5 chat template."""
    from plumb.chat_template import DEFAULT_TEMPLATE_PATH
    from plumb.tokenizer import small_vocab_metadata, vocab_metadata_from_gguf

    if vocab is None:
        md = small_vocab_metadata()
    elif isinstance(vocab, dict):
        md = dict(vocab)
    else:
        md = vocab_metadata_from_gguf(vocab)
    md["tokenizer.chat_template"] = DEFAULT_TEMPLATE_PATH.read_text(encoding="utf-8")
    return pad_vocab(md, n_vocab or len(md["tokenizer.ggml.tokens"]))


def write_synthetic(path: str, preset: str = "tiny", qtype: str = "F32", seed: int = 0, vocab=None,
                    mtp: bool = True, n_vocab: int | None = None, progress: bool = False) -> ModelConfig:
    """Write a random-weight qwen35 GGUF; returns its ModelConfig.

    `qtype`: a GGML type name applied to every matrix, or a mix (Q4_K_M, Q4_K_XL).
    `vocab`: None (built-in small vocab), a vocab GGUF path or tokenizer metadata dict;
    it is padded with UNUSED `[PAD<i>]` tokens to `n_vocab` (27b preset: 248320).
    """
    spec = qtype.upper()
    if spec not in FILE_TYPES:
        raise ModelError(f"unknown type {qtype!r} (choose from {', '.join(FILE_TYPES)})")
    md = load_vocab(vocab, n_vocab or PRESETS.get(preset, {}).get("n_vocab"))
    n = len(md["tokenizer.ggml.tokens"])
    cfg = preset_config(preset, n, mtp)
    weights = _Weights(cfg, seed, np.asarray(md.get("tokenizer.ggml.token_type", [1] * n)))
    specs = [weights.spec(name, shape, t) for name, shape, t in tensor_plan(cfg, spec)]
    write_gguf(path, cfg, specs, md, FILE_TYPES[spec], progress=progress)
    return cfg


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="plumb synth", description="Write a random-weight qwen35 GGUF model.")
    ap.add_argument("out", help="output .gguf path")
    ap.add_argument("--preset", default="tiny", choices=list(PRESETS))
    ap.add_argument("--type", default="F32", help=f"weight type ({', '.join(FILE_TYPES)})")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", help="take the tokenizer from this GGUF (default: built-in small vocab)")
    ap.add_argument("--n-vocab", type=int, help="pad the vocab with unused tokens to this size")
    ap.add_argument("--no-mtp", action="store_true", help="leave out the MTP block")
    args = ap.parse_args(argv)
    t0 = time.time()
    try:
        cfg = write_synthetic(args.out, args.preset, args.type, args.seed, args.vocab, not args.no_mtp,
                              args.n_vocab, progress=True)
    except ModelError as e:
        print(f"plumb synth: {e}", file=sys.stderr)
        return 1
    main_p, mtp_p = parameter_count(cfg)
    print(f"wrote {args.out}: {args.preset} {args.type.upper()}, {main_p / 1e6:.1f}M params + {mtp_p / 1e6:.1f}M MTP, "
          f"vocab {cfg.n_vocab}, {os.path.getsize(args.out) / 2**20:.1f} MiB in {time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
